"""Loss normalisation (`loss_norm`): the denominator rule by hand, config checking, and that a real
trainer step with the constant normaliser (Dr. GRPO's) is the sum of the informative rows' token
losses over batch rows x max_new_tokens, where the informative one is their token mean."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from murmur.gossip.errors import ConfigError
from murmur.node.config import Config
from murmur.training.tasksets import TaskRegistry
from murmur.training.tiny import new_tiny_engine, warmup
from murmur.training.trainer import LOSS_NORMS, Trainer, TrainerConfig, loss_denominator

SWARM = "test"

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")


def test_loss_denominator_by_hand() -> None:
    cfg = TrainerConfig(local_groups=6, external_groups=2, group_size=4, loss_norm="constant")
    assert loss_denominator(cfg, 8) == 32  # never fewer rows than configured: a thin step moves less
    assert loss_denominator(cfg, 40) == 40  # more rows collected than configured: all of them count
    assert loss_denominator(TrainerConfig(loss_norm="informative"), 8) is None


def test_loss_norm_is_checked_and_mapped_from_the_node_config() -> None:
    assert set(LOSS_NORMS) == {"informative", "constant"}
    with pytest.raises(ConfigError, match="loss_norm"):
        TrainerConfig(loss_norm="tokens")
    c = Config()
    assert TrainerConfig.from_config(c).loss_norm == c.training.loss_norm == "informative"
    c.training.loss_norm = "constant"
    assert TrainerConfig.from_config(c).loss_norm == "constant"


def test_constant_normaliser_scales_the_real_step_by_the_informative_fraction() -> None:
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    base = new_tiny_engine(seed=0)
    warmup(base, 40, seed=0)  # some sums right: a mix of informative and all-equal groups
    small = dict(local_groups=6, external_groups=2, group_size=4, max_new_tokens=4, lr=1e-4, seed=3)
    checked = 0
    for _ in range(4):  # bounded: find a step with some but not all groups informative
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        ra = Trainer(a, reg, reg.builtin_id, TrainerConfig(**small, loss_norm="informative")).step()
        rb = Trainer(b, reg, reg.builtin_id, TrainerConfig(**small, loss_norm="constant")).step()
        assert [r.text for r in ra.rollouts] == [r.text for r in rb.rollouts]  # same samples
        used = ra.n_local_groups - ra.dropped_groups
        if used == 0:
            base.gen.manual_seed(int(base.gen.initial_seed()) + 1)
            continue
        groups: dict[int, list] = {}
        for r in ra.rollouts:
            groups.setdefault(r.ref.seed, []).append(r)
        tokens = sum(len(r.ids) for g in groups.values() if len({x.reward for x in g}) > 1 for r in g)
        rows = max(len(ra.rollouts), (6 + 2) * 4)
        want = ra.loss * tokens / (rows * 4)  # token mean -> token sum over rows x max_new_tokens
        assert rb.loss == pytest.approx(want, rel=1e-4, abs=1e-7)
        if ra.loss != 0.0:
            assert abs(rb.loss) < abs(ra.loss)
        checked += 1
        break
    assert checked == 1
