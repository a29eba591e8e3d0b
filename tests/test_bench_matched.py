"""`murmur bench swarm --matched`: the reach and interval arithmetic by hand, and a tiny paired run
through the real trainers and pipelines in which every node of both arms spends the same CPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

from simulations.bench import matched as bm


def test_first_reach_by_hand() -> None:
    xs = [0.0, 2.0, 4.0, 6.0]
    assert bm._first_reach(xs, [0.1, 0.2, 0.4, 0.5], 0.3) == 3.0  # between the checkpoints around it
    assert bm._first_reach(xs, [0.5, 0.2, 0.4, 0.5], 0.3) == 3.0  # the start does not count
    assert bm._first_reach(xs, [0.1, 0.4, 0.4, 0.5], 0.3) == 2.0  # reached at the first checkpoint
    assert bm._first_reach(xs, [0.1, 0.2, 0.2, 0.2], 0.3) is None
    assert bm._auc([0.0, 1.0, 2.0], [0.0, 1.0, 1.0]) == 0.75


def test_bootstrap_interval_contains_the_mean_and_narrows_with_agreement() -> None:
    lo, hi = bm.bootstrap_ci([1.0, 1.2, 0.8, 1.1, 0.9], random.Random(0))
    assert lo <= 1.0 <= hi and hi - lo < 0.4
    lo2, hi2 = bm.bootstrap_ci([1.0] * 5, random.Random(0))
    assert lo2 == hi2 == 1.0


def test_a_tiny_paired_run_spends_equal_cpu_per_node(tmp_path: Path) -> None:
    r = bm.run_seed(2, 0, 0.6, 2, 2, home=str(tmp_path), warmup_steps=2)
    json.dumps(r)
    for arm in ("isolated", "swarm"):
        cpus = r["cpu_per_node"][arm]
        assert len(cpus) == 2 and min(cpus) >= 0.6  # each node stepped until it had spent the budget
        assert len(r["curves"][arm]) == 3  # the start and two equal-CPU checkpoints
    assert r["curves"]["cpu_s"] == [0.0, 0.3, 0.6]
    assert r["curves"]["isolated"][0] == r["curves"]["swarm"][0]  # paired: the same nodes start both arms
    assert r["speedup"] > 0 and r["used_over_verified"] is not None and 0 <= r["used_over_verified"] <= 1
    assert all(len(r["updates_per_node"][arm]) == 2 for arm in ("isolated", "swarm"))
    for arm in ("isolated", "swarm"):  # the last checkpoint, per family, means over the nodes
        assert set(r["final_wellformed"][arm]) == {"lookup", "rev", "sort"}
        assert r["final_by_family"][arm]["all"] == r["curves"][arm][-1]
        assert all(0 <= v <= 1 for v in r["final_wellformed"][arm].values())


def test_a_trainer_with_followers_verifies_and_pools_their_groups_on_its_own_cpu(tmp_path: Path) -> None:
    r = bm.run_seed(2, 0, 0.6, 2, 2, home=str(tmp_path), warmup_steps=2, followers=2)
    assert len(r["cpu_per_node"]["swarm"]) == 1 and r["cpu_per_node"]["swarm"][0] >= 0.6  # the trainer only
    assert r["curves"]["isolated"][0] == r["curves"]["swarm"][0]  # paired: the same trainer alone
    # every trainer step, each follower sent I groups of group_size rollouts, all of which verified
    per_step = 2 * bm.TRAINER["local_groups"] * bm.TRAINER["group_size"]
    assert r["verified_per_node"][0] >= per_step and r["verified_per_node"][0] % per_step == 0
    assert r["sampler"]["added"] + r["sampler"]["uninformative"] + r["sampler"]["too_small"] > 0
