"""`murmur bench swarm --matched [--nodes N] [--seeds K] [--cpu-s S]`: at equal CPU, how much sooner does a node in a swarm reach the held-out
accuracy it would reach alone?

Per seed, N murmur-tiny nodes, each warmed up from its own seed (volunteers' nodes differ), train on the
built-in task set twice, paired: (a) isolated, (b) in a swarm of N. Each node is a real
`training.trainer.Trainer` with a fixed minibatch (`minibatch_groups`): every optimizer update takes the
same number of informative groups in both arms, and a swarm node makes as many updates as its own and
its peers' fresh informative groups fill (swarm data adds updates, it never displaces local groups).

Compute-matched: every node's CPU is measured with `time.thread_time` (torch on one thread runs in the
calling thread): its generation and training (`Trainer.step`) and its share of verification (each
receiver's own `gossip.validation.Pipeline` check of every batch it is sent: signature, replay, task
regeneration, reward recomputation). The node that has spent the least CPU steps next, until every node
has spent `cpu_s`; so every node of every arm gets the same CPU. Held-out greedy accuracy (the first
`eval_per_family` seeds of each `-eval` generator) is measured on every node at `checkpoints` equal CPU
marks; evaluation CPU is not charged.

Per seed: `iso_cpu` = the CPU at which the isolated arm's mean accuracy curve first reaches its own
final value (linear between checkpoints), `swarm_cpu` = where the swarm arm's curve first reaches that
same value; `speedup` = iso_cpu / swarm_cpu (when the swarm never reaches it within the budget the
speedup is at most iso_cpu / cpu_s: reported so, with `reached` false). Across seeds: the mean and a
bootstrap 95 % interval (seeds resampled, 2000 times), `final_acc_delta` (swarm minus isolated final
accuracy) and `auc_delta` (the areas under the curves over the budget, per CPU-second), and
`used_over_verified` (rollouts that entered an update over rollouts a node verified). Per arm,
`generation_share`: the trainers' sampling CPU over their steps' CPU.

Two answer regimes (`answers`): "short", the built-in set (answers of at most 7 characters), and "worked",
the worked-answer set (`training.tasksets.worked_manifest`: >= 64 completion tokens of worked steps), in
which generation is most of a step, as in real RL post-training.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.node.config import MAX_OVERSAMPLE
from murmur.node.core.rewards import RewardBook
from murmur.simulations import curves
from murmur.simulations.bench import useless
from murmur.simulations.bench.swarm import SWARM, _ident, _seal
from murmur.training.downsample import MAX_SELECT_GROUPS
from murmur.training.foreign import FOREIGN_KEYS
from murmur.training.sampler import Sampler, split
from murmur.training.schedule import ScheduleBook, ScheduledDraw, round_at

# `murmur bench learn`'s regime (16 groups of 8 a step, lr 3e-4, 8 new tokens), in which one node alone
# measurably learns; with 4 groups a step and 4-group updates an isolated node did not rise in 40 CPU-s
# (docs/researcher.md), and a comparison with a flat baseline measures noise.
# `--foreign KEY=VALUE`: how a trainer uses swarm rollouts, other lineages' (the foreign keys) and its own
# followers' (`pod_yield`)
SWARM_USE_KEYS = (*FOREIGN_KEYS, "pod_yield")
TRAINER = dict(local_groups=16, external_groups=16, group_size=8, max_new_tokens=8, lr=3e-4, minibatch_groups=8)
# The worked-answer regime (`--answers worked`): the same trainer on the worked-answer set, whose completions
# are 70-77 tokens with EOS, so generation takes most of a node's step as it does in real RL post-training.
WORKED_NEW_TOKENS = 80
ANSWERS = ("short", "worked")
POOL_GROUPS = 64
BOOTSTRAP = 2000


def trainer_shape(answers: str) -> dict[str, Any]:
    """The trainer's regime for an answer regime: `TRAINER`, with room for worked answers."""
    if answers not in ANSWERS:
        raise ValueError(f"answers must be one of {', '.join(ANSWERS)}, not {answers!r}")
    return TRAINER if answers == "short" else {**TRAINER, "max_new_tokens": WORKED_NEW_TOKENS}


def task_registry(answers: str) -> tuple[Any, bytes]:
    """(a registry holding the regime's task set, that set's id): the built-in set, or the worked-answer
    set signed by the bench's coordinator key, which every node of the bench trusts."""
    from murmur.training.tasksets import TaskRegistry, sign_task_set, task_set_id, worked_manifest

    reg = TaskRegistry(SWARM)
    if answers == "short":
        reg.add_builtin()
        return reg, reg.builtin_id
    coord = _ident(0, 7777)
    env = sign_task_set(coord, worked_manifest(), swarm=SWARM)
    reg.add(env, {coord.public})
    return reg, task_set_id(env, swarm=SWARM)


