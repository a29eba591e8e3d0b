"""Role choice and the capacity rule (sans-IO: pure functions of announces and a clock reading).

Roles start from the hardware: a node that can hold a trainable copy of the
model within its memory budget may train its own lineage; weaker nodes follow a
stronger node's lineage and generate rollouts for it; GPU nodes also validate.
A node that may train and has no configured roles then chooses by the swarm's
need (`want_mode`, `PodRule`): it generates for a published lineage that is
short of rollouts and trains its own when every lineage's demand is met, so
nodes that start alike form pods (a trainer and its followers) rather than
lone lineages; it switches at most once a dwell.

The capacity rule (docs/architecture.md, after ECHO-2): a trainer needing B
rollouts per version, a version every T_L seconds, staleness bound S, needs a
supply `sum(lambda_i) >= (1+m) * B / T_L` from followers whose rollouts arrive
in time: `1 + ceil((D + G_i) / T_L) <= S` (D: dissemination latency of a
version, G_i: the follower's rollout latency). Cost-aware activation adds
followers in order of cost/lambda until the supply holds, skips those whose
latency breaks the bound, and tells the rest to stand by. A lambda is a claim:
the trainer counts it only as far as observed delivery backs it (`Offer.backed`,
from `node.core.credit`). A follower picks the
lineage with the largest unmet demand among those it can serve in time.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from murmur.gossip.errors import ConfigError
from murmur.node.core import credit

ROLES = ("trainer", "follower", "validator")
HARDWARE_CLASSES = ("cpu", "gpu-small", "gpu-large")
# A trainer holds the model, its fp32 master copy, Adam state and activations: about 4x
# what a generation-only copy needs. Below this budget a node follows instead.
TRAINER_MIN_BUDGET_MB = 1536
GPU_LARGE_BYTES = 40 * 2**30
DEFAULT_MARGIN = 0.2


@dataclass(frozen=True)
class Hardware:
    cpu_count: int
    memory_bytes: int
    gpu_name: str = ""
    gpu_memory_bytes: int = 0

    @property
    def klass(self) -> str:
        if not self.gpu_name:
            return "cpu"
        return "gpu-large" if self.gpu_memory_bytes >= GPU_LARGE_BYTES else "gpu-small"


def check_roles(roles: Iterable[str]) -> list[str]:
    out = list(dict.fromkeys(roles))
    bad = [r for r in out if r not in ROLES]
    if bad:
        raise ConfigError(f"node.roles: unknown role(s) {', '.join(bad)} (choose from {', '.join(ROLES)})")
    if "trainer" in out and "follower" in out:
        raise ConfigError("node.roles: a node is either the trainer of its own lineage or a follower of another")
    return out


def choose_roles(
    configured: Sequence[str], hardware_class: str, memory_budget_mb: int, memory_available_bytes: int
) -> tuple[list[str], str]:
    """(roles, why). Configured roles win; otherwise the hardware and the memory budget decide."""
    if configured:
        return check_roles(configured), "configured"
    if hardware_class not in HARDWARE_CLASSES:
        raise ConfigError(f"node.hardware: {hardware_class!r} is not one of auto, {', '.join(HARDWARE_CLASSES)}")
    usable_mb = min(memory_budget_mb, memory_available_bytes // 2**20)
    if usable_mb < TRAINER_MIN_BUDGET_MB:
        return ["follower", "validator"], (
            f"{usable_mb} MiB usable < {TRAINER_MIN_BUDGET_MB} MiB for training: follow a stronger node's lineage"
        )
    if hardware_class.startswith("gpu"):
        return ["trainer", "validator"], f"{hardware_class}: train own lineage and spot-check rollouts"
    return ["trainer"], f"cpu with {usable_mb} MiB usable: train own lineage (swarm sampling)"


def chooses_mode(configured: Sequence[str], node_roles: Sequence[str]) -> bool:
    """Whether the node trains or follows by the swarm's need (`PodRule`): no configured roles, and the
    hardware lets it train."""
    return not configured and "trainer" in node_roles


# ---------------------------------------------------------------- capacity rule


@dataclass(frozen=True)
class Offer:
    """A follower's capacity, from its NodeAnnounce."""

    peer_id: str
    rollouts_per_s: float  # lambda_i
    rollout_latency_s: float  # G_i (p95)
    cost: float = 1.0  # relative cost of activating it (e.g. energy, a paid GPU)
    # What observed delivery backs of the claim (node.core.credit); None: the claim counts in full
    # (a follower weighing other followers' announces, which it cannot observe).
    backed: float | None = None


