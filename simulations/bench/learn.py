"""`murmur bench learn`: does RL visibly raise held-out accuracy on one node, within a wall-clock budget?

One node, murmur-tiny and the built-in task set, fixed seed: build murmur-tiny
from scratch (supervised warm-up included in the budget), measure greedy
accuracy on the held-out eval generators (the eval side of every family's
problem space: no eval problem can be drawn in training or in the warm-up,
checked at start), run GRPO until the budget is spent (keeping time for the
final eval), measure again. `eval_overlap` counts the eval problems that did
occur among the warm-up's and the RL rollouts' prompts: it must be 0.
`eval_wellformed` is the share of greedy answers with the answer's shape, per
family, at start and end: when it is already ~1 at the start, the gain in
accuracy is skill, not answer format.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

from murmur.gossip.wire import DEFAULT_SWARM
from murmur.training.engine_hf import HFEngine, set_threads
from murmur.training.evaluation import check_evaluation, greedy_eval, held_out_tasks
from murmur.training.tasksets import TaskRegistry
from murmur.training.trainer import StepResult, Trainer, TrainerConfig

EVAL_PER_FAMILY = 100
# The built-in answers fit in 8 tokens (a sorted list of 4 digits, with EOS).
BENCH_CONFIG: dict[str, Any] = dict(local_groups=16, external_groups=0, group_size=8, lr=3e-4, max_new_tokens=8)


def run(budget_s: float = 300, seed: int = 0, threads: int = 1, steps: int | None = None) -> dict[str, Any]:
    """Warm up, evaluate, train, evaluate. With `steps`, exactly that many RL steps and no time budget
    (what a test needs: the same outcome on any machine); otherwise RL runs until `budget_s` is spent."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    set_threads(threads)
    t_start = time.monotonic()
    from murmur.training.tiny import WARMUP_STEPS, ensure_tiny, warmup_generators, warmup_prompts

    reg = TaskRegistry(DEFAULT_SWARM)  # only the built-in set, which is the same in every swarm
    m = reg.add_builtin()
    check_evaluation([m], warmup_generators())  # a clear error, before any work, if eval is not held out
    tasks = held_out_tasks(m, EVAL_PER_FAMILY)
    max_new = int(BENCH_CONFIG["max_new_tokens"])
    with tempfile.TemporaryDirectory(prefix="murmur-bench-learn-") as home:
        path = ensure_tiny(home, seed)
        warmup_s = time.monotonic() - t_start
        engine = HFEngine.from_path(path, device="cpu", seed=seed)
    t_eval = time.monotonic()
    eval_start, shaped_start = greedy_eval(engine, tasks, max_new)
    eval_cost = time.monotonic() - t_eval
    rewards: list[float] = []
    seen: set[str] = set()

    def on_step(r: StepResult) -> None:
        rewards.append(r.reward_mean)
        seen.update(x.task.prompt for x in r.rollouts)

    tr = Trainer(engine, reg, reg.builtin_id, TrainerConfig(seed=seed, **BENCH_CONFIG), on_step=on_step)
    rl_budget = max(0.0, budget_s - (time.monotonic() - t_start) - eval_cost - 1.0)
    t_rl = time.monotonic()
    steps = tr.run(max_steps=steps) if steps is not None else tr.run(budget_s=rl_budget)
    rl_s = time.monotonic() - t_rl
    eval_end, shaped_end = greedy_eval(engine, tasks, max_new)
    eval_prompts = {t.task.prompt for t in tasks}
    overlap = eval_prompts & (seen | warmup_prompts(seed))
    k = max(1, min(10, len(rewards) // 4 or 1))
    return {
        "bench": "learn",
        "model": "murmur-tiny",
        "model_params": engine.num_params(),
        "task_set": f"{m.name} v{m.version}",
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
        "eval_tasks": len(tasks),
        "eval_problems": len(eval_prompts),
        "eval_overlap": len(overlap),
        "train_prompts_seen": len(seen),
        "eval_start": round(eval_start["all"], 4),
        "eval_end": round(eval_end["all"], 4),
        "eval_gain": round(eval_end["all"] - eval_start["all"], 4),
        "eval_by_family": {
            f: {"start": round(eval_start[f], 4), "end": round(eval_end[f], 4)} for f in eval_start if f != "all"
        },
        "eval_wellformed": {
            f: {"start": round(shaped_start[f], 4), "end": round(shaped_end[f], 4)} for f in shaped_start
        },
        "total_s": round(time.monotonic() - t_start, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":  # pragma: no cover - manual run
    import json
    import sys

    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else 300)))
