"""Virtual-time simulator: one real node core per simulated node, modelled network, clock and learning.

`VirtualSim` builds the nodes and composes the parts, each a module of its own, then pops typed events
(`simulations.vevents`) in virtual-time order: it starts and stops nodes, sends the adversaries'
batches and samples their scores itself, and hands a worker's step to the worker model and every other
event to the cores' driver. The parts:

- `simulations.vnode`: one node's state, and the modelled model every node starts from;
- `simulations.vruntime`: what a node's runtime and gossip service do around its real core (the
  events it is fed, the actions it returns carried out, the validation of arriving batches);
- `simulations.vnet`: the network (links, topology, one-hop announces and manifests, the announce
  topic's swarm-wide view, the rollout shard topics' GossipSub meshes and forwarding);
- `simulations.vworker`: each node's modelled worker (step timing, generation, rewards, learning, the
  sampler intake, the isolated and alone twins);
- `simulations.adversary`: what the adversaries send (they run no core);
- `simulations.vbroadcast`: the start-up patch broadcasts through the nodes' broadcast cores;
- `simulations.vreport`: the metric rows, counters, summary and report folder.

What runs for real (the same code a live node runs):
- each honest node's network process is a `node.core.machine.NodeCore` (the class
  `node.shell.runtime` drives), built from its scenario spec, on the virtual
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
  links, with a real signed manifest and every chunk's hash checked
  (`simulations.vbroadcast`);
- the rollout exchange is `gossip.exchange`, run by each core (its shard
  count, the shards it joins and rotates, the shard it publishes to) and by
  each receiver's `ShardGate` (newcomer budget, wrong shard) before its
  pipeline verifies, both in the receiver's `gossip.intake.BatchIntake`, the
  object a node's gossip service runs on each batch copy.

What is modelled (each module's docstring says how):
- the network (`simulations.vnet`): the live announce topic reaches every
  node, so each core is fed the topic's sums before each tick (`SwarmHeard`:
  the number of live producers and the batches/s announced per lineage, what
  that topic would have told it) instead of counting the few it heard;
- the clock: virtual seconds (`EPOCH` + t as unix time);
- compute, the worker and learning (`simulations.vworker`);
- the patch transfer (`simulations.vruntime`): the core's `SeedVersion` sends
  the signed manifest over the modelled gossip and a catch-up `RequestOffer`
  has the peer send it to the asker; a receiver whose core accepts it gets the
  bytes one patch-broadcast delay later, the delay per follower measured once
  at start-up by a broadcast of the scenario's patch size through the nodes'
  broadcast cores (above). Later versions are not broadcast again: each takes
  that delay, so patches in flight at once do not compete for links in the
  main run;
- adversaries run no core: they send hostile bytes (`simulations.adversary`).

Memory follows the swarm's size and message rate, not the run's length: the
per-process memos keep only messages in flight (`MEMO_HORIZON_S` of virtual
time), and a node's state is what it heard (its core's peer and lineage
tables, bounded by `CoreSettings.max_peers` / `max_lineages`, pipeline
caches, scores, sampler); report rows are kept once.
"""

from __future__ import annotations

import gc
import heapq
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from murmur.gossip import wire
from murmur.gossip.exchange import first_subscription, shard_of
from murmur.gossip.intake import BatchIntake
from murmur.simulations import vreport
from murmur.simulations.adversary import SENDERS, Adversary
from murmur.simulations.scenario import Scenario, expand
from murmur.simulations.vbroadcast import setup_broadcasts
from murmur.simulations.vcache import SharedVerification
from murmur.simulations.vevents import (
    AdversaryDue,
    AnnounceArrives,
    BatchArrives,
    CatalogAsked,
    Event,
    EventQueue,
    Join,
    Leave,
    ManifestArrives,
    OfferAsked,
    PatchArrives,
    PeerLeft,
    Reply,
    Sample,
    StepDue,
    Wake,
    WorkerSends,
)
from murmur.simulations.vnet import Network
from murmur.simulations.vnode import BASE_MODEL, LINEAGE_NAME, VNode, identity_for
from murmur.simulations.vreport import Recorder
from murmur.simulations.vruntime import CoreDriver
from murmur.simulations.vworker import WORKER_S, Workers
from murmur.sync.ids import lineage_id
from murmur.training.schedule import ScheduleBook
from murmur.training.tasksets import TaskRegistry
from murmur.training.verifiers import score

