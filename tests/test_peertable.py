"""The peer table (`node.core.peertable`) on its own: which announces enter, the greeting of a new peer, the bound
and its eviction order, expiry and forgetting, the producer count and the swarm-wide figures."""

from __future__ import annotations

from murmur.gossip import exchange, wire
from murmur.gossip.identity import Identity
from murmur.node.core.events import AnnounceHeard, Log, ResendTaskSets, SeePeer, SwarmHeard
from murmur.node.core.peertable import PEER_EXPIRY_S, PEER_FORGET_S, PeerTable

ME = Identity.from_seed(b"\1" * 32)


def key(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def heard(
    ident: Identity,
    seq: int,
    rate: float = 0.0,
    signer: Identity | None = None,
    addrs: tuple[str, ...] = (),
    serving: bytes = b"",
) -> AnnounceHeard:
    body = wire.NodeAnnounce(
        v=1,
        peer_id=ident.peer_id,
        seq=seq,
        created_ms=1,
        hardware="cpu",
        gen_tokens_per_s=0.0,
        rollout_latency_s=0.0,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["trainer"],
        lineages_followed=[],
        serving=serving,
        owned=[],
        addrs=list(addrs),
        publish_batches_per_s=rate,
    )
    return AnnounceHeard((signer or ident).public, body, b"envelope %d" % seq)


def take(t: PeerTable, ev: AnnounceHeard, now: float) -> list | None:
    """`PeerTable.on_announce`'s appended actions when it took the announce, None when it did not."""
    out: list = []
    return out if t.on_announce(ev, now, out) else None


def test_a_new_peer_is_greeted_once_and_a_known_one_is_updated_silently() -> None:
    t = PeerTable(16, ME.peer_id)
    p = key(9)
    got = take(t, heard(p, 1, addrs=("/ip4/1.2.3.4/tcp/1",)), 5.0)
    assert got == [
        ResendTaskSets(),
        Log("peer announced", {"peer": p.peer_id, "roles": ["trainer"]}),
        SeePeer(p.peer_id, p.public, ("/ip4/1.2.3.4/tcp/1",), b"envelope 1"),
    ]
    assert take(t, heard(p, 2), 6.0) == []
    assert t.peers[p.peer_id].announce.seq == 2 and t.peers[p.peer_id].seen == 6.0
    assert t.peers[p.peer_id].public == p.public


def test_an_announce_not_newer_than_the_one_held_changes_nothing() -> None:
    t = PeerTable(16, ME.peer_id)
    p = key(9)
    take(t, heard(p, 5), 1.0)
    assert take(t, heard(p, 5), 2.0) is None  # a replay
    assert take(t, heard(p, 4), 3.0) is None  # reordered
    assert t.peers[p.peer_id].announce.seq == 5 and t.peers[p.peer_id].seen == 1.0


def test_announces_for_another_key_or_for_ourselves_are_ignored() -> None:
    t = PeerTable(16, ME.peer_id)
    assert take(t, heard(key(9), 1, signer=key(10)), 1.0) is None  # signed by a key it does not name
    assert take(t, heard(ME, 1), 1.0) is None  # our own, relayed back
    assert t.peers == {}


def test_a_full_table_evicts_the_least_recently_seen_peer() -> None:
    t = PeerTable(3, ME.peer_id)
    a, b, c, d = key(10), key(11), key(12), key(13)
    for i, p in enumerate((a, b, c)):
        take(t, heard(p, 1), float(i))
    take(t, heard(a, 2), 10.0)  # a heard again: b is now the least recently seen
    assert take(t, heard(d, 1), 11.0) is not None
    assert set(t.peers) == {a.peer_id, c.peer_id, d.peer_id} and t.evicted == 1
    take(t, heard(c, 2), 12.0)  # an update of a known peer evicts no one
    assert len(t.peers) == 3 and t.evicted == 1


def test_live_peers_are_those_heard_within_the_expiry_and_silent_ones_are_forgotten_later() -> None:
    t = PeerTable(16, ME.peer_id)
    old, mid, new = key(10), key(11), key(12)
    take(t, heard(old, 1), 0.0)
    take(t, heard(mid, 1), PEER_FORGET_S - PEER_EXPIRY_S)
    take(t, heard(new, 1), PEER_FORGET_S)
    now = PEER_FORGET_S
    assert [pid for pid, _ in t.live(now)] == [mid.peer_id, new.peer_id]  # mid exactly at the expiry age
    t.expire(now)
    assert set(t.peers) == {old.peer_id, mid.peer_id, new.peer_id}  # `old` is exactly at the forget age
    t.expire(now + 0.5)
    assert set(t.peers) == {mid.peer_id, new.peer_id}


def test_a_gone_peer_leaves_the_table() -> None:
    t = PeerTable(16, ME.peer_id)
    p = key(9)
    take(t, heard(p, 1), 0.0)
    t.gone(p.peer_id)
    t.gone("never heard")
    assert t.peers == {}
    assert take(t, heard(p, 1), 1.0) is not None  # heard again: a new peer, greeted again


def test_producers_are_counted_beyond_the_table_bound_and_only_when_they_state_a_rate() -> None:
    t = PeerTable(2, ME.peer_id)
    for i in range(5):
        take(t, heard(key(20 + i), 1, rate=1.5), 1.0)
    take(t, heard(key(40), 1, rate=0.0), 1.0)
    assert len(t.peers) == 2 and t.evicted == 4
    assert t.producers.count(1.0) == 5
    assert t.producers.count(1.0 + PEER_EXPIRY_S + 1) == 0


def test_the_swarm_figures_are_the_announces_taken_or_the_topic_sums_fed_while_fresh() -> None:
    t = PeerTable(16, ME.peer_id)
    lin, other = b"\7" * 32, b"\x08" * 32
    take(t, heard(key(9), 1, rate=2.0, serving=lin), 0.0)
    take(t, heard(key(8), 1, serving=lin), 0.0)  # states no rate: neither a producer nor supply
    f = t.swarm(1.0)
    assert (f.producers, f.supply.by_lineage, f.counts_self) == (1, {lin: 2.0}, False)
    fed = exchange.Supply({lin: 5.0, other: 1.0})
    t.on_swarm(SwarmHeard(40, fed), 2.0)
    f = t.swarm(2.0 + PEER_EXPIRY_S)
    assert (f.producers, f.supply, f.counts_self) == (40, fed, True)  # the sums count this node's announce too
    f = t.swarm(2.5 + PEER_EXPIRY_S)  # the sums are stale, and so are the announces taken
    assert (f.producers, f.supply.by_lineage, f.counts_self) == (0, {}, False)