@dataclass
class _Node:
    index: int
    ident: Any
    lineage: bytes
    trainer: Any
    engine: Any
    pipeline: Pipeline | None
    sampler: Sampler | None
    seq: int = 0
    cpu: float = 0.0
    verified: int = 0  # rollouts accepted by its pipeline
    verify_cpu: float = 0.0  # of `cpu`, checking what it was sent and sealing what it sends
    used: int = 0  # rollouts that entered its updates
    updates: int = 0
    ext_groups: int = 0
    gen_cpu: float = 0.0  # of `step_cpu`, spent sampling rollouts (the part a swarm's rollouts can save)
    step_cpu: float = 0.0  # of `cpu`, spent in the trainer's steps (generation and training)
    groups_generated: int = 0  # groups (one task's completions) it sampled
    groups_sent: int = 0  # ... of them sealed to others: informative ones only, as a node's sealer sends
    groups_trained: int = 0  # groups, own and others', that entered its updates
    groups_pooled: int = 0  # ... of them, own groups that swarm rollouts of the same task joined
    groups_rescued: int = 0  # ... of those, own groups that alone were all right or all wrong
    book: RewardBook | None = None  # verified rewards per lineage of what it sent and accepted (default roles)
    curve: list[float] = field(default_factory=list)
    wellformed: list[dict[str, float]] = field(default_factory=list)  # per checkpoint, per family
    last_eval: tuple[dict[str, float], dict[str, float]] = ({}, {})  # (accuracy, well-formed share) per family


def _lineage(ident: Any) -> bytes:
    return _lineage_of(ident.public)


def _lineage_of(public: bytes) -> bytes:
    """The lineage the key `public` publishes in the bench."""
    return hashlib.blake2b(b"lineage" + public, digest_size=32).digest()


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(sum(d[k] for d in ds) / len(ds), 4) for k in ds[0]} if ds else {}


def _follower_rollouts(
    engine: Any,
    gens: list[Any],
    task_set: bytes,
    resolve: Any,
    rng: random.Random,
    lineage: bytes,
    version: int,
    groups: int,
    max_new_tokens: int = int(TRAINER["max_new_tokens"]),
) -> list[Any]:
    """`groups` groups of a follower holding `lineage`'s `version`, as wire rollouts of that lineage (what
    ECHO-2's inference workers send their trainer)."""
    from murmur.gossip.wire import TaskRef
    from murmur.training.engine import Sampling
    from murmur.training.rollouts import RolloutRec, to_wire
    from murmur.training.verifiers import score

    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    out = []
    refs = []
    for _ in range(groups):
        g = rng.choices(gens, weights=[x.weight for x in gens])[0]
        refs.append((TaskRef(task_set, g.name, rng.randrange(g.seed_start, g.seed_end)), g))
    tasks = [resolve(ref) for ref, _ in refs]
    comps = engine.generate([t.prompt for t in tasks], int(TRAINER["group_size"]), sampling)
    for (ref, _), task, group in zip(refs, tasks, comps):
        for c in group:
            out.append(
                to_wire(
                    RolloutRec(
                        ref=ref,
                        task=task,
                        prompt_ids=c.prompt_ids,
                        ids=c.ids,
                        text=c.text,
                        logprobs=c.logprobs,
                        token_versions=[(0, version)],
                        version=version,
                        lineage=lineage,
                        tokenizer_hash=engine.tokenizer_hash,
                        sampling=sampling,
                        reward=score(task, c.text),
                        finished=c.finished,
                    )
                )
            )
    return out


def _send(node: _Node, rows: list[Any]) -> list[bytes]:
    """`node`'s sealed batches of `rows`, the groups a receiver's sampler keeps only: a node's sealer
    (`node.core.sealing`) keeps a group whose rewards are all equal local, unless it answers a shared-schedule
    prompt, so no receiver verifies it for nothing. Counts the groups sent."""
    groups, _ = split(rows)
    node.groups_sent += len(groups)
    if node.book is not None:
        node.book.add_groups(g for g in groups if g.lineage == node.lineage)
    return _seal(node, [r for g in groups for r in g.rollouts]) if groups else []


def _receive(node: _Node, payloads: list[bytes], sender: str) -> None:
    """`node` verifies `sender`'s sealed batches, keeps what it accepts and pays the CPU it took."""
    assert node.pipeline is not None and node.sampler is not None
    c0 = time.thread_time()
    for data in payloads:
        v = node.pipeline.check(data, sender)
        if v.accepted and v.batch is not None:
            node.verified += len(v.batch.rollouts)
            if node.book is not None:  # a lineage's score is its publisher's own samples (node.core.machine)
                mine = _lineage_of(bytes(v.batch.producer))
                node.book.add_groups(g for g in split(v.batch.rollouts)[0] if g.lineage == mine)
            node.sampler.add_rollouts(v.batch.rollouts, bytes(v.batch.producer))
    dt = time.thread_time() - c0
    node.cpu += dt
    node.verify_cpu += dt


