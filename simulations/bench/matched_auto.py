"""The default-roles arm of `murmur bench swarm --matched --default-roles`: N identical nodes with nothing
forced. Each starts as a node able to train does (a trainer of its own lineage) and its mode is then chosen
by the node's own rule, `node.core.roles.want_mode` held to its dwell by `node.core.roles.PodRule`, from
what it observes: the published lineages' demand (the trainer's `local_groups x group_size` rollouts a step
over its measured step time, as `node.core.machine` announces it), the supply their followers measurably
deliver, the verified rewards of their rollouts it sent or accepted (`node.core.rewards`), and its own
measured generation rate. A node that leaves its lineage takes the chosen lineage's weights on trial: it
measures them and its own on held-out tasks of its own (`trial_tasks`, none of which the arm's accuracy is
measured on), on its own CPU, and goes back to its own lineage at once when they are measurably worse
(`node.core.roles.not_worse`, `PodRule.refuse`). A follower picks its lineage with
`node.core.roles.choose_lineage`, holds that lineage's current weights (a patch applied at once: transport
is not modelled), generates `local_groups` groups per turn on its own CPU and sends the informative ones to
the trainer, which verifies them on its own CPU and trains on them as its own lineage's. A trainer takes up
to `external_groups` external groups a step per follower it has (at least one follower's worth, as a peer).
Trainers exchange their rollouts as the peers arm does; followers verify nothing they do not use. Every
node's accuracy is that of the weights it holds.

Time is each node's own CPU (nodes step least-CPU-first, so their CPU is a shared clock): the rule's
observation and dwell are fixed shares of the CPU budget (`OBSERVE_SHARE`, `DWELL_SHARE`), the compressed
form of the live node's 60 s and 300 s in a run of hours."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from murmur.node.core import roles as R
from murmur.node.core.rewards import RewardBook
from murmur.simulations.bench.matched import (
    _follower_rollouts,
    _mean_dicts,
    _Node,
    _receive,
    _send,
    evaluate_node,
    group_counts,
    make_adversary,
    make_nodes,
    seed_torch,
    trainer_shape,
    trainer_turn,
)

OBSERVE_SHARE = 1 / 12  # of the CPU budget, watched before the first choice
DWELL_SHARE = 1 / 4  # of the CPU budget, kept in a mode after a switch


@dataclass
class _Mode:
    """One node's role state: its rule, what it serves, and what its rates are measured from."""

    rule: R.PodRule
    serves: int | None = None  # index of the trainer node it generates for
    own_state: dict[str, Any] | None = None  # its own lineage's weights while it follows
    made: int = 0  # rollouts it generated as a follower
    made_cpu: float = 0.0  # and the CPU they took
    trials: int = 0  # lineages it took on trial
    refusals: int = 0  # ... and went back from, their weights measured worse than its own
    steps: int = 0  # its trainer steps
    history: list[tuple[float, str, str]] = field(default_factory=list)  # (cpu, mode, reason) per switch

    @property
    def mode(self) -> str:
        return self.rule.mode


def _gen_rate(n: _Node, m: _Mode, rollouts_per_step: int) -> float:
    """Rollouts per CPU-second this node generates, as measured (its trainer steps' sampling, or its own
    follower turns); 0 before any."""
    made = m.made + m.steps * rollouts_per_step
    cpu = m.made_cpu + n.gen_cpu
    return made / cpu if cpu > 0 and made else 0.0


def trial_tasks(answers: str, per_family: int) -> list[Any]:
    """The held-out tasks a node measures a lineage's weights on before it serves it: as many per family
    as the arm measures accuracy on, from seeds after those (`matched.make_nodes`), so no choice is made on
    the tasks that score the arm."""
    from murmur.simulations.bench.matched import task_registry
    from murmur.training.evaluation import held_out_tasks

    reg, set_id = task_registry(answers)
    return held_out_tasks(reg.get(set_id), per_family, skip=per_family)


def _quality(n: _Node, engine: Any, tasks: list[Any], new_tokens: int) -> R.Quality:
    """`engine`'s held-out accuracy on `tasks`, measured on `n`'s CPU (a node's rule pays for what it measures)."""
    from murmur.training.evaluation import greedy_eval

    gen_cpu, c0 = n.gen_cpu, time.thread_time()
    acc = greedy_eval(engine, tasks, new_tokens)[0]["all"]
    n.cpu += time.thread_time() - c0
    n.gen_cpu = gen_cpu  # the engine counts its sampling as a step's generation: this is none
    return R.Quality(acc, len(tasks))