@dataclass(frozen=True)
class Demand:
    """A trainer's need, from the LineageDemand in its NodeAnnounce (step = one published version)."""

    rollouts_per_step: int  # B
    step_time_s: float  # T_L
    max_staleness: int  # S
    publish_every: int = 1  # kappa, in versions (1: every version is published)


def offer_rate(gen_tokens_per_s: float, tokens_per_rollout: float) -> float:
    """Rollouts per second from measured generation throughput."""
    return gen_tokens_per_s / max(1.0, tokens_per_rollout)


def required_rate(d: Demand, margin: float = DEFAULT_MARGIN) -> float:
    """(1+m) * B / T_L rollouts per second; 0 when the trainer has not measured a step yet."""
    if not d.step_time_s > 0 or d.rollouts_per_step <= 0:
        return 0.0
    rate = (1.0 + margin) * d.rollouts_per_step / d.step_time_s
    return rate if math.isfinite(rate) else 0.0


def staleness_versions(d: Demand, latency_s: float, dissemination_s: float) -> int:
    """Versions a rollout lags the head when it arrives: kappa + ceil((D + G) / T_L)."""
    if d.step_time_s <= 0:
        return d.publish_every
    lag = (dissemination_s + latency_s) / d.step_time_s
    # a tiny or non-finite step time from the network must not overflow ceil: any lag past 2^31 is "too stale"
    if not lag < 2**31:
        return 2**31
    return d.publish_every + math.ceil(lag)


def fits_staleness(d: Demand, latency_s: float, dissemination_s: float) -> bool:
    return staleness_versions(d, latency_s, dissemination_s) <= d.max_staleness


@dataclass
class Activation:
    need: float  # rollouts/s required
    supply: float = 0.0  # rollouts/s of the active followers
    active: list[str] = field(default_factory=list)
    standby: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    capped: dict[str, float] = field(default_factory=dict)  # active followers whose claim counted only this much

    @property
    def met(self) -> bool:
        return self.supply >= self.need


def activate(
    d: Demand,
    offers: Iterable[Offer],
    dissemination_s: float = 0.0,
    margin: float = DEFAULT_MARGIN,
    trial_share: float = credit.TRIAL_SHARE,
) -> Activation:
    """Cost-aware activation: cheapest per rollout first until the demand is met; the rest stand by.

    An offer with `backed` counts for its claim only up to what delivery backs, plus a share of one
    trial credit (`trial_share` of the need) that all such offers draw from in turn: claims no
    delivery backs never meet more than that share of the demand, however large or many they are.
    """
    act = Activation(need=required_rate(d, margin))
    trial = max(0.0, trial_share * act.need)

    def believable(o: Offer) -> float:
        return o.rollouts_per_s if o.backed is None else min(o.rollouts_per_s, o.backed + trial)

    ranked = sorted(offers, key=lambda o: (o.cost / believable(o) if believable(o) > 0 else math.inf, o.peer_id))
    for o in ranked:
        if o.rollouts_per_s <= 0:
            act.rejected[o.peer_id] = "no measured throughput yet"
            continue
        if not fits_staleness(d, o.rollout_latency_s, dissemination_s):
            lag = staleness_versions(d, o.rollout_latency_s, dissemination_s)
            act.rejected[o.peer_id] = (
                f"latency {o.rollout_latency_s:.1f} s -> {lag} versions stale > bound {d.max_staleness}"
            )
            continue
        if act.need > 0 and act.met:
            act.standby.append(o.peer_id)
            continue
        act.active.append(o.peer_id)
        counted = o.rollouts_per_s
        if o.backed is not None:
            base = min(o.rollouts_per_s, max(0.0, o.backed))
            extra = min(o.rollouts_per_s - base, trial)
            trial -= extra
            counted = base + extra
            if counted < o.rollouts_per_s:
                act.capped[o.peer_id] = counted
        act.supply += counted
    return act


