"""The peer table (sans-IO, part of `node.core.machine`): the newest announce of each peer, bounded.

A peer enters when its signed announce names the peer id of its signer (never our own, relayed back)
and stays while it announces; an announce whose seq is not above the one held changes nothing (a replay
or a reordering). The table holds at most `max_peers` rows: a new peer evicts the least recently seen one
(counted). A peer silent for `PEER_EXPIRY_S` no longer counts for roles, demand and catch-up sources
(`live`), and one silent for `PEER_FORGET_S` is dropped (`expire`). A peer heard for the first time
yields its greeting: `ResendTaskSets` (our task sets are not re-gossiped otherwise), a log line and
`SeePeer` (persist it for discovery).

The distinct producers heard (announces that state a publishing rate, within `PEER_EXPIRY_S`) are counted
apart from the table, so the count is not bounded by `max_peers`. With the rollout batches/s the live peers
announce per lineage, they are what the announce topic says swarm-wide (`swarm`): from the announces taken,
or from the topic's sums a driver fed (`SwarmHeard`, no older than `PEER_EXPIRY_S`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from murmur.gossip import exchange, wire
from murmur.gossip.identity import peer_id_from_public
from murmur.node.core.events import Action, AnnounceHeard, Log, ResendTaskSets, SeePeer, SwarmHeard

PEER_EXPIRY_S = 30.0  # a peer silent this long no longer counts for roles and demand
PEER_FORGET_S = 120.0  # ... and this long is dropped from the table


@dataclass(slots=True)
class PeerInfo:
    announce: wire.NodeAnnounce
    public: bytes
    seen: float


@dataclass(frozen=True, slots=True)
class SwarmFigures:
    """What the announce topic says swarm-wide (`PeerTable.swarm`)."""

    producers: int  # producers other than this node
    supply: exchange.Supply  # rollout batches/s announced per lineage
    counts_self: bool  # `supply` includes this node's own last announce


class PeerTable:
    def __init__(self, max_peers: int, own_peer_id: str) -> None:
        self.max_peers = max_peers
        self.own_peer_id = own_peer_id
        self.peers: dict[str, PeerInfo] = {}
        self.evicted = 0
        self.producers = exchange.DistinctCount(window_s=PEER_EXPIRY_S)
        self.topic_sums: tuple[float, SwarmHeard] | None = None  # the last SwarmHeard fed, and when

    def on_announce(self, ev: AnnounceHeard, now: float, out: list[Action]) -> bool:
        """Record a verified announce: whether it was taken (False: another key's peer id, our own, or not
        newer than the one held). A new peer's greeting is appended to `out`."""
        body = ev.body
        if peer_id_from_public(ev.signer) != body.peer_id or body.peer_id == self.own_peer_id:
            return False
        prev = self.peers.get(body.peer_id)
        if prev is not None and prev.announce.seq >= body.seq:
            return False
        if prev is None and len(self.peers) >= self.max_peers:
            seen = [info.seen for info in self.peers.values()]  # the first least recently seen, in C
            del self.peers[next(itertools.islice(self.peers, seen.index(min(seen)), None))]
            self.evicted += 1
        self.peers[body.peer_id] = PeerInfo(body, bytes(ev.signer), now)
        if body.publish_batches_per_s > 0:
            self.producers.add(body.peer_id, now)
        if prev is None:
            out += [
                ResendTaskSets(),
                Log("peer announced", {"peer": body.peer_id, "roles": list(body.roles)}),
                SeePeer(body.peer_id, bytes(ev.signer), tuple(body.addrs), ev.data),
            ]
        return True

    def on_swarm(self, ev: SwarmHeard, now: float) -> None:
        """A driver fed the announce topic's swarm-wide sums."""
        self.topic_sums = (now, ev)

    def swarm(self, now: float) -> SwarmFigures:
        """What the announce topic says swarm-wide: the sums fed last, while no older than `PEER_EXPIRY_S`;
        else the distinct producers heard and what the live peers announce, each on the lineage it serves
        (or else owns)."""
        if self.topic_sums is not None and now - self.topic_sums[0] <= PEER_EXPIRY_S:
            fed = self.topic_sums[1]
            return SwarmFigures(fed.producers, fed.supply, True)
        supply = exchange.Supply()
        for _, p in self.live(now):
            a = p.announce
            if not a.publish_batches_per_s > 0:
                continue
            lid = bytes(a.serving) or (bytes(a.owned[0].lineage) if a.owned else b"")
            if lid:
                supply.add(lid, min(a.publish_batches_per_s, 1e3))
        return SwarmFigures(self.producers.count(now), supply, False)

    def gone(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)

    def expire(self, now: float) -> None:
        """Drop the peers silent for longer than `PEER_FORGET_S`."""
        for pid in [p for p, info in self.peers.items() if now - info.seen > PEER_FORGET_S]:
            del self.peers[pid]

    def live(self, now: float) -> Iterator[tuple[str, PeerInfo]]:
        """The peers heard within `PEER_EXPIRY_S`, in the table's order."""
        for pid, p in self.peers.items():
            if now - p.seen <= PEER_EXPIRY_S:
                yield pid, p
