"""GRPO-family losses: group advantages, asymmetric PPO clip, the staleness-aware
decoupled objective with an M2PO mask, and the HACPO-style loss for samples
from other models.

All token tensors are [B, T] with a 0/1 `mask`; losses are token means over
the batch (sequence-level losses are means over sequences) unless a `denom` is
given, in which case they are sums divided by it (Dr. GRPO's constant
normaliser, which the trainer computes); each returns a scalar to minimise
plus a stats dict. The formulas are in docs/training.md.
"""

from __future__ import annotations

import math

import torch

from murmur.training.foreign import CAPABILITY_CLIP, HACPO_DELTA, HACPO_STEP

EPS_LO = 0.2
EPS_HI = 0.28
M2_TAU = 0.04
HACPO_LOW = 0.8  # a sequence ratio below this counts as far off-policy (a statistic only)
MAX_LOG_WEIGHT = 30.0  # an untruncated sequence weight is a statistic only; this keeps it finite
MAX_SOURCES = 4096  # sources whose success rate is remembered (least recently updated forgotten first)
CAPABILITY_RAMP = 32  # rewards of a source seen before its capability counts in full (four groups of 8)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (R_i - mean R) / (std R + eps) for one group, std with Bessel's correction: TRL's GRPOTrainer
    and HACPO's reference code both divide by torch's default (unbiased) std. A group of one has none."""
    r = rewards.float()
    if r.numel() < 2:
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std() + eps)


def is_degenerate(rewards: list[float]) -> bool:
    """All rewards equal: zero advantage everywhere, so the group teaches nothing and is dropped."""
    return len(rewards) < 2 or max(rewards) - min(rewards) < 1e-9


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _reduce(x: torch.Tensor, mask: torch.Tensor, denom: float | None) -> torch.Tensor:
    """Token mean over `mask`, or the masked sum over `denom` when one is given."""
    return _token_mean(x, mask) if denom is None else (x * mask).sum() / max(float(denom), 1.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_lo: float = EPS_LO,
    eps_hi: float = EPS_HI,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-min(r A, clip(r, 1-eps_lo, 1+eps_hi) A), r = exp(logp - old_logp); `adv` is [B] or [B, T]."""
    a = adv[:, None] if adv.dim() == 1 else adv
    r = torch.exp(logp - old_logp)
    obj = torch.minimum(r * a, r.clamp(1 - eps_lo, 1 + eps_hi) * a)
    clipped = ((r < 1 - eps_lo) & (a < 0)) | ((r > 1 + eps_hi) & (a > 0))
    return -_token_mean(obj, mask), {"clip_frac": float(_token_mean(clipped.float(), mask))}


