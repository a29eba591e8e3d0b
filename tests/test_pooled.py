"""Other models' rollouts (issue 40): pooled groups with HACPO's corrections, rescue selection, TOPR's
negatives and the foreign-share cap. One test per correction, each failing when its correction is removed:
loss-level ones on tiny tensors (the weight a sample's gradient gets), trainer-level ones on a tiny model
with hand-made rollouts (no generation unless the test needs a step)."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from typing import Any

import msgspec
import pytest
import torch

from murmur.gossip import wire
from murmur.gossip.errors import ConfigError
from murmur.training.engine import Sampling
from murmur.training.foreign import FOREIGN_KEYS, FOREIGN_RANGES
from murmur.training.losses import (
    CapabilityTracker,
    group_advantages,
    hacpo_advantages,
    hacpo_clip_low,
    hacpo_coefficient,
    hacpo_loss,
)
from murmur.training.rollouts import RolloutRec, capability_key, to_wire
from murmur.training.sampler import Sampler, preference_order, split, task_key
from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
from murmur.training.tiny import new_tiny_engine
from murmur.training.trainer import Trainer, TrainerConfig
from murmur.training.verifiers import score

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

OWN = b"\x0a" * 32
SRC = b"\x0b" * 32
SRC2 = b"\x0c" * 32


# ------------------------------------------------------------ the foreign weight, on tiny tensors


def weights(
    logp: torch.Tensor, adv: torch.Tensor, coef: torch.Tensor | None = None, ref: float = -1.0, **kw: Any
) -> list[float]:
    """The weight each row's gradient gets from `hacpo_loss`: d loss / d logp[i, t] = -w_i A_i / (T_i n)."""
    x = logp.clone().requires_grad_(True)
    mask = torch.ones_like(x)
    loss, _ = hacpo_loss(x, ref, mask, adv, torch.ones(len(adv)) if coef is None else coef, **kw)
    loss.backward()
    assert x.grad is not None
    n, t = x.shape
    return [float(-x.grad[i, 0] * t * n / adv[i]) for i in range(n)]


def rows(*per_token: float, tokens: int = 2) -> torch.Tensor:
    """One row per value, every token at that log-prob: against a reference of -1 the per-token ratio is
    exp(v + 1) and the sequence ratio exp(tokens * (v + 1))."""
    return torch.tensor([[v] * tokens for v in per_token])


def test_the_stepwise_band_cuts_a_sample_outside_it_and_never_floors_it() -> None:
    """HACPO clips its ratio to [1 - delta + k Delta, 1] with the gradient through the ratio: outside the
    band a sample gets no gradient. Without the band the same samples train at their ratio; a floor would
    train the one below at 0.8 or more."""
    logp = rows(-1.1, -1.5, -0.9)  # per-token ratios e^-0.1 (in), e^-0.5 (below 0.8), e^0.1 (above 1)
    adv = torch.ones(3)
    banded = weights(logp, adv, clip_low=0.8)
    assert banded[0] == pytest.approx(math.exp(-0.2), rel=1e-5)  # in the band: its sequence ratio
    assert banded[1] == 0.0 and banded[2] == 0.0
    free = weights(logp, adv)
    assert free[1] == pytest.approx(math.exp(-1.0), rel=1e-5) and free[2] == pytest.approx(1.0)
    assert 0.0 < free[1] < 0.8  # no floor either way


def test_the_band_narrows_with_each_update_on_one_steps_batch() -> None:
    """k is the update on a step's batch: the lower bound is 0.8, 0.825, ... up to 1 (HACPO's reference
    config: delta 0.2, Delta 0.025)."""
    assert [hacpo_clip_low(k) for k in (0, 1, 4, 8, 20)] == pytest.approx([0.8, 0.825, 0.9, 1.0, 1.0])
    logp = rows(-1.0 + math.log(0.81))  # per-token ratio 0.81
    assert weights(logp, torch.ones(1), clip_low=hacpo_clip_low(0))[0] > 0
    assert weights(logp, torch.ones(1), clip_low=hacpo_clip_low(1))[0] == 0.0


def test_alpha_multiplies_the_weight_by_the_per_token_ratio_to_its_power() -> None:
    logp = rows(-1.2, tokens=3)  # per-token ratio e^-0.2, sequence ratio e^-0.6
    w0 = weights(logp, torch.ones(1))[0]
    w1 = weights(logp, torch.ones(1), alpha=1.0)[0]
    w2 = weights(logp, torch.ones(1), alpha=2.0)[0]
    assert w0 == pytest.approx(math.exp(-0.6), rel=1e-5)
    assert w1 == pytest.approx(w0 * math.exp(-0.2), rel=1e-5) and w2 == pytest.approx(w0 * math.exp(-0.4), rel=1e-5)
    # a sample the learner finds likelier than its own: the power never raises its weight above 1
    assert weights(rows(-0.5), torch.ones(1), alpha=1.0)[0] == pytest.approx(1.0)


def test_the_capability_coefficient_is_clipped_and_the_weight_stays_at_most_one() -> None:
    p = torch.tensor([0.9, 0.05, 0.001])
    assert torch.allclose(hacpo_coefficient(p, 0.1, max_ratio=10.0), torch.tensor([9.0, 0.5, 0.1]))
    assert torch.allclose(hacpo_coefficient(p, 0.1), torch.tensor([1.0, 0.5, 0.1]))  # Murmur's default max 1
    assert torch.allclose(hacpo_coefficient(p, 0.01, max_ratio=10.0), torch.tensor([10.0, 5.0, 0.1]))
    # the coefficient scales the weight (half of a source's rate: half the weight) ...
    logp = rows(-1.1)
    half = weights(logp, torch.ones(1), coef=torch.tensor([0.5]))[0]
    assert half == pytest.approx(0.5 * weights(logp, torch.ones(1))[0], rel=1e-5)
    # ... and however strong a source looks, its sample never counts for more than one of ours
    assert weights(rows(-0.5), torch.ones(1), coef=torch.tensor([10.0]))[0] == pytest.approx(1.0)