@dataclass(frozen=True)
class LineageOption:
    """A lineage a follower could serve, as the follower sees it."""

    lineage: bytes
    demand: Demand
    supply_by_others: float  # rollouts/s its trainer counts from other followers (its signed demand)
    standby: tuple[str, ...] = ()  # peers its trainer told to stand by


@dataclass(frozen=True)
class Choice:
    lineage: bytes | None
    reason: str


def choose_lineage(
    me: Offer,
    options: Iterable[LineageOption],
    dissemination_s: float = 0.0,
    current: bytes | None = None,
    margin: float = DEFAULT_MARGIN,
    configured: Sequence[bytes] = (),
) -> Choice:
    """Which lineage this follower serves, and why (shown on the dashboard).

    Only lineages it can serve within their staleness bound are eligible, and
    those whose trainer put it on standby are skipped. Among the eligible, the
    one with the largest unmet demand wins; staying on `current` wins ties, so
    followers do not flap. With `configured` lineages, only those are eligible.
    """
    opts = [o for o in options if not configured or o.lineage in configured]
    if not opts:
        return Choice(
            None, "no trainer lineage announced yet" if not configured else "configured lineage not announced yet"
        )
    eligible, why_not = [], []
    for o in opts:
        name = o.lineage.hex()[:8]
        if not fits_staleness(o.demand, me.rollout_latency_s, dissemination_s):
            lag = staleness_versions(o.demand, me.rollout_latency_s, dissemination_s)
            why_not.append(f"{name}: my latency would be {lag} versions stale > {o.demand.max_staleness}")
        elif me.peer_id in o.standby:
            why_not.append(f"{name}: trainer's demand is met, told to stand by")
        else:
            eligible.append(o)
    if not eligible:
        return Choice(None, "standby: " + "; ".join(why_not))

    def unmet(o: LineageOption) -> float:
        return required_rate(o.demand, margin) - o.supply_by_others

    best = max(eligible, key=lambda o: (round(unmet(o), 6), o.lineage == current, o.lineage))
    cur = next((o for o in eligible if o.lineage == current), None)
    if cur is not None and best is not cur:
        # hysteresis: moving costs a catch-up and takes our own supply from `cur`; switch only for a clear gain
        if unmet(best) <= unmet(cur) + max(me.rollouts_per_s, 0.1 * required_rate(best.demand, margin)):
            best = cur
    gap = unmet(best)
    if gap > 0:
        reason = f"largest unmet demand: {gap:.1f} rollouts/s short"
    else:
        reason = "every demand met; serving the least over-supplied lineage"
    if len(eligible) == 1 and len(opts) == 1:
        reason = "only lineage announced; " + reason
    return Choice(best.lineage, reason)


# ---------------------------------------------------------------- pods by default: train or generate

# A node whose roles come from its hardware (none configured) and that may train starts as a trainer, watches
# the swarm this long, then trains or follows by the swarm's need; after that it switches at most once a dwell.
ROLE_OBSERVE_S = 60.0
ROLE_DWELL_S = 300.0
# Each node's dwell is stretched by its own fraction (from its key) of this much: nodes that started together
# decide at different times, so each sees what those before it chose.
ROLE_JITTER = 0.5
# A trainer follows a lineage only if what it lacks is at least this share of what the trainer would generate.
FOLLOW_SHARE = 0.25


