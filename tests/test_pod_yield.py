"""A pod's trainer yields its own generation to its followers (`training/pod.py`, `[training] pod_yield`): the
rule on numbers, then a trainer on a tiny model whose external hook plays its followers."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from murmur.gossip import wire
from murmur.training.pod import MIN_OWN_DIVISOR, PodYield
from murmur.training.rollouts import to_wire
from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
from murmur.training.tiny import new_tiny_engine
from murmur.training.trainer import Trainer, TrainerConfig
from tests.test_pooled import OWN, group

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

OTHER = b"\x0b" * 32


def test_delivered_groups_stand_for_own_groups_by_the_measured_informative_share() -> None:
    p = PodYield(16)
    assert p.quota() == 16 and p.floor == 16 // MIN_OWN_DIVISOR
    p.observe(delivered=4, own_groups=16, own_informative=8)  # running mean 2 delivered, share 0.5
    assert p.quota() == 16 - 4
    for _ in range(10):
        p.observe(delivered=4, own_groups=8, own_informative=2)  # share falls to 0.25: each stands for 4
    assert p.informative == pytest.approx(0.25, abs=1e-2) and p.quota() == p.floor
    weak = PodYield(16)
    for _ in range(10):
        weak.observe(delivered=1, own_groups=16, own_informative=0)  # none informative: 1 stands for 10, not for all
    assert weak.quota() == 16 - 9


def test_the_quota_never_falls_below_the_floor_and_returns_when_deliveries_stop() -> None:
    p = PodYield(16)
    for _ in range(20):
        p.observe(delivered=10**6, own_groups=2, own_informative=1)
    assert p.quota() == p.floor == 2
    back = []
    for _ in range(30):
        p.observe(delivered=0, own_groups=p.quota(), own_informative=1)
        back.append(p.quota())
    assert back[-1] == 16 and back.index(16) < 25  # a pod whose followers left generates in full again
    assert all(a <= b for a, b in zip(back, back[1:]))  # never overshoots on the way


@pytest.fixture(scope="module")
def reg() -> TaskRegistry:
    r = TaskRegistry("test")
    r.add_builtin()
    return r


def rollouts(reg: TaskRegistry, engine: Any, seed: int, lineage: bytes, pattern: str = "1100") -> list[wire.Rollout]:
    """A delivered group of the built-in task `seed` by `lineage`: '1' a right answer, '0' a wrong one."""
    return [to_wire(r) for r in group(reg, engine, wire.TaskRef(reg.builtin_id, BUILTIN_TRAIN, seed), pattern, lineage)]


class Followers:
    """An external hook that delivers `per_step` informative groups of `lineage` each step, and records how
    many groups the trainer asked for."""

    def __init__(self, reg: TaskRegistry, engine: Any, lineage: bytes, per_step: int) -> None:
        self.reg, self.engine, self.lineage, self.per_step = reg, engine, lineage, per_step
        self.asked: list[int] = []
        self.seed = 5000

    def __call__(self, n: int, min_version: int) -> list[wire.Rollout]:
        self.asked.append(n)
        out: list[wire.Rollout] = []
        for _ in range(min(n, self.per_step)):
            self.seed += 1
            out += rollouts(self.reg, self.engine, self.seed, self.lineage)
        return out


def run(reg: TaskRegistry, lineage: bytes, steps: int, **kw: Any) -> tuple[list[int], Followers, Trainer]:
    engine = new_tiny_engine(seed=2)
    hook = Followers(reg, engine, lineage, per_step=6)
    cfg = TrainerConfig(local_groups=8, external_groups=2, group_size=4, max_new_tokens=6, seed=3, **kw)
    tr = Trainer(engine, reg, reg.builtin_id, cfg, lineage=OWN, external=hook)
    return [tr.step().n_local_groups for _ in range(steps)], hook, tr


def test_a_pod_trainer_generates_fewer_own_groups_and_takes_as_many_more_of_its_followers(reg) -> None:  # type: ignore[no-untyped-def]
    made, hook, tr = run(reg, OWN, 4)
    assert made[0] == 8 and made[-1] < 8 and tr.own_quota() == tr.pod.quota()
    assert made[-1] >= 1 and all(a >= b for a, b in zip(made, made[1:]))
    # every own group not generated is room for one more external group
    assert [n - 2 for n in hook.asked] == [8 - m for m in made]
    assert hook.asked[-1] > 2


def test_without_pod_yield_or_for_another_lineages_groups_the_trainer_generates_in_full(reg) -> None:  # type: ignore[no-untyped-def]
    made, hook, _ = run(reg, OWN, 3, pod_yield=False)
    assert made == [8, 8, 8] and hook.asked == [2, 2, 2]
    # another lineage's groups are not its followers' work: they stand for none of its own
    made, hook, _ = run(reg, OTHER, 3, foreign_share_max=1.0)
    assert made == [8, 8, 8] and hook.asked == [2, 2, 2]


def test_a_follower_that_delivers_then_stops_leaves_the_trainer_generating_in_full_within_a_few_steps(reg) -> None:  # type: ignore[no-untyped-def]
    """The attack: a key delivers a flood of informative groups for the trainer's lineage, so that the trainer
    generates almost nothing of its own, then stops. The trainer never generates fewer than the floor, and the
    running means bring it back to all its own groups within a few steps: the delivered count halves each step,
    and it stands for at most ten own groups each, so about log2(10 x a step's groups) steps."""
    engine = new_tiny_engine(seed=2)
    hook = Followers(reg, engine, OWN, per_step=64)
    cfg = TrainerConfig(local_groups=8, external_groups=2, group_size=4, max_new_tokens=6, seed=3)
    tr = Trainer(engine, reg, reg.builtin_id, cfg, lineage=OWN, external=hook)
    flooded = [tr.step().n_local_groups for _ in range(4)]
    assert min(flooded) == tr.pod.floor == 1
    hook.per_step = 0
    after = [tr.step().n_local_groups for _ in range(9)]
    assert after[-1] == 8 and after.index(8) <= math.ceil(math.log2(10 * (8 + 2))) and after == sorted(after)


def test_the_node_configs_pod_yield_reaches_the_workers_trainer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from murmur.gossip.identity import Identity
    from murmur.node.config import load_config
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec

    assert TrainerConfig().pod_yield
    (tmp_path / "config.toml").write_text("[training]\npod_yield = false\n")
    cfg = load_config(tmp_path / "config.toml")
    got = TrainerConfig(**worker_spec(cfg, tmp_path, Identity.generate(), ["trainer"], RunOptions())["trainer"])
    assert not got.pod_yield and not TrainerConfig.from_config(cfg).pod_yield
