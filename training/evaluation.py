"""Held-out evaluation: greedy accuracy per task family on a task set's eval generators.

A family is an eval generator's name without its "-eval" suffix. The tasks are
the first seeds of each eval generator, so every run evaluates on the same
problems; `check_held_out` (training/tasksets.py) has already proved that none
of them can be drawn by a training generator or by murmur-tiny's warm-up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from murmur.gossip.errors import TaskError
from murmur.gossip.wire import GeneratorSpec, TaskSetManifest
from murmur.training.engine import Sampling
from murmur.training.tasks import RG_PREFIX, Task, generate
from murmur.training.tasksets import EVAL_SUFFIX, check_held_out, eval_generators, train_generators
from murmur.training.verifiers import score, worked_digest

if TYPE_CHECKING:  # `murmur tasks` validates held-out sets through this module without loading torch
    from murmur.training.engine_hf import HFEngine


class EvalTask(msgspec.Struct, frozen=True):
    family: str
    task: Task


def family_of(generator_name: str) -> str:
    return generator_name[: -len(EVAL_SUFFIX)] if generator_name.endswith(EVAL_SUFFIX) else generator_name


RG_PROBE_EVAL = 128  # eval problems drawn per (eval, training) pair of one reasoning-gym dataset
RG_PROBE_TRAIN = 512  # training problems they are looked up in


def _prompts(g: GeneratorSpec, n: int) -> list[str]:
    return [generate(g.generator, g.config, s).prompt for s in range(g.seed_start, min(g.seed_end, g.seed_start + n))]


def rg_collisions(
    e: GeneratorSpec, t: GeneratorSpec, n_eval: int = RG_PROBE_EVAL, n_train: int = RG_PROBE_TRAIN
) -> int:
    """How many of the first `n_eval` problems of `e` also occur among the first `n_train` of `t`:
    disjoint seed ranges of one reasoning-gym dataset are held out only if its space is large."""
    train = set(_prompts(t, n_train))
    return sum(p in train for p in _prompts(e, n_eval))


def check_evaluation(sets: Iterable[TaskSetManifest], warmup: list[GeneratorSpec]) -> None:
    """TaskError unless every eval generator of `sets` is held out from every training generator of
    `sets` and from the warm-up's generators: by construction (`check_held_out`), and, for one
    reasoning-gym dataset on both sides, by a probe that finds no shared problem."""
    sets = list(sets)
    trains = [g for m in sets for g in train_generators(m)] + list(warmup)
    probes: dict[int, list[str]] = {}
    train_sets: dict[int, set[str]] = {}
    for m in sets:
        where = f" (task set {m.name!r})"
        check_held_out(eval_generators(m), trains, where=where)
        for e in eval_generators(m):
            for t in trains:
                if e.generator == t.generator and e.generator.startswith(RG_PREFIX):
                    # each generator's probe is drawn once however many pairs it is in
                    ep = probes.setdefault(id(e), _prompts(e, RG_PROBE_EVAL))
                    tp = train_sets.setdefault(id(t), set(_prompts(t, RG_PROBE_TRAIN)))
                    n = sum(p in tp for p in ep)
                    if n:
                        raise TaskError(
                            f"eval generator {e.name!r} overlaps training generator {t.name!r}{where}: "
                            f"{n} of its first {RG_PROBE_EVAL} problems occur in the first "
                            f"{RG_PROBE_TRAIN} training ones (the dataset's problem space is too "
                            "small for disjoint seeds to hold it out: widen its config)"
                        )


def held_out_tasks(m: TaskSetManifest, per_family: int, skip: int = 0) -> list[EvalTask]:
    """`per_family` seeds of each eval generator of `m`, after its first `skip`."""
    gens = eval_generators(m)
    if not gens:
        raise TaskError(f"task set {m.name!r} names no eval generator (a '<family>-eval' generator)")
    out = []
    for g in gens:
        for s in range(g.seed_start + skip, min(g.seed_end, g.seed_start + skip + per_family)):
            out.append(
                EvalTask(family_of(g.name), generate(g.generator, g.config, s, g.verifier or m.verifier, m.tolerance))
            )
    return out


def well_formed(task: Task, text: str) -> bool:
    """Whether a completion has the shape of the task's answer (each digit any digit, every other
    character itself): for the built-in families, the answer format without the skill; for worked
    answers, work of the reference solution's number of steps closed by the marker."""
    if task.verifier == "worked":
        got = worked_digest(text)
        return bool(got) and got.split("|")[0] == worked_digest(task.answer).split("|")[0]
    return re.fullmatch(re.sub(r"\d", r"\\d", re.escape(task.answer)), text.strip()) is not None


def greedy_eval(
    engine: HFEngine, tasks: list[EvalTask], max_new_tokens: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Greedy accuracy per family (and "all": over every task), and per family the share of greedy
    answers that are `well_formed`, so that a gain in accuracy can be told from a gain in format."""
    if not tasks:
        return {}, {}
    res = engine.sample(
        [engine.encode(t.task.prompt) for t in tasks], Sampling(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    hits: dict[str, list[float]] = {}
    shaped: dict[str, list[bool]] = {}
    for t, (ids, _, _) in zip(tasks, res):
        text = engine.decode(ids)
        hits.setdefault(t.family, []).append(score(t.task, text))
        shaped.setdefault(t.family, []).append(well_formed(t.task, text))
    acc = {f: sum(v) / len(v) for f, v in sorted(hits.items())}
    acc["all"] = sum(sum(v) for v in hits.values()) / len(tasks)
    return acc, {f: sum(v) / len(v) for f, v in sorted(shaped.items())}


def accuracy_by_family(engine: HFEngine, tasks: list[EvalTask], max_new_tokens: int) -> dict[str, float]:
    """Greedy accuracy per family (and "all": over every task)."""
    return greedy_eval(engine, tasks, max_new_tokens)[0]