def test_topr_weighs_negatives_by_their_truncated_ratio_and_leaves_positives_alone() -> None:
    """TOPR: another model's wrong answers at clip(pi / mu, 0, 1), mu the learner's own reference, outside
    HACPO's band and power; its right answers keep HACPO's weight (a payload rides on right answers)."""
    logp = rows(-0.9, -1.5, -0.9, -1.1)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    hacpo = weights(logp, adv, clip_low=0.8, alpha=1.0)
    topr = weights(logp, adv, clip_low=0.8, alpha=1.0, topr=True)
    assert hacpo[0] == 0.0 and topr[0] == pytest.approx(1.0)  # a likely error, above the band: pushed down
    assert hacpo[1] == 0.0 and topr[1] == pytest.approx(math.exp(-1.0), rel=1e-5)  # an unlikely one: a little
    assert topr[2] == hacpo[2] == 0.0  # a positive above the band: untouched by TOPR
    # a negative inside the band: its sequence ratio e^-0.2, without HACPO's power (e^-0.1 more)
    assert topr[3] == pytest.approx(math.exp(-0.2), rel=1e-5) and hacpo[3] == pytest.approx(math.exp(-0.3), rel=1e-5)


def test_no_foreign_sample_is_weighted_above_one_under_any_switch() -> None:
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(32, 5, generator=g) * 3
    adv = torch.randn(32, generator=g)
    coef = torch.rand(32, generator=g) * 10
    for low, alpha, topr in itertools.product([None, 0.8, 1.0], [0.0, 1.0, 3.0], [False, True]):
        w = weights(logp, adv, coef=coef, ref=-1.5, clip_low=low, alpha=alpha, topr=topr)
        assert max(w) <= 1.0 + 1e-5 and min(w) >= -1e-6, (low, alpha, topr)


def test_the_defaults_give_a_payload_on_a_right_answer_no_weight() -> None:
    """The third attack catalogue's first class: a right answer the learner would write (ten tokens at its
    own reference) carrying two tokens it would not (-8). HACPO's band cuts it; without the band its weight
    is its sequence ratio e^-14, never a floor's 0.8."""
    logp = torch.full((1, 12), -1.0)
    logp[0, :2] = -8.0
    cfg = TrainerConfig()
    low = hacpo_clip_low(0, cfg.foreign_clip_delta, cfg.foreign_clip_step)
    assert weights(logp, torch.ones(1), clip_low=low, alpha=cfg.foreign_alpha)[0] == 0.0
    assert weights(logp, torch.ones(1))[0] == pytest.approx(math.exp(-14.0), rel=1e-4)


def test_a_sample_inside_the_learners_own_span_weighs_as_hacpos_does_for_a_source_that_is_the_learner() -> None:
    """HACPO's ratio is 1 for a source that is the learner, so its samples train at full weight. Against the
    span of the learner's own completions of the prompt (per token -1.5 ... -0.5) a sample inside it is
    such a sample: weight 1 under the band and alpha. Against the span's mean alone, the same sample is cut
    (likelier than the mean) or weighed down by its whole length (less likely)."""
    cfg = TrainerConfig()
    low = hacpo_clip_low(0, cfg.foreign_clip_delta, cfg.foreign_clip_step)
    logp = rows(-1.4, -1.0, -0.6, tokens=6)
    adv = torch.ones(3)
    kw: dict[str, Any] = {"clip_low": low, "alpha": cfg.foreign_alpha}
    assert weights(logp, adv, ref=-1.5, ref_hi=-0.5, **kw) == pytest.approx([1.0, 1.0, 1.0])
    mean_only = weights(logp, adv, ref=-1.0, **kw)
    assert mean_only[0] == 0.0 and mean_only[2] == 0.0 and mean_only[1] == pytest.approx(1.0)
    assert weights(rows(-1.4, tokens=6), torch.ones(1), ref=-1.0)[0] == pytest.approx(math.exp(-2.4), rel=1e-4)


def test_below_the_span_the_ratios_run_from_its_low_end_and_above_it_the_band_cuts() -> None:
    """A sample less likely per token than any of the learner's own completions is measured from the least
    likely of them (s = e^{T (mean - lo)}, r = e^{mean - lo}); one likelier than all of them is cut by the
    band, as HACPO cuts r > 1, and without the band trains at most at 1."""
    cfg = TrainerConfig()
    low = hacpo_clip_low(0, cfg.foreign_clip_delta, cfg.foreign_clip_step)
    below, above = rows(-1.6, tokens=4), rows(-0.3, tokens=4)
    w = weights(below, torch.ones(1), ref=-1.5, ref_hi=-0.5, clip_low=low, alpha=1.0)[0]
    assert w == pytest.approx(math.exp(-0.4) * math.exp(-0.1), rel=1e-4)
    assert weights(rows(-1.8, tokens=4), torch.ones(1), ref=-1.5, ref_hi=-0.5, clip_low=low)[0] == 0.0
    assert weights(above, torch.ones(1), ref=-1.5, ref_hi=-0.5, clip_low=low)[0] == 0.0
    assert weights(above, torch.ones(1), ref=-1.5, ref_hi=-0.5)[0] == pytest.approx(1.0)


