"""Virtual-time simulator: one real node core per simulated node, modelled network, clock and learning.

What runs for real (the same code a live node runs):
- each honest node's network process is a `node.core.NodeCore` (the class
  `node.runtime` drives), built from its scenario spec, on the virtual
  clock (`clock` and `wall_ms` injected). The simulator feeds it events
  (`Tick` when its next timer is due, `AnnounceHeard` / `ManifestHeard` for
  messages that reach it, `FromWorker` messages of the modelled worker,
  `PeerGone` one latency after a neighbour leaves, `TransferDone`,
  `StoredItems`, `CatalogReceived` / `CatalogFailed`) and carries out the
  actions it returns. So the announces (timing and content: demand,
  capacity, standby list), the follower's lineage choice and pacing (the
  capacity rule), staleness admission (`sync.staleness.StalenessGuard` inside
  the core), heads (learned only from the announces and manifests that reach
  the node, bounded by the core's lineage table), the patch accept rule,
  catch-up planning, and rollout batching and sealing are the core's. A
  (re)joining node gets a fresh core, as a restarted process does, with the
  followed lineage's held version loaded as the runtime loads it from its
  store;
- every rollout batch is a real `gossip.wire.RolloutBatch` sealed by the
  producer's core with its ed25519 key, and every receiver runs it through
  its own `gossip.validation.Pipeline` (size, decode, signature, replay, task
  regeneration, reward recomputation, staleness against the heads its core
  learned) with its own `gossip.scoring.PeerScores` and rate limiter (bounded
  by the rate each peer's announce states); the cores' `Penalise` actions go
  to the same scores;
- each trainer's worker picks its external groups with its own
  `training.sampler.Sampler`, the sampler a node's worker runs, fed the
  accepted batches the core routes to it (`NodeCore.external_wanted`) and its
  own head each step;
- announces and manifests are real signed envelopes; each receiver checks
  them as its gossip layer does (memoised per process, `simulations/vcache.py`);
- the start-up patch broadcasts run one `sync.transfers.BroadcastCore` per
  node (the class `sync.broadcast` drives on a live node: transfer table,
  manifest requests, node-wide bans, upload round-robin, token-bucket
  pacing, and its `sync.swarm.SwarmSession`s: rarest-first, super-seeding,
  pipelining, corrupt-chunk bans) through `simulations.vsim` over the scenario's
  links, with a real signed manifest and every chunk's hash checked.

- the rollout exchange is `gossip.exchange`, run by each core (its shard
  count, the shards it joins and rotates, the shard it publishes to) and by
  each receiver's `ShardGate` (newcomer budget, wrong shard) before its
  pipeline.

What is modelled:
- the network. Rollout batches move as GossipSub moves them on the shard
  topics the cores join: each shard topic has a mesh among its subscribers
  (a joining node GRAFTs up to D = 6 random subscribers, a mesh falling below
  D_low = 4 is topped up, a leaving node is PRUNEd); a publisher subscribed
  to its batch's shard sends it to its mesh peers, one that is not to D
  random subscribers (fanout); a receiver that accepts a batch forwards it
  once to each mesh peer but the one it came from; a copy that reaches a node
  that already has it is a duplicate (counted, and its bytes, not verified:
  py-libp2p drops it by message id first). The mesh assumes a node can reach
  any subscriber of its shards (a live node connects to the peers it hears).
  Announces and manifests are one hop: they go to the `degree` neighbours
  and along the scenario's follow edges (a follower and the publisher it is
  configured to follow are connected); the live announce topic reaches every
  node, so each core's exchange is given the number of live producers (what
  that topic would have told it) instead of counting the few it heard. Links
  are `simulations.wan.LinkModel` (bandwidth queues, latency, jitter, loss as
  retransmission delay);
- the clock: virtual seconds (`EPOCH` + t as unix time);
- compute: a step takes `step_s / compute` virtual seconds (a follower's no
  less than its core's pace allows); a trainer's step that trains on u groups
  (local and external) takes `1 - train_share * (1 - u / I)` times that, so
  training on the swarm's groups costs the trainer its own time;
- the worker: it answers the core through the node's pipe messages
  (`node.pipe`: Ready, Rollouts, Step, Gen, Perf, Published, Applied) and
  obeys Follow, Admit, Pace and Patch; it applies stored patches in order
  from the version it holds, as `node/worker.py` does;
- learning: a node's policy is one number, its skill p = probability that a
  completion is correct. A step draws the completions' correctness from p,
  writes correct or wrong answer text, and scores it with the real verifier.
  A group is informative when its rewards are not all equal (GRPO drops the
  others). After a step, p += rate * (ceiling - p) * (u_local + w_own * u_own
  + w * u_other) / 8, with u the informative groups used (local, and the
  external ones its sampler gave: of its own lineage, from its followers, and
  of other lineages). The isolated twin of each node trains on I + J local groups
  with the same rule and its own draws, step for step (SAPO's comparison:
  `gain_swarm`); the alone twin trains on I local groups on its own clock,
  each of its steps costing what the same rule charges, so at equal virtual
  time it has spent the node's compute alone (the compute-matched benchmark's
  comparison: `alone`). A follower generates at the skill its publisher had
  at the version it holds;
- the patch transfer: the core's `SeedVersion` sends the signed manifest over
  the modelled gossip and a catch-up `RequestOffer` has the peer send it to
  the asker; a receiver whose core accepts it (`NodeCore.offer_manifest`)
  gets the bytes one patch-broadcast delay later (scaled by the item's size),
  the delay per follower measured once at start-up by a broadcast of the
  scenario's patch size through the nodes' broadcast cores (above). Later
  versions are not broadcast again: each takes that delay, so patches in
  flight at once do not compete for links in the main run. Patch contents
  are modelled (the manifest's chunk hashes are tokens); storing is a dict
  per node.
- adversaries run no core: they send hostile bytes (see `_ev_adv`).

Memory follows the swarm's size and message rate, not the run's length: the
per-process memos keep only messages in flight (`MEMO_HORIZON_S` of virtual
time), and a node's state is what it heard (its core's peer and lineage
tables, bounded by `CoreSettings.max_peers` / `max_lineages`, pipeline
caches, scores, sampler); report rows are kept once.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import heapq
import math
import os
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import filterfalse
from pathlib import Path
from typing import Any

from gossip import exchange, wire
from gossip.errors import MurmurError
from gossip.exchange import ShardGate, Stats, shard_of
from gossip.identity import Identity, peer_id_from_public
from gossip.scoring import ScoreParams
from gossip.validation import PENALTIES, Pending, Pipeline, PipelineConfig, Reason
from node import pipe
from node.core import (AnnounceHeard, CatalogFailed, CatalogReceived, CoreSettings, DropItem, FetchCatalog, FromWorker,
                       LineageKnown, LoadStored, Log, ManifestHeard, NodeCore, OfferFailed, PatchStored, PeerGone,
                       Penalise, Publish, RecordRollouts, RequestOffer, RolloutsPublished, RolloutsVerified, SeedVersion,
                       StoredItems, StorePatch, Subscribe, Tick, ToWorker, TransferDone)
from simulations import curves
from simulations.report import MetricsWriter, write_report
from simulations.scenario import NodeSpec, Scenario, dumps, expand
from simulations.vcache import Memo, SharedVerification, SimPipeline
from simulations.wan import LinkModel, LinkSpec, broadcast_lower_bound
from sync.ids import lineage_id
from sync.items import KIND_CODEC, MAX_ITEMS, StoredItem, item_of
from simulations.vsim import SimLink, VirtualSwarm
from training.sampler import Sampler, split
from training.tasksets import BUILTIN_TRAIN, TaskRegistry
from training.verifiers import score

EPOCH = 1_700_000_000.0  # virtual t = 0 as unix time (pipeline freshness checks and created_ms use unix time)
TOKENIZER = hashlib.blake2b(b"murmur/sim-tokenizer", digest_size=32).digest()
BASE_MODEL = hashlib.blake2b(b"murmur/sim-base-model", digest_size=32).digest()  # every node's base model
LINEAGE_NAME = "sim"
MODEL_PATCHES = 8  # the modelled model state weighs this many patches (the core's manifest size check reads it)
TOKENS_PER_ROLLOUT = 8  # the modelled completions' max_new_tokens: what throughput is counted in
WORKER_S = 0.001  # a worker message reaches the network process this long after the worker sends it
SEED_RANGE = 1_000_000
POOL_GROUPS = 256  # a trainer's sampler holds the newest this many informative groups
ALONE_POINTS = 20  # marks of virtual time at which the alone comparison is read
MAX_ALONE_STEPS = 64  # alone-twin steps per node step: its steps are never much shorter than the node's
MEMO_HORIZON_S = 5.0  # virtual seconds a per-message memo entry is kept: a batch reaches its receivers sooner
TICK = Tick()
MESH_D, MESH_D_LOW, MESH_D_HIGH = 6, 4, 12  # GossipSub's mesh degree as the live host sets it (gossip/host.py)


def identity_for(seed: int, index: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(f"murmur-sim/{seed}/{index}".encode(), digest_size=32).digest())


@dataclass
class _Alone:
    """A trainer's compute-matched twin: I local groups a step, its own draws and its own clock."""

    skill: float
    rng: random.Random
    clock: float | None = None  # virtual time its steps have reached (None: the node has not stepped)
    until: float = 0.0  # the end of the node's last step: time the node was away is not the twin's either
    curve: list[tuple[float, float]] = field(default_factory=list)  # (t, skill) after each of its steps