def _timed_sampling(node: _Node) -> None:
    """Count the thread CPU of `node`'s engine's sampling into `node.gen_cpu` (evaluation takes it back out)."""
    inner = node.engine.sample

    def sample(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            node.gen_cpu += time.thread_time() - c0

    node.engine.sample = sample


class _Adversary:
    """The swarm's adversary (`simulations.bench.useless`): its own key and lineage and a weak policy; one
    batch of its informative groups out of I per round of honest steps. Every `FORGE_EVERY`-th batch is
    provably bad and goes out under a fresh key (a Sybil: the first forgery gets its key banned, so the
    main key never forges and its useless rollouts flow for the whole run)."""

    def __init__(self, seed: int, engine: Any, max_new_tokens: int = int(TRAINER["max_new_tokens"])) -> None:
        self.max_new_tokens = max_new_tokens
        ident = _ident(seed, 99)
        self.node = _Node(99, ident, _lineage(ident), None, engine, None, None)
        self.rng = random.Random(seed * 100 + 99)
        self.seed = seed
        self.batches = 0
        self.forged = 0  # batches sent with a forged reward
        self.misscheduled = 0  # batches claiming a schedule round for tasks that are not its prompts
        self.last_ms = 0
        self.bad_keys: set[tuple[bytes, str, int, str, int]] = set()
        self.taken = 0  # its rows that honest trainers took into their steps
        self.bad_taken = 0  # of them, rows of a provably bad batch

    def payloads(self, gens: list[Any], task_set: bytes, resolve: Any) -> tuple[str, list[bytes]]:
        """(the sending key's peer id, its sealed batches) for this round."""
        from murmur.gossip.wire import now_ms

        self.batches += 1
        self.last_ms = max(now_ms(), self.last_ms + 1)  # every batch's rows are told apart by it
        size = int(TRAINER["group_size"])
        rows = _follower_rollouts(
            self.node.engine,
            gens,
            task_set,
            resolve,
            self.rng,
            self.node.lineage,
            self.batches,
            int(TRAINER["local_groups"]),
            self.max_new_tokens,
        )
        rows = useless.stamp(useless.claim_low_logprobs(useless.informative(rows)), self.last_ms)
        if not rows:
            return self.node.ident.peer_id, []
        if self.batches % useless.FORGE_EVERY == 0:
            if (self.batches // useless.FORGE_EVERY) % 2:
                rows = useless.forge(rows, size)
                self.forged += 1
            else:
                rows = useless.misschedule(rows, round_at(self.last_ms))
                self.misscheduled += 1
            self.bad_keys.update(useless.row_key(r) for r in rows)
            sybil = _Node(
                1000 + self.batches,
                _ident(seed=self.seed, i=1000 + self.batches),
                self.node.lineage,
                None,
                None,
                None,
                None,
            )
            return sybil.ident.peer_id, _seal(sybil, rows)
        return self.node.ident.peer_id, _seal(self.node, rows)

    def deliver(self, node: _Node, receivers: list[_Node], heads: dict[bytes, int]) -> None:
        """One turn: this round's batches (built on `node`'s task set) to every one of `receivers`, each
        verifying them on its own CPU; the adversary's lineage moves to its next version (it publishes)."""
        from murmur.training.tasksets import train_generators

        reg = node.trainer.registry
        sender, payloads = self.payloads(
            train_generators(reg.get(node.trainer.task_set)), node.trainer.task_set, reg.resolve
        )
        heads[self.node.lineage] = self.batches
        for other in receivers:
            assert other.sampler is not None
            other.sampler.observe_head(self.node.lineage, self.batches)
            _receive(other, payloads, sender)

    def report(self, ns: list[_Node]) -> dict[str, int]:
        """What it sent, what honest trainers took of it, and what honest pipelines (`ns`) refused."""
        return {
            "batches": self.batches,
            "forged_batches": self.forged,
            "misscheduled_batches": self.misscheduled,
            "rows_taken": self.taken,
            "provably_bad_rows_taken": self.bad_taken,
            # honest nodes forge nothing: every forgery refused is its
            "rejected": sum(n.pipeline.counts["forged_reward"] for n in ns if n.pipeline is not None),
            "rejected_misscheduled": sum(n.pipeline.counts["misscheduled"] for n in ns if n.pipeline is not None),
        }

    def watch(self, take: Any) -> Any:
        """`take` (a sampler's `take_rollouts`), counting the adversary's rows it hands a trainer."""

        def counted(*a: Any, **k: Any) -> Any:
            out = take(*a, **k)
            for _, r in out:
                if bytes(r.lineage) == self.node.lineage:
                    self.taken += 1
                    self.bad_taken += useless.row_key(r) in self.bad_keys
            return out

        return counted


def make_adversary(seed: int, home: Path, answers: str) -> _Adversary:
    """The seed's adversary, on its weak policy (`useless.WEAK_WARMUP_STEPS` of warm-up) in the regime's shape."""
    from murmur.training.engine_hf import HFEngine
    from murmur.training.tiny import ensure_tiny

    weak = ensure_tiny(home, seed=seed * 64 + 99, warmup_steps=useless.WEAK_WARMUP_STEPS, answers=answers)
    engine = HFEngine.from_path(weak, device="cpu", seed=seed * 100 + 99)
    return _Adversary(seed, engine, int(trainer_shape(answers)["max_new_tokens"]))


def make_nodes(
    nodes: int,
    seed: int,
    home: Path,
    warmup_steps: int | None,
    answers: str,
    eval_per_family: int,
    external_groups: int,
    swarm: bool,
    adv: _Adversary | None = None,
    select_groups: int = 0,
    schedule_share: float = 0.0,
    foreign: dict[str, Any] | None = None,
    same_start: bool = False,
) -> tuple[list[_Node], list[Any], dict[bytes, int]]:
    """`nodes` trainers, node i warmed up from its own seed, each with its own key, lineage, engine and (in a
    swarm) its own pipeline and sampler; with the adversary `adv`, each sampler's `take_rollouts` is wrapped
    by its `watch` and its lineage starts at head 0;
    `select_groups`: the trainers' PODS down-sampling (`TrainerConfig.select_groups`); `schedule_share`: the
    share of each trainer's prompts drawn from the shared prompt schedule (`[training] schedule_share`);
    `foreign`: `TrainerConfig` values of the foreign-rollout keys (`training.foreign.FOREIGN_KEYS`) that
    replace their defaults; `same_start`: every node from node 0's warm-up (volunteers who fetch one base
    model), not each from its own. Returns the nodes, the held-out tasks and the heads table their pipelines
    read."""
    from murmur.training.engine_hf import HFEngine
    from murmur.training.evaluation import held_out_tasks
    from murmur.training.tiny import ensure_tiny
    from murmur.training.tokencheck import for_model
    from murmur.training.tokenizer import TINY_NAME
    from murmur.training.trainer import Trainer, TrainerConfig
    from murmur.training.verifiers import score

    shape = trainer_shape(answers)
    heads: dict[bytes, int] = {}
    ns: list[_Node] = []
    tasks = None
    check_tokens = for_model(TINY_NAME)
    assert check_tokens is not None  # murmur-tiny's tokenizer is built in
    for i in range(nodes):
        ident = _ident(seed, i)
        lineage = _lineage(ident)
        reg, set_id = task_registry(answers)
        tasks = tasks or held_out_tasks(reg.get(set_id), eval_per_family)
        # each node its own warm-up, or all node 0's
        path = ensure_tiny(home, seed=seed * 64 + (0 if same_start else i), warmup_steps=warmup_steps, answers=answers)
        engine = HFEngine.from_path(path, device="cpu", seed=seed * 100 + i)
        cfg = TrainerConfig(
            **{**shape, "external_groups": external_groups, **(foreign or {})},
            select_groups=select_groups,
            seed=seed * 100 + i,
        )
        # what a node's pipeline checks: its own token budget and tokenizer (node.shell.runtime)
        pipeline = (
            Pipeline(
                PipelineConfig(
                    swarm=SWARM,
                    max_staleness=cfg.max_staleness,
                    rate_per_s=1e6,
                    burst=10**6,
                    max_completion_tokens=cfg.max_new_tokens,
                ),
                clock=time.time,
                resolve_task=reg.resolve,
                reward=score,
                head_version=lambda lin: heads.get(bytes(lin)),
                task_set_trusted=reg.__contains__,
                check_tokens=check_tokens,
                schedule=ScheduleBook.of(reg),
            )
            if swarm
            else None
        )
        sampler = Sampler(POOL_GROUPS, cfg.max_staleness, seed=seed * 100 + i, own=lineage) if swarm else None
        node = _Node(i, ident, lineage, None, engine, pipeline, sampler)
        _timed_sampling(node)
        take = None if sampler is None else sampler.take_rollouts if adv is None else adv.watch(sampler.take_rollouts)
        node.trainer = Trainer(engine, reg, set_id, cfg, lineage=lineage, external=take)
        if schedule_share > 0:
            node.trainer.schedule = ScheduledDraw(ScheduleBook.of(reg), schedule_share)
        heads[lineage] = 0
        ns.append(node)
    if adv is not None:
        heads[adv.node.lineage] = 0
    assert tasks is not None
    return ns, tasks, heads


def trainer_turn(node: _Node, ns: list[_Node], heads: dict[bytes, int], peers: list[_Node]) -> None:
    """One trainer step of `node` on its own CPU; in a swarm (`ns` have samplers) every node learns its new
    head, and its rollouts, sealed on its CPU, go to `peers`, each verifying them on its own."""
    from murmur.training.rollouts import to_wire

    c0 = time.thread_time()
    res = node.trainer.step()
    dt = time.thread_time() - c0
    node.cpu += dt
    node.step_cpu += dt
    node.updates += res.updates
    node.ext_groups += res.trained_external_groups
    node.used += sum(res.used_by_set.values())
    node.groups_trained += res.trained_groups
    node.groups_pooled += res.trained_pooled_groups
    node.groups_rescued += res.trained_rescued_groups
    node.groups_generated += res.n_local_groups
    heads[node.lineage] = node.trainer.version
    if node.sampler is None or not res.rollouts:
        return
    for other in ns:
        assert other.sampler is not None
        other.sampler.observe_head(node.lineage, node.trainer.version)
    if not peers:  # a pod's trainer: no one asked for its rollouts, and a node signs none no one asked for
        return
    c0 = time.thread_time()
    payloads = _send(node, [to_wire(r) for r in res.rollouts])
    dt = time.thread_time() - c0
    node.cpu += dt
    node.verify_cpu += dt
    for other in peers:
        _receive(other, payloads, node.ident.peer_id)


def seed_torch(seed: int) -> None:
    """One torch thread (the CPU matching measures thread time) and the arm's seed."""
    import torch

    from murmur.training.engine_hf import set_threads

    set_threads(1)
    torch.manual_seed(seed)


def evaluate_node(n: _Node, tasks: list[Any], new_tokens: int) -> None:
    """Held-out greedy accuracy of the weights `n` holds, appended to its curve; not charged as CPU."""
    from murmur.training.evaluation import greedy_eval

    gen_cpu = n.gen_cpu
    n.last_eval = greedy_eval(n.engine, tasks, new_tokens)
    n.curve.append(n.last_eval[0]["all"])
    n.wellformed.append(n.last_eval[1])
    n.gen_cpu = gen_cpu


def run_arm(
    swarm: bool,
    nodes: int,
    seed: int,
    cpu_s: float,
    checkpoints: int,
    eval_per_family: int,
    home: Path,
    warmup_steps: int | None = None,
    followers: int = 0,
    adversary: bool = False,
    answers: str = "short",
    select_groups: int = 0,
    follower_oversample: float = 1.0,
    schedule_share: float = 0.0,
    foreign: dict[str, Any] | None = None,
    same_start: bool = False,
) -> dict[str, Any]:
    """One arm: `nodes` trainers, isolated or in a swarm; with `followers` = K > 0, one trainer (node 0)
    and K followers that hold its current weights and generate I groups each for its lineage per trainer
    step (their CPU is theirs, not the trainer's: the trainer's own CPU-seconds are what is matched), or
    `follower_oversample` times I, and send their informative groups (`_send`);
    `select_groups`: the trainers' PODS down-sampling (`TrainerConfig.select_groups`, 0: off);
    with `adversary`, the swarm also holds one adversary (`_Adversary`), which sends a batch per `nodes`
    honest steps (an honest node's rate) and whose rollouts every honest node verifies at its own cost.
    `answers` picks the regime: the built-in set's short answers or the worked-answer set (`trainer_shape`)."""
    from murmur.training.engine_hf import HFEngine
    from murmur.training.tasksets import train_generators
    from murmur.training.tiny import ensure_tiny

    shape = trainer_shape(answers)
    new_tokens = int(shape["max_new_tokens"])
    seed_torch(seed)
    adv = make_adversary(seed, home, answers) if swarm and adversary else None
    ext = 0 if not swarm else int(shape["external_groups"]) * max(1, followers)
    ns, tasks, heads = make_nodes(
        nodes,
        seed,
        home,
        warmup_steps,
        answers,
        eval_per_family,
        ext,
        swarm,
        adv,
        select_groups,
        schedule_share,
        foreign,
        same_start,
    )
    per_follower = math.ceil(int(TRAINER["local_groups"]) * follower_oversample)
    fols: list[tuple[Any, Any, random.Random]] = []  # (engine, identity, task rng) of node 0's followers
    for k in range(followers):
        fpath = ensure_tiny(home, seed=seed * 64, warmup_steps=warmup_steps, answers=answers)  # node 0's model
        fols.append(
            (
                HFEngine.from_path(fpath, device="cpu", seed=seed * 100 + 50 + k),
                _ident(seed, 50 + k),
                random.Random(seed * 100 + 50 + k),
            )
        )
    fol_nodes = [_Node(50 + k, ident, ns[0].lineage, None, eng, None, None) for k, (eng, ident, _) in enumerate(fols)]
    marks = [cpu_s * k / checkpoints for k in range(checkpoints + 1)]

    def evaluate(n: _Node) -> None:
        evaluate_node(n, tasks, new_tokens)

    for n in ns:
        evaluate(n)
    wall0 = time.monotonic()
    honest_steps = 0
    while True:
        todo = [n for n in ns if n.cpu < cpu_s]
        if not todo:
            break
        node = min(todo, key=lambda n: n.cpu)
        if fols and node is ns[0]:
            gens = train_generators(node.trainer.registry.get(node.trainer.task_set))
            state = node.engine.model.state_dict()
            for (eng, _, rng), fn in zip(fols, fol_nodes):
                eng.model.load_state_dict(state)  # a patch applied at once: transport not modelled
                batch = _follower_rollouts(
                    eng,
                    gens,
                    node.trainer.task_set,
                    node.trainer.registry.resolve,
                    rng,
                    node.lineage,
                    node.trainer.version,
                    per_follower,
                    new_tokens,
                )
                fn.groups_generated += per_follower
                assert node.pipeline is not None and node.sampler is not None
                _receive(node, _send(fn, batch), fn.ident.peer_id)
        trainer_turn(node, ns, heads, [o for o in ns if o is not node] if swarm else [])
        honest_steps += 1
        if adv is not None and honest_steps % nodes == 0:
            adv.deliver(node, ns, heads)
        while len(node.curve) < len(marks) and node.cpu >= marks[len(node.curve)]:
            evaluate(node)
    for n in ns:
        while len(n.curve) < len(marks):
            evaluate(n)
    curve = [sum(n.curve[k] for n in ns) / len(ns) for k in range(len(marks))]
    return {
        "marks": marks,
        "curve": curve,
        "per_node_final": [n.curve[-1] for n in ns],
        "eval_tasks": len(tasks),
        "updates_per_node": [n.updates for n in ns],
        "external_groups_per_node": [n.ext_groups for n in ns],
        "steps_per_node": [n.trainer.step_no for n in ns],
        "used_over_verified": (
            round(sum(n.used for n in ns) / max(1, sum(n.verified for n in ns)), 4) if swarm else None
        ),
        "cpu_per_node": [round(n.cpu, 3) for n in ns],
        "verified_per_node": [n.verified for n in ns],
        "final_by_family": _mean_dicts([n.last_eval[0] for n in ns]),
        "final_wellformed": _mean_dicts([n.last_eval[1] for n in ns]),
        "wellformed_curve": [_mean_dicts([n.wellformed[k] for n in ns]) for k in range(len(marks))],
        "verify_share": round(sum(n.verify_cpu for n in ns) / max(1e-9, sum(n.cpu for n in ns)), 4),
        # measured: the part of the trainers' steps spent sampling (pooled over the arm's nodes)
        "generation_share": round(sum(n.gen_cpu for n in ns) / max(1e-9, sum(n.step_cpu for n in ns)), 4),
        "adversary": None if adv is None else adv.report(ns),
        "sampler": {
            k: sum(n.sampler.counts[k] for n in ns if n.sampler is not None)
            for k in (ns[0].sampler.counts if ns[0].sampler is not None else {})
        },
        "groups": group_counts(ns + fol_nodes),
        "wall_s": round(time.monotonic() - wall0, 1),
    }


GROUP_COUNTS = ("generated", "sent", "trained", "pooled", "rescued")


def group_counts(nodes: list[_Node]) -> dict[str, int]:
    """An arm's groups: `generated` (by its trainers and followers), `sent` (sealed to another node: the groups a
    receiver's sampler keeps), `trained` (that entered an update), and of those `pooled` (own groups that other nodes' rollouts of
    the same task joined) and `rescued` (pooled own groups that alone were all right or all wrong)."""
    return {
        "generated": sum(n.groups_generated for n in nodes),
        "sent": sum(n.groups_sent for n in nodes),
        "trained": sum(n.groups_trained for n in nodes),
        "pooled": sum(n.groups_pooled for n in nodes),
        "rescued": sum(n.groups_rescued for n in nodes),
    }


def run_seed(
    nodes: int,
    seed: int,
    cpu_s: float,
    checkpoints: int,
    eval_per_family: int,
    home: str | None = None,
    warmup_steps: int | None = None,
    followers: int = 0,
    adversary: bool = False,
    answers: str = "short",
    default_roles: bool = False,
    select_groups: int = 0,
    follower_oversample: float = 1.0,
    schedule_share: float = 0.0,
    foreign: dict[str, Any] | None = None,
    same_start: bool = False,
) -> dict[str, Any]:
    """Both arms of one seed: N isolated nodes and a swarm of N; with `followers` = K > 0, node 0 alone
    and node 0 with K followers; with `adversary`, N - 1 honest nodes alone and the same N - 1 in a swarm
    whose N-th member is the adversary; with `default_roles`, the swarm's roles chosen by the node's own
    rule (`simulations.bench.matched_auto`). `select_groups` and `follower_oversample` change the swarm arm
    only (`run_arm`): the isolated arm, the target, is the node alone as it runs by default. `schedule_share`
    applies to both arms alike (a prompt draw teaches a node alone nothing; peers meet on it), and so do the
    `foreign` key values (a node alone takes no other model's rollouts, so they change its arm in nothing), and
    `same_start` (`make_nodes`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = Path(home) if home else Path(tempfile.gettempdir()) / "murmur-bench-matched"
    n = 1 if followers else nodes - 1 if adversary else nodes
    arm = (n, seed, cpu_s, checkpoints, eval_per_family, base, warmup_steps)
    iso = run_arm(False, *arm, answers=answers, schedule_share=schedule_share, foreign=foreign, same_start=same_start)
    if default_roles:
        from murmur.simulations.bench.matched_auto import run_auto_arm

        sw = run_auto_arm(*arm, answers=answers, adversary=adversary, foreign=foreign, same_start=same_start)
    else:
        sw = run_arm(
            True,
            *arm,
            followers=followers,
            adversary=adversary,
            answers=answers,
            select_groups=select_groups,
            follower_oversample=follower_oversample,
            schedule_share=schedule_share,
            foreign=foreign,
            same_start=same_start,
        )
    xs = iso["marks"]
    target = iso["curve"][-1]
    speedup, reached, iso_cpu, sw_cpu = curves.speedup(xs, iso["curve"], sw["curve"])
    return {
        "seed": seed,
        "answers": answers,
        "eval_tasks": iso["eval_tasks"],
        "speedup": round(speedup, 4),
        "reached": reached,
        "iso_cpu": round(iso_cpu, 2),
        "swarm_cpu": None if sw_cpu is None else round(sw_cpu, 2),
        "iso_final": round(target, 4),
        "swarm_final": round(sw["curve"][-1], 4),
        "final_acc_delta": round(sw["curve"][-1] - target, 4),
        "auc_delta": round(curves.auc(xs, sw["curve"]) - curves.auc(xs, iso["curve"]), 4),
        "curves": {
            "cpu_s": [round(x, 2) for x in xs],
            "isolated": [round(y, 4) for y in iso["curve"]],
            "swarm": [round(y, 4) for y in sw["curve"]],
        },
        "updates_per_node": {"isolated": iso["updates_per_node"], "swarm": sw["updates_per_node"]},
        "steps_per_node": {"isolated": iso["steps_per_node"], "swarm": sw["steps_per_node"]},
        "external_groups_per_node": sw["external_groups_per_node"],
        "used_over_verified": sw["used_over_verified"],
        "cpu_per_node": {"isolated": iso["cpu_per_node"], "swarm": sw["cpu_per_node"]},
        "final_by_family": {"isolated": iso["final_by_family"], "swarm": sw["final_by_family"]},
        "final_wellformed": {"isolated": iso["final_wellformed"], "swarm": sw["final_wellformed"]},
        "wellformed_curve": {"isolated": iso["wellformed_curve"], "swarm": sw["wellformed_curve"]},
        "verified_per_node": sw["verified_per_node"],
        "verify_share": sw["verify_share"],
        "sampler": sw["sampler"],
        "generation_share": {"isolated": iso["generation_share"], "swarm": sw["generation_share"]},
        "adversary": sw["adversary"],
        "roles": sw.get("roles"),
        "groups": {"isolated": iso["groups"], "swarm": sw["groups"]},
        "wall_s": {"isolated": iso["wall_s"], "swarm": sw["wall_s"]},
    }


def bootstrap_ci(xs: list[float], rng: random.Random, n: int = BOOTSTRAP) -> tuple[float, float]:
    """Percentile 95 % interval of the mean, seeds resampled with replacement."""
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(n))
    return means[int(0.025 * n)], means[min(n - 1, int(0.975 * n))]


def check_foreign(foreign: dict[str, Any]) -> None:
    """Refuse a key that is not a key of how a trainer uses swarm rollouts (`SWARM_USE_KEYS`), or a value
    `TrainerConfig` refuses (ValueError)."""
    from murmur.gossip.errors import ConfigError
    from murmur.training.trainer import TrainerConfig

    bad = sorted(set(foreign) - set(SWARM_USE_KEYS))
    if bad:
        raise ValueError(f"not a swarm-rollout key: {', '.join(bad)} (one of {', '.join(SWARM_USE_KEYS)})")
    try:
        TrainerConfig(**foreign)
    except (ConfigError, TypeError) as e:
        raise ValueError(str(e)) from e


def _run_seed_args(
    a: tuple[
        int, int, float, int, int, str | None, int | None, int, bool, str, bool, int, float, float, dict[str, Any], bool
    ],
) -> dict[str, Any]:
    return run_seed(*a)


def run(
    nodes: int = 4,
    seeds: int = 5,
    seed: int = 0,
    cpu_s: float = 48.0,
    checkpoints: int = 6,
    eval_per_family: int = 30,
    workers: int = 1,
    home: str | None = None,
    followers: int = 0,
    adversary: bool = False,
    answers: str = "short",
    default_roles: bool = False,
    select_groups: int = 0,
    follower_oversample: float = 1.0,
    schedule_share: float = 0.0,
    foreign: dict[str, Any] | None = None,
    same_start: bool = False,
) -> dict[str, Any]:
    """`seeds` paired seeds from `seed` (each in its own process, `workers` at a time) and their summary;
    `followers` = K > 0: the trainer-with-K-followers arm instead of the swarm of `nodes`; `adversary`:
    one of the `nodes` is the adversary (`_Adversary`), the others are compared with themselves alone;
    `answers`: "short" (the built-in set) or "worked" (the worked-answer set, `trainer_shape`);
    `default_roles`: the swarm of `nodes` with roles chosen by the node's own rule, nothing forced;
    `select_groups` (PODS down-sampling, 0: off) and `follower_oversample` (followers' groups per trainer step
    over I): the swarm arm's trainers and followers only; `schedule_share`: the share of every trainer's prompts
    drawn from the shared prompt schedule, in both arms; `foreign`: values of the foreign-rollout keys
    (`training.foreign.FOREIGN_KEYS`, for the ablation of each correction), in both arms; `same_start`: every
    node of both arms starts from one warm-up (`make_nodes`)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if (nodes < 2 + adversary and not followers) or followers < 0 or seeds < 1 or cpu_s <= 0 or checkpoints < 1:
        raise ValueError(
            "need nodes >= 2 (3 with an adversary; or followers >= 1), seeds >= 1, cpu_s > 0, checkpoints >= 1"
        )
    trainer_shape(answers)  # an unknown regime is refused before any process starts
    if followers and adversary:
        raise ValueError("the adversary joins a swarm of peers, not a trainer's followers")
    if default_roles and followers:
        raise ValueError("default roles choose trainers and followers themselves: no --followers")
    if not 0 <= select_groups <= MAX_SELECT_GROUPS or not 1.0 <= follower_oversample <= MAX_OVERSAMPLE:
        raise ValueError(
            f"need select_groups in 0..{MAX_SELECT_GROUPS} and follower_oversample in 1..{MAX_OVERSAMPLE:g}"
        )
    if default_roles and (select_groups or follower_oversample != 1.0):
        raise ValueError("--select-groups and --follower-oversample apply to forced arms, not to default roles")
    if not 0.0 <= schedule_share <= 1.0 or (default_roles and schedule_share):
        raise ValueError("need schedule_share in 0..1, and 0 with default roles")
    foreign = dict(foreign or {})
    check_foreign(foreign)
    t0 = time.monotonic()
    from murmur.training.tiny import default_warmup_steps

    warmup = default_warmup_steps(answers)
    todo = [
        (
            nodes,
            seed + k,
            cpu_s,
            checkpoints,
            eval_per_family,
            home,
            warmup,
            followers,
            adversary,
            answers,
            default_roles,
            select_groups,
            follower_oversample,
            schedule_share,
            foreign,
            same_start,
        )
        for k in range(seeds)
    ]
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        per = list(pool.map(_run_seed_args, todo))
    out = summarise(
        per,
        nodes=nodes,
        followers=followers,
        adversary=adversary,
        cpu_s=cpu_s,
        answers=answers,
        checkpoints=checkpoints,
        seed=seed,
        warmup=warmup,
        default_roles=default_roles,
        select_groups=select_groups,
        follower_oversample=follower_oversample,
        schedule_share=schedule_share,
    )
    out["foreign"] = foreign
    out["same_start"] = same_start
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def summarise(
    per: list[dict[str, Any]],
    *,
    nodes: int,
    followers: int,
    adversary: bool,
    cpu_s: float,
    answers: str,
    checkpoints: int,
    seed: int,
    warmup: int | None,
    default_roles: bool = False,
    select_groups: int = 0,
    follower_oversample: float = 1.0,
    schedule_share: float = 0.0,
) -> dict[str, Any]:
    """The run's summary of its seeds' results (`run_seed`): means, the speedup's interval, the seeds."""
    shape = trainer_shape(answers)
    sp = [r["speedup"] for r in per]
    lo, hi = bootstrap_ci(sp, random.Random(seed))
    mean = sum(sp) / len(sp)
    return {
        "bench": "swarm-matched",
        "nodes": 1 if followers else nodes,
        "followers": followers,
        "with_adversary": adversary,
        "default_roles": default_roles,
        "pods": None if not default_roles else [sorted(len(f) for f in r["roles"]["pods"].values()) for r in per],
        "seeds": [r["seed"] for r in per],
        "cpu_s_per_node": cpu_s,
        "answers": answers,
        "checkpoints": checkpoints,
        "eval_tasks": per[0]["eval_tasks"],
        "trainer": shape,
        "select_groups": select_groups,
        "follower_oversample": follower_oversample,
        "schedule_share": schedule_share,
        "warmup_steps": warmup,
        "speedup": round(mean, 4),
        "speedup_ci": [round(lo, 4), round(hi, 4)],
        "reached": sum(r["reached"] for r in per),
        "final_acc_delta": round(sum(r["final_acc_delta"] for r in per) / len(per), 4),
        "auc_delta": round(sum(r["auc_delta"] for r in per) / len(per), 4),
        "used_over_verified": round(sum(r["used_over_verified"] for r in per) / len(per), 4),
        "verify_share": round(sum(r["verify_share"] for r in per) / len(per), 4),
        "generation_share": {
            arm: round(sum(r["generation_share"][arm] for r in per) / len(per), 4) for arm in ("isolated", "swarm")
        },
        # summed over the seeds (a result JSON written before they were counted has none)
        "groups": {
            arm: {k: sum(r.get("groups", {}).get(arm, {}).get(k, 0) for r in per) for k in GROUP_COUNTS}
            for arm in ("isolated", "swarm")
        },
        "adversary": None
        if not adversary
        else {
            k: sum(r["adversary"][k] for r in per)
            for k in (
                "batches",
                "forged_batches",
                "misscheduled_batches",
                "rows_taken",
                "provably_bad_rows_taken",
                "rejected",
                "rejected_misscheduled",
            )
        },
        "per_seed": per,
        "method": "measured: per-node thread CPU (generation, training, verification of what it is sent), "
        "nodes stepped least-CPU-first to an equal budget, held-out greedy accuracy at equal CPU "
        "marks, paired seeds (same nodes, warm-ups and trainer seeds in both arms)",
    }


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    print(
        json.dumps(
            run(
                nodes=int(sys.argv[1]) if len(sys.argv) > 1 else 4,
                seeds=int(sys.argv[2]) if len(sys.argv) > 2 else 5,
                cpu_s=float(sys.argv[3]) if len(sys.argv) > 3 else 20.0,
                workers=int(sys.argv[4]) if len(sys.argv) > 4 else 1,
            )
        )
    )
