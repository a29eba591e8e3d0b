"""The virtual simulator's network: links, topology, delivery, and the rollout shard topics as GossipSub
moves batches on them.

- Links are `simulations.wan.LinkModel` (bandwidth queues, latency, jitter, loss as retransmission delay)
  between every pair of nodes.
- Announces and manifests are one hop: they go to a node's `ctrl` peers, its `degree` random neighbours
  (a connected random graph) plus the scenario's follow edges (a follower and the publisher it is
  configured to follow are connected).
- The live announce topic reaches every node, so what it would tell each core is kept here once: the
  number of live producers, each one's announced supply (`exchange.Supply`) and when each first announced
  (the table every node's `ShardGate` reads).
- Rollout batches move on the shard topics the cores join: each topic has a mesh among its subscribers
  (a joining node GRAFTs up to D = 6 random subscribers, a mesh falling below D_low = 4 is topped up, a
  leaving node is PRUNEd); a publisher subscribed to its batch's shard sends it to its mesh peers, one
  that is not to D random subscribers (fanout); a receiver that accepts a batch passes it on once to each
  mesh peer but the one it came from and its publisher; a copy that reaches a node that already has it is
  a duplicate (counted, and its bytes, not verified: py-libp2p drops it by message id first). The mesh
  assumes a node can reach any subscriber of its shards (a live node connects to the peers it hears).
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import filterfalse
from typing import Any

from murmur.gossip import exchange, wire
from murmur.gossip.errors import MurmurError
from murmur.gossip.exchange import ShardGate
from murmur.simulations.scenario import Scenario
from murmur.simulations.vcache import Memo, SharedVerification
from murmur.simulations.vevents import BatchArrives, EventQueue
from murmur.simulations.vnode import VNode
from murmur.simulations.wan import LinkModel, LinkSpec

MESH_D, MESH_D_LOW, MESH_D_HIGH = 6, 4, 12  # GossipSub's mesh degree as the live host sets it (gossip/host.py)


class Network:
    """Every link, connection and topic of one simulated swarm. `rng` is the simulation's shared draw
    stream (topology, mesh grafts, fanout), so a seed gives one run."""

    def __init__(
        self,
        sc: Scenario,
        nodes: list[VNode],
        queue: EventQueue,
        rng: random.Random,
        counts: Counter[str],
        shared: SharedVerification | None,
        memo_horizon_s: float,
    ) -> None:
        self.sc = sc
        self.nodes = nodes
        self.queue = queue
        self.rng = rng
        self.counts = counts
        self.shared = shared
        self.links = LinkModel([LinkSpec.of(n.spec) for n in nodes], seed=sc.seed)
        # envelope bytes -> (envelope, body) of announces and manifests in flight: every receiver of the same
        # bytes gets the same verdict (a pure function of them, as in vcache.py); failures are not kept
        self.opened = Memo(1_000_000, queue.unix, memo_horizon_s)
        # the announce topic's view
        self.alive_producers = 0
        self.supply = exchange.Supply()  # batches/s per lineage, as the announces of live nodes state
        self.heard = ShardGate()  # when each node first announced: one table every node's gate reads
        self.supplied: dict[int, tuple[bytes, float]] = {}  # node -> what its last announce added
        # the rollout shard topics: subscribers and each subscriber's mesh peers
        self.subs: dict[int, set[int]] = {}
        self.mesh: dict[int, dict[int, set[int]]] = {}
        self.full: dict[int, set[int]] = {}  # shard -> its subscribers whose mesh holds MESH_D_HIGH peers
        self.got = Memo(2_000_000, queue.unix, memo_horizon_s)  # batch bytes -> nodes that have it
        self.shards_seen = 1

    # ------------------------------------------------------------ connections and one-hop messages

    def connect(self) -> None:
        """Each node's neighbours (a connected random graph of the scenario's degree) and control peers."""
        nodes = self.nodes
        n = len(nodes)
        d = self.sc.gossip.degree
        adj: list[set[int]] = [set() for _ in range(n)]
        if d >= n - 1:
            for i in range(n):
                adj[i] = set(range(n)) - {i}
        else:
            order = list(range(n))
            self.rng.shuffle(order)
            for a, b in zip(order, order[1:] + order[:1]):
                adj[a].add(b)
                adj[b].add(a)
            for i in range(n):
                tries = 0
                while len(adj[i]) < d and tries < 20 * d:
                    j = self.rng.randrange(n)
                    tries += 1
                    if j != i:
                        adj[i].add(j)
                        adj[j].add(i)
        ctrl = [set(a) for a in adj]
        for node in nodes:  # a follower is connected to the publisher of the lineage it is configured to follow
            if node.spec.role == "follower" and node.spec.follow is not None:
                ctrl[node.spec.index].add(node.spec.follow)
                ctrl[node.spec.follow].add(node.spec.index)
        for i, node in enumerate(nodes):
            node.neighbours = sorted(adj[i])
            node.ctrl = sorted(ctrl[i])

    def latency(self, a: int, b: int) -> float:
        return self.links.links[a].latency_s + self.links.links[b].latency_s

    def send(self, src: VNode, targets: list[int], arrives: Any, data: bytes) -> None:
        """One-hop gossip: `data` to each live target over the links, arriving as `arrives(node, src, data,
        inc)` (`AnnounceArrives`, `ManifestArrives`)."""
        for j in targets:
            dst = self.nodes[j]
            if dst.alive:
                at = self.links.send(src.spec.index, j, len(data), self.queue.now)
                self.queue.push(at, arrives(j, src.spec.index, data, dst.inc))

    def open(self, data: bytes, kind: str) -> tuple[wire.Envelope, Any] | None:
        """What a node's gossip layer does with an announce or manifest: size, structure, signature, body."""
        hit = self.opened.get(data)
        if hit is not None:
            return hit
        try:
            env = wire.decode_envelope(data, kind, swarm=self.sc.swarm)
            if self.shared is not None:
                self.shared.verify_envelope(env)
                got = env, self.shared.decode_body(env)
            else:
                wire.verify_envelope(env)
                got = env, wire.decode_body(env)
        except MurmurError:
            self.counts[f"{kind}_refused"] += 1
            return None
        self.opened.put(data, got)
        return got

    # ------------------------------------------------------------ the announce topic

    def announced(self, n: VNode, data: bytes) -> None:
        """A node announced: the swarm-wide supply view the live announce topic gives every node."""
        got = self.open(data, wire.NODE_ANNOUNCE)
        if got is None:
            return
        self.heard.announced(n.peer_id, self.queue.unix())  # every gate hears it, as from the live announce topic
        a = got[1]
        lid = bytes(a.serving) or (bytes(a.owned[0].lineage) if a.owned else b"")
        new = (lid, min(a.publish_batches_per_s, 1e3)) if lid and a.publish_batches_per_s > 0 else None
        self.withdraw(n.spec.index)
        if new is not None:
            self.supplied[n.spec.index] = new
            self.supply.add(*new)

    def withdraw(self, i: int) -> None:
        """Node `i`'s last announced supply no longer stands (it announced again, or left)."""
        old = self.supplied.pop(i, None)
        if old is not None:
            self.supply.add(old[0], -old[1])

    def shards_now(self) -> int:
        """The shard count the live producers agree on (the largest of the cores' near-equal counts)."""
        return exchange.shard_count(self.alive_producers, self.shards_seen) if self.alive_producers else 1

    # ------------------------------------------------------------ the shard topics (GossipSub, modelled)

    def subscribe(self, n: VNode, shards: int, subscribe: tuple[int, ...]) -> None:
        """What `GossipService.set_shards` does: leave (PRUNE) and join (GRAFT up to D subscribers)."""
        i = n.spec.index
        n.intake.shards = shards
        self.shards_seen = max(self.shards_seen, shards)
        want = set(subscribe)
        for j in [j for j in n.shards if j not in want]:
            self.subs.get(j, set()).discard(i)
            mesh = self.mesh.get(j, {})
            full = self.full.setdefault(j, set())
            full.discard(i)
            for k in mesh.pop(i, set()):
                peers = mesh.get(k)
                if peers is not None:
                    peers.discard(i)
                    if len(peers) < MESH_D_HIGH:
                        full.discard(k)
                    if len(peers) < MESH_D_LOW:
                        self._graft(j, k)
        for j in sorted(want - set(n.shards)):
            self.subs.setdefault(j, set()).add(i)
            self.mesh.setdefault(j, {})[i] = set()
            self._graft(j, i)
        n.shards = tuple(sorted(want))

    def _graft(self, j: int, i: int) -> None:
        mesh = self.mesh[j]
        mine = mesh[i]
        need = MESH_D - len(mine)
        if need <= 0:
            return
        full = self.full.setdefault(j, set())
        # the subscribers but i, its mesh peers and the full ones, in the set's order; filtered in C (a shard
        # every node joins at start has thousands of subscribers)
        cands = list(
            filterfalse(i.__eq__, filterfalse(mine.__contains__, filterfalse(full.__contains__, self.subs[j])))
        )
        for k in self.rng.sample(cands, need) if len(cands) > need else cands:
            mine.add(k)
            peers = mesh[k]
            peers.add(i)
            if len(peers) >= MESH_D_HIGH:
                full.add(k)

    def publish(self, src: VNode, data: bytes, shard: int) -> bool:
        """A batch published to a shard: to the publisher's mesh peers, or (not subscribed) to D random
        subscribers (fanout); none subscribed: it goes nowhere (a live publish error)."""
        i = src.spec.index
        mesh = self.mesh.get(shard, {})
        if i in mesh:
            targets = list(mesh[i])
        else:
            subs = self.subs.get(shard)
            if not subs:
                self.counts["publish_no_subscriber"] += 1
                return False
            targets = list(subs) if len(subs) <= MESH_D else self.rng.sample(list(subs), MESH_D)
        self.got.put(data, {i})
        self._forward(src, i, data, shard, targets)
        return True

    def first_copy(self, d: VNode, data: bytes) -> bool:
        """A copy of a batch reached `d`: True if it is the first, else it is counted as a duplicate."""
        got = self.got.get(data)
        if got is None:
            got = set()
            self.got.put(data, got)
        if d.spec.index in got:
            d.duplicates += 1
            return False
        got.add(d.spec.index)
        return True

    def pass_on(self, d: VNode, fwd: int, origin: int, data: bytes, shard: int) -> None:
        """`d` accepted a batch that came from `fwd`: GossipSub forwards it to its other mesh peers."""
        mesh = self.mesh.get(shard, {}).get(d.spec.index, ())
        self._forward(d, origin, data, shard, [k for k in mesh if k != fwd and k != origin])

    def _forward(self, src: VNode, origin: int, data: bytes, shard: int, targets: list[int]) -> None:
        got = self.got.get(data)
        for j in targets:
            dst = self.nodes[j]
            if not dst.alive:
                continue
            if got is not None and j in got:  # it has it: a duplicate, dropped by message id on arrival
                dst.duplicates += 1
                self.links.bytes_up[src.spec.index] += len(data)
                self.links.bytes_down[j] += len(data)
                continue
            at = self.links.send(src.spec.index, j, len(data), self.queue.now)
            self.queue.push(at, BatchArrives(j, src.spec.index, origin, shard, data, dst.inc))