@dataclass
class VNode:
    """One simulated node: its network process is a real `NodeCore` and its own pipeline; its worker is
    modelled here (skill, held version, the worker's real `Sampler`)."""

    spec: NodeSpec
    ident: Identity
    peer_id: str
    lineage: bytes  # the lineage this node publishes when it trains (sync.ids.lineage_id of its key)
    skill: float
    iso_skill: float
    rng: random.Random
    alone: _Alone | None = None  # trainers: the compute-matched twin
    pipeline: Pipeline | None = None
    core: NodeCore | None = None  # None for adversaries (they send hostile bytes, they run no node)
    sampler: Sampler | None = None  # trainers: the worker's external-rollout sampler
    alive: bool = False
    inc: int = 0  # incarnation: events scheduled before a leave are ignored after it
    version: int = 0  # trainers: own lineage version
    steps: int = 0
    neighbours: list[int] = field(default_factory=list)  # rollout gossip
    ctrl: list[int] = field(default_factory=list)  # announces and manifests: neighbours + follow edges
    # the modelled worker
    following: bytes | None = None  # the lineage the core told it to follow (pipe.Follow)
    admitted: bool = False  # pipe.Admit: the core's staleness admission
    pace: float = 0.0  # pipe.Pace: rollouts/s cap (0 = none)
    held_lineage: bytes | None = None
    held: int = 0  # the version of held_lineage the worker holds (0: the base model)
    store: dict[bytes, dict[tuple[str, int, int], bytes]] = field(default_factory=dict)  # item -> manifest envelope
    transfers: dict[bytes, tuple[bytes, wire.PatchManifest, float]] = field(default_factory=dict)
    reward_sum: float = 0.0
    iso_sum: float = 0.0
    curve: list[tuple[float, float]] = field(default_factory=list)  # trainers: (t, skill) after each step
    consumed_ext: int = 0
    adv_accepted: int = 0
    seq: int = 0  # adversaries' own batch sequence
    sent_batches: list[bytes] = field(default_factory=list)
    patch_delay: float = 0.0
    gate: ShardGate = field(default_factory=ShardGate)  # the gossip service's exchange gate
    stats: Stats = field(default_factory=Stats)  # received, verified, dropped, distinct producers
    shards: tuple[int, ...] = ()  # rollout shards subscribed
    shard_count: int = 1
    duplicates: int = 0  # copies of a batch it already had


