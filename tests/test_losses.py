"""GRPO-family losses against hand-computed references on small batches."""

from __future__ import annotations

import math

import pytest
import torch

from murmur.training.losses import (
    EPS_HI,
    EPS_LO,
    CapabilityTracker,
    decoupled_loss,
    group_advantages,
    hacpo_advantages,
    hacpo_coefficient,
    hacpo_loss,
    is_degenerate,
    m2po_mask,
    ppo_clip_loss,
)

torch.set_num_threads(1)


def test_group_advantages_by_hand() -> None:
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5, std with Bessel's correction sqrt(1/3) (the population std 0.5 would give +-1)
    std = math.sqrt(1 / 3)
    assert torch.allclose(a, torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std]), atol=1e-5)
    b = group_advantages(torch.tensor([2.0, 0.0, 1.0]))  # unbiased std 1
    assert torch.allclose(b, torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)
    assert group_advantages(torch.tensor([1.0])).tolist() == [0.0]  # a group of one has no spread


def test_group_advantages_equal_trls_grpo_advantages() -> None:
    """TRL's GRPOTrainer: (R - mean of the group) / (std(dim=1) + 1e-4), torch's default (unbiased) std."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    g = rewards.view(-1, 4)
    trl = (rewards - g.mean(dim=1).repeat_interleave(4)) / (g.std(dim=1).repeat_interleave(4) + 1e-4)
    ours = torch.cat([group_advantages(rewards[:4], eps=1e-4), group_advantages(rewards[4:], eps=1e-4)])
    assert torch.allclose(ours, trl, atol=1e-6)


def test_degenerate_groups_are_detected() -> None:
    assert is_degenerate([1.0, 1.0, 1.0]) and is_degenerate([0.0]) and not is_degenerate([0.0, 1.0])
    assert torch.all(group_advantages(torch.tensor([1.0, 1.0])) == 0)


def test_ppo_clip_asymmetric_by_hand() -> None:
    # ratios 1.5 (A>0, clipped at 1.28), 0.5 (A<0, clipped at 0.8), 1.1 (A>0, unclipped), 0.7 (A>0: min keeps 0.7)
    r = torch.tensor([[1.5, 0.5], [1.1, 0.7]])
    old = torch.zeros(2, 2)
    logp = torch.log(r).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0], [2.0, 1.0]])
    mask = torch.ones(2, 2)
    loss, st = ppo_clip_loss(logp, old, adv, mask)
    expect = -(1.28 * 1 + 0.8 * -1 + 1.1 * 2 + 0.7 * 1) / 4
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # clipped tokens give no gradient; unclipped ones give -A*r/4
    g = logp.grad
    assert g[0, 0] == 0 and g[0, 1] == 0
    assert g[1, 0].item() == pytest.approx(-2 * 1.1 / 4, abs=1e-6)
    assert g[1, 1].item() == pytest.approx(-1 * 0.7 / 4, abs=1e-6)


def test_ppo_mask_and_sequence_advantage_broadcast() -> None:
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_clip_loss(logp, logp, torch.tensor([1.0, -2.0]), mask)
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    # a ratio above 1 + eps_hi with a small negative advantage: the min keeps the ratio, nothing is clipped
    _, st = ppo_clip_loss(torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1), torch.tensor([-0.5]), torch.ones(1, 1))
    assert st["clip_frac"] == 0.0


def test_m2po_mask_by_hand() -> None:
    b = torch.zeros(1, 4)
    logp = torch.tensor([[0.1, -0.1, 0.6, 0.3]])  # squares .01 .01 .36 .09: mean .1175 > .04
    mask = torch.ones(1, 4)
    keep = m2po_mask(logp, b, mask, 0.04)
    # drop .36 -> mean(.01,.01,.09)=.0367 <= .04: stop
    assert keep.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    # only candidates may be removed: with token 2 protected, remove 3 then 0 or 1 ...
    cand = torch.tensor([[True, True, False, True]])
    keep2 = m2po_mask(logp, b, mask, 0.04, cand)
    assert keep2[0, 2] == 1.0 and keep2[0, 3] == 0.0
    # already below tau: nothing masked
    assert m2po_mask(torch.full((1, 4), 0.1), b, mask, 0.04).sum() == 4


def test_decoupled_loss_by_hand() -> None:
    behav = torch.log(torch.tensor([[0.5, 0.25]]))
    prox = torch.log(torch.tensor([[0.6, 0.2]]))
    theta = torch.log(torch.tensor([[0.9, 0.2]])).requires_grad_(True)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    loss, st = decoupled_loss(theta, prox, behav, adv, mask, stale=None, tau=0.0)
    # token 0: w = .6/.5 = 1.2, u = 1.5 -> clipped 1.28 -> 1.2*1.28; token 1: w = .8, u = 1 -> .8
    expect = -(1.2 * 1.28 + 0.8 * 1.0) / 2
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    assert st["behav_weight_mean"] == pytest.approx(1.0, rel=1e-5)
    loss.backward()
    assert theta.grad[0, 0] == 0  # clipped
    assert theta.grad[0, 1].item() == pytest.approx(-0.8 / 2, rel=1e-5)


def test_decoupled_behaviour_weight_is_truncated() -> None:
    behav = torch.log(torch.tensor([[0.01]]))
    prox = torch.log(torch.tensor([[0.5]]))
    loss, _ = decoupled_loss(prox.clone(), prox, behav, torch.tensor([1.0]), torch.ones(1, 1), tau=0.0, behav_cap=2.0)
    assert loss.item() == pytest.approx(-2.0)


def test_decoupled_applies_m2po_to_stale_tokens() -> None:
    behav = torch.zeros(1, 3)
    theta = torch.tensor([[0.0, 0.0, 1.0]])
    stale = torch.tensor([[False, False, True]])
    _, st = decoupled_loss(theta, theta, behav, torch.tensor([1.0]), torch.ones(1, 3), stale=stale)
    assert st["m2_masked_frac"] == pytest.approx(1 / 3)


def test_hacpo_advantages_and_coefficient_by_hand() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    p_src = torch.tensor([0.5, 0.5, 0.25, 0.25])
    a = hacpo_advantages(r, p_src, p_learner=0.5)
    # b = mean(1*1, 1*0, 2*1, 2*0) = 0.75; std (unbiased) = sqrt(1/3)
    sd = math.sqrt(1 / 3)
    assert torch.allclose(a, torch.tensor([0.25 / sd, -0.75 / sd, 0.25 / sd, -0.75 / sd]), atol=1e-5)
    c = hacpo_coefficient(torch.tensor([0.01, 0.5, 0.9]), 0.05)
    assert torch.allclose(c, torch.tensor([0.2, 1.0, 1.0]))  # a stronger source is never weighted above 1
    assert torch.allclose(hacpo_coefficient(torch.tensor([0.001]), 0.9), torch.tensor([0.1]))  # nor below 0.1
    # a source that never succeeds moves the baseline by at most ten times its rewards (HACPO's clip)
    # (a baseline of 5 is above every reward: the binary guard of HACPO's reference code falls back to the
    # learner's own rows, here the second)
    far = hacpo_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([1e-6, 0.5]), p_learner=0.5, own=torch.tensor([False, True])
    )
    sd = math.sqrt(0.5)
    assert torch.allclose(far, torch.tensor([1.0 / sd, 0.0]), atol=1e-4)
    # below the guard: the clip alone holds that source's weight at 10 (unclipped 0.5 / 1e-3 = 500)
    r12 = torch.tensor([1.0] + [0.0] * 11)
    clipped = hacpo_advantages(r12, torch.tensor([1e-6] + [0.5] * 11), p_learner=0.5)
    assert torch.allclose(clipped, (r12 - 10.0 / 12) / r12.std(), atol=1e-4)


def test_hacpo_loss_truncates_sequence_ratio_at_one() -> None:
    # learner log-prob -1 per token against references of -2 (row 0, two tokens: s = e^2 > 1 -> 1) and
    # -0.5 (row 1, one token: s = e^-0.5, kept)
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    src = torch.tensor([-2.0, -0.5])
    adv = torch.tensor([1.0, -1.0])
    coef = torch.tensor([2.0, 1.0])  # a coefficient above 1 (HACPO's bound is 10): the weight stays <= 1
    loss, st = hacpo_loss(logp, src, mask, adv, coef)
    s1 = math.exp(-0.5)
    expect = -((1.0 * 1.0 * 1.0 * -1.0) + (1.0 * s1 * -1.0 * -1.0)) / 2
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    assert st["seq_ratio_truncated_frac"] == 0.5 and st["seq_ratio_low_frac"] == 0.5  # e^-0.5 < 0.8
    assert st["seq_ratio_mean"] == pytest.approx((1 + math.exp(-0.5)) / 2, rel=1e-5)  # the weights applied
    loss.backward()
    # length-normalised: row 0 tokens get -min(coef*s, 1)*A/len/2 = -1*1/2/2
    assert logp.grad[0, 0].item() == pytest.approx(-0.25, rel=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx(s1 / 2, rel=1e-5)
    assert logp.grad[1, 1].item() == 0.0


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_hacpo_weight_of_a_far_off_policy_sample_is_its_ratio(adv: float) -> None:
    # a completion the learner is e^3 times less likely per token to write than one of its own, over four
    # tokens: its importance weight is e^-12 (the product over the tokens, not their mean); a floor (clip
    # from below) would train on it far harder than that
    logp = torch.full((1, 4), -4.0, requires_grad=True)
    loss, _ = hacpo_loss(logp, -1.0, torch.ones(1, 4), torch.tensor([adv]), torch.ones(1))
    loss.backward()
    assert logp.grad.abs().sum().item() == pytest.approx(math.exp(-12.0), rel=1e-5)


def test_hacpo_weight_sees_a_few_unlikely_tokens_that_a_per_token_mean_dilutes() -> None:
    """Attack (issue 43): a payload of a few tokens the learner would not write, riding on an answer it
    would. Ten typical tokens (log-prob -1, the reference) and two at -8: the weight is e^-14, where a
    per-token mean (e^-(14/12)) would keep a third of it."""
    logp = torch.full((1, 12), -1.0)
    logp[0, :2] = -8.0
    _, st = hacpo_loss(logp, -1.0, torch.ones(1, 12), torch.tensor([1.0]), torch.ones(1))
    assert st["seq_ratio_mean"] == pytest.approx(math.exp(-14.0), rel=1e-4)


def test_capability_tracker_forgets_the_least_recently_updated_source_past_its_bound() -> None:
    t = CapabilityTracker(max_sources=2)
    t.update(b"a", [1.0])
    t.update(b"b", [1.0])
    t.update(b"a", [1.0])  # a is now the most recently updated
    t.update(b"c", [1.0])
    assert set(t.rate) == {b"a", b"c"} and t.get(b"b") == t.prior


def test_capability_tracker() -> None:
    t = CapabilityTracker(decay=0.5, prior=0.5)
    t.update(b"a", [1.0, 1.0])
    assert t.get(b"a") == pytest.approx(0.875)
    assert t.get(b"unknown") == 0.5
    t.update(b"b", [0.0, 1.0])  # a failure pulls the rate down by the same rule
    assert t.get(b"b") == pytest.approx(0.625)
    t.update(b"c", [-1.0])  # a negative reward is a failure too
    assert t.get(b"c") == pytest.approx(0.25)
    default = CapabilityTracker()  # moves 5 % of the way towards each outcome, from 0.5
    default.update(b"a", [1.0])
    assert default.get(b"a") == pytest.approx(0.525)


# ------------------------------------------------------------ the asymmetric clip, one side at a time


@pytest.mark.parametrize(
    "ratio,adv,want,clipped",
    [
        (1.25, 1.0, 1.25, False),  # inside 1 + 0.28: unclipped (swapped bounds would clip it at 1.2)
        (1.30, 1.0, 1.28, True),  # above 1 + 0.28: clipped at 1.28
        (0.75, -1.0, -0.80, True),  # below 1 - 0.2: clipped at 0.8 (swapped bounds would keep 0.75)
        (0.78, 1.0, 0.78, False),  # A > 0 below the floor: min keeps the ratio, gradient flows
        (1.25, -1.0, -1.25, False),  # A < 0 above: min keeps the ratio
    ],
)
def test_each_clip_bound_alone(ratio: float, adv: float, want: float, clipped: bool) -> None:
    assert (EPS_LO, EPS_HI) == (0.2, 0.28)
    for fn in ("ppo", "decoupled"):
        logp = torch.log(torch.tensor([[ratio]])).requires_grad_(True)
        old = torch.zeros(1, 1)
        a, mask = torch.tensor([adv]), torch.ones(1, 1)
        if fn == "ppo":
            loss, _ = ppo_clip_loss(logp, old, a, mask)
        else:  # on-policy proximal = behaviour: the behaviour weight is 1
            loss, _ = decoupled_loss(logp, old, old, a, mask, stale=None)
        assert loss.item() == pytest.approx(-want, abs=1e-6), fn
        loss.backward()
        assert (logp.grad.item() == 0.0) == clipped, fn
        if not clipped:
            assert logp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_decoupled_without_stale_tokens_masks_nothing() -> None:
    behav = torch.zeros(1, 3)
    theta = torch.tensor([[0.0, 0.0, 1.0]])  # M2 = 1/3 >> tau: M2PO would act on stale tokens
    loss, st = decoupled_loss(theta, theta, behav, torch.tensor([1.0]), torch.ones(1, 3), stale=None)
    assert st["m2_masked_frac"] == 0.0
    full, _ = decoupled_loss(
        theta, theta, behav, torch.tensor([1.0]), torch.ones(1, 3), stale=torch.zeros(1, 3, dtype=torch.bool)
    )
    assert loss.item() == pytest.approx(full.item())


# ------------------------------------------------------------ against TRL's GRPO loss definitions


def _trl_per_token_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """TRL GRPOTrainer._compute_loss, beta = 0: coef_1 = exp(logp - old), coef_2 = clamp(coef_1, 1-eps_low,
    1+eps_high), per-token loss -min(coef_1 A, coef_2 A) (written from its published definition)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    return -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two groups of 3 with different lengths; the second group's rewards are all equal (zero advantage)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 5, generator=g) * 2
    logp = old + (torch.rand(6, 5, generator=g) - 0.5) * 0.8  # ratios on both sides of both bounds
    mask = torch.zeros(6, 5)
    for i, n in enumerate([5, 2, 3, 1, 1, 2]):
        mask[i, :n] = 1
    adv = torch.cat([group_advantages(torch.tensor([1.0, 0.0, 1.0])), group_advantages(torch.ones(3))])
    return logp, old, adv, mask