def m2po_mask(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    tau: float = M2_TAU,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask out the tokens with the largest squared log-ratio until the rest has mean <= tau.

    The second moment M2 = mean((logp - b)^2) over the kept tokens. Only
    `candidates` (default: all masked tokens; the trainer passes the stale
    ones) can be removed; the mean is over every kept token.
    """
    d2 = (logp.detach() - behav_logp).pow(2) * mask
    keep = mask.clone()
    n = float(mask.sum())
    if n == 0:
        return keep
    total = float(d2.sum())
    if total / n <= tau:
        return keep
    cand = mask.bool() if candidates is None else (candidates.bool() & mask.bool())
    flat = torch.where(cand, d2, torch.full_like(d2, -1.0)).flatten()
    order = torch.argsort(flat, descending=True)
    vals = flat[order].tolist()
    removed = 0
    kept_n = n
    for v in vals:
        if v < 0 or total / kept_n <= tau or kept_n <= 1:
            break
        total -= v
        kept_n -= 1
        removed += 1
    keep.view(-1)[order[:removed]] = 0.0
    return keep


def decoupled_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    stale: torch.Tensor | None = None,
    eps_lo: float = EPS_LO,
    eps_hi: float = EPS_HI,
    tau: float = M2_TAU,
    behav_cap: float = 2.0,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL) with an M2PO mask on stale tokens.

    J = exp(p - b) * min(u A, clip(u, 1-eps_lo, 1+eps_hi) A), u = exp(logp - p);
    the behaviour weight exp(p - b) is detached and truncated at `behav_cap`.
    `stale` ([B, T] bool) marks tokens produced by an older policy version; only
    those may be masked by M2PO (tau on the second moment of logp - b), so with
    `stale=None` (every token fresh) nothing is masked. The loss is the token mean
    over the kept tokens, or their sum over `denom` when one is given.
    """
    a = adv[:, None] if adv.dim() == 1 else adv
    keep = m2po_mask(logp, behav_logp, mask, tau, stale) if tau > 0 and stale is not None else mask
    w = torch.exp(prox_logp - behav_logp).detach().clamp(max=behav_cap)
    u = torch.exp(logp - prox_logp.detach())
    obj = w * torch.minimum(u * a, u.clamp(1 - eps_lo, 1 + eps_hi) * a)
    n = float(mask.sum()) or 1.0
    return -_reduce(obj, keep, denom), {
        "m2_masked_frac": float((mask - keep).sum()) / n,
        "behav_weight_mean": float(_token_mean(w, mask)),
    }


def hacpo_advantages(
    rewards: torch.Tensor,
    p_src: torch.Tensor,
    p_learner: float | torch.Tensor,
    eps: float = 1e-6,
    own: torch.Tensor | None = None,
    max_reward: float = 1.0,
) -> torch.Tensor:
    """HACPO's capability-aware advantage over one (pooled) group: A_i = (R_i - b) / (std R + eps),
    b = mean_j clip(P_learner(j) / P_src(j), 0.1, 10) R_j.

    A stronger source's rewards overstate what the learner would score, so they count for less in the
    baseline, a weaker one's for more; the ratio is clipped as HACPO clips it. As in HACPO's reference code:
    a group whose rewards are all equal gets the plain mean (a weighting must not invent a signal there);
    a baseline above the highest reward (`max_reward`, binary rewards) falls back to the mean of the
    learner's own rows (`own`, a bool mask), or the plain mean when there are none; the std is the
    unbiased one over the whole group. `p_learner` is one rate, or one per row (the learner's rate measured
    on the same prompts as that row's source)."""
    r = rewards.float()
    if r.numel() < 2 or float(r.max() - r.min()) < 1e-9:
        return torch.zeros_like(r)
    p_l = torch.as_tensor(p_learner, dtype=torch.float32)
    ratio = (p_l / p_src.float().clamp(min=1e-3)).clamp(1.0 / CAPABILITY_CLIP, CAPABILITY_CLIP)
    b = (ratio * r).mean()
    if float(b) > max_reward:
        b = r[own].mean() if own is not None and bool(own.any()) else r.mean()
    return (r - b) / (r.std() + eps)


def hacpo_coefficient(p_src: torch.Tensor, p_learner: float | torch.Tensor, max_ratio: float = 1.0) -> torch.Tensor:
    """clip(P_src / P_learner, 0.1, max_ratio): trust a weaker source less. HACPO's upper bound is 10; the
    default here is 1, never a sample of another model more than one of our own: a source's success rate is
    measured on what it chose to send, and a coefficient above 1 multiplies the weight of exactly the
    low-likelihood samples (a payload) that the sequence ratio holds down. The weight it enters is capped
    at 1 whatever `max_ratio` is (`hacpo_loss`)."""
    p_l = torch.as_tensor(p_learner, dtype=torch.float32).clamp(min=1e-3)
    return (p_src.float() / p_l).clamp(1.0 / CAPABILITY_CLIP, max(max_ratio, 1.0 / CAPABILITY_CLIP))


def hacpo_clip_low(update: int, delta: float = HACPO_DELTA, step: float = HACPO_STEP) -> float:
    """HACPO's stepwise lower bound 1 - delta + k * Delta, at most 1, where k counts the optimizer updates
    made on one step's batch (the reference code's minibatch update index, reset every training step):
    each further update on the same data is held closer to the learner's own distribution."""
    return min(1.0, 1.0 - delta + max(0, update) * step)


def hacpo_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor | float,
    mask: torch.Tensor,
    adv: torch.Tensor,
    coef: torch.Tensor,
    denom: float | None = None,
    clip_low: float | None = None,
    alpha: float = 0.0,
    topr: bool = False,
    ref_hi: torch.Tensor | float | None = None,
    tok_floor: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss for samples of another model (sequence level).

    The importance weight is s = exp(sum_t (logp_learner(y_t) - ref_logp)), truncated at 1 and detached:
    how likely the learner is to write the whole completion, against how likely it is to write one of
    its own of that length. `ref_logp` is a per-token log-prob the receiver holds itself (the trainer
    passes the mean behaviour log-prob of its own recent completions), never the producer's claimed
    log-probs: no receiver can re-score another model's sampling, and a claim of -999 per token would pin
    a claimed ratio at its cap. The sum, not the per-token mean, is the test: a few tokens the learner
    would not write (a payload riding on a correct answer) weigh the completion down by their product,
    where a mean over the whole completion dilutes them.

    HACPO's corrections, each optional (defaults: none, the weight is coef * min(s, 1)):
    - `clip_low` (stepwise clipping): HACPO clips its sequence ratio to [clip_low, 1] with the gradient
      flowing through the ratio, so a sample outside that band gets no gradient at all. The band is on the
      per-token ratio r = s^(1/T), the scale HACPO's ratio is on (a mean log-ratio per token); a sample
      outside it gets weight 0. It is a cut, never a floor: a floor would train a payload-carrying
      completion at weight >= clip_low.
    - `alpha` (exponential importance sampling): times min(r, 1)^alpha, detached.
    - `topr`: a sample with a negative advantage gets TOPR's clip(pi/mu, 0, 1) = min(s, 1) (times coef)
      instead, outside the band and without the alpha power: another model's errors are pushed down in
      proportion to how likely the learner is to make them. Positives keep the weight above (TOPR's full
      weight would rest on nothing but the reward, and a payload rides on correct answers).
    `ref_hi` (per row, or one for all; default `ref_logp`) makes the reference a span [ref_logp, ref_hi]:
    the per-token log-probs the learner's own completions of the prompt had, from the least to the most
    likely. A sample inside the span is one the learner might have written itself, so its ratio is 1, as
    HACPO's is for a source that is the learner; below it the ratios are measured from the span's low end,
    and above it (likelier than anything the learner wrote for the prompt) the band cuts it. Inside the
    span the sum over tokens no longer weighs a sample down, so `tok_floor` (per row, or one for all; NaN
    or None: none) does it token by token: a sample holding a token less likely than any the learner wrote
    in its own answers to the prompt gets weight 0, band or no band. A payload padded with tokens the
    learner is sure of can bring its mean into the span, not its rarest token above the floor.
    The weight is coef * min(s, 1) * ..., capped at 1 whatever coef is: a foreign sample never counts for
    more than one of the learner's own. The per-sample objective is weight * A * mean_t logp_learner, so
    the gradient is length-normalised and bounded by |A|. The loss is the mean over sequences, or their
    sum over `denom` when one is given.
    """
    w, stats = hacpo_weights(logp, ref_logp, mask, adv, coef, clip_low, alpha, topr, ref_hi, tok_floor)
    n_tok = mask.sum(-1).clamp(min=1.0)
    seq_lp = (logp * mask).sum(-1) / n_tok
    obj = w * adv * seq_lp
    valid = (mask.sum(-1) > 0).float()
    n = valid.sum().clamp(min=1.0)
    loss = -(obj * valid).sum() / (n if denom is None else max(float(denom), 1.0))
    return loss, stats


def hacpo_weights(
    logp: torch.Tensor,
    ref_logp: torch.Tensor | float,
    mask: torch.Tensor,
    adv: torch.Tensor,
    coef: torch.Tensor,
    clip_low: float | None = None,
    alpha: float = 0.0,
    topr: bool = False,
    ref_hi: torch.Tensor | float | None = None,
    tok_floor: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached weight of each of another model's samples in `hacpo_loss`, and its stats, from the
    learner's log-probs of them (computed without a graph: a sample of weight 0 needs no backward)."""
    logp = logp.detach()
    n_tok = mask.sum(-1).clamp(min=1.0)
    lo = torch.as_tensor(ref_logp, dtype=logp.dtype).expand(logp.shape[0])  # one reference per row, or one for all
    hi = lo if ref_hi is None else torch.maximum(torch.as_tensor(ref_hi, dtype=logp.dtype).expand_as(lo), lo)
    mean = (logp * mask).sum(-1) / n_tok
    inside = (mean >= lo) & (mean <= hi)
    per_tok = torch.where(inside, torch.zeros_like(mean), mean - lo)  # log of the per-token ratio r
    above = mean > hi
    gap = per_tok * n_tok
    s = torch.exp(gap.clamp(max=MAX_LOG_WEIGHT))
    t = s.clamp(max=1.0)
    w = coef.float() * t
    if alpha:
        w = w * torch.exp(per_tok.clamp(max=0.0) * alpha)
    out = torch.zeros_like(t, dtype=torch.bool)
    if clip_low is not None:
        out = above | (per_tok < math.log(max(clip_low, 1e-12)))
        w = torch.where(out, torch.zeros_like(w), w)
    if topr:
        w = torch.where(adv < 0, coef.float() * t, w)
    if tok_floor is not None:
        floor = torch.as_tensor(tok_floor, dtype=logp.dtype).expand_as(lo)
        rarest = logp.masked_fill(mask <= 0, math.inf).min(-1).values
        w = torch.where(~torch.isnan(floor) & (rarest < floor), torch.zeros_like(w), w)
    w = w.clamp(max=1.0).detach()
    valid = (mask.sum(-1) > 0).float()
    n = valid.sum().clamp(min=1.0)
    return w, {
        "seq_ratio_mean": float((t * valid).sum() / n),
        "seq_ratio_truncated_frac": float(((s > 1).float() * valid).sum() / n),
        "seq_ratio_low_frac": float(((s < HACPO_LOW).float() * valid).sum() / n),
        "foreign_weight_mean": float((w * valid).sum() / n),
        "trust_region_out_frac": float((out.float() * valid).sum() / n),
    }


class CapabilityTracker:
    """Rolling positive-reward rate per source (the learner's lineage, or another model's producer key and
    lineage), for HACPO weights; at most `max_sources` remembered, least recently updated forgotten first.

    `get` is the rate (a source never seen: `prior`); `earned` is the rate scaled by the evidence behind
    it, min(1, rewards seen / `ramp`), so that a key seen for the first time starts at 0 and reaches its
    measured rate only after `ramp` of its rewards. A producer that signs with fresh keys therefore never
    gets more weight than one whose record is measured; a forgotten source starts over."""

    def __init__(
        self, decay: float = 0.95, prior: float = 0.5, max_sources: int = MAX_SOURCES, ramp: int = CAPABILITY_RAMP
    ) -> None:
        self.decay = decay
        self.prior = prior
        self.max_sources = max(1, max_sources)
        self.ramp = max(1, ramp)
        self.rate: dict[bytes, float] = {}
        self.seen: dict[bytes, int] = {}  # rewards seen per source, counted up to `ramp`

    def update(self, source: bytes, rewards: list[float]) -> None:
        p = self.rate.pop(source, self.prior)
        for r in rewards:
            p = self.decay * p + (1 - self.decay) * (1.0 if r > 0 else 0.0)
        self.rate[source] = p  # re-inserted last: the dict's order is least recently updated first
        self.seen[source] = min(self.ramp, self.seen.get(source, 0) + len(rewards))
        while len(self.rate) > self.max_sources:
            gone = next(iter(self.rate))
            del self.rate[gone]
            self.seen.pop(gone, None)

    def get(self, source: bytes) -> float:
        return self.rate.get(source, self.prior)

    def earned(self, source: bytes) -> float:
        return self.get(source) * self.seen.get(source, 0) / self.ramp