class VirtualSim:
    def __init__(self, sc: Scenario, out_dir: str | Path | None = None, *,
                 progress: bool = False, max_events: int = 50_000_000, shared_verify: bool = True) -> None:
        self.created, self.created_cpu = time.perf_counter(), time.process_time()  # building the nodes counts too
        self.sc = sc
        self.out_dir = Path(out_dir) if out_dir else None
        self.progress = progress
        self.max_events = max_events
        self.rng = random.Random(sc.seed)
        self.specs = expand(sc)
        self.registry = TaskRegistry(sc.swarm)
        self.registry.add_builtin()
        self.task_set = self.registry.builtin_id
        # one memo of the pure verification work per process (simulations/vcache.py says why it is faithful)
        self.shared = (SharedVerification(self.registry.resolve, score, clock=self._unix, horizon_s=MEMO_HORIZON_S)
                       if shared_verify else None)
        self._resolve = self.shared.resolve_task if self.shared else self.registry.resolve
        self._score = self.shared.reward if self.shared else score
        self.links = LinkModel([LinkSpec.of(s) for s in self.specs], seed=sc.seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self.metrics = MetricsWriter(self.out_dir, sc.report.format) if self.out_dir else None
        self.rows: dict[str, list[dict[str, Any]]] = self.metrics.rows if self.metrics else {}
        self.rejections: Counter[str] = Counter()
        self.core_logs: Counter[str] = Counter()  # the cores' Log actions, by message
        self.counts: Counter[str] = Counter()  # what the simulator carried out for the cores
        # accepted batch id -> its split, for the receivers still to come (in flight only, like the memos)
        self._groups = Memo(1_000_000, self._unix, MEMO_HORIZON_S)
        # envelope bytes -> (envelope, body) of announces and manifests in flight: every receiver of the same
        # bytes gets the same verdict (a pure function of them, as in vcache.py); failures are not kept
        self._opened = Memo(1_000_000, self._unix, MEMO_HORIZON_S)
        self.skill_at: dict[bytes, list[float]] = {}  # lineage -> skill per version (followers sample from it)
        self.nodes: list[VNode] = []
        self.score_params = ScoreParams(graylist_threshold=sc.gossip.graylist_threshold,
                                        blacklist_s=sc.gossip.blacklist_s)
        for s in self.specs:
            ident = identity_for(sc.seed, s.index)
            if self.shared is not None:  # what it signs enters the signature memo as valid (vcache.py says why)
                ident = self.shared.signer(ident)
            node_rng = random.Random(self.rng.randrange(2**63))
            p0 = min(sc.learning.ceiling, max(0.0, sc.learning.initial + node_rng.uniform(-1, 1) * sc.learning.spread))
            n = VNode(s, ident, ident.peer_id, lineage_id(ident.public, BASE_MODEL, LINEAGE_NAME), p0, p0, node_rng)
            n.pipeline = self._pipeline(n)
            if s.role == "trainer":
                n.sampler = Sampler(POOL_GROUPS, sc.training.max_staleness, seed=sc.seed * 100_003 + s.index)
                n.sampler.observe_head(n.lineage, 0)
                self.skill_at[n.lineage] = [n.skill]
                # its own stream: the twin's draws leave every other draw of the run as it was
                n.alone = _Alone(p0, random.Random(sc.seed * 1_000_003 + s.index))
            self.nodes.append(n)
        self.by_peer = {n.peer_id: n for n in self.nodes}
        self.trainer_ids = [n.spec.index for n in self.nodes if n.spec.role == "trainer"]
        # the rollout shard topics: subscribers and each subscriber's mesh peers
        self.subs: dict[int, set[int]] = {}
        self.mesh: dict[int, dict[int, set[int]]] = {}
        self._full: dict[int, set[int]] = {}  # shard -> its subscribers whose mesh holds MESH_D_HIGH peers
        self._got = Memo(2_000_000, self._unix, MEMO_HORIZON_S)  # batch bytes -> nodes that have it
        self.alive_producers = 0
        self.supply = exchange.Supply()  # batches/s per lineage, as the announces of live nodes state
        self._heard = ShardGate()  # when each node first announced: one table every node's gate reads
        for n in self.nodes:
            n.gate.first_heard = self._heard.first_heard
        self._supplied: dict[int, tuple[bytes, float]] = {}  # node -> what its last announce added
        self._shards_seen = 1
        self._topology()

    # ------------------------------------------------------------ plumbing

    def _unix(self) -> float:
        return EPOCH + self.now

    def _unix_ms(self) -> int:
        return int((EPOCH + self.now) * 1000)

    def _pipeline(self, n: VNode) -> Pipeline:
        sc = self.sc
        cfg = PipelineConfig(swarm=sc.swarm, max_staleness=sc.training.max_staleness,
                             rate_per_s=sc.gossip.rate_limit_per_s, burst=sc.gossip.rate_burst,
                             replay_entries=50_000, replay_ttl_s=900.0, score=self.score_params)

        def head(lineage: bytes) -> int | None:  # no core yet: no head known (replaced by the core's on join)
            return None

        if self.shared is not None:
            return SimPipeline(cfg, clock=self._unix, resolve_task=self._resolve, reward=self._score,
                               head_version=head, shared=self.shared)
        return Pipeline(cfg, clock=self._unix, resolve_task=self.registry.resolve, reward=score, head_version=head)

    def _new_core(self, n: VNode) -> NodeCore:
        """A (re)started node's network process: a fresh core, as `node.runtime` builds it."""
        s, tr = n.spec, self.sc.training
        follow = (self.nodes[s.follow].lineage,) if s.role == "follower" and s.follow is not None else ()
        settings = CoreSettings(swarm=self.sc.swarm, roles=(s.role,), max_staleness=tr.max_staleness,
                                publish_every=self.sc.sync.publish_every, external_rollouts=tr.external_groups,
                                group_size=tr.group_size, max_new_tokens=TOKENS_PER_ROLLOUT,
                                upload_bytes_per_s=s.upload_bytes_per_s, follow=follow)
        # what the live announce topic tells every node: how many producers there are, what each supplies
        core = NodeCore(settings, n.ident, self._unix, self._unix_ms,
                        producers_count=lambda now: self.alive_producers - 1, supply_view=lambda: self.supply)
        if n.held_lineage is not None and n.held_lineage != n.lineage:  # what its store holds, as the runtime loads it
            lead = self._publisher_of(n.held_lineage)
            core.handle(LineageKnown(n.held_lineage, LINEAGE_NAME, "follow", lead.ident.public, BASE_MODEL, n.held))
        return core

    def _publisher_of(self, lineage: bytes) -> VNode:
        return self._lineage_owner[lineage]

    def _push(self, t: float, kind: str, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, args))

    def _row(self, kind: str, **fields: Any) -> None:
        if self.metrics:  # it keeps the rows for the report: one copy
            self.metrics.add(kind, **fields)
        else:
            self.rows.setdefault(kind, []).append(fields)

    def _topology(self) -> None:
        n = len(self.nodes)
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
        for node in self.nodes:  # a follower is connected to the publisher of the lineage it is configured to follow
            if node.spec.role == "follower" and node.spec.follow is not None:
                ctrl[node.spec.index].add(node.spec.follow)
                ctrl[node.spec.follow].add(node.spec.index)
        for i, node in enumerate(self.nodes):
            node.neighbours = sorted(adj[i])
            node.ctrl = sorted(ctrl[i])
        self._lineage_owner = {node.lineage: node for node in self.nodes}

    def _latency(self, a: int, b: int) -> float:
        return self.links.links[a].latency_s + self.links.links[b].latency_s

    def _send(self, src: VNode, targets: list[int], kind: str, data: bytes) -> None:
        """Modelled one-hop gossip: `data` to each live target over the scenario's links."""
        for j in targets:
            dst = self.nodes[j]
            if dst.alive:
                at = self.links.send(src.spec.index, j, len(data), self.now)
                self._push(at, kind, j, src.spec.index, data, dst.inc)

    def _open(self, data: bytes, kind: str) -> tuple[wire.Envelope, Any] | None:
        """What a node's gossip layer does with an announce or manifest: size, structure, signature, body."""
        hit = self._opened.get(data)
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
        self._opened.put(data, got)
        return got

    # ------------------------------------------------------------ the cores' actions, carried out in virtual time

    def _feed(self, n: VNode, ev: Any) -> None:
        if n.core is not None:
            self._do(n, n.core.handle(ev))

    def _do(self, n: VNode, actions: list[Any]) -> None:  # noqa: C901 - one branch per action
        for a in actions:
            t = type(a)
            if t is Publish:
                if a.topic == "announce":
                    self.counts["announces"] += 1
                    self._supplies(n, a.data)
                    self._send(n, n.ctrl, "announce", a.data)
                else:
                    if self._publish(n, a.data, a.shard):  # as the runtime: counted once it went out
                        self._feed(n, RolloutsPublished(a.count))
            elif t is Subscribe:
                self._subscribe(n, a.shards, a.subscribe)
            elif t is ToWorker:
                self._to_worker(n, a.msg)
            elif t is Log:
                self.core_logs[a.msg] += 1
            elif t is RecordRollouts:
                self.counts["rollouts_recorded"] += len(a.entries)
            elif t is SeedVersion:
                self.counts["versions_seeded"] += 1
                self._send(n, n.ctrl, "manifest", a.envelope)
            elif t is StorePatch:
                self._store_patch(n, a.pid)
            elif t is DropItem:
                items = n.store.get(a.lineage, {})
                for key in [k for k in items if k[1] == a.base and k[2] == a.target]:
                    del items[key]
            elif t is LoadStored:
                self._feed(n, StoredItems(a.lineage, self._items(n, a.lineage)))
            elif t is FetchCatalog:
                self.counts["catalog_requests"] += 1
                dst = self.by_peer.get(a.peer)
                if dst is not None:
                    self._push(self.now + self._latency(n.spec.index, dst.spec.index), "catalog",
                               dst.spec.index, n.spec.index, a.lineage, n.inc)
            elif t is RequestOffer:
                self.counts["offers_requested"] += 1
                dst = self.by_peer.get(a.peer)
                if dst is not None:
                    self._push(self.now + self._latency(n.spec.index, dst.spec.index), "offer",
                               dst.spec.index, n.spec.index, a.lineage, (a.item.kind, a.item.base, a.item.target),
                               n.inc)
            elif t is Penalise:
                n.pipeline.scores.penalise(a.peer, a.reason[:120], a.amount, self._unix())  # type: ignore[union-attr]
            # SeePeer (persist a peer for discovery), ResendTaskSets (one modelled task set): nothing to model;
            # RestartWorker: modelled workers never exit

    def _items(self, n: VNode, lineage: bytes) -> tuple[StoredItem, ...]:
        items = n.store.get(lineage, {})
        return tuple(StoredItem(k, b, t, self._item_bytes(k)) for (k, b, t) in list(items)[-MAX_ITEMS:])

    def _item_bytes(self, kind: str) -> int:
        return self.sc.sync.patch_bytes * (MODEL_PATCHES if kind == "anchor" else 1)

    def _manifest(self, owner: VNode, kind: str, base: int, target: int) -> bytes:
        """The publisher's signed manifest of one item (chunk contents are modelled: their hashes are tokens)."""
        sy = self.sc.sync
        total = self._item_bytes(kind)
        sizes = [sy.chunk_bytes] * (total // sy.chunk_bytes) + ([total % sy.chunk_bytes] if total % sy.chunk_bytes else [])
        tag = hashlib.blake2b(b"%s/%d/%d" % (owner.lineage, base, target), digest_size=32).digest()
        codec = KIND_CODEC[kind]
        m = wire.PatchManifest(v=wire.FORMAT_VERSION, lineage=owner.lineage, lineage_name=LINEAGE_NAME,
                               base_model_hash=BASE_MODEL, publisher=owner.ident.public, base_version=base,
                               target_version=target, base_hash=b"" if kind == "anchor" else tag[:16] + b"base",
                               target_hash=tag[:16], codec=codec, total_bytes=total, chunk_bytes=sy.chunk_bytes,
                               chunks=[wire.ChunkRef(tag, s) for s in sizes], created_ms=self._unix_ms())
        return wire.seal(owner.ident, wire.PATCH_MANIFEST, m, swarm=self.sc.swarm)

    def _store_patch(self, n: VNode, pid: bytes) -> None:
        """The runtime's store step: a completed transfer is written to the lineage store, then reported."""
        got = n.transfers.pop(pid, None)
        if got is None:
            return
        env, m, seconds = got
        it = item_of(m)
        n.store.setdefault(bytes(m.lineage), {})[(it.kind, it.base, it.target)] = env
        self.counts["patches_stored"] += 1
        self._feed(n, PatchStored(m, m.total_bytes, seconds))

    # ------------------------------------------------------------ the modelled worker

    def _from_worker(self, n: VNode, msg: Any, delay: float = WORKER_S) -> None:
        self._push(self.now + delay, "worker", n.spec.index, msg, n.inc)

    def _ev_worker(self, i: int, msg: Any, inc: int) -> None:
        n = self.nodes[i]
        if n.alive and n.inc == inc:
            self._feed(n, FromWorker(msg))

    def _to_worker(self, n: VNode, m: Any) -> None:
        if isinstance(m, pipe.Follow):
            n.following = bytes.fromhex(m.info.id) if m.info is not None else None
            n.admitted = False  # until the core's Admit for the new lineage
            if n.following is not None:
                if n.held_lineage != n.following:
                    n.held_lineage, n.held = n.following, 0  # a lineage new to it starts from the base model
                self._from_worker(n, pipe.Applied(n.following.hex(), n.held))
                self._apply_held(n, n.following)  # as node/worker.py does on opening a lineage
        elif isinstance(m, pipe.Admit):
            n.admitted = m.generate and bytes.fromhex(m.lineage) == n.following
        elif isinstance(m, pipe.Pace):
            n.pace = m.rollouts_per_s
        elif isinstance(m, pipe.Head):
            if n.sampler is not None:  # as node/worker.py's reader does
                n.sampler.observe_head(bytes.fromhex(m.lineage), m.version)
        elif isinstance(m, pipe.Patch):
            self._apply_held(n, bytes.fromhex(m.lineage))

    def _apply_held(self, n: VNode, lineage: bytes) -> None:
        """The worker applies what its store holds, in order from the version it holds (as node/worker.py)."""
        if lineage != n.held_lineage:
            return
        items = n.store.get(lineage, {})
        moved = False
        while True:
            nxt = [t for (k, b, t) in items if t > n.held and (k == "anchor" or b == n.held)]
            if not nxt:
                break
            n.held = max(nxt)
            moved = True
        if moved:
            self._from_worker(n, pipe.Applied(lineage.hex(), n.held))

    def _perf(self, n: VNode, rollouts: int, seconds: float) -> None:
        self._from_worker(n, pipe.Perf(rollouts * TOKENS_PER_ROLLOUT / max(seconds, 1e-9), seconds))

    # ------------------------------------------------------------ rollouts

    def _wrong(self, answer: str, rng: random.Random) -> str:
        try:
            return str(int(answer) + rng.choice((-2, -1, 1, 2, 3)))
        except ValueError:
            return answer + "?"

    def _group(self, node: VNode, lineage: bytes, version: int, skill: float) -> list[wire.Rollout]:
        g = self.sc.training.group_size
        ref = wire.TaskRef(self.task_set, BUILTIN_TRAIN, node.rng.randrange(SEED_RANGE))
        task = self._resolve(ref)
        created = self._unix_ms()
        out = []
        for _ in range(g):
            text = task.answer if node.rng.random() < skill else self._wrong(task.answer, node.rng)
            ids = [ord(c) % 256 for c in text] + [1]
            out.append(wire.Rollout(task=ref, lineage=lineage, version=version, completion_ids=ids, text=text,
                                    tokenizer_hash=TOKENIZER, logprobs=bytes(4 * len(ids)), token_versions=[],
                                    sampling=wire.SamplingParams(max_new_tokens=TOKENS_PER_ROLLOUT),
                                    reward=self._score(task, text), created_ms=created))
        return out

    @staticmethod
    def _informative(rollouts: list[wire.Rollout]) -> bool:
        rewards = [r.reward for r in rollouts]
        return max(rewards) != min(rewards)

    def _seal(self, node: VNode, rollouts: list[wire.Rollout], seq: int | None = None) -> bytes:
        """An adversary's batch (honest nodes' batches are sealed by their cores)."""
        if seq is None:
            node.seq += 1
            seq = node.seq
        batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=self.sc.swarm, producer=node.ident.public, seq=seq,
                                  created_ms=self._unix_ms(), rollouts=rollouts)
        return wire.seal(node.ident, wire.ROLLOUT_BATCH, batch, swarm=self.sc.swarm)

    def _gossip(self, node: VNode, data: bytes, lineage: bytes) -> None:
        """An adversary publishes to the shard of the lineage its batch names, as a producer would."""
        self._publish(node, data, shard_of(lineage, self._shards_now()))

    def _shards_now(self) -> int:
        """The shard count the live producers agree on (the largest of the cores' near-equal counts)."""
        return exchange.shard_count(self.alive_producers, self._shards_seen) if self.alive_producers else 1

    # ------------------------------------------------------------ the shard topics (GossipSub, modelled)

    def _supplies(self, n: VNode, data: bytes) -> None:
        """A node announced: the swarm-wide supply view the live announce topic gives every node."""
        got = self._open(data, wire.NODE_ANNOUNCE)
        if got is None:
            return
        self._heard.announced(n.peer_id, self._unix())  # every gate hears it, as from the live announce topic
        a = got[1]
        lid = bytes(a.serving) or (bytes(a.owned[0].lineage) if a.owned else b"")
        new = (lid, min(a.publish_batches_per_s, 1e3)) if lid and a.publish_batches_per_s > 0 else None
        old = self._supplied.pop(n.spec.index, None)
        if old is not None:
            self.supply.add(old[0], -old[1])
        if new is not None:
            self._supplied[n.spec.index] = new
            self.supply.add(*new)

    def _subscribe(self, n: VNode, shards: int, subscribe: tuple[int, ...]) -> None:
        """What `GossipService.set_shards` does: leave (PRUNE) and join (GRAFT up to D subscribers)."""
        i = n.spec.index
        n.shard_count = shards
        self._shards_seen = max(self._shards_seen, shards)
        want = set(subscribe)
        for j in [j for j in n.shards if j not in want]:
            self.subs.get(j, set()).discard(i)
            mesh = self.mesh.get(j, {})
            full = self._full.setdefault(j, set())
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
        full = self._full.setdefault(j, set())
        # the subscribers but i, its mesh peers and the full ones, in the set's order; filtered in C (a shard
        # every node joins at start has thousands of subscribers)
        cands = list(filterfalse(i.__eq__, filterfalse(mine.__contains__, filterfalse(full.__contains__, self.subs[j]))))
        for k in (self.rng.sample(cands, need) if len(cands) > need else cands):
            mine.add(k)
            peers = mesh[k]
            peers.add(i)
            if len(peers) >= MESH_D_HIGH:
                full.add(k)

    def _publish(self, src: VNode, data: bytes, shard: int) -> bool:
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
        self._got.put(data, {i})
        self._forward(src, i, data, shard, targets)
        return True

    def _forward(self, src: VNode, origin: int, data: bytes, shard: int, targets: list[int]) -> None:
        got = self._got.get(data)
        for j in targets:
            dst = self.nodes[j]
            if not dst.alive:
                continue
            if got is not None and j in got:  # it has it: a duplicate, dropped by message id on arrival
                dst.duplicates += 1
                self.links.bytes_up[src.spec.index] += len(data)
                self.links.bytes_down[j] += len(data)
                continue
            at = self.links.send(src.spec.index, j, len(data), self.now)
            self._push(at, "deliver", j, src.spec.index, origin, shard, data, dst.inc)

    # ------------------------------------------------------------ events

    def _ev_join(self, i: int) -> None:
        n = self.nodes[i]
        if n.alive:
            return
        n.alive = True
        n.inc += 1
        self.links.reset(i, self.now)
        self._row("event", t=self.now, node=i, action="join")
        if n.spec.role == "adversary":
            self._push(self.now + n.rng.uniform(0, 1.0 / n.spec.rate_per_s), "adv", i, n.inc)
            return
        n.core = self._new_core(n)
        self.alive_producers += 1
        n.pipeline.head_version = n.core.head_of  # type: ignore[union-attr] - as node.runtime wires it
        n.shards = ()
        self._subscribe(n, 1, (0,))  # the live service joins shard 0 before the core's first plan
        n.pipeline.own_lineage = lambda lid, core=n.core: bytes(lid) == core.own  # type: ignore[union-attr]
        n.following, n.admitted, n.pace = None, False, 0.0
        n.transfers.clear()
        model_bytes = self._item_bytes("anchor")
        if n.spec.role == "trainer":
            ready = pipe.Ready(BASE_MODEL.hex(), n.version, TOKENIZER.hex(), model_bytes, n.lineage.hex(), LINEAGE_NAME)
        else:
            ready = pipe.Ready(BASE_MODEL.hex(), 0, TOKENIZER.hex(), model_bytes)
        self._from_worker(n, ready)
        self._push(self.now + n.rng.uniform(2 * WORKER_S, 0.5), "tick", i, n.inc)
        self._push(self.now + n.rng.uniform(0, self._step_time(n)), "step", i, n.inc)

    def _ev_leave(self, i: int) -> None:
        n = self.nodes[i]
        if not n.alive:
            return
        if n.core is not None:
            self.alive_producers -= 1
            old = self._supplied.pop(i, None)
            if old is not None:
                self.supply.add(old[0], -old[1])
            self._subscribe(n, n.shard_count, ())  # its connections close: the meshes lose it
        n.alive = False
        n.inc += 1
        n.core = None  # the process is gone; a rejoin starts a new one
        self._row("event", t=self.now, node=i, action="leave")
        for j in n.ctrl:  # its connections close: peers notice one latency later
            if self.nodes[j].alive:
                self._push(self.now + self._latency(i, j), "gone", j, n.peer_id, self.nodes[j].inc)

    def _ev_gone(self, i: int, peer: str, inc: int) -> None:
        n = self.nodes[i]
        if n.alive and n.inc == inc:
            self._feed(n, PeerGone(peer))

    def _ev_tick(self, i: int, inc: int) -> None:
        n = self.nodes[i]
        if not n.alive or n.inc != inc or n.core is None:
            return
        self._do(n, n.core.handle(TICK))
        due = n.core.next_deadline() - EPOCH
        self._push(max(due, self.now + WORKER_S), "tick", i, inc)

    def _step_time(self, n: VNode) -> float:
        return self.sc.training.step_s / n.spec.compute

    def _ev_step(self, i: int, inc: int) -> None:
        n = self.nodes[i]
        if not n.alive or n.inc != inc:
            return
        tr = self.sc.training
        if tr.max_steps and n.steps >= tr.max_steps:
            return
        dt = self._step_time(n)
        if n.spec.role == "trainer":
            dt = self._train_step(n, dt)
            n.steps += 1
        else:
            if self._follower_step(n, dt):
                n.steps += 1
            rollouts = tr.local_groups * tr.group_size
            if n.pace > 0:  # the core's pace: no faster than the trainer needs
                dt = max(dt, rollouts / n.pace)
        self._push(self.now + dt, "step", i, inc)

    def _rollouts_out(self, n: VNode, local: list[list[wire.Rollout]]) -> None:
        """The worker hands its rollouts to the network process, which batches, seals and publishes them."""
        items = [wire.encode(r) for g in local for r in g]
        if items:
            self._from_worker(n, pipe.Rollouts(items))

    def _training_cost(self, used_groups: int) -> float:
        """A trainer step's time, as a multiple of its `_step_time`, when it trains on `used_groups`."""
        lr, tr = self.sc.learning, self.sc.training
        return 1.0 - lr.train_share * (1.0 - used_groups / max(1, tr.local_groups))

    def _learned(self, skill: float, value: float) -> float:
        """The learning rule: `skill` after a step whose groups are worth `value` informative local groups."""
        lr = self.sc.learning
        return min(lr.ceiling, max(0.0, skill + lr.rate * (lr.ceiling - skill) * value / 8.0))

    def _twin_groups(self, rng: random.Random, skill: float, groups: int) -> list[int]:
        """Correct completions in each of a twin's `groups` drawn groups at `skill`."""
        size = self.sc.training.group_size
        return [sum(rng.random() < skill for _ in range(size)) for _ in range(groups)]

    def _alone_until(self, n: VNode, t: float, base: float) -> None:
        """Step `n`'s alone twin until its clock would pass `t`: I local groups a step, each step
        costing `base` scaled by `_training_cost` of its informative groups."""
        tr = self.sc.training
        a = n.alone
        assert a is not None
        if a.clock is None:
            a.clock = a.until = self.now
        a.clock += max(0.0, self.now - a.until)
        a.until = t
        for _ in range(MAX_ALONE_STEPS):
            u = sum(0 < h < tr.group_size for h in self._twin_groups(a.rng, a.skill, tr.local_groups))
            dt = base * self._training_cost(u)
            if a.clock + dt > t:
                return
            a.clock += dt
            a.skill = self._learned(a.skill, u)
            a.curve.append((a.clock, a.skill))

    def _train_step(self, n: VNode, dt: float) -> float:
        """One step of a trainer's modelled worker; returns the step's virtual time."""
        tr, lr = self.sc.training, self.sc.learning
        local = [self._group(n, n.lineage, n.version, n.skill) for _ in range(tr.local_groups)]
        sampler = n.sampler
        assert sampler is not None and n.core is not None
        ext = sampler.take(tr.external_groups)  # the worker's rule: informative only, a uniform draw, within the bound
        for g in ext:
            head = n.core.head_of(g.lineage)
            self._row("staleness", t=self.now, node=n.spec.index,
                      staleness=max(0, (head if head is not None else g.version) - g.version))
        u_local = sum(self._informative(g) for g in local)
        u_ext = len(ext)
        n.consumed_ext += len(ext)
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        u_own = sum(g.lineage == n.lineage for g in ext)  # its followers' groups: its own policy's samples
        value = u_local + lr.own_lineage_weight * u_own + lr.external_weight * (u_ext - u_own)
        n.skill = self._learned(n.skill, value)
        step_s = dt
        dt = step_s * self._training_cost(u_local + u_ext)
        n.curve.append((self.now + dt, n.skill))
        self._alone_until(n, self.now + dt, step_s)
        # isolated twin: I + J local groups, same rule, own draws
        k = tr.local_groups + tr.external_groups
        hits = self._twin_groups(n.rng, n.iso_skill, k)
        iso_reward = sum(hits) / (k * tr.group_size)
        u_iso = sum(0 < h < tr.group_size for h in hits)
        n.iso_skill = self._learned(n.iso_skill, u_iso)
        n.reward_sum += reward
        n.iso_sum += iso_reward
        n.version += 1
        sampler.observe_head(n.lineage, n.version)  # its own head, as node/worker.py reports it
        self.skill_at[n.lineage].append(n.skill)
        self._row("reward", t=self.now, node=n.spec.index, reward=reward, isolated=iso_reward, version=n.version,
                  group=n.spec.group)
        self._rollouts_out(n, local)
        self._from_worker(n, pipe.Step(n.steps + 1, n.version, reward, None, len(ext), dt,
                                       used=sum(len(g.rollouts) for g in ext), external_groups=len(ext),
                                       external_lineages=len({g.lineage for g in ext}), updates=1))
        self._perf(n, tr.local_groups * tr.group_size, dt)
        if n.version % self.sc.sync.publish_every == 0:
            base = n.version - self.sc.sync.publish_every
            env = self._manifest(n, "patch", base, n.version)
            n.store.setdefault(n.lineage, {})[("patch", base, n.version)] = env
            self._from_worker(n, pipe.Published(n.version, env))
        return dt

    def _follower_step(self, n: VNode, dt: float) -> bool:
        """Generate for the lineage the core follows, when its staleness admission allows; True if it did."""
        core = n.core
        assert core is not None
        lid = n.following
        if lid is not None:
            head = core.head_of(lid)
            self._row("lag", t=self.now, node=n.spec.index, lag=max(0, (head if head is not None else n.held) - n.held))
        if lid is None or not n.admitted or lid != n.held_lineage:
            return False
        skills = self.skill_at[lid]
        skill = skills[min(n.held, len(skills) - 1)]
        local = [self._group(n, lid, n.held, skill) for _ in range(self.sc.training.local_groups)]
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        self._row("reward", t=self.now, node=n.spec.index, reward=reward, isolated=None, version=n.held,
                  group=n.spec.group)
        self._rollouts_out(n, local)
        self._from_worker(n, pipe.Gen(reward, n.held, sum(len(r.completion_ids) for g in local for r in g), dt))
        self._perf(n, sum(len(g) for g in local), dt)
        return True

    # ------------------------------------------------------------ messages between nodes

    def _ev_announce(self, dst: int, src: int, data: bytes, inc: int) -> None:
        d = self.nodes[dst]
        if not d.alive or d.inc != inc or d.core is None:
            return
        got = self._open(data, wire.NODE_ANNOUNCE)
        if got is None:
            return
        env, body = got
        signer = bytes(env.signer)
        if peer_id_from_public(signer) == body.peer_id:
            d.pipeline.announced(body.peer_id, body)  # type: ignore[union-attr] - the rate it states bounds it
        self._feed(d, AnnounceHeard(signer, body, data))

    def _ev_manifest(self, dst: int, src: int, data: bytes, inc: int) -> None:
        """A manifest reaches a node: its core hears it, and its broadcast asks the core whether to fetch it."""
        d = self.nodes[dst]
        if not d.alive or d.inc != inc or d.core is None:
            return
        got = self._open(data, wire.PATCH_MANIFEST)
        if got is None:
            return
        env, m = got
        self._feed(d, ManifestHeard(m))
        if d.core is not None and d.core.offer_manifest(m):
            pid = wire.content_id(data)
            if pid in d.transfers:
                return
            seconds = d.patch_delay * m.total_bytes / self.sc.sync.patch_bytes  # the modelled broadcast
            d.transfers[pid] = (data, m, seconds)
            self.counts["transfers"] += 1
            self._push(self.now + seconds, "transfer", dst, pid, inc)

    def _ev_transfer(self, i: int, pid: bytes, inc: int) -> None:
        n = self.nodes[i]
        if not n.alive or n.inc != inc or pid not in n.transfers:
            return
        self._feed(n, TransferDone(pid, n.transfers[pid][1]))
        n.transfers.pop(pid, None)  # stored (StorePatch) or already held

    def _ev_catalog(self, src: int, asker: int, lineage: bytes, inc: int) -> None:
        """A catch-up catalog request reaches a peer: the reply lists what its lineage store holds."""
        p = self.nodes[src]
        back = self.now + self._latency(src, asker)
        if p.alive and lineage in p.store:
            self._push(back, "catalog_reply", asker, CatalogReceived(p.peer_id, lineage, self._items(p, lineage)), inc)
        else:
            self._push(back, "catalog_reply", asker, CatalogFailed(p.peer_id, lineage, "unreachable or not held"),
                       inc)

    def _ev_catalog_reply(self, i: int, ev: Any, inc: int) -> None:
        n = self.nodes[i]
        if n.alive and n.inc == inc:
            self._feed(n, ev)

    def _ev_offer(self, src: int, asker: int, lineage: bytes, item: tuple[str, int, int], inc: int) -> None:
        """A peer asked to seed an item into the broadcast: the asker hears its manifest one latency later."""
        p = self.nodes[src]
        env = p.store.get(lineage, {}).get(item) if p.alive else None
        back = self.now + self._latency(src, asker)
        if env is not None:
            self._push(back, "manifest", asker, src, env, inc)
        else:  # as the runtime's failed offer request: the asker's core moves to its next source
            self._push(back, "catalog_reply", asker, OfferFailed(p.peer_id, lineage, "unreachable or not held"), inc)

    def _ev_deliver(self, dst: int, fwd: int, origin: int, shard: int, data: bytes, inc: int) -> None:
        """A copy of a batch reaches a subscriber of its shard: what `GossipService._validate_rollouts` does
        (gate, pipeline), then GossipSub forwards what was accepted to the node's other mesh peers."""
        d = self.nodes[dst]
        if not d.alive or d.inc != inc or shard not in d.shards:
            return
        got = self._got.get(data)
        if got is None:
            got = set()
            self._got.put(data, got)
        if dst in got:
            d.duplicates += 1
            return
        got.add(dst)
        s = self.nodes[origin]
        now = self._unix()
        d.stats.received()
        why = d.gate.admit(s.peer_id, shard, now)
        if why is None:
            p = d.pipeline
            step = p.admit(data, s.peer_id, self.nodes[fwd].peer_id)  # type: ignore[union-attr]
            if step.batch is not None:
                d.stats.counts["received_rollouts"] += len(step.batch.rollouts)
            if isinstance(step, Pending):
                why = d.gate.belongs([bytes(r.lineage) for r in step.batch.rollouts], shard, d.shard_count)
                if why is not None:
                    p.abandon(step)  # type: ignore[union-attr]
                else:
                    p.verify(step)  # type: ignore[union-attr]
                    step = p.commit(step)  # type: ignore[union-attr]
            v = step
        if why is not None:
            d.stats.drop(why)
            self.rejections[why] += 1
            return
        if not v.accepted:
            d.stats.drop(v.reason.value)
            self.rejections[v.reason.value] += 1
            self._row("rejection", t=self.now, node=dst, peer=origin, reason=v.reason.value)
            if v.newly_banned:
                self._row("event", t=self.now, node=dst, action=f"ban {origin}")
            return
        d.stats.verified(bytes(v.batch.producer), (), len(v.batch.rollouts), now)  # type: ignore[union-attr]
        mesh = self.mesh.get(shard, {}).get(dst, ())
        self._forward(d, origin, data, shard, [k for k in mesh if k != fwd and k != origin])
        if s.spec.role == "adversary":
            s.adv_accepted += 1
        if v.batch is not None:
            self._feed(d, RolloutsVerified.of(v.batch))  # what the producer delivered, as the runtime feeds it
        if d.sampler is None or v.batch is None or d.core is None:
            return
        if not d.core.external_wanted({bytes(r.lineage) for r in v.batch.rollouts}):
            return
        cut = self._groups.get(v.msg_id)
        if cut is None:  # a batch's groups depend on its content only: split once per process (Groups are frozen)
            cut = split(v.batch.rollouts)
            self._groups.put(v.msg_id, cut)
        groups, dropped = cut
        for k, c in dropped.items():  # what `Sampler.add_rollouts` counts, per receiver
            d.sampler.counts[k] += c
        d.sampler.add(groups)


    # ------------------------------------------------------------ adversaries

    def _ev_adv(self, i: int, inc: int) -> None:
        n = self.nodes[i]
        if not n.alive or n.inc != inc:
            return
        b = n.spec.behaviour
        if b == "forged_reward":
            g = self._group(n, n.lineage, 0, 0.0)  # all wrong ...
            forged = [wire.Rollout(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "reward": 1.0})
                      for r in g]  # ... each claiming full reward
            self._gossip(n, self._seal(n, forged), n.lineage)
        elif b == "invalid_signature":
            data = bytearray(self._seal(n, self._group(n, n.lineage, 0, 0.5)))
            data[-5] ^= 0xFF  # inside the signature, the envelope's last field
            self._gossip(n, bytes(data), n.lineage)
        elif b == "replay":
            if not n.sent_batches:
                data = self._seal(n, self._group(n, n.lineage, 0, 0.5))
                n.sent_batches.append(data)
            else:  # the same seq again with other content (equivocation), and the old bytes again
                data = self._seal(n, self._group(n, n.lineage, 0, 0.5), seq=n.seq)
                self._gossip(n, n.sent_batches[0], n.lineage)
            self._gossip(n, data, n.lineage)
        elif b == "stale_spam":
            lead = self.nodes[self.trainer_ids[n.rng.randrange(len(self.trainer_ids))]]
            self._gossip(n, self._seal(n, self._group(n, lead.lineage, 0, 0.5)), lead.lineage)
        # corrupt_chunks and free_ride act in the broadcasts / by never producing
        if b in ("forged_reward", "invalid_signature", "replay", "stale_spam"):
            self._push(self.now + 1.0 / n.spec.rate_per_s, "adv", i, inc)

    # ------------------------------------------------------------ broadcasts (the nodes' broadcast cores)

    def _broadcast(self, origin: int, receivers: list[int]) -> dict[str, Any]:
        sy = self.sc.sync
        sizes = [sy.chunk_bytes] * (sy.patch_bytes // sy.chunk_bytes)
        if sy.patch_bytes % sy.chunk_bytes:
            sizes.append(sy.patch_bytes % sy.chunk_bytes)
        ids = [origin] + receivers
        links = {}
        for k, i in enumerate(ids):
            s = self.specs[i]
            up = s.upload_bytes_per_s if s.behaviour != "free_ride" else 1.0  # a free-rider uploads nothing
            links[k] = SimLink(up_bps=up, down_bps=s.download_bytes_per_s, latency_s=s.latency_ms / 1000.0,
                               loss=s.loss)
        vs = VirtualSwarm(len(receivers), sizes, links=links, degree=min(self.sc.gossip.degree, len(receivers)),
                          seed=self.rng.randrange(2**32), swarm=self.sc.swarm)
        for k, i in enumerate(ids):
            if self.specs[i].behaviour == "corrupt_chunks":
                vs.make_corrupt(k)
        res = vs.run(until_s=max(600.0, 50 * sy.patch_bytes / min(links[0].up_bps, 1e12)))
        res["times"] = {ids[k]: vs.nodes[k].completed_at for k in range(1, len(ids))}
        res["bans"] = sum(len(nd.banned) for nd in vs.nodes)
        res["bytes_out"] = {ids[k]: vs.nodes[k].bytes_out for k in range(len(ids))}
        rtt = 2 * self.specs[origin].latency_ms / 1000.0
        res["lower_bound_s"] = broadcast_lower_bound(sy.patch_bytes, len(receivers), links[0].up_bps, len(sizes), rtt)
        return res

    def _setup_broadcasts(self) -> list[dict[str, Any]]:
        out = []
        # followers: one broadcast per followed lineage gives each follower its patch delay
        leads = sorted({n.spec.follow for n in self.nodes if n.spec.role == "follower"})
        for lead in leads:
            fol = [n.spec.index for n in self.nodes if n.spec.role == "follower" and n.spec.follow == lead]
            res = self._broadcast(lead, fol)
            for i, t in res["times"].items():
                self.nodes[i].patch_delay = t if t is not None else self.sc.duration_s
        # measured swarm-wide broadcasts, sample of receivers (adversaries included)
        every = [n.spec.index for n in self.nodes]
        trainers = [n.spec.index for n in self.nodes if n.spec.role == "trainer"]
        for b in range(self.sc.sync.broadcasts):
            origin = trainers[b % len(trainers)]
            pool = [i for i in every if i != origin]
            self.rng.shuffle(pool)
            adv = [i for i in pool if self.specs[i].behaviour in ("corrupt_chunks", "free_ride")]
            recv = (adv + [i for i in pool if i not in adv])[: self.sc.sync.broadcast_nodes]
            if not recv:
                continue
            res = self._broadcast(origin, sorted(recv))
            for i, t in res["times"].items():
                self._row("broadcast", n=b, receiver=i, completion_s=t if t is not None else math.inf,
                          lower_bound_s=res["lower_bound_s"], bytes=self.sc.sync.patch_bytes)
            out.append({"n": b, "receivers": len(recv), "p50_s": res["completion_s_p50"],
                        "max_s": res["completion_s_max"], "lower_bound_s": res["lower_bound_s"],
                        "bans": res["bans"], "hashes_ok": res["all_hashes_match"]})
            for i, bo in res["bytes_out"].items():
                self.links.bytes_up[i] += bo
        return out

    # ------------------------------------------------------------ schedule and run

    def _schedule(self) -> None:
        sc = self.sc
        for n in self.nodes:
            self._push(n.spec.join_s, "join", n.spec.index)
            if n.spec.leave_s is not None:
                self._push(n.spec.leave_s, "leave", n.spec.index)
        for e in sc.events:
            if e.action == "restart":
                self._push(e.at_s, "leave", e.node)
                self._push(e.at_s + e.down_s, "join", e.node)
            else:
                self._push(e.at_s, e.action, e.node)
        if sc.churn.leaves_per_min > 0:
            honest = [i for i in range(sc.honest_nodes) if i not in set(sc.churn.protect)]
            t = sc.churn.start_s
            bound = 100_000
            while honest and bound:
                bound -= 1
                t += self.rng.expovariate(sc.churn.leaves_per_min / 60.0)
                if t >= sc.duration_s:
                    break
                i = self.rng.choice(honest)
                self._push(t, "leave", i)
                self._push(t + sc.churn.down_s, "join", i)
        t = 0.0
        while t <= sc.duration_s:
            self._push(t, "sample")
            t += sc.report.sample_every_s

    def _ev_sample(self) -> None:
        now = self._unix()
        for a in self.nodes:
            if a.spec.role != "adversary":
                continue
            honest = (self.nodes[j] for j in a.neighbours)  # the graph is symmetric; index order as before
            vals = [h.pipeline.scores.score(a.peer_id, now) for h in honest if h.spec.role != "adversary" and h.alive]
            if vals:
                self._row("score", t=self.now, peer=a.spec.index, behaviour=a.spec.behaviour,
                          score=sum(vals) / len(vals))

    def run(self, on_progress: Callable[[float], None] | None = None) -> dict[str, Any]:
        wall = time.perf_counter()
        self.build_s = wall - self.created
        self._say(f"virtual: {self.sc.name}: {len(self.nodes)} nodes, measuring "
                  f"{self.sc.sync.broadcasts} broadcast(s) with the real swarm core")
        broadcasts = self._setup_broadcasts()
        self.setup_s = time.perf_counter() - wall
        self._schedule()
        with _few_collections():
            self._loop(on_progress)
        self.cpu_s = time.process_time() - self.created_cpu
        return self._finish(broadcasts, time.perf_counter() - self.created)

    def _say(self, line: str) -> None:
        if self.progress and not sys.stderr.isatty():
            print(line, file=sys.stderr, flush=True)

    def _loop(self, on_progress: Callable[[float], None] | None) -> None:
        """Pop events in time order; progress on a terminal as a bar, elsewhere one stderr line per 10 %."""
        progress_ctx = None
        if self.progress and sys.stderr.isatty():
            from rich.progress import Progress  # noqa: PLC0415

            progress_ctx = Progress(transient=True)
            progress_ctx.start()
            task = progress_ctx.add_task(f"virtual: {self.sc.name}", total=self.sc.duration_s)
        handlers = {k[4:]: getattr(self, k) for k in dir(self) if k.startswith("_ev_")}
        heap, pop, end = self._heap, heapq.heappop, self.sc.duration_s
        last, tenth, start = 0.0, end / 10.0, time.perf_counter()
        next_line = tenth
        try:
            while heap and self.events < self.max_events:
                t, _, kind, args = pop(heap)
                if t > end:
                    break
                self.now = t
                self.events += 1
                handlers[kind](*args)
                if t - last >= 1.0:
                    last = t
                    if progress_ctx is not None:
                        progress_ctx.update(task, completed=t)
                    elif self.progress and t >= next_line:
                        next_line += tenth
                        w = time.perf_counter() - start
                        self._say(f"virtual: t={t:.0f}/{end:g} s, {self.events} events, wall {w:.1f} s "
                                  f"({self.events / max(w, 1e-9):.0f} events/s)")
                    if on_progress is not None:
                        on_progress(t)
        finally:
            if progress_ctx is not None:
                progress_ctx.stop()

    def _core_summary(self) -> dict[str, Any]:
        """What the nodes' cores decided and what the simulator carried out for them."""
        cores = [n.core for n in self.nodes if n.core is not None]
        followers = [n for n in self.nodes if n.spec.role == "follower"]
        return {
            "actions": dict(sorted(self.counts.items())),
            "logs": dict(self.core_logs.most_common(24)),
            "followers_serving": sum(1 for n in followers if n.core is not None and n.core.serving is not None),
            "followers_admitted": sum(1 for n in followers if n.admitted),
            "followers": len(followers),
            "patches_applied": sum(c.stats()["applied"] for c in cores),
            "peers_evicted": sum(c.stats()["peers_evicted"] for c in cores),
            "lineages_evicted": sum(c.table.evicted for c in cores),
            "peers_max": max((len(c.peers) for c in cores), default=0),
            "lineages_max": max((len(c.lineages) for c in cores), default=0),
        }

    def exchange_summary(self) -> dict[str, Any]:
        """Per-node load of the rollout exchange over the run: what each trainer (a consumer) received,
        verified and used per virtual second, and from how many producers; followers' inbound apart."""
        span = max(1e-9, min(self.now, self.sc.duration_s))
        g = self.sc.training.group_size

        def per_s(xs: list[float]) -> dict[str, float]:
            return {"mean": round(sum(xs) / len(xs), 3), "max": round(max(xs), 3)} if xs else {"mean": 0.0, "max": 0.0}

        out: dict[str, Any] = {}
        for role in ("trainer", "follower"):
            ns = [n for n in self.nodes if n.spec.role == role and n.core is not None]
            if not ns:
                continue
            rec = [n.stats.counts["received_rollouts"] / span for n in ns]
            ver = [n.stats.counts["verified_rollouts"] / span for n in ns]
            used = sum(n.consumed_ext * g for n in ns)
            verified = sum(n.stats.counts["verified_rollouts"] for n in ns)
            out[role] = {"nodes": len(ns), "inbound_rollouts_per_s": per_s(rec), "verified_rollouts_per_s": per_s(ver),
                         "duplicates_per_s": per_s([n.duplicates / span for n in ns]),
                         "used_over_verified": round(used / verified, 3) if verified else None,
                         "distinct_producers": per_s([float(n.stats.distinct_producers(self._unix())) for n in ns]),
                         "shards_subscribed": per_s([float(len(n.shards)) for n in ns])}
        out["shard_count"] = self._shards_seen
        dropped: Counter[str] = Counter()
        for n in self.nodes:
            dropped.update(n.stats.dropped)
        out["dropped"] = dict(dropped.most_common(16))
        return out

    def _alone_summary(self, trainers: list[VNode]) -> dict[str, Any] | None:
        """The trainers' mean skill and their alone twins' at `ALONE_POINTS` equal marks of virtual time,
        and the time-to-target speedup of the swarm over alone (`simulations.curves`)."""
        end = min(self.now, self.sc.duration_s)
        if not trainers or end <= 0:
            return None
        xs = [end * k / ALONE_POINTS for k in range(ALONE_POINTS + 1)]

        def mean_at(curves: list[tuple[list[float], list[float], float]], t: float) -> float:
            total = 0.0
            for times, values, start in curves:
                k = bisect.bisect_right(times, t)
                total += values[k - 1] if k else start
            return total / len(curves)

        def prepared(pairs: list[tuple[float, float]], start: float) -> tuple[list[float], list[float], float]:
            return [t for t, _ in pairs], [v for _, v in pairs], start

        swarm = [prepared(n.curve, self.skill_at[n.lineage][0]) for n in trainers]
        alone = [prepared(n.alone.curve if n.alone else [], self.skill_at[n.lineage][0]) for n in trainers]
        sw = [mean_at(swarm, t) for t in xs]
        al = [mean_at(alone, t) for t in xs]
        speedup, reached, _, _ = curves.speedup(xs, al, sw)
        return {"marks_s": [round(x, 2) for x in xs], "skill": [round(v, 4) for v in sw],
                "alone_skill": [round(v, 4) for v in al], "speedup": round(speedup, 4), "reached": reached,
                "final_skill_delta": round(sw[-1] - al[-1], 4)}

    def _finish(self, broadcasts: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        for n in self.nodes:
            self._row("bytes", node=n.spec.index, group=n.spec.group, bytes_up=self.links.bytes_up[n.spec.index],
                      bytes_down=self.links.bytes_down[n.spec.index])
        trainers = [n for n in self.nodes if n.spec.role == "trainer"]
        swarm = sum(n.reward_sum for n in trainers)
        iso = sum(n.iso_sum for n in trainers)
        summary: dict[str, Any] = {
            "title": f"Murmur virtual simulation: {self.sc.name}",
            "mode": "virtual",
            "scenario": self.sc.name,
            "seed": self.sc.seed,
            "nodes": len(self.nodes),
            "virtual_s": min(self.now, self.sc.duration_s),
            "wall_s": round(wall_s, 2),
            "cpu_s": round(getattr(self, "cpu_s", 0.0), 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "build_s": round(getattr(self, "build_s", 0.0), 2),
            "setup_s": round(getattr(self, "setup_s", 0.0), 2),  # start-up broadcasts through the swarm core
            "peak_rss_mb": peak_rss_mb(),
            "events": self.events,
            "steps": sum(n.steps for n in self.nodes),
            "swarm_cumulative_reward": round(swarm, 3),
            "isolated_cumulative_reward": round(iso, 3),
            "gain_swarm": round(swarm / iso - 1, 4) if iso > 0 else None,
            "final_skill_mean": round(sum(n.skill for n in trainers) / max(1, len(trainers)), 4),
            "final_isolated_skill_mean": round(sum(n.iso_skill for n in trainers) / max(1, len(trainers)), 4),
            "alone": self._alone_summary(trainers),
            "external_groups_consumed": sum(n.consumed_ext for n in trainers),
            "sampler": {k: sum(n.sampler.counts[k] for n in trainers if n.sampler is not None)
                        for k in (trainers[0].sampler.counts if trainers and trainers[0].sampler else {})},
            "adversarial_accepted": sum(n.adv_accepted for n in self.nodes
                                        if n.spec.behaviour in ("forged_reward", "invalid_signature")),
            "rejections": dict(self.rejections),
            "broadcasts": broadcasts,
            "graylist_threshold": self.sc.gossip.graylist_threshold,
            "cores": self._core_summary(),
            "exchange": self.exchange_summary(),
            "modelled": "the network (rollouts: GossipSub meshes of degree 6 on the shard topics the cores "
                        "join, forwarded once per mesh link, duplicates counted; announces and manifests: one hop; "
                        "modelled links), the clock, compute time, learning (skill curve), patch transfer time; "
                        "real: one node core per node (announces, roles and lineage choice, staleness admission, "
                        "heads from messages, catch-up plans, rollout batching and sealing, the rollout exchange's "
                        "shards), the exchange gate, signatures, verification pipeline, scoring, the worker's "
                        "sampler, swarm broadcast core",
        }
        if self.shared is not None:
            summary["verification"] = self.shared.stats()
        if self.out_dir:
            self._say(f"virtual: {self.events} events in {wall_s:.1f} s; writing the report to {self.out_dir}")
            self.metrics.close()  # type: ignore[union-attr]
            t0 = time.perf_counter()
            write_report(self.out_dir, self.rows, summary, dumps(self.sc), title=summary["title"],
                         notes="Virtual time. " + summary["modelled"] + ".",
                         threshold=self.sc.gossip.graylist_threshold, plots=self.sc.report.plots)
            summary["report_s"] = round(time.perf_counter() - t0, 2)  # not in summary.json: written before
        return summary


@contextmanager
def _few_collections() -> Iterator[None]:
    """A full pass of the cyclic collector scans every live object, and a big run holds millions of them
    (pools, memos, report rows), nearly all acyclic, so default thresholds make collection work grow with
    the heap on every pass. Freeze what set-up built and collect young generations rarely: collection
    work follows what the loop allocates, and cyclic garbage still goes in the young passes."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1)


def run_virtual(sc: Scenario, out_dir: str | Path | None = None, progress: bool = False) -> dict[str, Any]:
    return VirtualSim(sc, out_dir, progress=progress).run()


_ = PENALTIES, Reason  # re-exported names used by docs/tests