def test_constant_normaliser_equals_trl_dr_grpo_value_and_gradient() -> None:
    logp, old, adv, mask = _batch()
    max_len = 5
    a = logp.clone().requires_grad_(True)
    ref = (_trl_per_token_loss(a, old, adv, 0.2, 0.28) * mask).sum() / (a.size(0) * max_len)
    ref.backward()
    # ours: the zero-advantage group is dropped before the loss, the denominator keeps the whole batch
    b = logp[:3].clone().requires_grad_(True)
    ours, _ = decoupled_loss(b, old[:3], old[:3], adv[:3], mask[:3], stale=None, denom=6 * max_len)
    ours.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(b.grad, a.grad[:3], rtol=1e-6, atol=1e-9)
    assert torch.all(a.grad[3:] == 0)  # what we drop contributes nothing in TRL either


def test_informative_mean_equals_trl_bnpo_only_on_the_informative_rows() -> None:
    logp, old, adv, mask = _batch()
    ours, _ = decoupled_loss(logp[:3], old[:3], old[:3], adv[:3], mask[:3], stale=None)
    ptl = _trl_per_token_loss(logp, old, adv, 0.2, 0.28)
    bnpo_inf = (ptl[:3] * mask[:3]).sum() / mask[:3].sum()
    bnpo_all = (ptl * mask).sum() / mask.sum()
    assert ours.item() == pytest.approx(bnpo_inf.item(), rel=1e-6)
    # with unequal lengths, scaling the informative mean by the informative row fraction is not TRL's
    # bnpo (nor dr_grpo): the reason "constant" is defined as dr_grpo's sum over a constant
    assert ours.item() * 3 / 6 != pytest.approx(bnpo_all.item(), rel=1e-3)


