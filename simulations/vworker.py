"""The virtual simulator's worker model: each node's worker, modelled, speaking to its real core.

- the pipe: a worker answers its core through the node's pipe messages
  (`node.pipe`: Ready, Rollouts, Step, Gen, Perf, Published, Applied) and
  obeys Follow, Admit, Pace, Head and Patch; it applies what its store holds
  beyond the version it holds by `node/worker/main.py`'s plan
  (`sync.catchup.local_plan`);
- compute: a step takes `step_s / compute` virtual seconds (a follower's no
  less than its core's pace allows); a trainer's step that trains on u groups
  (local and external) takes `1 - train_share * (1 - u / I)` times that, so
  training on the swarm's groups costs the trainer its own time;
- learning: a node's policy is one number, its skill p = probability that a
  completion is correct. A step draws the completions' correctness from p,
  writes correct or wrong answer text, and scores it with the real verifier.
  A group is informative when its rewards are not all equal
  (`training.sampler.informative`; GRPO drops the others). After a step, p += rate * (ceiling - p) * (u_local + w_own * u_own
  + w * u_other) / 8, with u the informative groups used (local, and the
  external ones its sampler gave: of its own lineage, from its followers, and
  of other lineages). The isolated twin of each node trains on I + J local groups
  with the same rule and its own draws, step for step (SAPO's comparison:
  `gain_swarm`); the alone twin trains on I local groups on its own clock,
  each of its steps costing what the same rule charges, so at equal virtual
  time it has spent the node's compute alone (the compute-matched benchmark's
  comparison: `alone`). A follower generates at the skill its publisher had
  at the version it holds;
- held-out readings: a trainer's first step and every `EVAL_EVERY_STEPS`-th
  after it, as the live worker's, and a follower's first generation at each
  version it holds report a held-out accuracy, the share of
  `HELDOUT_TASKS` tasks drawn correct at the skill of the weights held (a
  modelled evaluation, from its own random stream), which the core's trial of
  a lineage it left its own for reads (`node.core.roles.not_worse`);
- the sampler intake: a trainer takes its external groups from its own
  `training.sampler.Sampler`, fed the accepted batches its core routes to the
  worker (`NodeCore.external_wanted`), each batch split once per process.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from murmur.gossip import wire
from murmur.gossip.validation import Verdict
from murmur.node import pipe
from murmur.node.worker.main import EVAL_EVERY_STEPS
from murmur.simulations.scenario import Scenario
from murmur.simulations.vcache import Memo
from murmur.simulations.vevents import EventQueue, StepDue, WorkerSends
from murmur.simulations.vnode import (
    BASE_MODEL,
    LINEAGE_NAME,
    TOKENIZER,
    TOKENS_PER_ROLLOUT,
    Alone,
    VNode,
    item_bytes,
    stored_items,
)
from murmur.simulations.vreport import Recorder
from murmur.sync.catchup import local_plan
from murmur.sync.items import KIND_CODEC
from murmur.training.sampler import Sampler, informative, split
from murmur.training.schedule import ScheduleBook, ScheduledDraw
from murmur.training.tasks import Task
from murmur.training.tasksets import BUILTIN_TRAIN

WORKER_S = 0.001  # a worker message reaches the network process this long after the worker sends it
SEED_RANGE = 1_000_000
POOL_GROUPS = 256  # a trainer's sampler holds the newest this many informative groups
HELDOUT_TASKS = 90  # tasks of a modelled held-out evaluation (murmur-tiny's built-in set: 30 per family)
MAX_ALONE_STEPS = 64  # alone-twin steps per node step: its steps are never much shorter than the node's


class Workers:
    """Every simulated node's modelled worker."""

    def __init__(
        self,
        sc: Scenario,
        nodes: list[VNode],
        queue: EventQueue,
        recorder: Recorder,
        task_set: bytes,
        resolve: Callable[[wire.TaskRef], Task],
        reward: Callable[[Task, str], float],
        memo_horizon_s: float,
        schedule: ScheduleBook | None = None,
    ) -> None:
        self.sc = sc
        self.nodes = nodes
        self.queue = queue
        self.recorder = recorder
        self.task_set = task_set
        self.resolve = resolve
        self.reward = reward
        self.skill_at: dict[bytes, list[float]] = {}  # lineage -> skill per version (followers sample from it)
        self.eval_rngs: dict[int, random.Random] = {}  # node index -> the stream of its modelled evaluations
        # lineage -> newest version a signed manifest of it went out for: the live announce topic carries every
        # manifest to every node, whose core then tells its trainer's worker that head (`NodeCore._tell_head`);
        # the simulator sends announces and manifests one hop, so a trainer's sampler reads the swarm-wide view
        self.published_heads: dict[bytes, int] = {}
        # accepted batch id -> its split, for the receivers still to come (in flight only, like the memos)
        self.groups = Memo(1_000_000, queue.unix, memo_horizon_s)
        # each node's draw of `training.schedule_share` of its prompts from the shared schedule (none at share 0)
        self.schedule = schedule
        self.draws: dict[int, ScheduledDraw] = {}

    def equip(self, n: VNode) -> None:
        """A trainer's worker: its sampler, its lineage's skill per version, and its alone twin."""
        sc, s = self.sc, n.spec
        n.sampler = Sampler(POOL_GROUPS, sc.training.max_staleness, seed=sc.seed * 100_003 + s.index, own=n.lineage)
        n.sampler.observe_head(n.lineage, 0)
        self.skill_at[n.lineage] = [n.skill]
        # its own stream: the twin's draws leave every other draw of the run as it was
        n.alone = Alone(n.skill, random.Random(sc.seed * 1_000_003 + s.index))

    # ------------------------------------------------------------ the pipe

    def send(self, n: VNode, msg: Any, delay: float = WORKER_S) -> None:
        """A message from the worker to its network process."""
        self.queue.push(self.queue.now + delay, WorkerSends(n.spec.index, msg, n.inc))

    def start(self, n: VNode) -> None:
        """A (re)started worker: a clean slate from its core, and its Ready."""
        n.transfers.clear()
        self.ready(n)

    def restart(self, n: VNode, roles: tuple[str, ...]) -> None:
        """The core restarts the worker with new roles (it chose to train or to generate): the node keeps its
        store, its transfers in flight and its own lineage's history; the new worker starts from them."""
        n.role = "trainer" if "trainer" in roles else "follower"
        if n.role == "trainer" and n.sampler is None:
            self.equip(n)
        self.recorder.row("event", t=self.queue.now, node=n.spec.index, action=f"role {n.role}")
        self.ready(n)

    def ready(self, n: VNode) -> None:
        """A new worker: nothing followed, admitted or paced until its core says so; its Ready."""
        n.following, n.admitted, n.pace = None, False, 0.0
        model_bytes = item_bytes(self.sc.sync.patch_bytes, "anchor")
        if n.role == "trainer":
            ready = pipe.Ready(BASE_MODEL.hex(), n.version, TOKENIZER.hex(), model_bytes, n.lineage.hex(), LINEAGE_NAME)
        else:
            ready = pipe.Ready(BASE_MODEL.hex(), 0, TOKENIZER.hex(), model_bytes)
        self.send(n, ready)

    def receive(self, n: VNode, m: Any) -> None:
        """A message from the core (`ToWorker`)."""
        if isinstance(m, pipe.Follow):
            n.following = bytes.fromhex(m.info.id) if m.info is not None else None
            n.admitted = False  # until the core's Admit for the new lineage
            if n.following is not None:
                if n.held_lineage != n.following:
                    n.held_lineage, n.held = n.following, 0  # a lineage new to it starts from the base model
                self.send(n, pipe.Applied(n.following.hex(), n.held))
                self.apply_held(n, n.following)  # as node/worker/main.py does on opening a lineage
        elif isinstance(m, pipe.Admit):
            n.admitted = m.generate and bytes.fromhex(m.lineage) == n.following
        elif isinstance(m, pipe.Pace):
            n.pace = m.rollouts_per_s
        elif isinstance(m, pipe.Head):
            if n.sampler is not None:  # as node/worker/main.py's reader does
                n.sampler.observe_head(bytes.fromhex(m.lineage), m.version)
        elif isinstance(m, pipe.Patch):
            self.apply_held(n, bytes.fromhex(m.lineage))

    def apply_held(self, n: VNode, lineage: bytes) -> None:
        """The worker applies what its store holds beyond the version it holds, by `node/worker/main.py`'s plan
        (`sync.catchup.local_plan`); modelled items always apply. The simulated swarm shares one base model,
        so a worker never needs an anchor to start (`need_anchor` stays false)."""
        if lineage != n.held_lineage:
            return
        plan = local_plan(n.held, stored_items(n.store.get(lineage, {}), self.sc.sync.patch_bytes))
        if plan is not None and plan.steps:
            n.held = plan.steps[-1].target
            self.send(n, pipe.Applied(lineage.hex(), n.held))

    def _perf(self, n: VNode, rollouts: int, seconds: float) -> None:
        self.send(n, pipe.Perf(rollouts * TOKENS_PER_ROLLOUT / max(seconds, 1e-9), seconds))

    def _rollouts_out(self, n: VNode, local: list[list[wire.Rollout]]) -> None:
        """The worker hands its rollouts to the network process, which batches, seals and publishes them."""
        items = [wire.encode(r) for g in local for r in g]
        if items:
            self.send(n, pipe.Rollouts(items))

    # ------------------------------------------------------------ rollouts

    @staticmethod
    def _wrong(answer: str, rng: random.Random) -> str:
        try:
            return str(int(answer) + rng.choice((-2, -1, 1, 2, 3)))
        except ValueError:
            return answer + "?"

    def group(self, node: VNode, lineage: bytes, version: int, skill: float) -> list[wire.Rollout]:
        """One group of completions of a fresh task, each correct with probability `skill`, scored."""
        g = self.sc.training.group_size
        ref, rnd = wire.TaskRef(self.task_set, BUILTIN_TRAIN, node.rng.randrange(SEED_RANGE)), 0
        created = self.queue.unix_ms()
        share = self.sc.training.schedule_share
        if share > 0 and self.schedule is not None:  # the free draw above is made anyway: the run's stream stays
            draw = self.draws.setdefault(node.spec.index, ScheduledDraw(self.schedule, share))
            got = draw.draw(self.task_set, created)
            if got is not None and got[0].generator == BUILTIN_TRAIN:  # the one family this model answers in
                ref, rnd = got  # TOKENS_PER_ROLLOUT (as a trainer restricted to some generators skips the rest)
        task = self.resolve(ref)
        out = []
        for _ in range(g):
            text = task.answer if node.rng.random() < skill else self._wrong(task.answer, node.rng)
            ids = [ord(c) % 256 for c in text] + [1]
            out.append(
                wire.Rollout(
                    task=ref,
                    lineage=lineage,
                    version=version,
                    completion_ids=ids,
                    text=text,
                    tokenizer_hash=TOKENIZER,
                    logprobs=bytes(4 * len(ids)),
                    token_versions=[],
                    sampling=wire.SamplingParams(max_new_tokens=TOKENS_PER_ROLLOUT),
                    reward=self.reward(task, text),
                    created_ms=created,
                    schedule_round=rnd,
                )
            )
        return out

    def intake(self, d: VNode, v: Verdict) -> None:
        """An accepted batch at a trainer: the groups its core routes to the worker go to its sampler."""
        if d.sampler is None or v.batch is None or d.core is None:
            return
        if not d.core.external_wanted({bytes(r.lineage) for r in v.batch.rollouts}):
            return
        cut = self.groups.get(v.msg_id)
        if cut is None:  # a batch's groups depend on its content only: split once per process (Groups are frozen)
            cut = split(v.batch.rollouts, bytes(v.batch.producer))
            self.groups.put(v.msg_id, cut)
        for g in cut[0]:
            head = self.published_heads.get(g.lineage)
            if head is not None:
                d.sampler.observe_head(g.lineage, head)
        d.sampler.add_split(cut)

    # ------------------------------------------------------------ steps

    def step_time(self, n: VNode) -> float:
        return self.sc.training.step_s / n.spec.compute

    def on_step(self, ev: StepDue) -> None:
        n = self.nodes[ev.node]
        if not n.alive or n.inc != ev.inc:
            return
        tr = self.sc.training
        if tr.max_steps and n.steps >= tr.max_steps:
            return
        dt = self.step_time(n)
        if n.role == "trainer":
            dt = self._train_step(n, dt)
            n.steps += 1
        else:
            if self._follower_step(n, dt):
                n.steps += 1
            rollouts = tr.local_groups * tr.group_size
            if n.pace > 0:  # the core's pace: no faster than the trainer needs
                dt = max(dt, rollouts / n.pace)
        self.queue.push(self.queue.now + dt, StepDue(ev.node, ev.inc))

    def _training_cost(self, used_groups: int) -> float:
        """A trainer step's time, as a multiple of its `step_time`, when it trains on `used_groups`."""
        lr, tr = self.sc.learning, self.sc.training
        return 1.0 - lr.train_share * (1.0 - used_groups / max(1, tr.local_groups))

    def _heldout(self, n: VNode, skill: float) -> float:
        """A modelled held-out evaluation of weights at `skill`: the share of `HELDOUT_TASKS` drawn correct."""
        rng = self.eval_rngs.setdefault(n.spec.index, random.Random(self.sc.seed * 7_919 + n.spec.index))
        return sum(rng.random() < skill for _ in range(HELDOUT_TASKS)) / HELDOUT_TASKS

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
        now = self.queue.now
        a = n.alone
        assert a is not None
        if a.clock is None:
            a.clock = a.until = now
        a.clock += max(0.0, now - a.until)
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
        now = self.queue.now
        local = [self.group(n, n.lineage, n.version, n.skill) for _ in range(tr.local_groups)]
        sampler = n.sampler
        assert sampler is not None and n.core is not None
        ext = sampler.take(tr.external_groups)  # the worker's rule: informative only, a uniform draw, within the bound
        for g in ext:
            head = n.core.head_of(g.lineage)
            self.recorder.row(
                "staleness",
                t=now,
                node=n.spec.index,
                staleness=max(0, (head if head is not None else g.version) - g.version),
            )
        u_local = sum(informative(r.reward for r in g) for g in local)
        u_ext = len(ext)
        n.consumed_ext += len(ext)
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        u_own = sum(g.lineage == n.lineage for g in ext)  # its followers' groups: its own policy's samples
        value = u_local + lr.own_lineage_weight * u_own + lr.external_weight * (u_ext - u_own)
        n.skill = self._learned(n.skill, value)
        step_s = dt
        dt = step_s * self._training_cost(u_local + u_ext)
        n.curve.append((now + dt, n.skill))
        self._alone_until(n, now + dt, step_s)
        # isolated twin: I + J local groups, same rule, own draws
        k = tr.local_groups + tr.external_groups
        hits = self._twin_groups(n.rng, n.iso_skill, k)
        iso_reward = sum(hits) / (k * tr.group_size)
        u_iso = sum(0 < h < tr.group_size for h in hits)
        n.iso_skill = self._learned(n.iso_skill, u_iso)
        n.reward_sum += reward
        n.iso_sum += iso_reward
        n.version += 1
        sampler.observe_head(n.lineage, n.version)  # its own head, as node/worker/main.py reports it
        self.skill_at[n.lineage].append(n.skill)
        self.recorder.row(
            "reward",
            t=now,
            node=n.spec.index,
            reward=reward,
            isolated=iso_reward,
            version=n.version,
            group=n.spec.group,
        )
        self._rollouts_out(n, local)
        due = n.steps % EVAL_EVERY_STEPS == 0  # a held-out reading, at the live worker's cadence
        self.send(
            n,
            pipe.Step(
                n.steps + 1,
                n.version,
                reward,
                None,
                len(ext),
                dt,
                used=sum(len(g.rollouts) for g in ext),
                external_groups=len(ext),
                external_lineages=len({g.lineage for g in ext}),
                updates=1,
                trained_groups=u_local + u_ext,
                heldout=self._heldout(n, n.skill) if due else None,
                heldout_tasks=HELDOUT_TASKS if due else 0,
            ),
        )
        self._perf(n, tr.local_groups * tr.group_size, dt)
        if n.version % self.sc.sync.publish_every == 0:
            base = n.version - self.sc.sync.publish_every
            env = self._manifest(n, "patch", base, n.version)
            n.store.setdefault(n.lineage, {})[("patch", base, n.version)] = env
            self.send(n, pipe.Published(n.version, env))
        return dt

    def _follower_step(self, n: VNode, dt: float) -> bool:
        """Generate for the lineage the core follows, when its staleness admission allows; True if it did."""
        core = n.core
        assert core is not None
        lid = n.following
        if lid is not None:
            head = core.head_of(lid)
            self.recorder.row(
                "lag", t=self.queue.now, node=n.spec.index, lag=max(0, (head if head is not None else n.held) - n.held)
            )
        if lid is None or not n.admitted or lid != n.held_lineage:
            return False
        skills = self.skill_at[lid]
        skill = skills[min(n.held, len(skills) - 1)]
        local = [self.group(n, lid, n.held, skill) for _ in range(self.sc.training.local_groups)]
        reward = sum(r.reward for g in local for r in g) / max(1, sum(len(g) for g in local))
        self.recorder.row(
            "reward",
            t=self.queue.now,
            node=n.spec.index,
            reward=reward,
            isolated=None,
            version=n.held,
            group=n.spec.group,
        )
        self._rollouts_out(n, local)
        tokens = sum(len(r.completion_ids) for g in local for r in g)
        fresh = n.evaluated != (lid, n.held)  # a version it holds is measured once, as a live follower's
        n.evaluated = (lid, n.held)
        heldout = self._heldout(n, skill) if fresh else None
        self.send(n, pipe.Gen(reward, n.held, tokens, dt, heldout, HELDOUT_TASKS if fresh else 0))
        self._perf(n, sum(len(g) for g in local), dt)
        return True

    def _manifest(self, owner: VNode, kind: str, base: int, target: int) -> bytes:
        """The publisher's signed manifest of one item (chunk contents are modelled: their hashes are tokens)."""
        sy = self.sc.sync
        total = item_bytes(sy.patch_bytes, kind)
        sizes = [sy.chunk_bytes] * (total // sy.chunk_bytes) + (
            [total % sy.chunk_bytes] if total % sy.chunk_bytes else []
        )
        tag = hashlib.blake2b(b"%s/%d/%d" % (owner.lineage, base, target), digest_size=32).digest()
        codec = KIND_CODEC[kind]
        m = wire.PatchManifest(
            v=wire.FORMAT_VERSION,
            lineage=owner.lineage,
            lineage_name=LINEAGE_NAME,
            base_model_hash=BASE_MODEL,
            publisher=owner.ident.public,
            base_version=base,
            target_version=target,
            base_hash=b"" if kind == "anchor" else tag[:16] + b"base",
            target_hash=tag[:16],
            codec=codec,
            total_bytes=total,
            chunk_bytes=sy.chunk_bytes,
            chunks=[wire.ChunkRef(tag, s) for s in sizes],
            created_ms=self.queue.unix_ms(),
        )
        return wire.seal(owner.ident, wire.PATCH_MANIFEST, m, swarm=self.sc.swarm)