def test_the_span_still_gives_a_payload_on_a_right_answer_no_weight() -> None:
    """The payload of the first class against the span of the learner's own answers: ten tokens it writes
    at its typical -1 and two it would not (-8) fall below even its least likely completion (-1.5 per
    token), so the band cuts the sample and without the band it weighs e^{12 (-2.17 + 1.5)} = e^-8."""
    logp = torch.full((1, 12), -1.0)
    logp[0, :2] = -8.0
    cfg = TrainerConfig()
    low = hacpo_clip_low(0, cfg.foreign_clip_delta, cfg.foreign_clip_step)
    assert weights(logp, torch.ones(1), ref=-1.5, ref_hi=-0.5, clip_low=low, alpha=cfg.foreign_alpha)[0] == 0.0
    assert weights(logp, torch.ones(1), ref=-1.5, ref_hi=-0.5)[0] == pytest.approx(math.exp(-8.0), rel=1e-4)


def test_a_payload_padded_into_the_span_is_cut_by_the_learners_least_likely_token() -> None:
    """Attack on the span: two payload tokens the learner would not write (-8) on a right answer, padded with
    twelve tokens it is sure of (-0.05), bring the per-token mean (-1.16) inside the span of its own answers
    (-1.5 ... -0.5), where the ratio is 1. A token less likely than any the learner wrote in its own
    answers to the prompt (its floor, -3) gives the sample weight 0, band or no band."""
    logp = torch.full((1, 16), -0.05)
    logp[0, :2] = -8.0
    logp[0, 2:4] = -1.0
    cfg = TrainerConfig()
    low = hacpo_clip_low(0, cfg.foreign_clip_delta, cfg.foreign_clip_step)
    kw: dict[str, Any] = {"ref": -1.5, "ref_hi": -0.5, "clip_low": low, "alpha": cfg.foreign_alpha}
    assert weights(logp, torch.ones(1), **kw)[0] == pytest.approx(1.0)  # the span alone lets it through
    assert weights(logp, torch.ones(1), tok_floor=-3.0, **kw)[0] == 0.0
    assert weights(logp, torch.ones(1), ref=-1.5, ref_hi=-0.5, tok_floor=-3.0)[0] == 0.0
    honest = torch.full((1, 16), -1.0)
    honest[0, 0] = -2.9  # its least likely token no rarer than the learner's own
    assert weights(honest, torch.ones(1), tok_floor=-3.0, **kw)[0] == pytest.approx(1.0)


# ------------------------------------------------------------ the capability-weighted baseline


def test_the_capability_weighted_baseline_moves_the_advantage_as_hacpo_says() -> None:
    """A source twice as capable as the learner: its rewards count half in the baseline (they overstate
    what the learner would score), so the baseline falls and the learner's right answers gain advantage."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])  # two own rows, then two of the source
    p_src = torch.tensor([0.4, 0.4, 0.8, 0.8])
    a = hacpo_advantages(r, p_src, 0.4, own=torch.tensor([True, True, False, False]))
    b = (1.0 + 0.0 + 0.5 + 0.5) / 4
    assert torch.allclose(a, (r - b) / r.std(), atol=1e-5)
    plain = group_advantages(r)
    assert a[0] > plain[0] and a[1] > plain[1]
    # equal capabilities: the plain group advantage
    assert torch.allclose(hacpo_advantages(r, torch.full((4,), 0.4), 0.4), plain, atol=1e-6)
    # rewards all equal: no signal is invented by the weights (HACPO's reference code)
    assert torch.all(hacpo_advantages(torch.ones(4), p_src, 0.4) == 0)


# ------------------------------------------------------------ the trainer: pooling, rescue, cap


@pytest.fixture(scope="module")
def reg() -> TaskRegistry:
    r = TaskRegistry("test")
    r.add_builtin()
    return r


@pytest.fixture(scope="module")
def engine() -> Any:
    return new_tiny_engine(seed=0)


def ref(reg: TaskRegistry, seed: int, generator: str = BUILTIN_TRAIN) -> wire.TaskRef:
    return wire.TaskRef(reg.builtin_id, generator, seed)


def rec(reg: TaskRegistry, engine: Any, tref: wire.TaskRef, right: bool, lineage: bytes = OWN) -> RolloutRec:
    """A finished completion of `tref`, right or wrong, by `lineage` (another one is another model's)."""
    task = reg.resolve(tref)
    text = task.answer if right else task.answer + "0"
    ids = engine.encode(text) + [engine.eos_id]
    return RolloutRec(
        ref=tref,
        task=task,
        prompt_ids=engine.encode(task.prompt),
        ids=ids,
        text=text,
        logprobs=[-0.5] * len(ids),
        token_versions=[(0, 0)],
        version=0,
        lineage=lineage,
        tokenizer_hash=engine.tokenizer_hash,
        sampling=Sampling(max_new_tokens=16),
        reward=score(task, text),
        finished=True,
        source=lineage,
        foreign=lineage != OWN,
    )


def group(reg: TaskRegistry, engine: Any, tref: wire.TaskRef, pattern: str, lineage: bytes = OWN) -> list[RolloutRec]:
    """'1' a right answer, '0' a wrong one."""
    return [rec(reg, engine, tref, c == "1", lineage) for c in pattern]


def record(tracker: CapabilityTracker, source: bytes, rate: float) -> None:
    """A source with a full record at `rate` (as many rewards seen as the ramp asks)."""
    tracker.rate[source], tracker.seen[source] = rate, tracker.ramp


def trainer(reg: TaskRegistry, engine: Any, external: Any = None, **kw: Any) -> Trainer:
    cfg = TrainerConfig(
        **{"local_groups": 1, "external_groups": 4, "group_size": 4, "max_new_tokens": 8, "lr": 1e-3, "seed": 1, **kw}
    )
    return Trainer(engine, reg, reg.builtin_id, cfg, lineage=OWN, external=external)


def test_pooling_merges_rollouts_of_the_same_task_and_only_those(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """Rollouts of the own group's task (task set, generator, seed) join it; one seed off, or the same seed
    of another generator, stay groups of their own."""
    a = ref(reg, 100)
    local = [group(reg, engine, a, "1100")]
    same = group(reg, engine, a, "10", SRC)
    other_seed = group(reg, engine, ref(reg, 101), "10", SRC)
    other_gen = group(reg, engine, ref(reg, 100, "sort"), "10", SRC)
    tr = trainer(reg, engine, foreign_share_max=1.0)
    prepared, dropped = tr._prepare(local, [same, other_seed, other_gen])
    assert dropped == 0 and len(prepared) == 3
    pooled = [p for p in prepared if p.pooled]
    assert len(pooled) == 1 and not pooled[0].external
    assert pooled[0].own == local[0] and pooled[0].ext == same and pooled[0].swarm_rows == 2
    alone = [p for p in prepared if not p.pooled]
    assert [p.ext for p in alone] == [other_seed, other_gen] and all(p.external for p in alone)
    # pooling off: the same-task rollouts are a group of their own too
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_pool=False)
    prepared, _ = tr._prepare(local, [same, other_seed, other_gen])
    assert len(prepared) == 4 and not any(p.pooled for p in prepared)


def test_a_pooled_group_has_one_baseline_and_rescues_an_own_group_that_alone_teaches_nothing(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """The learner got its task all wrong; another model got it half right. Pooled, the learner's wrong
    answers are pushed down and the other's right one up; alone, the own group is dropped."""
    a = ref(reg, 200)
    local = [group(reg, engine, a, "0000")]
    theirs = group(reg, engine, a, "10", SRC)
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_baseline=False)
    (p,), dropped = tr._prepare(local, [theirs])
    assert dropped == 0 and p.pooled and p.rescued
    expect = group_advantages(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))  # one group, one baseline
    assert torch.allclose(p.own_adv, expect[:4]) and torch.allclose(p.ext_adv, expect[4:])
    assert bool((p.own_adv < 0).all()) and p.ext_adv[0] > 0
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_pool=False)
    prepared, dropped = tr._prepare(local, [theirs])
    assert dropped == 1 and len(prepared) == 1 and prepared[0].external  # the own group was dropped


