"""The stream budget's accounting in-process (gossip/limits.py, the hooks of gossip/hostlimits.py): counts given
back, offences expiring, only inbound connections counted per address. Each test fails with a one-line bug
that leaves every defence in place (issue 43; docs/testing.md lists the bugs); the live attacks on real
hosts are in test_stream_limits.py and test_ip_limits.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio

from gossip.hostlimits import range_full
from gossip.limits import StreamBudget, StreamLimits


def test_the_node_wide_stream_count_returns_to_zero_as_one_peers_streams_close() -> None:
    """One key opening and closing a node's whole stream cap, one stream at a time, leaves nothing counted:
    a count not given back on close would lock every other peer out after 4,096 streams."""
    budget = StreamBudget()
    for _ in range(budget.limits.node_streams + 1):
        assert budget.open_stream("churner")
        budget.close_stream("churner")
    assert budget.node_streams == 0 and budget.streams == {}
    assert budget.open_stream("honest")
    # the per-peer count is given back as well: the key may hold its whole share again
    for _ in range(budget.limits.peer_streams):
        assert budget.open_stream("churner")
    assert not budget.open_stream("churner")
    assert budget.node_streams == budget.limits.peer_streams + 1


def _swarm_conn(budget: StreamBudget, peer: str, handled: list[Any]) -> Any:
    """Just what py-libp2p 0.8.1's `SwarmConn._handle_muxed_stream` reads, around the budget hook."""
    async def add_stream(muxed: Any) -> Any:
        return SimpleNamespace(muxed=muxed, _resource_released=True)

    async def handler(net_stream: Any) -> None:
        handled.append(net_stream.muxed)
        if net_stream.muxed == "fails":
            raise RuntimeError("the protocol handler failed")

    swarm = SimpleNamespace(_murmur_budget=budget, common_stream_handler=handler)
    return SimpleNamespace(swarm=swarm, muxed_conn=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer)),
                           _add_stream=add_stream, remove_stream=lambda s: None)


def test_the_stream_hook_gives_each_stream_back_however_its_handler_ends() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    from gossip import libp2p_fixes

    libp2p_fixes.install()
    budget = StreamBudget(StreamLimits(peer_streams=4, node_streams=8))
    handled: list[Any] = []
    conn = _swarm_conn(budget, "churner", handled)

    async def main() -> None:
        for i in range(3 * budget.limits.node_streams):
            try:
                await SwarmConn._handle_muxed_stream(conn, "fails" if i % 2 else f"s{i}")
            except RuntimeError:
                pass
            assert budget.node_streams == 0, i

    trio.run(main)
    assert len(handled) == 3 * budget.limits.node_streams  # every stream reached its handler
    assert budget.open_stream("honest")


def _conn(ip: str, direction: str = "") -> Any:
    """A direct connection from `ip`; `direction` as py-libp2p's `Direction` prints (`inbound`, `outbound`)."""
    return SimpleNamespace(get_connection_type=lambda: "ConnectionType.DIRECT",
                           get_transport_addresses=lambda: [f"/ip4/{ip}/tcp/4001"], direction=direction)


def test_outbound_connections_do_not_count_against_the_inbound_per_address_limit() -> None:
    lim = StreamLimits(ip_connections=2, ip_unlimited=())
    ip = "198.51.100.7"
    # the node dialled this address many times: none of those count against its inbound share
    dialled = [_conn(ip, "outbound") for _ in range(10)]
    assert range_full(lim, "inbound", _conn(ip), dialled) is None
    # its inbound connections do, and the one past the cap is refused
    held = dialled + [_conn(ip, "inbound"), _conn(ip, "inbound")]
    assert range_full(lim, "inbound", _conn(ip), held) == f"{ip}/32"
    assert range_full(lim, "inbound", _conn("198.51.100.8"), held) is None
    # and a connection the node dials itself is never refused for the address's inbound share
    assert range_full(lim, "outbound", _conn(ip), held) is None


def test_stream_offences_expire_after_their_window() -> None:
    charged: list[str] = []
    budget = StreamBudget(StreamLimits(offences=3, offence_window_s=600.0), on_charge=lambda p, w: charged.append(p))
    # three offences within the window: charged
    for t in (0.0, 100.0, 599.0):
        budget.offence("a", "held frame", t)
    assert charged == ["a"]
    # three offences spread wider than the window: the first two have expired when the third comes
    for t in (1000.0, 1100.0, 1700.0):
        budget.offence("b", "held frame", t)
    assert charged == ["a"]
    # an offence exactly one window old has expired (the window is open at its old end)
    for t in (2000.0, 2300.0, 2600.0):
        budget.offence("c", "held frame", t)
    assert charged == ["a"]
    budget.offence("c", "held frame", 2600.5)  # 2300, 2600, 2600.5: three within 600 s
    assert charged == ["a", "c"]
