"""The worker's view of its task sets: what it trains on, what it waits for, and per-set counters.

`TaskMix` polls the node's state database for task sets the network process
stored (only trusted ones reach it), resolves `[training] task_sets` against
them (training/selection.py), checks that every chosen set's evaluation is held
out (training/evaluation.py) and counts, per set, the rollouts the node
produced, accepted from the swarm and used in its loss. It writes one status
record to the database's key-value table, which `murmur tasks list` and the
demo read. Nothing here falls back to another set: an entry that matches no
set held (or only a refused one) is reported as waiting.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Final

from murmur.gossip.errors import MurmurError, TaskError
from murmur.gossip.wire import TaskRef, TaskSetManifest, now_ms
from murmur.training.evaluation import EvalTask, check_evaluation, held_out_tasks
from murmur.training.selection import Resolution, TaskSetChoice, normalise, resolve
from murmur.training.tasksets import BUILTIN_COORDINATOR, TaskRegistry

STATUS_KEY: Final = "tasks_status"
REFRESH_S: Final = 2.0  # how often the database is polled for newly stored task sets
PROBE_SEEDS: Final = 8  # tasks generated per generator of a chosen set before training on it
EVAL_PER_FAMILY: Final = 50  # held-out tasks per family in the node's periodic evaluation
REWARD_WINDOW: Final = 256  # recent local rewards kept per (set, generator)


def _counter() -> dict[str, int]:
    return {"produced": 0, "accepted": 0, "used": 0}


class TaskMix:
    def __init__(
        self,
        registry: TaskRegistry,
        db: Any,
        entries: list[Any],
        trusted: set[bytes],
        warmup: list[Any],
        clock: Any = time.monotonic,
    ) -> None:
        self.registry = registry
        self.db = db
        self.choices: list[TaskSetChoice] = normalise(entries)
        self.trusted = trusted
        self.warmup = warmup  # the model's warm-up generators: eval must be held out from them too
        self.clock = clock
        self.resolution = Resolution(mixture=[], waiting=[c.set for c in self.choices])
        self.mixture: list[tuple[bytes, float]] = []
        self.refused: dict[bytes, str] = {}
        self.checked: set[bytes] = set()
        self.counts: dict[bytes, dict[str, int]] = {}
        self.rewards: dict[tuple[bytes, str], collections.deque[float]] = {}
        self.evals: dict[bytes, dict[str, Any]] = {}
        self._next = 0.0

    # ------------------------------------------------------------ sets

    def refresh(self, force: bool = False) -> bool:
        """Register newly stored sets and re-resolve; True when the mixture changed."""
        now = self.clock()
        if not force and now < self._next:
            return False
        self._next = now + REFRESH_S
        for row in self.db.task_sets():
            tid = bytes(row["task_set_id"])
            if tid in self.registry or tid in self.refused:
                continue
            try:
                self.registry.add(bytes(row["envelope"]), self.trusted)
            except MurmurError as e:
                self.refused[tid] = str(e)
        res = resolve(
            self.choices,
            [(t, m) for t, m in self.registry.list() if t not in self.refused],
            self.registry.builtin_id,
            BUILTIN_COORDINATOR.public,
        )
        for tid, _ in res.mixture:
            if tid not in self.checked:
                self._check(tid)
        if any(t in self.refused for t, _ in res.mixture):  # refused just now: resolve without them
            res = resolve(
                self.choices,
                [(t, m) for t, m in self.registry.list() if t not in self.refused],
                self.registry.builtin_id,
                BUILTIN_COORDINATOR.public,
            )
        self.resolution = res
        changed = res.mixture != self.mixture
        self.mixture = list(res.mixture)
        return changed

    def _check(self, tid: bytes) -> None:
        """A chosen set trains only if its generators work and its evaluation is held out."""
        m = self.registry.get(tid)
        try:
            for g in m.generators:
                for s in range(g.seed_start, min(g.seed_end, g.seed_start + PROBE_SEEDS)):
                    self.registry.resolve(TaskRef(tid, g.name, s))
            check_evaluation([m], self.warmup)
        except TaskError as e:
            self.refused[tid] = f"task set {m.name!r} v{m.version}: {e}"
            return
        self.checked.add(tid)

    def manifest(self, tid: bytes) -> TaskSetManifest:
        return self.registry.get(tid)

    def describe_waiting(self) -> str:
        refused = "; ".join(self.refused.values())
        why = f" (refused: {refused})" if refused else ""
        return (
            f"waiting for task set(s) {', '.join(self.resolution.waiting)}: not received from a trusted "
            f"coordinator yet{why}"
        )

    # ------------------------------------------------------------ counters

    def _c(self, tid: bytes) -> dict[str, int]:
        c = self.counts.get(tid)
        if c is None:
            c = self.counts[tid] = _counter()
        return c

    def produced(self, rollouts: list[Any]) -> None:
        for r in rollouts:
            tid = bytes(r.ref.task_set)
            self._c(tid)["produced"] += 1
            key = (tid, r.ref.generator)
            if key not in self.rewards:
                self.rewards[key] = collections.deque(maxlen=REWARD_WINDOW)
            self.rewards[key].append(float(r.reward))

    def accepted(self, by_set: dict[bytes, int]) -> None:
        for tid, n in by_set.items():
            if tid in self.registry:  # only sets held here; the network process verified the rest
                self._c(tid)["accepted"] += n

    def used(self, by_set: dict[bytes, int]) -> None:
        for tid, n in by_set.items():
            self._c(tid)["used"] += n

    # ------------------------------------------------------------ held-out evaluation

    def eval_tasks(self, tid: bytes) -> list[EvalTask]:
        try:
            return held_out_tasks(self.registry.get(tid), EVAL_PER_FAMILY)
        except TaskError:
            return []  # a set without eval generators is trained on, not evaluated

    def record_eval(self, tid: bytes, step: int, acc: dict[str, float]) -> None:
        e = self.evals.setdefault(tid, {})
        if "start" not in e:
            e["start"] = {"step": step, "accuracy": acc}
        e["last"] = {"step": step, "accuracy": acc}

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        weights = dict(self.mixture)
        sets = []
        for tid, m in self.registry.list():
            if tid not in weights and tid not in self.counts:
                continue
            fams = {g: round(sum(d) / len(d), 4) for (t, g), d in sorted(self.rewards.items()) if t == tid and d}
            sets.append(
                {
                    "task_set_id": tid.hex(),
                    "name": m.name,
                    "version": m.version,
                    "weight": weights.get(tid, 0.0),
                    "training": tid in weights,
                    **self.counts.get(tid, _counter()),
                    "reward_by_generator": fams,
                    "eval": self.evals.get(tid, {}),
                }
            )
        return {
            "choices": [{"set": c.set, "weight": c.weight} for c in self.choices],
            "sets": sets,
            "waiting": list(self.resolution.waiting),
            "refused": {t.hex(): why for t, why in self.refused.items()},
            "updated_ms": now_ms(),
        }

    def save(self) -> None:
        self.db.put(STATUS_KEY, self.status())