@dataclass(frozen=True)
class PodOption:
    """A published lineage (a signed manifest of it was accepted) as a node that may train sees it.

    `demand`: its publisher's signed demand, its step time no shorter than the signed versions' cadence
    (`node.core.lineages.LineageTable.effective_demand`); `supply`: the supply its publisher signs (followers'
    claims capped by their verified delivery), less this node's own share; `standby`: its publisher told
    this node to stand by; `reward`: the mean verified reward of its rollouts this node saw
    (`node.core.rewards`), None before any. Nothing a follower says of itself enters."""

    lineage: bytes
    demand: Demand
    supply: float
    standby: bool = False
    reward: float | None = None


def seen_reward(reward: float | None) -> float:
    """A lineage's verified reward for ordering: one whose work this node never verified comes last."""
    return -1.0 if reward is None else reward


class Wanted(NamedTuple):
    """`want_mode`'s answer: the mode, why, and (to follow) the lineage it would serve."""

    mode: str
    why: str
    lineage: bytes | None = None


@dataclass(frozen=True)
class Quality:
    """Held-out greedy accuracy that this node measured itself on weights it holds, and over how many tasks:
    no peer's word enters it."""

    accuracy: float
    tasks: int


def not_worse(candidate: Quality, own: Quality) -> bool:
    """Whether weights measured at `candidate` are not measurably worse than our own at `own`: at most one
    standard error of the difference below. A node leaving its lineage for another gives up its own weights
    for that lineage's, so it takes only weights at least as good (a fast-stepping, worse lineage asks for the
    most rollouts and would draw the best nodes to it). With either side unmeasured, nothing is known: it passes."""
    if own.tasks <= 0 or candidate.tasks <= 0:
        return True
    if not (0.0 <= candidate.accuracy <= 1.0 and 0.0 <= own.accuracy <= 1.0):
        return False
    var = (
        candidate.accuracy * (1 - candidate.accuracy) / candidate.tasks + own.accuracy * (1 - own.accuracy) / own.tasks
    )
    return candidate.accuracy >= own.accuracy - math.sqrt(var)


def pod_unmet(o: PodOption, margin: float = DEFAULT_MARGIN) -> float:
    return required_rate(o.demand, margin) - max(0.0, o.supply)


def want_mode(
    mode: str,
    options: Iterable[PodOption],
    me: Offer,
    own: tuple[float | None, bytes] | None,
    own_supply: float = 0.0,
    dissemination_s: float = 0.0,
    margin: float = DEFAULT_MARGIN,
    refused: Collection[bytes] = (),
) -> Wanted:
    """What a node able to train should be, why, and the lineage it would serve, from what it observes now.

    It follows while a lineage it can serve within the staleness bound, and was not told to stand by for,
    has unmet demand (a trainer: at least `FOLLOW_SHARE` of its own generation rate); it trains when every
    such lineage's demand is met. A trainer whose own lineage has
    followers (`own_supply`, what its activation counts) keeps its pod; and a trainer follows only a lineage
    whose rollouts it verified scoring above its own (`own`: its own lineage's verified reward and id; ties
    by id), so trainers that start together never all leave their lineages on the same evidence: the one
    whose policy scores best keeps training. Of the lineages it could follow it takes the best scoring
    (then the shortest of rollouts). The score only orders: lineages it `refused` (their weights, on trial,
    measured worse than its own: `not_worse`, `PodRule.refuse`) are not options.
    """
    # a trainer leaves its lineage only for a gap worth a share of what it would generate: a publisher whose
    # signed versions come slowly asks for little (its demand is bounded by their cadence) and pulls no one
    floor = FOLLOW_SHARE * me.rollouts_per_s if mode == "trainer" else 0.0
    best: tuple[float, PodOption] | None = None
    for o in options:
        gap = pod_unmet(o, margin)
        if gap <= max(floor, 1e-9) or o.standby or o.lineage in refused:
            continue
        if not fits_staleness(o.demand, me.rollout_latency_s, dissemination_s):
            continue
        if (
            mode == "trainer"
            and own is not None
            and (seen_reward(o.reward), o.lineage) <= (seen_reward(own[0]), own[1])
        ):
            continue
        rank = (seen_reward(o.reward), gap, o.lineage)
        if best is None or rank > (seen_reward(best[1].reward), best[0], best[1].lineage):
            best = (gap, o)
    if mode == "trainer" and own_supply > 0:
        return Wanted("trainer", f"my lineage has followers ({own_supply:.1f} rollouts/s): keep training it")
    if best is not None:
        why = f"lineage {best[1].lineage.hex()[:8]} is {best[0]:.1f} rollouts/s short: generate for it"
        return Wanted("follower", why, best[1].lineage)
    return Wanted("trainer", "no published lineage I can serve in time is short of rollouts: train my own")