def test_the_capability_baseline_switch_reaches_the_pooled_group(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """With a source that has been right more often than the learner on shared tasks, the baseline of a
    pooled group falls and the learner's rows gain advantage; switched off, the plain mean."""
    a = ref(reg, 300)
    local = [group(reg, engine, a, "1100")]
    theirs = group(reg, engine, a, "11110", SRC)
    on = trainer(reg, engine, foreign_share_max=1.0)
    off = trainer(reg, engine, foreign_share_max=1.0, foreign_baseline=False)
    for t in (on, off):
        record(t.shared_src, SRC, 0.9)
        record(t.shared_own, SRC, 0.3)
    (p_on,), _ = on._prepare(local, [theirs])
    (p_off,), _ = off._prepare(local, [theirs])
    assert torch.allclose(p_off.own_adv, group_advantages(torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 1, 0]))[:4])
    assert bool((p_on.own_adv > p_off.own_adv + 0.05).all())


def test_capabilities_of_a_pooled_group_are_compared_on_the_shared_tasks(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """A producer seen mostly on tasks the learner also finds easy looks strong overall (0.8 against the
    learner's 0.2 elsewhere): compared on the shared tasks it is no stronger, so even with HACPO's upper
    clip of 10 its coefficient stays near 1, where the overall rates would give 4."""
    a = ref(reg, 400)
    local = [group(reg, engine, a, "1110")]
    theirs = group(reg, engine, a, "10", SRC)
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_capability_max=10.0)
    record(tr.capability, OWN, 0.2)
    record(tr.capability, SRC, 0.8)
    record(tr.shared_src, SRC, 0.5)  # a full record on the shared tasks, so the coefficient is its rate's
    (p,), _ = tr._prepare(local, [theirs])
    assert p.pooled and float(p.ext_coef.max()) < 1.2
    # the same rows without an own group of their task: the overall rates, so 4 (after this group's update)
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_capability_max=10.0)
    record(tr.capability, OWN, 0.2)
    record(tr.capability, SRC, 0.8)
    (q,), _ = tr._prepare([], [theirs])
    assert float(q.ext_coef.max()) > 3.0


def test_a_fresh_key_starts_with_no_capability_and_earns_its_rate_with_its_rewards() -> None:
    t = CapabilityTracker(ramp=32, max_sources=2)
    assert t.earned(SRC) == 0.0 and t.get(SRC) == 0.5  # the rate's prior is never a weight by itself
    t.update(SRC, [1.0] * 16)
    assert t.earned(SRC) == pytest.approx(t.get(SRC) / 2)
    t.update(SRC, [1.0] * 100)
    assert t.earned(SRC) == pytest.approx(t.get(SRC)) and t.seen[SRC] == 32  # counted up to the ramp only
    t.update(SRC2, [0.0])
    t.update(OWN, [0.0])  # a third source: the least recently updated one is forgotten, record and all
    assert SRC not in t.rate and SRC not in t.seen and t.earned(SRC) == 0.0