def run_auto_arm(
    nodes: int,
    seed: int,
    cpu_s: float,
    checkpoints: int,
    eval_per_family: int,
    home: Path,
    warmup_steps: int | None = None,
    answers: str = "short",
    adversary: bool = False,
    foreign: dict[str, Any] | None = None,
    same_start: bool = False,
) -> dict[str, Any]:
    """The default-roles swarm of `nodes` honest nodes; with `adversary`, beside them the compute-matched
    bench's adversary (`matched._Adversary`), which sends a batch per `nodes` honest turns to every node that
    trains at the time (followers verify nothing they do not use). It publishes no weights a node could
    follow, so it is never a pod to join. `foreign`: the trainers' foreign-rollout key values, `same_start`: all
    nodes from one warm-up (`make_nodes`)."""
    from murmur.training.tasksets import train_generators

    shape = trainer_shape(answers)
    new_tokens = int(shape["max_new_tokens"])
    per_step = int(shape["local_groups"]) * int(shape["group_size"])
    j = int(shape["external_groups"])
    seed_torch(seed)
    adv = make_adversary(seed, home, answers) if adversary else None
    ns, tasks, heads = make_nodes(
        nodes,
        seed,
        home,
        warmup_steps,
        answers,
        eval_per_family,
        j,
        True,
        adv,
        foreign=foreign,
        same_start=same_start,
    )
    turns = 0
    modes = [
        _Mode(R.PodRule("trainer", 0.0, cpu_s * OBSERVE_SHARE, cpu_s * DWELL_SHARE, n.ident.public[0] / 256))
        for n in ns
    ]
    rngs = [random.Random(seed * 100 + 70 + n.index) for n in ns]
    judge = trial_tasks(answers, eval_per_family)
    for n in ns:
        n.book = RewardBook(nodes + 1)
    marks = [cpu_s * k / checkpoints for k in range(checkpoints + 1)]
    for n in ns:
        evaluate_node(n, tasks, new_tokens)
    wall0 = time.monotonic()

    def followers_of(t: int) -> list[int]:
        return [i for i, m in enumerate(modes) if m.mode == "follower" and m.serves == t]

    def supply(t: int, but: int | None = None) -> float:
        return sum(_gen_rate(ns[i], modes[i], per_step) for i in followers_of(t) if i != but)

    def demand(t: int) -> R.Demand:
        m = modes[t]
        step_t = ns[t].step_cpu / m.steps if m.steps else 0.0
        return R.Demand(rollouts_per_step=per_step, step_time_s=step_t, max_staleness=ns[t].trainer.cfg.max_staleness)

    def offer(i: int) -> R.Offer:
        rate = _gen_rate(ns[i], modes[i], per_step)
        # the time one turn's rollouts take to make: what a follower's lag behind the head is made of
        return R.Offer(ns[i].ident.peer_id, rate, per_step / rate if rate > 0 else 0.0)

    def published(i: int) -> list[int]:
        return [t for t, m in enumerate(modes) if t != i and m.mode == "trainer" and m.steps > 0]

    def decide(i: int) -> None:
        m = modes[i]
        me = offer(i)
        seen = [(t, demand(t), supply(t, but=i)) for t in published(i)]  # what this node observes now
        book = ns[i].book
        assert book is not None
        options = [R.PodOption(ns[t].lineage, d, sup, reward=book.mean(ns[t].lineage)) for t, d, sup in seen]
        own = (book.mean(ns[i].lineage), ns[i].lineage) if m.mode == "trainer" else None
        wanted = R.want_mode(
            m.mode, options, me, own, supply(i) if m.mode == "trainer" else 0.0, refused=m.rule.refused(ns[i].cpu)
        )
        new = m.rule.step(ns[i].cpu, wanted)
        if new == "follower":
            m.own_state = {k: v.clone() for k, v in ns[i].engine.model.state_dict().items()}
            m.serves = None
            t = next(t for t, _, _ in seen if ns[t].lineage == wanted.lineage)
            # the trial: the chosen lineage's weights (taken at once: transport is not modelled) against its own
            mine = _quality(ns[i], ns[i].engine, judge, new_tokens)
            ns[i].engine.model.load_state_dict(ns[t].engine.model.state_dict())
            theirs = _quality(ns[i], ns[i].engine, judge, new_tokens)
            m.trials += 1
            if R.not_worse(theirs, mine):
                m.serves = t
            else:
                why = f"lineage {ns[t].lineage.hex()[:8]} measured {theirs.accuracy:.2f} < my {mine.accuracy:.2f}"
                m.history.append((round(ns[i].cpu, 2), "follower", f"on trial: {wanted.why}"))
                new = m.rule.refuse(ns[t].lineage, ns[i].cpu, why)
                m.refusals += 1
        if new == "trainer":
            assert m.own_state is not None
            ns[i].engine.model.load_state_dict(m.own_state)  # back to its own lineage, where it left it
            m.own_state, m.serves = None, None
        if new is not None:
            m.history.append((round(ns[i].cpu, 2), new, m.rule.reason))
        if m.mode == "follower":
            refused = m.rule.refused(ns[i].cpu)
            choice = R.choose_lineage(
                me,
                [R.LineageOption(ns[t].lineage, d, sup) for t, d, sup in seen if ns[t].lineage not in refused],
                current=None if m.serves is None else ns[m.serves].lineage,
            )
            m.serves = next((t for t, _, _ in seen if ns[t].lineage == choice.lineage), None)

    while True:
        todo = [n for n in ns if n.cpu < cpu_s]
        if not todo:
            break
        node = min(todo, key=lambda n: n.cpu)
        m = modes[node.index]
        if m.mode == "trainer":
            node.trainer.cfg.external_groups = j * max(1, len(followers_of(node.index)))
            trainer_turn(node, ns, heads, [o for o in ns if o is not node and modes[o.index].mode == "trainer"])
            m.steps += 1
        elif m.serves is not None and modes[m.serves].mode == "trainer":
            t = ns[m.serves]
            node.engine.model.load_state_dict(t.engine.model.state_dict())  # a patch applied at once
            gens = train_generators(t.trainer.registry.get(t.trainer.task_set))
            gen_cpu = node.gen_cpu
            c0 = time.thread_time()
            batch = _follower_rollouts(
                node.engine,
                gens,
                t.trainer.task_set,
                t.trainer.registry.resolve,
                rngs[node.index],
                t.lineage,
                t.trainer.version,
                int(shape["local_groups"]),
                new_tokens,
            )
            node.groups_generated += int(shape["local_groups"])
            payloads = _send(node, batch)  # its informative groups, as a node's sealer sends
            dt = time.thread_time() - c0
            node.gen_cpu = gen_cpu  # `gen_cpu` is the trainer steps' sampling: a follower turn counts in `made_cpu`
            node.cpu += dt
            m.made += len(batch)
            m.made_cpu += dt
            _receive(t, payloads, node.ident.peer_id)
        else:
            # a follower with no lineage to serve (its trainer stopped training) waits a turn: its CPU idles
            node.cpu = min(cpu_s, node.cpu + 0.01 * cpu_s)
        turns += 1
        if adv is not None and turns % nodes == 0:
            adv.deliver(node, [o for o in ns if modes[o.index].mode == "trainer"], heads)
        decide(node.index)
        while len(node.curve) < len(marks) and node.cpu >= marks[len(node.curve)]:
            evaluate_node(node, tasks, new_tokens)
    for n in ns:
        while len(n.curve) < len(marks):
            evaluate_node(n, tasks, new_tokens)
    curve = [sum(n.curve[k] for n in ns) / len(ns) for k in range(len(marks))]
    pods = {ns[t].index: followers_of(t) for t, mm in enumerate(modes) if mm.mode == "trainer"}
    return {
        "marks": marks,
        "curve": curve,
        "per_node_final": [n.curve[-1] for n in ns],
        "eval_tasks": len(tasks),
        "updates_per_node": [n.updates for n in ns],
        "external_groups_per_node": [n.ext_groups for n in ns],
        "steps_per_node": [modes[n.index].steps for n in ns],
        "used_over_verified": round(sum(n.used for n in ns) / max(1, sum(n.verified for n in ns)), 4),
        "cpu_per_node": [round(n.cpu, 3) for n in ns],
        "verified_per_node": [n.verified for n in ns],
        "verify_share": round(sum(n.verify_cpu for n in ns) / max(1e-9, sum(n.cpu for n in ns)), 4),
        "generation_share": round(sum(n.gen_cpu for n in ns) / max(1e-9, sum(n.step_cpu for n in ns)), 4),
        "final_by_family": _mean_dicts([n.last_eval[0] for n in ns]),
        "final_wellformed": _mean_dicts([n.last_eval[1] for n in ns]),
        "wellformed_curve": [_mean_dicts([n.wellformed[k] for n in ns]) for k in range(len(marks))],
        "roles": {
            "final": [modes[n.index].mode for n in ns],
            "pods": pods,
            "switches": [len(modes[n.index].history) for n in ns],
            "history": [modes[n.index].history for n in ns],
            "follower_rollouts": [modes[n.index].made for n in ns],
            "trials": [modes[n.index].trials for n in ns],
            "refused": [modes[n.index].refusals for n in ns],
        },
        "sampler": {
            k: sum(n.sampler.counts[k] for n in ns if n.sampler is not None)
            for k in (ns[0].sampler.counts if ns[0].sampler is not None else {})
        },
        "adversary": None if adv is None else adv.report(ns),
        "groups": group_counts(ns),
        "wall_s": round(time.monotonic() - wall0, 1),
    }
