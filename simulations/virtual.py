"""Virtual-time simulator: the real protocol cores, many nodes, modelled learning.

What runs for real (the same code the nodes run):
- every rollout batch is a real `gossip.wire.RolloutBatch`, sealed with the
  producer's real ed25519 key, and every receiver runs it through its own
  `gossip.validation.Pipeline` (size, decode, signature, replay, task
  regeneration from the built-in task set, reward recomputation with the real
  verifier, staleness bound) with its own `gossip.scoring.PeerScores`
  (graylist, blacklist) and rate limiter, on the virtual clock;
- each trainer picks its external groups with its own `training.sampler.Sampler`,
  the sampler a node's worker runs (informative groups only, newest first,
  each used once, staleness against the heads the node has heard);
- each follower pauses and resumes generating by `sync.staleness.StalenessGuard`,
  the node's staleness admission (fed the heads it heard and the versions it
  applied);
- patch broadcasts run `sync.swarm.SwarmSession` through `sync.vsim`
  (rarest-first, super-seeding, pipelining, corrupt-chunk bans) over the
  scenario's links.

Heads are learned from messages: a trainer's announce of its new head travels
with its rollout batch to its neighbours, a publisher's manifest reaches its
followers one link latency after the version, and a (re)joining follower asks
the publisher; each node's pipeline and sampler judge staleness by the heads
that node heard (at most `training.sampler.MAX_HEADS` lineages per node).

What is modelled:
- learning: a node's policy is one number, its skill p = probability that a
  completion is correct. A step draws the completions' correctness from p,
  writes correct or wrong answer text, and scores it with the real verifier.
  A group is informative when its rewards are not all equal (GRPO drops the
  others). After a step, p += rate * (ceiling - p) * (u_local + w * u_ext),
  with u the informative groups used (local, and the external ones its
  sampler gave). The isolated twin of each node
  trains on I + J local groups with the same rule and its own draws.
- compute: a step takes `step_s / compute` virtual seconds;
- rollout gossip is one hop: a batch goes to the producer's `degree`
  neighbours, who verify it and do not forward it;
- links: `simulations.wan.LinkModel` (bandwidth queues, latency, jitter,
  loss as retransmission delay);
- followers receive each version one patch-broadcast delay after it is
  published; the delay per follower comes from a broadcast of the
  scenario's patch size run through the real swarm core at start-up.

Also modelled here rather than run from the node's code: roles (fixed by the
scenario), rollout batching and sealing, announces and catch-up.

Memory follows the swarm's size and message rate, not the run's length: the
per-process memos keep only messages in flight (`MEMO_HORIZON_S` of virtual
time), a node's state is what it heard (pipeline caches, scores, heads,
sampler), and report rows are kept once.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

from gossip import wire
from gossip.scoring import ScoreParams
from gossip.validation import PENALTIES, Pipeline, PipelineConfig, Reason
from gossip.identity import Identity
from simulations.report import MetricsWriter, write_report
from simulations.scenario import NodeSpec, Scenario, dumps, expand
from simulations.vcache import Memo, SharedVerification, SimPipeline
from simulations.wan import LinkModel, LinkSpec, broadcast_lower_bound
from sync.staleness import StalenessGuard
from training.sampler import MAX_HEADS, Sampler, split
from training.tasksets import BUILTIN_TRAIN, TaskRegistry
from training.verifiers import score

EPOCH = 1_700_000_000.0  # virtual t = 0 as unix time (pipeline freshness checks use unix seconds)
TOKENIZER = hashlib.blake2b(b"murmur/sim-tokenizer", digest_size=32).digest()
SEED_RANGE = 1_000_000
POOL_GROUPS = 256  # a trainer's sampler holds the newest this many informative groups
MEMO_HORIZON_S = 5.0  # virtual seconds a per-message memo entry is kept: a batch reaches its receivers sooner


def identity_for(seed: int, index: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(f"murmur-sim/{seed}/{index}".encode(), digest_size=32).digest())


@dataclass
class VNode:
    spec: NodeSpec
    ident: Identity
    peer_id: str
    pipeline: Pipeline
    heads: dict[bytes, int]  # lineage -> newest version this node heard its publisher announce
    sampler: Sampler | None  # trainers: the node worker's external-rollout sampler
    guard: StalenessGuard | None  # followers: the node's staleness admission for the lineage it follows
    lineage: bytes
    skill: float
    iso_skill: float
    rng: random.Random
    alive: bool = False
    inc: int = 0  # incarnation: events scheduled before a leave are ignored after it
    version: int = 0  # trainers: own lineage head; followers: version of the followed lineage held
    seq: int = 0
    steps: int = 0
    neighbours: list[int] = field(default_factory=list)
    reward_sum: float = 0.0
    iso_sum: float = 0.0
    consumed_ext: int = 0
    adv_accepted: int = 0
    sent_batches: list[bytes] = field(default_factory=list)
    patch_delay: float = 0.0


class VirtualSim:
    def __init__(self, sc: Scenario, out_dir: str | Path | None = None, *,
                 progress: bool = False, max_events: int = 20_000_000, shared_verify: bool = True) -> None:
        self.sc = sc
        self.out_dir = Path(out_dir) if out_dir else None
        self.progress = progress
        self.max_events = max_events
        self.rng = random.Random(sc.seed)
        self.specs = expand(sc)
        self.registry = TaskRegistry()
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
        # accepted batch id -> its split, for the receivers still to come (in flight only, like the memos)
        self._groups = Memo(1_000_000, self._unix, MEMO_HORIZON_S)
        self.skill_at: dict[bytes, list[float]] = {}  # lineage -> skill per version (followers sample from it)
        self.nodes: list[VNode] = []
        score_params = ScoreParams(graylist_threshold=sc.gossip.graylist_threshold, blacklist_s=sc.gossip.blacklist_s)
        for s in self.specs:
            ident = identity_for(sc.seed, s.index)
            lineage = hashlib.blake2b(b"lineage" + ident.public, digest_size=32).digest()
            node_rng = random.Random(self.rng.randrange(2**63))
            p0 = min(sc.learning.ceiling, max(0.0, sc.learning.initial + node_rng.uniform(-1, 1) * sc.learning.spread))
            cfg = PipelineConfig(swarm=sc.swarm, max_staleness=sc.training.max_staleness,
                                 rate_per_s=sc.gossip.rate_limit_per_s, burst=sc.gossip.rate_burst,
                                 replay_entries=50_000, replay_ttl_s=900.0, score=score_params)
            heads: dict[bytes, int] = {}
            if self.shared is not None:
                pipe: Pipeline = SimPipeline(cfg, clock=self._unix, resolve_task=self._resolve, reward=self._score,
                                             head_version=heads.get, shared=self.shared)
            else:
                pipe = Pipeline(cfg, clock=self._unix, resolve_task=self.registry.resolve, reward=score,
                                head_version=heads.get)
            sampler = Sampler(POOL_GROUPS, sc.training.max_staleness) if s.role == "trainer" else None
            guard = StalenessGuard(sc.training.max_staleness) if s.role == "follower" else None
            self.nodes.append(VNode(s, ident, ident.peer_id, pipe, heads, sampler, guard, lineage, p0, p0, node_rng))
        for n in self.nodes:
            if n.spec.role == "trainer":
                n.heads[n.lineage] = 0
                n.sampler.observe_head(n.lineage, 0)  # type: ignore[union-attr]
                self.skill_at[n.lineage] = [n.skill]
        for n in self.nodes:
            if n.guard is not None:  # a follower starts holding the base (version 0) of the lineage it follows
                n.guard.applied(self.nodes[n.spec.follow].lineage, 0, 0.0)  # type: ignore[index]
        self.by_peer = {n.peer_id: n for n in self.nodes}
        self.trainer_ids = [n.spec.index for n in self.nodes if n.spec.role == "trainer"]
        self.followers_of: dict[int, list[int]] = {}
        for n in self.nodes:
            if n.spec.role == "follower" and n.spec.follow is not None:
                self.followers_of.setdefault(n.spec.follow, []).append(n.spec.index)
        self._topology()

    # ------------------------------------------------------------ plumbing

    def _unix(self) -> float:
        return EPOCH + self.now

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
        for i, node in enumerate(self.nodes):
            node.neighbours = sorted(adj[i])

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
        created = int(self._unix() * 1000)
        out = []
        for _ in range(g):
            text = task.answer if node.rng.random() < skill else self._wrong(task.answer, node.rng)
            ids = [ord(c) % 256 for c in text] + [1]
            out.append(wire.Rollout(task=ref, lineage=lineage, version=version, completion_ids=ids, text=text,
                                    tokenizer_hash=TOKENIZER, logprobs=bytes(4 * len(ids)), token_versions=[],
                                    sampling=wire.SamplingParams(max_new_tokens=8), reward=self._score(task, text),
                                    created_ms=created))
        return out

    @staticmethod
    def _informative(rollouts: list[wire.Rollout]) -> bool:
        rewards = [r.reward for r in rollouts]
        return max(rewards) != min(rewards)

    def _seal(self, node: VNode, rollouts: list[wire.Rollout], seq: int | None = None) -> bytes:
        if seq is None:
            node.seq += 1
            seq = node.seq
        batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=self.sc.swarm, producer=node.ident.public, seq=seq,
                                  created_ms=int(self._unix() * 1000), rollouts=rollouts)
        return wire.seal(node.ident, wire.ROLLOUT_BATCH, batch)

    def _gossip(self, node: VNode, data: bytes, head: tuple[bytes, int] | None = None) -> None:
        for j in node.neighbours:
            dst = self.nodes[j]
            if not dst.alive:
                continue
            at = self.links.send(node.spec.index, j, len(data), self.now)
            self._push(at, "deliver", j, node.spec.index, data, dst.inc, head)

    # ------------------------------------------------------------ events

    def _ev_join(self, i: int) -> None:
        n = self.nodes[i]
        if n.alive:
            return
        n.alive = True
        n.inc += 1
        self.links.reset(i, self.now)
        self._row("event", t=self.now, node=i, action="join")
        if n.spec.role == "follower" and n.spec.follow is not None:  # ask the publisher where its head is
            self._push(self.now + self._latency(i, n.spec.follow), "catalog", n.spec.follow, i, n.inc)
        if n.spec.role == "adversary":
            self._push(self.now + n.rng.uniform(0, 1.0 / n.spec.rate_per_s), "adv", i, n.inc)
        else:
            self._push(self.now + n.rng.uniform(0, self._step_time(n)), "step", i, n.inc)

    def _ev_leave(self, i: int) -> None:
        n = self.nodes[i]
        if not n.alive:
            return
        n.alive = False
        n.inc += 1
        self._row("event", t=self.now, node=i, action="leave")

    def _step_time(self, n: VNode) -> float:
        return self.sc.training.step_s / n.spec.compute

    def _ev_step(self, i: int, inc: int) -> None:
        n = self.nodes[i]
        if not n.alive or n.inc != inc:
            return
        tr = self.sc.training
        if tr.max_steps and n.steps >= tr.max_steps:
            return
        if n.spec.role == "trainer":
            self._train_step(n)
        else:
            self._follower_step(n)
        n.steps += 1
        self._push(self.now + self._step_time(n), "step", i, inc)

    def _train_step(self, n: VNode) -> None:
        tr, lr = self.sc.training, self.sc.learning
        local = [self._group(n, n.lineage, n.version, n.skill) for _ in range(tr.local_groups)]
        sampler = n.sampler
        assert sampler is not None
        ext = sampler.take(tr.external_groups)  # the node's rule: informative only, newest first, within the bound
        for g in ext:
            self._row("staleness", t=self.now, node=n.spec.index,
                      staleness=max(0, (sampler.head(g.lineage) or g.version) - g.version))
        u_local = sum(self._informative(g) for g in local)
        u_ext = len(ext)
        n.consumed_ext += len(ext)
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        n.skill += lr.rate * (lr.ceiling - n.skill) * (u_local + lr.external_weight * u_ext) / 8.0
        n.skill = min(lr.ceiling, max(0.0, n.skill))
        # isolated twin: I + J local groups, same rule, own draws
        k = tr.local_groups + tr.external_groups
        hits = [sum(n.rng.random() < n.iso_skill for _ in range(tr.group_size)) for _ in range(k)]
        iso_reward = sum(hits) / (k * tr.group_size)
        u_iso = sum(0 < h < tr.group_size for h in hits)
        n.iso_skill = min(lr.ceiling, n.iso_skill + lr.rate * (lr.ceiling - n.iso_skill) * u_iso / 8.0)
        n.reward_sum += reward
        n.iso_sum += iso_reward
        n.version += 1
        n.heads[n.lineage] = n.version
        sampler.observe_head(n.lineage, n.version)
        self.skill_at[n.lineage].append(n.skill)
        self._row("reward", t=self.now, node=n.spec.index, reward=reward, isolated=iso_reward, version=n.version,
                  group=n.spec.group)
        if local:
            rollouts = [r for g in local for r in g]
            head = (n.lineage, n.version)  # the node's announce of its new head travels with its batch
            for k0 in range(0, len(rollouts), wire.MAX_ROLLOUTS_PER_BATCH):
                self._gossip(n, self._seal(n, rollouts[k0:k0 + wire.MAX_ROLLOUTS_PER_BATCH]), head)
        if n.version % self.sc.sync.publish_every == 0:
            for fi in self.followers_of.get(n.spec.index, ()):
                f = self.nodes[fi]
                if f.alive:  # the signed manifest reaches the follower first, the patch one broadcast later
                    self._push(self.now + self._latency(n.spec.index, fi), "head", fi, n.lineage, n.version, f.inc)
                    self._push(self.now + f.patch_delay, "patch", f.spec.index, n.version, f.inc)

    def _follower_step(self, n: VNode) -> None:
        lead = self.nodes[n.spec.follow]  # type: ignore[index]
        guard = n.guard
        assert guard is not None
        self._row("lag", t=self.now, node=n.spec.index, lag=max(0, n.heads.get(lead.lineage, n.version) - n.version))
        if not guard.may_generate(lead.lineage):
            return  # beyond the bound: stop producing, wait for the catch-up patch
        skills = self.skill_at[lead.lineage]
        skill = skills[min(n.version, len(skills) - 1)]
        local = [self._group(n, lead.lineage, n.version, skill) for _ in range(self.sc.training.local_groups)]
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        self._row("reward", t=self.now, node=n.spec.index, reward=reward, isolated=None, version=n.version,
                  group=n.spec.group)
        rollouts = [r for g in local for r in g]
        for k0 in range(0, len(rollouts), wire.MAX_ROLLOUTS_PER_BATCH):
            self._gossip(n, self._seal(n, rollouts[k0:k0 + wire.MAX_ROLLOUTS_PER_BATCH]))

    def _ev_patch(self, i: int, version: int, inc: int) -> None:
        n = self.nodes[i]
        if n.alive and n.inc == inc and version > n.version:
            n.version = version
            if n.guard is not None:
                n.guard.applied(self.nodes[n.spec.follow].lineage, version, self.now)  # type: ignore[index]

    def _ev_head(self, i: int, lineage: bytes, version: int, inc: int) -> None:
        """A head announced by the lineage's publisher reaches node i."""
        n = self.nodes[i]
        if n.alive and n.inc == inc:
            self._learn_head(n, lineage, version)

    def _ev_catalog(self, lead: int, i: int, inc: int) -> None:
        """A (re)joined follower's catalog request reaches the publisher: the reply carries the publisher's
        head, and the catch-up patch follows one broadcast delay later."""
        p, n = self.nodes[lead], self.nodes[i]
        if not p.alive or n.inc != inc:
            return
        self._push(self.now + self._latency(lead, i), "head", i, p.lineage, p.version, inc)
        if p.version > n.version:
            self._push(self.now + self._latency(lead, i) + n.patch_delay, "patch", i, p.version, inc)

    def _learn_head(self, n: VNode, lineage: bytes, version: int) -> None:
        if version > n.heads.get(lineage, -1):
            if len(n.heads) >= MAX_HEADS and lineage not in n.heads:
                n.heads.pop(next(iter(n.heads)))  # the longest-known lineage goes first: bounded per node
            n.heads[lineage] = version
        if n.sampler is not None:
            n.sampler.observe_head(lineage, version)
        if n.guard is not None and n.spec.follow is not None and lineage == self.nodes[n.spec.follow].lineage:
            n.guard.observe_head(lineage, version, self.now)

    def _latency(self, a: int, b: int) -> float:
        return self.links.links[a].latency_s + self.links.links[b].latency_s

    def _ev_deliver(self, dst: int, src: int, data: bytes, inc: int, head: tuple[bytes, int] | None) -> None:
        d = self.nodes[dst]
        if not d.alive or d.inc != inc:
            return
        s = self.nodes[src]
        if head is not None:
            self._learn_head(d, *head)
        v = d.pipeline.check(data, s.peer_id)
        if not v.accepted:
            self.rejections[v.reason.value] += 1
            self._row("rejection", t=self.now, node=dst, peer=src, reason=v.reason.value)
            if v.newly_banned:
                self._row("event", t=self.now, node=dst, action=f"ban {src}")
            return
        if s.spec.role == "adversary":
            s.adv_accepted += 1
        if d.sampler is None or v.batch is None:
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
            self._gossip(n, self._seal(n, forged))
        elif b == "invalid_signature":
            data = bytearray(self._seal(n, self._group(n, n.lineage, 0, 0.5)))
            data[-5] ^= 0xFF  # inside the signature, the envelope's last field
            self._gossip(n, bytes(data))
        elif b == "replay":
            if not n.sent_batches:
                data = self._seal(n, self._group(n, n.lineage, 0, 0.5))
                n.sent_batches.append(data)
            else:  # the same seq again with other content (equivocation), and the old bytes again
                data = self._seal(n, self._group(n, n.lineage, 0, 0.5), seq=n.seq)
                self._gossip(n, n.sent_batches[0])
            self._gossip(n, data)
        elif b == "stale_spam":
            lead = self.nodes[self.trainer_ids[n.rng.randrange(len(self.trainer_ids))]]
            self._gossip(n, self._seal(n, self._group(n, lead.lineage, 0, 0.5)))
        # corrupt_chunks and free_ride act in the broadcasts / by never producing
        if b in ("forged_reward", "invalid_signature", "replay", "stale_spam"):
            self._push(self.now + 1.0 / n.spec.rate_per_s, "adv", i, inc)

    # ------------------------------------------------------------ broadcasts (real swarm core)

    def _broadcast(self, origin: int, receivers: list[int]) -> dict[str, Any]:
        from sync.vsim import SimLink, VirtualSwarm  # noqa: PLC0415

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
                          seed=self.rng.randrange(2**32))
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
        wall, cpu = time.perf_counter(), time.process_time()
        self._say(f"virtual: {self.sc.name}: {len(self.nodes)} nodes, measuring "
                  f"{self.sc.sync.broadcasts} broadcast(s) with the real swarm core")
        broadcasts = self._setup_broadcasts()
        self.setup_s = time.perf_counter() - wall
        self._schedule()
        with _few_collections():
            self._loop(on_progress)
        self.cpu_s = time.process_time() - cpu
        return self._finish(broadcasts, time.perf_counter() - wall)

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
            "setup_s": round(getattr(self, "setup_s", 0.0), 2),  # start-up broadcasts through the swarm core
            "peak_rss_mb": peak_rss_mb(),
            "events": self.events,
            "steps": sum(n.steps for n in self.nodes),
            "swarm_cumulative_reward": round(swarm, 3),
            "isolated_cumulative_reward": round(iso, 3),
            "gain_swarm": round(swarm / iso - 1, 4) if iso > 0 else None,
            "final_skill_mean": round(sum(n.skill for n in trainers) / max(1, len(trainers)), 4),
            "final_isolated_skill_mean": round(sum(n.iso_skill for n in trainers) / max(1, len(trainers)), 4),
            "external_groups_consumed": sum(n.consumed_ext for n in trainers),
            "sampler": {k: sum(n.sampler.counts[k] for n in trainers if n.sampler is not None)
                        for k in (trainers[0].sampler.counts if trainers and trainers[0].sampler else {})},
            "adversarial_accepted": sum(n.adv_accepted for n in self.nodes
                                        if n.spec.behaviour in ("forged_reward", "invalid_signature")),
            "rejections": dict(self.rejections),
            "broadcasts": broadcasts,
            "graylist_threshold": self.sc.gossip.graylist_threshold,
            "modelled": "learning (skill curve), compute time, one-hop rollout gossip, fixed roles; "
                        "real: signatures, verification pipeline, scoring, the node's sampler, "
                        "heads learned from messages, swarm broadcast core",
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
