"""`murmur bench learn`: does RL visibly raise the reward on one node, within a wall-clock budget?

One node, the built-in tiny model and task set, fixed seed: build murmur-tiny
from scratch (supervised warm-up included in the budget), measure greedy
accuracy on held-out tasks (the task set's `add-eval` seeds), run GRPO until
the budget is spent (keeping time for the final eval), measure again.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

from training.engine import Sampling
from training.engine_hf import HFEngine, set_threads
from training.tasksets import BUILTIN_EVAL, TaskRegistry
from training.trainer import Trainer, TrainerConfig

EVAL_TASKS = 300
BENCH_CONFIG = dict(local_groups=16, external_groups=0, group_size=8, lr=3e-4, max_new_tokens=4)


def greedy_accuracy(engine: HFEngine, registry: TaskRegistry, task_set: bytes, n: int = EVAL_TASKS) -> float:
    """Greedy accuracy on the first `n` seeds of the held-out eval generator."""
    from gossip.wire import TaskRef  # noqa: PLC0415
    from training.verifiers import score  # noqa: PLC0415

    g = next(x for x in registry.get(task_set).generators if x.name == BUILTIN_EVAL)
    tasks = [registry.resolve(TaskRef(task_set, g.name, g.seed_start + s)) for s in range(n)]
    res = engine.sample([engine.encode(t.prompt) for t in tasks], Sampling(temperature=0.0, max_new_tokens=4))
    return sum(score(t, engine.decode(ids)) for t, (ids, _, _) in zip(tasks, res)) / n


def run(budget_s: float = 300, seed: int = 0, threads: int = 1) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    set_threads(threads)
    t_start = time.monotonic()
    from training.tiny import WARMUP_STEPS, ensure_tiny  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="murmur-bench-learn-") as home:
        path = ensure_tiny(home, seed)
        warmup_s = time.monotonic() - t_start
        engine = HFEngine.from_path(path, device="cpu", seed=seed)
    reg = TaskRegistry()
    reg.add_builtin()
    eval_start = greedy_accuracy(engine, reg, reg.builtin_id)
    rewards: list[float] = []
    tr = Trainer(engine, reg, reg.builtin_id, TrainerConfig(seed=seed, **BENCH_CONFIG),
                 on_step=lambda r: rewards.append(r.reward_mean))
    t_eval = time.monotonic()
    greedy_accuracy(engine, reg, reg.builtin_id, 50)
    eval_cost = (time.monotonic() - t_eval) * EVAL_TASKS / 50
    rl_budget = max(0.0, budget_s - (time.monotonic() - t_start) - 2 * eval_cost - 1.0)
    t_rl = time.monotonic()
    steps = tr.run(budget_s=rl_budget)
    rl_s = time.monotonic() - t_rl
    eval_end = greedy_accuracy(engine, reg, reg.builtin_id)
    k = max(1, min(10, len(rewards) // 4 or 1))
    return {
        "bench": "learn",
        "model": "murmur-tiny",
        "model_params": engine.num_params(),
        "seed": seed,
        "threads": threads,
        "budget_s": budget_s,
        "warmup_steps": WARMUP_STEPS,
        "warmup_s": round(warmup_s, 2),
        "rl_steps": steps,
        "rl_s": round(rl_s, 2),
        "rollouts_per_step": BENCH_CONFIG["local_groups"] * BENCH_CONFIG["group_size"],
        "reward_start": round(sum(rewards[:k]) / k, 4) if rewards else None,
        "reward_end": round(sum(rewards[-k:]) / k, 4) if rewards else None,
        "eval_tasks": EVAL_TASKS,
        "eval_start": round(eval_start, 4),
        "eval_end": round(eval_end, 4),
        "eval_gain": round(eval_end - eval_start, 4),
        "total_s": round(time.monotonic() - t_start, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":  # pragma: no cover - manual run
    import json
    import sys

    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else 300)))