def test_hacpo_loss_with_a_denominator_is_the_sum_over_it() -> None:
    logp = -torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 3)
    src, adv, coef = logp.mean(-1), torch.tensor([1.0, -1.0, 0.5, 0.0]), torch.ones(4)
    mean, _ = hacpo_loss(logp, src, mask, adv, coef)
    summed, _ = hacpo_loss(logp, src, mask, adv, coef, denom=10)
    assert summed.item() == pytest.approx(mean.item() * 4 / 10, rel=1e-6)


def test_hacpo_a_row_without_tokens_contributes_nothing() -> None:
    """A sequence whose mask is empty (nothing re-tokenised survived) is left out of the loss and its stats."""
    logp = -torch.rand(3, 3, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 3)
    mask[2] = 0.0
    src, adv, coef = torch.tensor([-0.4, -0.9, -0.5]), torch.tensor([1.0, -0.5, 2.0]), torch.ones(3)
    loss, st = hacpo_loss(logp, src, mask, adv, coef)
    ref, st_ref = hacpo_loss(logp[:2], src[:2], mask[:2], adv[:2], coef[:2])
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert st == pytest.approx(st_ref)
    empty, st_empty = hacpo_loss(logp, src, torch.zeros(3, 3), adv, coef)  # nothing at all: zero, not NaN
    assert empty.item() == 0.0 and set(st_empty.values()) == {0.0}
