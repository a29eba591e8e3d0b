"""PODS down-sampling (`training.downsample`, `TrainerConfig.select_groups`): the rule by hand and against
brute force, and a real trainer that updates on exactly the groups of largest reward variance, counts the
rest, and trains fewer rows per step; the node config reaches the worker's trainer."""

from __future__ import annotations

import copy
import itertools
import random
import warnings
from pathlib import Path

import pytest
import torch

from murmur.gossip.errors import ConfigError
from murmur.training.downsample import max_variance_groups, reward_variance
from murmur.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")


def test_the_groups_kept_are_those_closest_to_half_right_ties_to_the_earlier() -> None:
    g = [
        [1, 1, 1, 0],  # 3/4 right: variance 3/16
        [1, 0, 1, 0],  # 2/4: 1/4, the most
        [0, 0, 0, 1],  # 1/4: 3/16, ties with the first
        [1, 1, 0, 0],
    ]  # 2/4: 1/4
    assert max_variance_groups(g, 2) == [1, 3]
    assert max_variance_groups(g, 3) == [0, 1, 3]  # of the two 3/16 groups the earlier stays
    assert max_variance_groups(g, 0) == max_variance_groups(g, 4) == max_variance_groups(g, 9) == [0, 1, 2, 3]
    assert max_variance_groups([], 2) == []
    assert reward_variance([1, 0, 1, 0]) == 0.25 and reward_variance([1.0]) == 0.0
    with pytest.raises(ValueError):
        max_variance_groups(g, -1)


def test_the_subset_kept_has_the_largest_summed_variance_of_any_subset_of_its_size() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 7)
        groups = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(2, 6))] for _ in range(n)]
        m = rng.randint(1, n)
        kept = max_variance_groups(groups, m)
        assert len(kept) == m and kept == sorted(set(kept))
        best = max(sum(reward_variance(groups[i]) for i in c) for c in itertools.combinations(range(n), m))
        assert sum(reward_variance(groups[i]) for i in kept) == pytest.approx(best)


def _groups(rollouts: list) -> list[list]:  # type: ignore[type-arg]
    by: dict[int, list] = {}
    for r in rollouts:
        by.setdefault(r.ref.seed, []).append(r)
    return list(by.values())


def test_a_trainer_updates_on_exactly_the_max_variance_groups_and_counts_the_rest(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    m = 2
    cfg = TrainerConfig(local_groups=16, group_size=8, max_new_tokens=4, lr=1e-4, seed=3, select_groups=m)
    tr = Trainer(copy.deepcopy(warm_engine), registry, registry.builtin_id, cfg, lineage=b"\x0a" * 32)
    trained: list[list[float]] = []
    update = tr._update

    def record(batch, prox, rows):  # type: ignore[no-untyped-def]
        trained.extend([r.reward for r in p.own + p.ext] for p in batch)
        return update(batch, prox, rows)

    tr._update = record  # type: ignore[method-assign]  # to see which groups enter the loss
    cut = left = 0
    for _ in range(8):
        trained.clear()
        res = tr.step()
        rewards = [[r.reward for r in g] for g in _groups(res.rollouts)]
        informative = sorted((reward_variance(x) for x in rewards if len(set(x)) > 1), reverse=True)
        assert sorted(map(reward_variance, trained), reverse=True) == informative[:m]  # the m largest variances
        assert (
            res.trained_groups == min(m, len(informative))
            and res.unselected_groups == len(informative) - res.trained_groups
        )
        cut += len(informative) > m
        left += res.unselected_groups
    assert cut >= 2  # steps with more informative groups than m were seen: the selection did choose
    assert tr.drops["group_not_selected"] == left > 0


def test_down_sampling_trains_fewer_rows_of_the_same_generation(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    """The same engine and seed, one step: the completions are the same, and with select_groups the update
    takes fewer groups, rows and tokens (the step's training work falls; its generation does not change)."""
    fewer = 0
    for seed in range(6):
        shape = dict(local_groups=8, group_size=4, max_new_tokens=4, lr=1e-4, seed=seed)
        full, cut = (
            Trainer(
                copy.deepcopy(warm_engine),
                registry,
                registry.builtin_id,
                TrainerConfig(**shape, select_groups=m),
                lineage=b"\x0a" * 32,
            ).step()
            for m in (0, 1)
        )
        assert [r.ids for r in full.rollouts] == [r.ids for r in cut.rollouts]
        assert cut.trained_groups == min(1, full.trained_groups)
        assert cut.trained_groups + cut.unselected_groups == full.trained_groups
        if full.trained_groups > 1:
            assert cut.tokens < full.tokens
            fewer += 1
    assert fewer >= 2


def test_select_groups_is_checked_and_reaches_the_workers_trainer(tmp_path: Path) -> None:
    from murmur.gossip.identity import Identity
    from murmur.node.config import Config, TrainingSection
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec

    with pytest.raises(ConfigError, match="select_groups"):
        TrainerConfig(select_groups=-1)
    with pytest.raises(ConfigError, match="select_groups"):
        TrainerConfig(select_groups=5000)
    cfg = Config(training=TrainingSection(select_groups=3, follower_oversample=2.0))
    spec = worker_spec(cfg, tmp_path, Identity.generate(), ["trainer"], RunOptions())
    got = TrainerConfig(**spec["trainer"])
    assert got.select_groups == 3 and got == TrainerConfig.from_config(cfg)
    assert spec["follower_oversample"] == 2.0
    assert TrainerConfig.from_config(Config()).select_groups == Config().training.select_groups
