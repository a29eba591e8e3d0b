"""Inbound connections per source range (gossip/iprange.py, the add_conn hook in gossip/hostlimits.py): one
machine's many keys cannot take every connection a node accepts, and loopback, relays and outbound
connections are not counted."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from murmur.gossip.host import open_transport
from murmur.gossip.hostlimits import remote_ip
from murmur.gossip.identity import Identity
from murmur.gossip.iprange import full_range, range_of
from murmur.gossip.limits import StreamLimits


def test_ranges_are_one_ipv4_address_or_one_ipv6_slash_56() -> None:
    assert range_of("198.51.100.7") == "198.51.100.7/32"
    assert range_of("::ffff:198.51.100.7") == "198.51.100.7/32"  # a v4-mapped address is its v4 address
    assert range_of("2001:db8:0:1ff::1") == range_of("2001:db8:0:100::9") == "2001:db8:0:100::/56"
    assert range_of("2001:db8:0:200::1") != range_of("2001:db8:0:100::1")
    assert range_of("127.0.0.1") is None and range_of("::1") is None and range_of("127.8.9.10") is None
    assert range_of("not an address") is None and range_of("") is None
    assert range_of("127.0.0.1", unlimited=()) == "127.0.0.1/32"


def test_a_range_holds_its_cap_and_others_are_unaffected() -> None:
    held = ["198.51.100.7"] * 3 + ["198.51.100.8", "2001:db8:0:1ff::1"]
    assert full_range("198.51.100.7", held, 3) == "198.51.100.7/32"
    assert full_range("198.51.100.7", held, 4) is None
    assert full_range("198.51.100.8", held, 1) == "198.51.100.8/32"
    assert full_range("198.51.100.9", held, 1) is None
    assert full_range("2001:db8:0:100::2", held, 1) == "2001:db8:0:100::/56"
    assert full_range("127.0.0.1", ["127.0.0.1"] * 1000, 8) is None  # loopback: the operator's own


def test_a_relayed_connection_has_no_address_of_its_own() -> None:
    relayed = SimpleNamespace(
        get_connection_type=lambda: "ConnectionType.RELAYED",
        get_transport_addresses=lambda: ["/ip4/198.51.100.7/tcp/4001"],
    )
    direct = SimpleNamespace(
        get_connection_type=lambda: "ConnectionType.DIRECT",
        get_transport_addresses=lambda: ["/ip4/198.51.100.7/tcp/4001"],
    )
    assert remote_ip(relayed) == "" and remote_ip(direct) == "198.51.100.7"
    assert remote_ip(object()) == ""


def test_one_address_holds_at_most_its_inbound_connections_on_real_hosts() -> None:
    """Five keys dial a node from one address (loopback counted here, cap 2): two connect, three are
    refused and counted; when one leaves, a new key gets its place; the node's own outbound dial to a
    sixth key on that address is not refused."""
    limits = StreamLimits(ip_connections=2, ip_unlimited=())
    victim = Identity.from_seed(bytes([90]) * 32)
    keys = [Identity.from_seed(bytes([91 + i]) * 32) for i in range(6)]

    async def main() -> None:
        async with open_transport(victim, limits=limits) as v:
            addr = v.listen_addrs()[0]
            async with trio.open_nursery() as n:
                clients = []
                for k in keys[:5]:
                    clients.append(await n.start(_client, k))
                results = []
                for c in clients:
                    try:
                        with trio.fail_after(15):
                            await c.connect(addr)
                    except Exception:
                        pass
                    with trio.fail_after(15):
                        while v.peer_id in c.peers() and c.peer_id not in v.peers():
                            await trio.sleep(0.02)
                    results.append(c.peer_id in v.peers())
                assert sum(results) == 2, results
                assert v.budget.counters["connections_refused_ip"] >= 3, v.budget.counters
                # a place freed by a leaving key goes to a new one
                first = clients[results.index(True)]
                await first.disconnect(v.peer_id)
                with trio.fail_after(15):
                    while first.peer_id in v.peers():
                        await trio.sleep(0.02)
                late = clients[results.index(False)]
                with trio.fail_after(15):
                    await late.connect(addr)
                    while late.peer_id not in v.peers():
                        await trio.sleep(0.02)
                # the node's own dial is outbound: not counted against the address
                sixth = await n.start(_client, keys[5])
                with trio.fail_after(15):
                    await v.connect(sixth.listen_addrs()[0])
                    while sixth.peer_id not in v.peers():
                        await trio.sleep(0.02)
                n.cancel_scope.cancel()

    trio.run(main)


async def _client(k: Identity, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_transport(k) as t:
        task_status.started(t)
        await trio.sleep_forever()
