"""Role choice and the capacity rule (sans-IO)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.gossip.errors import ConfigError
from murmur.node.core import roles
from murmur.node.core.roles import (
    Demand,
    LineageOption,
    Offer,
    activate,
    choose_lineage,
    choose_roles,
    fits_staleness,
    required_rate,
)

GB = 2**30


def test_configured_roles_win_and_are_checked() -> None:
    assert choose_roles(["follower", "validator"], "gpu-large", 65536, 64 * GB)[0] == ["follower", "validator"]
    with pytest.raises(ConfigError):
        choose_roles(["trainer", "follower"], "cpu", 4096, 8 * GB)
    with pytest.raises(ConfigError):
        choose_roles(["miner"], "cpu", 4096, 8 * GB)


def test_roles_follow_hardware() -> None:
    assert choose_roles([], "cpu", 4096, 16 * GB)[0] == ["trainer"]
    assert choose_roles([], "gpu-small", 8192, 32 * GB)[0] == ["trainer", "validator"]
    # a small budget, or little free memory, makes a follower
    assert choose_roles([], "cpu", 1024, 16 * GB)[0] == ["follower", "validator"]
    assert choose_roles([], "gpu-large", 8192, 1 * GB)[0] == ["follower", "validator"]
    with pytest.raises(ConfigError):
        choose_roles([], "tpu", 4096, 16 * GB)


def test_hardware_class() -> None:
    assert roles.Hardware(8, 16 * GB).klass == "cpu"
    assert roles.Hardware(8, 16 * GB, "RTX 4090", 24 * GB).klass == "gpu-small"
    assert roles.Hardware(8, 16 * GB, "H200", 141 * GB).klass == "gpu-large"


def test_staleness_inequality() -> None:
    d = Demand(rollouts_per_step=32, step_time_s=2.0, max_staleness=4)
    # kappa 1 + ceil((D + G) / T_L) <= 4  <=>  D + G <= 6 s
    assert fits_staleness(d, latency_s=5.0, dissemination_s=1.0)
    assert not fits_staleness(d, latency_s=5.5, dissemination_s=1.0)
    assert roles.staleness_versions(d, 0.0, 0.0) == 1


def test_activation_cheapest_first_until_met_rest_standby() -> None:
    d = Demand(rollouts_per_step=20, step_time_s=2.0, max_staleness=4)  # need 1.2 * 10 = 12 rollouts/s
    offers = [
        Offer("slow", 2.0, 1.0),
        Offer("fast", 8.0, 1.0),
        Offer("mid", 5.0, 1.0),
        Offer("extra", 4.0, 1.0),
        Offer("laggy", 50.0, 30.0),
    ]
    act = activate(d, offers)
    assert act.need == pytest.approx(12.0)
    assert act.active == ["fast", "mid"]  # 8 + 5 = 13 >= 12
    assert act.met
    assert sorted(act.standby) == ["extra", "slow"]
    assert "laggy" in act.rejected and "stale" in act.rejected["laggy"]


def test_activation_cost_aware() -> None:
    d = Demand(rollouts_per_step=10, step_time_s=1.0, max_staleness=4)  # need 12/s
    # an expensive fast GPU loses to two cheap nodes that suffice together
    act = activate(d, [Offer("gpu", 20.0, 0.5, cost=10.0), Offer("a", 7.0, 0.5), Offer("b", 7.0, 0.5)])
    assert act.active == ["a", "b"] and act.standby == ["gpu"]


def test_activation_unmet_keeps_everyone() -> None:
    d = Demand(rollouts_per_step=100, step_time_s=1.0, max_staleness=4)
    act = activate(d, [Offer("a", 3.0, 0.1), Offer("b", 2.0, 0.1)])
    assert not act.met and act.active == ["a", "b"] and act.standby == []


def test_follower_picks_largest_unmet_demand() -> None:
    me = Offer("me", 5.0, 1.0)
    a = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=11.0)  # need 12: 1 short
    b = LineageOption(b"B" * 32, Demand(20, 1.0, 4), supply_by_others=4.0)  # need 24: 20 short
    c = choose_lineage(me, [a, b])
    assert c.lineage == b"B" * 32 and "unmet" in c.reason


def test_follower_skips_lineage_whose_bound_it_would_break() -> None:
    me = Offer("me", 5.0, latency_s := 9.0)
    tight = LineageOption(b"T" * 32, Demand(100, 1.0, 2), supply_by_others=0.0)  # 1 + ceil(9/1) = 10 > 2
    loose = LineageOption(b"L" * 32, Demand(4, 10.0, 4), supply_by_others=0.0)  # 1 + ceil(9/10) = 2 <= 4
    assert latency_s == 9.0
    assert choose_lineage(me, [tight, loose]).lineage == b"L" * 32
    c = choose_lineage(me, [tight])
    assert c.lineage is None and "stale" in c.reason


def test_follower_on_standby_list_stands_by() -> None:
    me = Offer("me", 5.0, 1.0)
    opt = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=20.0, standby=("me",))
    c = choose_lineage(me, [opt])
    assert c.lineage is None and "stand by" in c.reason


def test_follower_sticks_to_current_on_ties_and_honours_configured() -> None:
    me = Offer("me", 5.0, 1.0)
    a = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=0.0)
    b = LineageOption(b"B" * 32, Demand(10, 1.0, 4), supply_by_others=0.0)
    assert choose_lineage(me, [a, b], current=b"A" * 32).lineage == b"A" * 32
    assert choose_lineage(me, [a, b], current=b"B" * 32).lineage == b"B" * 32
    assert choose_lineage(me, [a, b], configured=[b"B" * 32]).lineage == b"B" * 32
    assert choose_lineage(me, []).lineage is None


def test_follower_does_not_flap_for_a_small_gain() -> None:
    me = Offer("me", 5.0, 1.0)
    a = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=0.0)  # unmet 12
    b = LineageOption(b"B" * 32, Demand(11, 1.0, 4), supply_by_others=0.0)  # unmet 13.2: not worth a move
    assert choose_lineage(me, [a, b], current=b"A" * 32).lineage == b"A" * 32
    c = LineageOption(b"C" * 32, Demand(30, 1.0, 4), supply_by_others=0.0)  # unmet 36: clearly worth it
    assert choose_lineage(me, [a, c], current=b"A" * 32).lineage == b"C" * 32


_offer = st.builds(
    lambda i, claim, backed, cost, latency: (i, claim, backed, cost, latency),
    st.integers(0, 10**6),
    st.floats(0.0, 1e4, allow_nan=False),
    st.one_of(st.none(), st.floats(-10.0, 1e4, allow_nan=False)),
    st.floats(0.1, 10.0),
    st.floats(0.0, 20.0),
)


@settings(max_examples=150, deadline=None)
@given(
    offers=st.lists(_offer, max_size=8),
    rollouts=st.integers(0, 256),
    step=st.floats(0.1, 60.0),
    trial=st.floats(0.0, 1.0),
)
def test_the_supply_counted_for_followers_never_exceeds_their_claims(
    offers: list, rollouts: int, step: float, trial: float
) -> None:
    d = Demand(rollouts_per_step=rollouts, step_time_s=step, max_staleness=4)
    os_ = [
        Offer(f"p{i}-{n}", claim, latency, cost, backed) for n, (i, claim, backed, cost, latency) in enumerate(offers)
    ]
    act = activate(d, os_, trial_share=trial)
    by_id = {o.peer_id: o for o in os_}
    active = [by_id[p] for p in act.active]
    assert act.supply <= sum(o.rollouts_per_s for o in active) * (1 + 1e-12)
    for p, counted in act.capped.items():
        assert 0.0 <= counted < by_id[p].rollouts_per_s
    # what no delivery backs counts for the trial share of the need at most, however many claim it
    backed = sum(
        min(o.rollouts_per_s, max(0.0, o.backed)) if o.backed is not None else o.rollouts_per_s for o in active
    )
    assert act.supply <= backed + trial * required_rate(d) + 1e-9


def test_claims_no_delivery_backs_share_one_trial_credit() -> None:
    d = Demand(rollouts_per_step=64, step_time_s=2.0, max_staleness=4)
    need = required_rate(d)
    minted = [Offer(f"minted{i}", 1e9, 0.5, 1.0, backed=0.0) for i in range(8)]
    act = activate(d, minted, trial_share=0.25)
    assert act.supply == pytest.approx(0.25 * need) and not act.met
    assert sum(act.capped.values()) == pytest.approx(0.25 * need)
    # a follower whose delivery backs its claim is counted for all of it, beside the minted keys
    honest = Offer("honest", need, 0.5, 1.0, backed=need)
    act = activate(d, [*minted, honest], trial_share=0.25)
    assert "honest" in act.active and act.met and act.supply <= need + 0.25 * need + 1e-9


def test_the_role_and_hardware_thresholds_are_inclusive() -> None:
    assert roles.Hardware(8, 16 * GB, "A100", roles.GPU_LARGE_BYTES).klass == "gpu-large"
    assert roles.Hardware(8, 16 * GB, "A100", roles.GPU_LARGE_BYTES - 1).klass == "gpu-small"
    assert choose_roles([], "cpu", roles.TRAINER_MIN_BUDGET_MB, 16 * GB)[0] == ["trainer"]
    assert choose_roles([], "cpu", roles.TRAINER_MIN_BUDGET_MB - 1, 16 * GB)[0] == ["follower", "validator"]


def test_offer_rate_divides_by_at_least_one_token() -> None:
    assert roles.offer_rate(100.0, 50.0) == 2.0
    assert roles.offer_rate(100.0, 0.0) == 100.0


@pytest.mark.parametrize("step", [0.0, -1.0, float("nan"), float("inf")])
def test_no_demand_without_a_measured_finite_step(step: float) -> None:
    assert required_rate(Demand(rollouts_per_step=32, step_time_s=step, max_staleness=4)) == 0.0
    assert required_rate(Demand(rollouts_per_step=0, step_time_s=2.0, max_staleness=4)) == 0.0
    assert required_rate(Demand(rollouts_per_step=32, step_time_s=2.0, max_staleness=4)) == pytest.approx(1.2 * 16)


def test_a_step_too_short_to_divide_by_gives_no_demand_and_no_lag() -> None:
    tiny = Demand(rollouts_per_step=32, step_time_s=5e-324, max_staleness=4)  # 32 / 5e-324 overflows to inf
    assert required_rate(tiny) == 0.0
    assert required_rate(Demand(rollouts_per_step=32, step_time_s=2.0, max_staleness=4), margin=float("nan")) == 0.0
    unmeasured = Demand(rollouts_per_step=32, step_time_s=0.0, max_staleness=4, publish_every=2)
    assert roles.staleness_versions(unmeasured, latency_s=1.0, dissemination_s=1.0) == 2
    assert roles.staleness_versions(tiny, latency_s=1.0, dissemination_s=1.0) == 2**31  # "too stale", no overflow


def test_a_lag_at_or_past_2_31_or_not_a_number_is_too_stale() -> None:
    d = Demand(rollouts_per_step=32, step_time_s=1.0, max_staleness=4)
    assert roles.staleness_versions(d, latency_s=float(2**31), dissemination_s=0.0) == 2**31
    assert roles.staleness_versions(d, latency_s=float("nan"), dissemination_s=0.0) == 2**31
    assert not fits_staleness(d, float("nan"), 0.0)


def test_a_demand_met_exactly_stands_the_next_follower_by() -> None:
    d = Demand(rollouts_per_step=10, step_time_s=1.2, max_staleness=4)  # need: 1.2 * 10 / 1.2 = 10
    need = required_rate(d)
    act = activate(d, [Offer("a", need, 0.5), Offer("b", 5.0, 0.5, cost=2.0)])
    assert act.supply == need and act.met
    assert act.active == ["a"] and act.standby == ["b"]


def test_before_a_step_is_measured_every_follower_stays_active_and_a_zero_claim_is_rejected() -> None:
    unmeasured = Demand(rollouts_per_step=32, step_time_s=0.0, max_staleness=4)
    act = activate(unmeasured, [Offer("a", 5.0, 0.5), Offer("b", 5.0, 0.5), Offer("zero", 0.0, 0.5)])
    assert required_rate(unmeasured) == 0.0
    assert act.active == ["a", "b"] and act.standby == [] and act.supply == 10.0
    assert act.rejected == {"zero": "no measured throughput yet"}


def test_a_move_must_gain_more_than_the_followers_own_rate_or_a_tenth_of_the_new_need() -> None:
    a = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=12.0)  # need 12: met
    # a tenth of B's need (10 of 100) is the larger threshold: 8 more unmet is not worth a move, 11 is
    b8 = LineageOption(b"B" * 32, Demand(100, 1.2, 4), supply_by_others=92.0)
    b11 = LineageOption(b"B" * 32, Demand(100, 1.2, 4), supply_by_others=89.0)
    slow = Offer("me", 1.0, 0.5)
    assert choose_lineage(slow, [a, b8], current=b"A" * 32).lineage == b"A" * 32
    assert choose_lineage(slow, [a, b11], current=b"A" * 32).lineage == b"B" * 32
    # the follower's own rate (20) is the larger: 15 more unmet is not worth moving its whole supply
    c15 = LineageOption(b"C" * 32, Demand(10, 1.2, 4), supply_by_others=-5.0)
    fast = Offer("me", 20.0, 0.5)
    assert choose_lineage(fast, [a, c15], current=b"A" * 32).lineage == b"A" * 32


def test_the_reason_says_every_demand_is_met_at_a_gap_of_exactly_zero() -> None:
    me = Offer("me", 5.0, 1.0)
    met = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=12.0)
    short = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=11.0)
    assert "every demand met" in choose_lineage(me, [met]).reason
    assert "1.0 rollouts/s short" in choose_lineage(me, [short]).reason


def test_a_gain_of_exactly_the_threshold_is_no_reason_to_move() -> None:
    me = Offer("me", 5.0, 1.0)  # the threshold: max(5, 0.1 x 12) = 5
    a = LineageOption(b"A" * 32, Demand(10, 1.0, 4), supply_by_others=12.0)  # unmet 0
    b = LineageOption(b"B" * 32, Demand(10, 1.0, 4), supply_by_others=7.0)  # unmet 5: exactly the threshold
    assert choose_lineage(me, [a, b], current=b"A" * 32).lineage == b"A" * 32
    b = LineageOption(b"B" * 32, Demand(10, 1.0, 4), supply_by_others=6.5)
    assert choose_lineage(me, [a, b], current=b"A" * 32).lineage == b"B" * 32


def test_the_required_rate_does_not_depend_on_the_staleness_bound() -> None:
    assert required_rate(Demand(rollouts_per_step=32, step_time_s=2.0, max_staleness=0)) == pytest.approx(1.2 * 16)