class PodRule:
    """The mode of a node able to train whose roles are not configured (sans-IO: `now` passed in).

    The first decision comes `observe_s` after start; after a switch the node stays `dwell_s` (stretched by
    its `jitter` in [0, 1) times `ROLE_JITTER`) in its mode, however the announces it hears change: it
    switches at most once a dwell. `reason` says why it is in its mode (and when it may leave it).
    """

    def __init__(
        self,
        mode: str,
        now: float,
        observe_s: float = ROLE_OBSERVE_S,
        dwell_s: float = ROLE_DWELL_S,
        jitter: float = 0.0,
    ) -> None:
        if mode not in ("trainer", "follower"):
            raise ValueError(f"mode {mode!r}")
        self.mode = mode
        self.stretch = 1.0 + ROLE_JITTER * min(max(jitter, 0.0), 1.0)
        self.dwell_s = max(0.0, dwell_s)
        self.since = now
        self.next_at = now + max(0.0, observe_s) * self.stretch
        self.switches = 0
        self.reason = f"{mode} from the hardware; watching the swarm before choosing"
        self.refusals: dict[bytes, float] = {}  # lineage -> until when it is no option (`refuse`)

    def refused(self, now: float) -> set[bytes]:
        """The lineages refused within a dwell of `now`: `want_mode` passes them over."""
        return {lin for lin, until in self.refusals.items() if until > now}

    def refuse(self, lineage: bytes, now: float, why: str) -> str | None:
        """`lineage`'s weights measured worse than this node's own (`not_worse`): it is no option for a dwell.
        A trainer stays one (None); a follower on trial of it goes back to its own lineage at once ("trainer"),
        a switch that counts and starts a dwell, so a node leaves and returns at most once a dwell."""
        self.refusals = {lin: until for lin, until in self.refusals.items() if until > now}
        self.refusals[lineage] = now + self.dwell_s * self.stretch
        return self._switch("trainer", now, why) if self.mode == "follower" else None

    def step(self, now: float, wanted: tuple[str, str] | Wanted) -> str | None:
        """Feed `want_mode`'s answer at `now`: the new mode when the node switches now, else None."""
        mode, why = wanted[0], wanted[1]
        if mode == self.mode:
            watching = not self.switches and now < self.next_at
            self.reason = f"{why} (watching the swarm: first choice in {self.next_at - now:.0f} s)" if watching else why
            return None
        if now < self.next_at:
            self.reason = f"{why} (in {self.next_at - now:.0f} s: a node keeps its mode {self.dwell_s:.0f} s)"
            return None
        return self._switch(mode, now, why)

    def _switch(self, mode: str, now: float, why: str) -> str:
        """Enter `mode` at `now`, for at least a dwell."""
        self.mode, self.since, self.reason = mode, now, why
        self.next_at = now + self.dwell_s * self.stretch
        self.switches += 1
        return mode


def switch_roles(roles: Sequence[str], mode: str) -> list[str]:
    """`roles` with trainer/follower set to `mode`; validator kept as it was."""
    return [mode] + [r for r in roles if r not in ("trainer", "follower")]