MEMO_HORIZON_S = 5.0  # virtual seconds a per-message memo entry is kept: a batch reaches its receivers sooner


class VirtualSim:
    """One run of a scenario in virtual time: `run()` returns its summary (and writes the report folder
    when given `out_dir`)."""

    def __init__(
        self,
        sc: Scenario,
        out_dir: str | Path | None = None,
        *,
        progress: bool = False,
        max_events: int = 50_000_000,
        shared_verify: bool = True,
    ) -> None:
        self.created, self.created_cpu = time.perf_counter(), time.process_time()  # building the nodes counts too
        self.sc = sc
        self.out_dir = Path(out_dir) if out_dir else None
        self.progress = progress
        self.max_events = max_events
        self.rng = random.Random(sc.seed)  # one draw stream for the whole run: a seed gives one run
        self.queue = EventQueue()
        self.events = 0
        self.recorder = Recorder(self.out_dir, sc.report.format)
        self.rows = self.recorder.rows
        registry = TaskRegistry(sc.swarm)
        registry.add_builtin()
        # one memo of the pure verification work per process (simulations/vcache.py says why it is faithful)
        self.shared = (
            SharedVerification(registry.resolve, score, clock=self.queue.unix, horizon_s=MEMO_HORIZON_S)
            if shared_verify
            else None
        )
        resolve = self.shared.resolve_task if self.shared else registry.resolve
        reward = self.shared.reward if self.shared else score
        self.nodes: list[VNode] = []
        self.schedule = ScheduleBook.of(registry)  # the shared prompt schedule: pure, one for every node
        self.workers = Workers(
            sc,
            self.nodes,
            self.queue,
            self.recorder,
            registry.builtin_id,
            resolve,
            reward,
            MEMO_HORIZON_S,
            self.schedule,
        )
        for s in expand(sc):
            ident = identity_for(sc.seed, s.index)
            if self.shared is not None:  # what it signs enters the signature memo as valid (vcache.py says why)
                ident = self.shared.signer(ident)
            node_rng = random.Random(self.rng.randrange(2**63))
            p0 = min(sc.learning.ceiling, max(0.0, sc.learning.initial + node_rng.uniform(-1, 1) * sc.learning.spread))
            self.nodes.append(
                VNode(s, ident, ident.peer_id, lineage_id(ident.public, BASE_MODEL, LINEAGE_NAME), p0, p0, node_rng)
            )
        self.net = Network(sc, self.nodes, self.queue, self.rng, self.recorder.counts, self.shared, MEMO_HORIZON_S)
        self.driver = CoreDriver(
            sc,
            self.nodes,
            self.queue,
            self.net,
            self.workers,
            self.recorder,
            self.shared,
            resolve,
            reward,
            self.schedule,
        )
        trainers = [n.lineage for n in self.nodes if n.role == "trainer"]
        for n in self.nodes:
            n.intake = BatchIntake(self.driver.pipeline(n))
            n.intake.gate.first_heard = self.net.heard.first_heard  # the announce topic's table, as every gate reads it
            if n.role == "trainer":
                self.workers.equip(n)
            elif n.spec.role == "adversary":
                n.adversary = self._adversary(n, trainers)
        self.net.connect()
        self.handlers: dict[type[Event], Callable[[Any], None]] = {
            Join: self._join,
            Leave: self._leave,
            Sample: self._sample,
            AdversaryDue: self._adversary_sends,
            StepDue: self.workers.on_step,
            Wake: self.driver.on_wake,
            WorkerSends: self.driver.on_worker,
            PeerLeft: self.driver.on_peer_left,
            Reply: self.driver.on_reply,
            AnnounceArrives: self.driver.on_announce,
            ManifestArrives: self.driver.on_manifest,
            PatchArrives: self.driver.on_patch,
            CatalogAsked: self.driver.on_catalog,
            OfferAsked: self.driver.on_offer,
            BatchArrives: self.driver.on_batch,
        }

    def _adversary(self, n: VNode, trainers: list[bytes]) -> Adversary:
        """An adversary's sender: its batches drawn by the worker model from its own stream, at skill 0
        (the forger's all-wrong answers) or 0.5, on the virtual clock; stale_spam names a random trainer's
        lineage."""
        workers = self.workers

        def draw(lineage: bytes, wrong: bool) -> list[wire.Rollout]:
            return workers.group(n, lineage, 0, 0.0 if wrong else 0.5)

        def victim() -> bytes:
            return trainers[n.rng.randrange(len(trainers))]

        return Adversary(n.ident, self.sc.swarm, n.lineage, self.queue.unix_ms, draw, victim, self.schedule)

    # ------------------------------------------------------------ a node's processes start and stop

    def _join(self, ev: Join) -> None:
        i = ev.node
        n = self.nodes[i]
        if n.alive:
            return
        q = self.queue
        n.alive = True
        n.inc += 1
        self.net.links.reset(i, q.now)
        self.recorder.row("event", t=q.now, node=i, action="join")
        if n.spec.role == "adversary":
            q.push(q.now + n.rng.uniform(0, 1.0 / n.spec.rate_per_s), AdversaryDue(i, n.inc))
            return
        n.core = self.driver.new_core(n)
        self.net.alive_producers += 1
        n.pipeline.head_version = n.core.head_of  # as node.shell.runtime wires it
        n.shards = ()
        self.net.subscribe(n, *first_subscription())  # as the live service, before the core's first plan
        n.pipeline.own_lineage = lambda lid, core=n.core: bytes(lid) == core.own
        self.workers.start(n)
        q.push(q.now + n.rng.uniform(2 * WORKER_S, 0.5), Wake(i, n.inc))
        q.push(q.now + n.rng.uniform(0, self.workers.step_time(n)), StepDue(i, n.inc))

    def _leave(self, ev: Leave) -> None:
        i = ev.node
        n = self.nodes[i]
        if not n.alive:
            return
        if n.core is not None:
            self.net.alive_producers -= 1
            self.net.withdraw(i)
            self.net.subscribe(n, n.intake.shards, ())  # its connections close: the meshes lose it
        n.alive = False
        n.inc += 1
        n.core = None  # the process is gone; a rejoin starts a new one
        q = self.queue
        self.recorder.row("event", t=q.now, node=i, action="leave")
        for j in n.ctrl:  # its connections close: peers notice one latency later
            if self.nodes[j].alive:
                q.push(q.now + self.net.latency(i, j), PeerLeft(j, n.peer_id, self.nodes[j].inc))

    def _adversary_sends(self, ev: AdversaryDue) -> None:
        """An adversary publishes its next batches to the shard of the lineage each names, as a producer
        would; corrupt_chunks and free_ride act in the broadcasts / by never producing."""
        n = self.nodes[ev.node]
        if not n.alive or n.inc != ev.inc:
            return
        b = n.spec.behaviour
        for data, lineage in n.adversary.payloads(b):  # type: ignore[arg-type,union-attr]  # adversaries have both
            self.net.publish(n, data, shard_of(lineage, self.net.shards_now()))
        if b in SENDERS:
            self.queue.push(self.queue.now + 1.0 / n.spec.rate_per_s, AdversaryDue(ev.node, ev.inc))

    def _sample(self, ev: Sample) -> None:
        now = self.queue.unix()
        for a in self.nodes:
            if a.spec.role != "adversary":
                continue
            honest = (self.nodes[j] for j in a.neighbours)  # the graph is symmetric; index order as before
            vals = [h.pipeline.scores.score(a.peer_id, now) for h in honest if h.spec.role != "adversary" and h.alive]
            if vals:
                self.recorder.row(
                    "score",
                    t=self.queue.now,
                    peer=a.spec.index,
                    behaviour=a.spec.behaviour,
                    score=sum(vals) / len(vals),
                )

    # ------------------------------------------------------------ schedule and run

    def _schedule(self) -> None:
        sc, push = self.sc, self.queue.push
        for n in self.nodes:
            push(n.spec.join_s, Join(n.spec.index))
            if n.spec.leave_s is not None:
                push(n.spec.leave_s, Leave(n.spec.index))
        for e in sc.events:
            if e.action == "restart":
                push(e.at_s, Leave(e.node))
                push(e.at_s + e.down_s, Join(e.node))
            else:
                push(e.at_s, Join(e.node) if e.action == "join" else Leave(e.node))
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
                push(t, Leave(i))
                push(t + sc.churn.down_s, Join(i))
        t = 0.0
        while t <= sc.duration_s:
            push(t, Sample())
            t += sc.report.sample_every_s

    def run(self, on_progress: Callable[[float], None] | None = None) -> dict[str, Any]:
        wall = time.perf_counter()
        self.build_s = wall - self.created
        self._say(
            f"virtual: {self.sc.name}: {len(self.nodes)} nodes, measuring "
            f"{self.sc.sync.broadcasts} broadcast(s) with the real swarm core"
        )
        broadcasts = setup_broadcasts(self.sc, self.nodes, self.rng, self.recorder.row, self.net.links.bytes_up)
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
            from rich.progress import Progress

            progress_ctx = Progress(transient=True)
            progress_ctx.start()
            task = progress_ctx.add_task(f"virtual: {self.sc.name}", total=self.sc.duration_s)
        handlers, queue = self.handlers, self.queue
        heap, pop, end = queue.heap, heapq.heappop, self.sc.duration_s
        last, tenth, start = 0.0, end / 10.0, time.perf_counter()
        next_line = tenth
        try:
            while heap and self.events < self.max_events:
                t, _, ev = pop(heap)
                if t > end:
                    break
                queue.now = t
                self.events += 1
                handlers[type(ev)](ev)
                if t - last >= 1.0:
                    last = t
                    if progress_ctx is not None:
                        progress_ctx.update(task, completed=t)
                    elif self.progress and t >= next_line:
                        next_line += tenth
                        w = time.perf_counter() - start
                        self._say(
                            f"virtual: t={t:.0f}/{end:g} s, {self.events} events, wall {w:.1f} s "
                            f"({self.events / max(w, 1e-9):.0f} events/s)"
                        )
                    if on_progress is not None:
                        on_progress(t)
        finally:
            if progress_ctx is not None:
                progress_ctx.stop()

    def _finish(self, broadcasts: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        rec, end = self.recorder, min(self.queue.now, self.sc.duration_s)
        vreport.record_bytes(rec, self.nodes, self.net.links.bytes_up, self.net.links.bytes_down)
        summary = vreport.summary(
            self.sc,
            self.nodes,
            rec,
            end=end,
            events=self.events,
            wall_s=wall_s,
            cpu_s=self.cpu_s,
            build_s=self.build_s,
            setup_s=self.setup_s,
            broadcasts=broadcasts,
            skill_at=self.workers.skill_at,
            exchange=vreport.exchange_summary(self.sc, self.nodes, end, self.queue.unix(), self.net.shards_seen),
        )
        if self.shared is not None:
            summary["verification"] = self.shared.stats()
        if self.out_dir:
            self._say(f"virtual: {self.events} events in {wall_s:.1f} s; writing the report to {self.out_dir}")
            t0 = time.perf_counter()
            vreport.write(self.out_dir, rec, summary, self.sc)
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


def run_virtual(sc: Scenario, out_dir: str | Path | None = None, progress: bool = False) -> dict[str, Any]:
    return VirtualSim(sc, out_dir, progress=progress).run()