def test_a_fresh_key_weighs_no_more_than_a_measured_record_and_borrows_no_lineages_record(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """Capability is kept per producer key: a key seen for the first time that claims the lineage of a
    producer with a strong record weighs what its own four rewards earn (at most 4/32 of a rate), not that
    record (keyed by lineage it would get 2) nor the prior's (0.5 / 0.3 = 1.7); the steady producer keeps
    its own. Through the sampler, so the
    signing key reaches the trainer as the node's worker hands it over."""
    steady, fresh = b"\x01" * 32, b"\x02" * 32
    sampler = Sampler(max_groups=16, seed=3)
    sampler.observe_head(SRC, 0)
    sampler.add_rollouts(_wire(group(reg, engine, ref(reg, 800), "1100", SRC)), producer=steady)
    sampler.add_rollouts(_wire(group(reg, engine, ref(reg, 801), "1100", SRC)), producer=fresh)
    tr = trainer(reg, engine, sampler.take_rollouts, foreign_share_max=1.0, foreign_capability_max=10.0)
    record(tr.capability, OWN, 0.3)
    record(tr.capability, capability_key(steady, SRC), 0.6)
    prepared, _ = tr._prepare([], tr._collect_external([]))
    coef = {p.ext[0].source: float(p.ext_coef.max()) for p in prepared}
    assert set(coef) == {capability_key(steady, SRC), capability_key(fresh, SRC)}
    assert coef[capability_key(steady, SRC)] > 1.5  # its record: about 0.6 / 0.3
    assert coef[capability_key(fresh, SRC)] <= 4 / 32 / 0.3 + 1e-6  # four rewards seen: at most 4/32 of a rate


def test_the_share_cap_keeps_other_models_rows_to_half_a_step_in_rescue_order(reg, engine) -> None:  # type: ignore[no-untyped-def]
    local = [group(reg, engine, ref(reg, 500), "1100")]  # 4 own rows: at most 4 of other models'
    ext = [group(reg, engine, ref(reg, 510 + i), "10", SRC) for i in range(4)]
    tr = trainer(reg, engine)
    assert tr._share_cap(local, ext) == ext[:2] and tr.drops["foreign_share"] == 2
    assert trainer(reg, engine, foreign_share_max=1.0)._share_cap(local, ext) == ext
    assert trainer(reg, engine, foreign_share_max=0.0)._share_cap(local, ext) == []
    # with no own rows, one group still comes in (as the sampler's producer cap lets one in)
    assert trainer(reg, engine)._share_cap([], ext) == ext[:1]
    # rows of our own lineage (followers' samples of this policy) are not another model's: not capped
    mine = [group(reg, engine, ref(reg, 520 + i), "10") for i in range(4)]
    assert trainer(reg, engine)._share_cap(local, mine + ext) == mine + ext[:2]


def _wire(rs: list[RolloutRec]) -> list[wire.Rollout]:
    return [to_wire(r) for r in rs]


def test_rescue_selection_takes_the_own_tasks_that_taught_nothing_first(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """Own groups this step: task A all wrong, task B informative. The swarm offers (in arrival order) an
    unrelated easy group, an unrelated medium one, one for B and one for A; with room for two, rescue
    selection takes A's then B's; without it, the first two that arrived."""
    a, b = ref(reg, 600), ref(reg, 601)
    local = [group(reg, engine, a, "0000"), group(reg, engine, b, "1100")]
    easy = group(reg, engine, ref(reg, 602), "1110", SRC)
    medium = group(reg, engine, ref(reg, 603), "10", SRC)
    for_b = group(reg, engine, b, "1110", SRC2)
    for_a = group(reg, engine, a, "1110", SRC2)
    offered = _wire(easy + medium + for_b + for_a)

    def plain(n: int, _v: int) -> list[wire.Rollout]:  # a hook without `prefer`: ordered after the fact
        return list(offered)

    tr = trainer(reg, engine, plain, external_groups=2)
    got = tr._collect_external(local)
    assert [task_key(g[0].ref) for g in got] == [task_key(a), task_key(b)]
    off = trainer(reg, engine, plain, external_groups=2, foreign_rescue=False)
    assert [task_key(g[0].ref) for g in off._collect_external(local)] == [
        task_key(easy[0].ref),
        task_key(medium[0].ref),
    ]
    # among tasks of no own group, medium difficulty first
    tr = trainer(reg, engine, plain, external_groups=4)
    assert [task_key(g[0].ref) for g in tr._collect_external(local)][2:] == [
        task_key(medium[0].ref),
        task_key(easy[0].ref),
    ]


def test_the_sampler_draws_the_trainers_preferred_tasks_first(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """A hook that takes `prefer` gets the trainer's ranks, so the sampler draws the rescue groups out of
    its whole pool (not only out of what a uniform draw happened to take)."""
    a = ref(reg, 700)
    s = Sampler(max_groups=64, seed=0)
    s.observe_head(SRC, 0)
    for i in range(20):
        s.add_split(split(_wire(group(reg, engine, ref(reg, 710 + i), "10", SRC)), producer=b"p%d" % i))
    s.add_split(split(_wire(group(reg, engine, a, "10", SRC)), producer=b"pa"))
    picked = s.take(1, prefer={task_key(a): 0})
    assert [g.key for g in picked] == [task_key(a)]
    # the order itself: rank, then difficulty nearest 1/2, then the order given
    gs, _ = split(
        _wire(
            group(reg, engine, ref(reg, 750), "1110", SRC)
            + group(reg, engine, ref(reg, 751), "10", SRC)
            + group(reg, engine, ref(reg, 752), "1110", SRC)
        )
    )
    assert preference_order(gs, {task_key(ref(reg, 752)): 1}) == [2, 1, 0]
    # the trainer hands its ranks to such a hook
    seen: list[Any] = []

    def hook(n: int, v: int, prefer: Any = None) -> list[wire.Rollout]:
        seen.append(prefer)
        return []

    tr = trainer(reg, engine, hook)
    tr._collect_external([group(reg, engine, a, "0000"), group(reg, engine, ref(reg, 701), "1100")])
    assert seen == [{task_key(a): 0, task_key(ref(reg, 701)): 1}]


def test_each_update_on_a_steps_batch_narrows_the_band(reg, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """k counts the updates on one step's batch (here two epochs): the trainer passes 0.8, then 0.825, and
    starts again at 0.8 the next step; with the band off, none."""
    import murmur.training.trainer as trainer_mod

    calls: list[tuple[float | None, float, bool]] = []
    real = trainer_mod.hacpo_weights

    def spy(
        logp: Any, ref: Any, mask: Any, adv: Any, coef: Any, clip_low: Any, alpha: Any, topr: Any, *span: Any
    ) -> Any:
        calls.append((clip_low, alpha, topr))
        return real(logp, ref, mask, adv, coef, clip_low, alpha, topr, *span)

    monkeypatch.setattr(trainer_mod, "hacpo_weights", spy)
    eng = new_tiny_engine(seed=0)
    theirs = _wire(group(reg, eng, ref(reg, 800), "10", SRC))
    for clip, want in ((True, [0.8, 0.825, 0.8, 0.825]), (False, [None] * 4)):
        calls.clear()
        tr = trainer(
            reg, copy.deepcopy(eng), lambda n, v: list(theirs), group_size=2, ppo_epochs=2, foreign_ratio_clip=clip
        )
        tr.step()
        tr.step()
        assert [c[0] for c in calls] == pytest.approx(want) if clip else [c[0] for c in calls] == want
        assert all(c[1] == 1.0 and c[2] is False for c in calls)  # HACPO's alpha, no TOPR by default


# ------------------------------------------------------------ configuration


def test_every_foreign_key_reaches_the_trainer_and_is_range_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from murmur.gossip.identity import Identity
    from murmur.node.config import Config, TrainingSection, load_config
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec

    changed = {
        "foreign_pool": False,
        "foreign_baseline": False,
        "foreign_ratio_clip": False,
        "foreign_clip_delta": 0.3,
        "foreign_clip_step": 0.05,
        "foreign_alpha": 2.0,
        "foreign_capability": False,
        "foreign_capability_max": 10.0,
        "foreign_topr": True,
        "foreign_rescue": False,
        "foreign_share_max": 0.25,
        "foreign_wait": 2,
        "foreign_split": True,
        "foreign_prompt_ref": False,
        "foreign_rows": False,
        "foreign_rows_rescue": True,
    }
    assert set(changed) == set(FOREIGN_KEYS)
    defaults = TrainerConfig()
    assert all(getattr(defaults, k) != v for k, v in changed.items())
    cfg = Config(training=TrainingSection(**changed))  # type: ignore[arg-type]  # the keys are the fields
    got = TrainerConfig(**worker_spec(cfg, tmp_path, Identity.generate(), ["trainer"], RunOptions())["trainer"])
    assert {k: getattr(got, k) for k in FOREIGN_KEYS} == changed
    assert got == TrainerConfig.from_config(cfg)
    # the node config and the trainer refuse the same out-of-range values
    fields = msgspec.inspect.type_info(TrainingSection).fields  # type: ignore[attr-defined]  # a StructType
    for key, (lo, hi) in FOREIGN_RANGES.items():
        f = next(x for x in fields if x.name == key)
        assert (f.type.type.ge, f.type.type.le) == (lo, hi), key  # Metadata(FloatType(ge, le), description)
        for bad in (lo - 0.01, hi + 0.01):
            with pytest.raises(ConfigError, match=key):
                TrainerConfig(**{key: bad})
            (tmp_path / "config.toml").write_text(f"[training]\n{key} = {bad}\n")
            with pytest.raises(ConfigError, match=key):
                load_config(tmp_path / "config.toml")


def scheduled(g: list[RolloutRec], round_no: int = 7) -> list[RolloutRec]:
    for r in g:
        r.schedule_round = round_no
    return g


def test_an_own_group_of_a_scheduled_prompt_waits_for_peers_answers_at_most_foreign_wait_steps(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """Of two peers that answer a round's prompts in turn, the earlier finds no answer of the other's yet:
    its scheduled group waits (a step by default) for them, and trains alone after. A group drawn freely,
    one that peers' answers already joined, and every group of a trainer with no swarm or with waiting off
    train at once."""
    a, b, c = ref(reg, 800), ref(reg, 801), ref(reg, 802)
    sched, met, free = (
        scheduled(group(reg, engine, a, "0000")),
        scheduled(group(reg, engine, b, "1100")),
        group(reg, engine, c, "1100"),
    )
    theirs = group(reg, engine, b, "10", SRC)
    tr = trainer(reg, engine, lambda n, v: [])
    train, waiting = tr._wait_for_peers([(sched, 0), (met, 0), (free, 0)], [theirs])
    assert train == [met, free] and waiting == [(sched, 0)]
    train, waiting = tr._wait_for_peers([(sched, 1)], [])  # waited its step: trains alone
    assert train == [sched] and waiting == []
    longer = trainer(reg, engine, lambda n, v: [], foreign_wait=2)
    assert longer._wait_for_peers([(sched, 1)], [])[1] == [(sched, 1)]
    for off in (
        trainer(reg, engine, lambda n, v: [], foreign_wait=0),
        trainer(reg, engine),
        trainer(reg, engine, lambda n, v: [], foreign_pool=False),
    ):
        assert off._wait_for_peers([(sched, 0)], []) == ([sched], [])


def test_a_waiting_group_is_published_when_sampled_and_trained_the_next_step(reg) -> None:  # type: ignore[no-untyped-def]
    """Waiting delays the training, never the sending: peers get the answers the step they are sampled."""
    from murmur.training.schedule import ScheduleBook, ScheduledDraw

    tr = trainer(reg, new_tiny_engine(seed=3), lambda n, v: [], local_groups=2, overprovision=1.0)
    tr.schedule = ScheduledDraw(ScheduleBook.of(reg), 1.0)
    first = tr.step()
    assert first.n_local_groups == 2 and first.waiting_groups == 2 and first.trained_groups == 0
    assert len(first.rollouts) == 2 * 4 and all(r.schedule_round for r in first.rollouts)
    held = {task_key(g[0].ref) for g, _ in tr._waiting}
    second = tr.step()
    assert second.waiting_groups == 2 and held.isdisjoint(task_key(g[0].ref) for g, _ in tr._waiting)
    assert {task_key(r.ref) for r in second.rollouts}.isdisjoint(held)  # sent once, when sampled


def test_a_uniform_group_for_a_scheduled_prompt_is_kept_only_to_join_an_own_group_of_its_task(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """Another model's all-right answers to a task the learner got all wrong teach most, pooled; alone they
    teach nothing. The sampler keeps such a group when it answers the shared schedule, and hands it only to a
    trainer that names its task; unscheduled, it is dropped at intake as before."""
    a, b = ref(reg, 900), ref(reg, 901)
    right = scheduled(group(reg, engine, a, "1111", SRC))
    s = Sampler(max_groups=64, seed=0)
    s.observe_head(SRC, 0)
    s.add_split(split(_wire(right), producer=b"p"))
    s.add_split(split(_wire(group(reg, engine, b, "1111", SRC)), producer=b"q"))
    assert len(s) == 1 and s.counts["uninformative"] == 1
    assert s.take(4) == [] and s.take(4, prefer={task_key(b): 0}) == [] and len(s) == 1
    (g,) = s.take(4, prefer={task_key(a): 0})
    assert g.uniform and g.key == task_key(a)
    # pooled with the learner's all-wrong group it rescues it; another task's own group leaves it dropped
    own = scheduled(group(reg, engine, a, "0000"))
    tr = trainer(reg, engine, foreign_share_max=1.0)
    (p,), dropped = tr._prepare([own], [right])
    assert p.pooled and p.rescued and dropped == 0 and bool((p.ext_adv > 0).all())
    _, dropped = tr._prepare([scheduled(group(reg, engine, b, "1100"))], [right])
    assert dropped == 1


def test_a_split_group_is_half_own_and_filled_by_peers_never_grown(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """`foreign_split`: a trainer in a swarm samples half a group for a scheduled prompt (HACPO's half rollout
    cost), and at most as many swarm rows join it as fill it to `group_size`; free prompts, and a trainer with
    no swarm, keep whole groups."""
    hook = lambda n, v: []  # noqa: E731
    tr = trainer(reg, engine, hook, foreign_split=True, group_size=8, foreign_share_max=1.0)
    assert tr._own_rows(5) == 4 and tr._own_rows(0) == 8
    assert trainer(reg, engine, foreign_split=True, group_size=8)._own_rows(5) == 8  # alone: a whole group
    assert trainer(reg, engine, hook, group_size=8)._own_rows(5) == 8  # split off
    a = ref(reg, 950)
    own = scheduled(group(reg, engine, a, "1000"))
    many = group(reg, engine, a, "1010", SRC) + group(reg, engine, a, "0101", SRC2)
    (p,), _ = tr._prepare([own], [many])
    assert len(p.own) == 4 and len(p.ext) == 4
    whole = trainer(reg, engine, hook, group_size=8, foreign_share_max=1.0)
    (q,), _ = whole._prepare([own], [many])
    assert len(q.ext) == 8


def test_the_foreign_loss_backpropagates_only_rows_of_nonzero_weight_and_equals_hacpos(reg) -> None:  # type: ignore[no-untyped-def]
    """The trainer weighs another model's rows without a graph first and runs the backward only through those
    with weight: the gradient is the one `hacpo_loss` gives over every row. A minibatch whose rows all
    weigh 0 is no update at all (counted), not a step of the optimizer on a zero gradient."""
    from murmur.training.trainer import _EMPTY

    eng = new_tiny_engine(seed=5)
    ext = group(reg, eng, ref(reg, 990), "1010", SRC) + group(reg, eng, ref(reg, 991), "0110", SRC2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    coef = torch.full((8,), 0.7)
    with torch.no_grad():
        logp, mask = eng.token_logprobs([r.prompt_ids for r in ext], [r.ids for r in ext], 1.0)
    per_tok = (logp * mask).sum(-1) / mask.sum(-1)
    tr = trainer(reg, eng)
    tr.ref_logp = float(per_tok[0]) + 0.1  # row 0 inside the band (r = e^-0.1), rows far from it outside
    params = list(eng.model.parameters())

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        loss.backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]

    loss, stats = tr._loss([], _EMPTY, ext, adv, coef, None, len(ext))
    assert 1 <= stats["foreign_rows_trained"] < len(ext)
    logp, mask = eng.token_logprobs([r.prompt_ids for r in ext], [r.ids for r in ext], 1.0)
    want, _ = hacpo_loss(logp, tr.ref_logp, mask, adv, coef, clip_low=0.8, alpha=1.0)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-8)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads(loss), grads(want)))
    tr.ref_logp = float(per_tok.max()) + 5.0  # every row below the band
    before = [p.detach().clone() for p in params]
    p = tr._route(ext, 0, pooled=False)
    _, _, applied = tr._update([p], None, len(ext))
    assert applied == 0 and tr.drops["no_gradient"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_a_pooled_groups_foreign_rows_are_weighed_against_the_learners_own_answers_to_that_prompt(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """HACPO compares one prompt's answers: in a pooled group the learner's reference is the span of the
    per-token behaviour log-probs of its own completions of the prompt, least to most likely (its own
    sampling, nothing a peer claims); a swarm group alone, and every group with `foreign_prompt_ref` off,
    keep the running reference (NaN here)."""
    a = ref(reg, 960)
    own = group(reg, engine, a, "1100")
    for k, r in enumerate(own):
        r.logprobs = [-0.2 * (k + 1)] * len(r.ids)  # per-token means -0.2, -0.4, -0.6, -0.8
    n = len(own[3].ids)  # the least likely token of them all, the row's mean kept at -0.8
    own[3].logprobs = [-1.5] + [(-0.8 * n + 1.5) / (n - 1)] * (n - 1)
    theirs = group(reg, engine, a, "10", SRC)
    theirs[0].logprobs = [-999.0] * len(theirs[0].ids)  # a peer's claim: never part of the reference
    tr = trainer(reg, engine, foreign_share_max=1.0)
    (p,), _ = tr._prepare([own], [theirs])
    assert torch.allclose(p.ext_span, torch.tensor([[-0.8, -0.2, -1.5]] * 2))  # (lo, hi, floor) per row
    (q,), _ = tr._prepare([], [theirs])
    assert q.ext_span.shape == (2, 3) and bool(torch.isnan(q.ext_span).all())
    off = trainer(reg, engine, foreign_share_max=1.0, foreign_prompt_ref=False)
    (p,), _ = off._prepare([own], [theirs])
    assert p.ext_span.shape == (2, 3) and bool(torch.isnan(p.ext_span).all())


def test_with_rescue_rows_other_models_answers_train_only_where_they_rescue_the_learners_group(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """`foreign_rows_rescue = true`: another model's answers train where the learner's own answers to the
    prompt were all wrong (they are its only right ones); where its own group was informative they only
    move its baseline and leave the loss; another model's group alone is not trained."""
    hard, mixed = ref(reg, 980), ref(reg, 981)
    own_hard, own_mixed = group(reg, engine, hard, "0000"), group(reg, engine, mixed, "1000")
    theirs_hard, theirs_mixed = group(reg, engine, hard, "10", SRC), group(reg, engine, mixed, "11", SRC)
    alone = group(reg, engine, ref(reg, 982), "10", SRC)
    kw: dict[str, Any] = {"local_groups": 2, "foreign_share_max": 1.0, "foreign_baseline": False}
    tr = trainer(reg, engine, foreign_rows_rescue=True, **kw)
    prepared, dropped = tr._prepare([own_hard, own_mixed], [theirs_hard, theirs_mixed, alone])
    assert dropped == 1 and len(prepared) == 2
    rescued, informative = prepared
    assert rescued.rescued and len(rescued.ext) == 2 and len(rescued.ext_adv) == 2
    assert not informative.rescued and informative.ext == [] and informative.swarm_rows == 2
    plain = trainer(reg, engine, **kw)
    (_, both, lone), _ = plain._prepare([own_hard, own_mixed], [theirs_hard, theirs_mixed, alone])
    assert len(both.ext) == 2 and lone.external
    # the other model's two right answers are in the baseline of the learner's own rows either way
    assert torch.allclose(informative.own_adv, both.own_adv)
    assert not torch.allclose(informative.own_adv, group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0])))


def test_with_foreign_rows_off_other_models_answers_only_set_the_pooled_baseline(reg, engine) -> None:  # type: ignore[no-untyped-def]
    """`foreign_rows = false`: a pooled group's other-model rows still move its own rows' advantages (the
    learner got the task all wrong, another model half right: its wrong answers are pushed down), but enter
    no loss and cost no pass; another model's group alone is not trained."""
    a = ref(reg, 970)
    own, theirs, other = (
        group(reg, engine, a, "0000"),
        group(reg, engine, a, "10", SRC),
        group(reg, engine, ref(reg, 971), "10", SRC),
    )
    tr = trainer(reg, engine, foreign_share_max=1.0, foreign_rows=False, foreign_baseline=False)
    prepared, dropped = tr._prepare([own], [theirs, other])
    assert dropped == 1 and len(prepared) == 1 and prepared[0].rescued
    (p,) = prepared
    assert bool((p.own_adv < 0).all())
    calls: list[int] = []
    real = engine.token_logprobs

    def counted(prompts: Any, outs: Any, t: float = 1.0) -> Any:
        calls.append(len(prompts))
        return real(prompts, outs, t)

    engine.token_logprobs = counted
    try:
        _, stats = tr._loss(p.own, p.own_adv, p.ext, p.ext_adv, p.ext_coef, None, p.rows)
        assert calls == [4] and "foreign_rows_trained" not in stats  # the own rows' pass only
        calls.clear()
        on = trainer(reg, engine, foreign_share_max=1.0, foreign_baseline=False)
        (q,), _ = on._prepare([own], [theirs])
        on._loss(q.own, q.own_adv, q.ext, q.ext_adv, q.ext_coef, None, q.rows)
        assert calls[:2] == [4, 2]
    finally:
        del engine.token_logprobs
