"""The stream budget's accounting in-process (gossip/limits.py, the hooks of gossip/hostlimits.py): counts given
back, offences expiring, only inbound connections counted per address. Each test fails with a one-line bug
that leaves every defence in place (issue 43; docs/testing.md lists the bugs); the live attacks on real
hosts are in test_stream_limits.py and test_ip_limits.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from murmur.gossip.hostlimits import range_full
from murmur.gossip.limits import StreamBudget, StreamLimits


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
    return SimpleNamespace(
        swarm=swarm,
        muxed_conn=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer)),
        _add_stream=add_stream,
        remove_stream=lambda s: None,
    )


def test_the_stream_hook_gives_each_stream_back_however_its_handler_ends() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    from murmur.gossip import libp2p_fixes

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
    return SimpleNamespace(
        get_connection_type=lambda: "ConnectionType.DIRECT",
        get_transport_addresses=lambda: [f"/ip4/{ip}/tcp/4001"],
        direction=direction,
    )


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


def test_the_stream_caps_hold_exactly_per_peer_and_per_node() -> None:
    budget = StreamBudget(StreamLimits(peer_streams=2, node_streams=5))
    assert [budget.open_stream(p) for p in "aabbc"] == [True] * 5
    assert not budget.open_stream("c")  # the node holds its five
    assert not budget.open_stream("a")  # and a holds its two
    assert budget.counters["streams_refused_node"] == 1 and budget.counters["streams_refused_peer"] == 1
    assert budget.node_streams == 5 and budget.streams == {"a": 2, "b": 2, "c": 1}
    budget.close_stream("ghost")  # a close with nothing open changes nothing
    assert budget.node_streams == 5 and "ghost" not in budget.streams
    budget.close_stream("a")
    assert budget.open_stream("c") and budget.streams == {"a": 1, "b": 2, "c": 2}


def test_buffered_bytes_fit_both_shares_exactly_and_are_given_back() -> None:
    from murmur.gossip.limits import BufferFull

    charged: list[str] = []
    budget = StreamBudget(
        StreamLimits(peer_buffer_bytes=100, node_buffer_bytes=250, offences=2), on_charge=lambda p, w: charged.append(p)
    )
    budget.reserve("a", 100, 0.0)  # exactly the peer's share
    with pytest.raises(BufferFull):
        budget.reserve("a", 1, 0.0)
    assert budget.counters["buffer_full_peer"] == 1 and charged == []  # one offence of two
    budget.reserve("b", 100, 0.0)
    budget.reserve("c", 50, 0.0)  # exactly the node's share
    for _ in range(3):  # the node-wide share is no one peer's fault: never an offence
        with pytest.raises(BufferFull):
            budget.reserve("c", 1, 0.0)
    assert budget.counters["buffer_full_node"] == 3 and charged == []
    assert budget.node_buffered == 250 and budget.buffered == {"a": 100, "b": 100, "c": 50}
    budget.release("a", 40)
    assert budget.buffered["a"] == 60 and budget.node_buffered == 210
    budget.release("a", 1000)  # more than it holds: what it holds
    assert "a" not in budget.buffered and budget.node_buffered == 150
    budget.release("ghost", 10)
    assert budget.node_buffered == 150
    with pytest.raises(BufferFull):
        budget.reserve("a", 101, 1.0)  # a's second offence: charged
    assert charged == ["a"] and "a" not in budget.buffered


def test_a_lease_gives_back_what_it_holds_and_no_more() -> None:
    from murmur.gossip.limits import BufferFull, Lease

    budget = StreamBudget(StreamLimits(peer_buffer_bytes=100, node_buffer_bytes=1000))
    budget.reserve("p", 10, 0.0)  # another reader of the same peer
    lease = Lease(budget, "p", lambda: 0.0)
    lease.grow(30)
    lease.release(10)
    assert lease.held == 20 and budget.buffered["p"] == 30 and budget.node_buffered == 30
    lease.release(50)  # more than the lease holds: the other reader's bytes stay reserved
    assert lease.held == 0 and budget.buffered["p"] == 10 and budget.node_buffered == 10
    lease.grow(60)
    with pytest.raises(BufferFull):
        lease.grow(31)
    assert lease.held == 60
    lease.free()
    lease.free()
    assert lease.held == 0 and budget.buffered["p"] == 10 and budget.node_buffered == 10


def test_a_charge_starts_the_count_over_and_the_offence_table_stays_bounded() -> None:
    charged: list[str] = []
    budget = StreamBudget(StreamLimits(offences=3, offence_window_s=600.0), on_charge=lambda p, w: charged.append(p))
    for t in range(6):
        budget.offence("a", "held frame", float(t))
    assert charged == ["a", "a"]  # the 3rd and the 6th, not the 4th and 5th
    small = StreamBudget(StreamLimits(peer_streams=8, node_streams=2, offences=1))
    for i in range(100):  # every offence charged at once leaves its peer nothing recent
        small.offence(f"k{i}", "held frame", float(i))
        assert len(small._offences) <= 4 * small.limits.node_streams + 1, i


def test_a_yamux_receive_window_may_reach_zero_but_not_below() -> None:
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    from murmur.gossip import libp2p_fixes
    from murmur.gossip.hostlimits import WindowExceeded

    libp2p_fixes.install()
    faults: list[str] = []
    swarm = SimpleNamespace(_murmur_faults=SimpleNamespace(record=lambda peer, proto, err: faults.append(peer)))
    stream = SimpleNamespace(
        _murmur_recv_window=10,
        stream_id=1,
        conn=SimpleNamespace(swarm=swarm, peer_id=SimpleNamespace(to_base58=lambda: "p")),
    )
    window = YamuxStream.recv_window
    window.fset(stream, 0)  # every byte of credit used: honest
    assert window.fget(stream) == 0 and faults == []
    with pytest.raises(WindowExceeded):
        window.fset(stream, -1)
    assert faults == ["p"] and window.fget(stream) == 0


def test_an_address_without_a_host_part_has_no_ip() -> None:
    from murmur.gossip.hostlimits import remote_ip

    for addr in ("/ip4", "/dns4/example.org/tcp/1", "/ip4/198.51.100.7/tcp/1/p2p-circuit"):
        conn = SimpleNamespace(
            get_connection_type=lambda: "ConnectionType.DIRECT", get_transport_addresses=lambda a=addr: [a]
        )
        assert remote_ip(conn) == "", addr


def _reader(budget: StreamBudget, data: bytes) -> tuple[Any, list[int]]:
    reads: list[int] = []
    buf = bytearray(data)

    async def read(n: int) -> bytes:
        reads.append(n)
        if not buf:
            return b"\x80"  # a varint that never ends
        part = bytes(buf[:n])
        del buf[:n]
        return part

    stream = SimpleNamespace(
        read=read,
        swarm_conn=SimpleNamespace(swarm=SimpleNamespace(_murmur_budget=budget)),
        muxed_conn=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "p")),
    )
    return stream, reads


def test_a_pubsub_frame_is_read_within_the_budget_and_its_bytes_given_back() -> None:
    from libp2p.io.exceptions import MessageTooLarge

    from murmur.gossip.hostlimits import read_varint_frame
    from murmur.gossip.transport import FrameError

    budget = StreamBudget(StreamLimits(peer_buffer_bytes=64))
    stream, _ = _reader(budget, b"\x05hello")
    assert trio.run(read_varint_frame, stream, 5, None) == b"hello"  # exactly the largest allowed
    assert budget.node_buffered == 0 and budget.buffered == {}
    stream, _ = _reader(budget, b"\x05hello")
    with pytest.raises(MessageTooLarge):
        trio.run(read_varint_frame, stream, 4, None)
    # a u64 varint has at most 10 bytes: the 10th with its continuation bit set ends the read
    stream, reads = _reader(budget, b"")
    with pytest.raises(FrameError):
        trio.run(read_varint_frame, stream, 1 << 20, None)
    assert len(reads) == 10
