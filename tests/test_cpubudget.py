"""Verification CPU per peer (gossip/cpubudget.py, sans-IO, explicit time): keys that stay in debt do not
shrink an honest producer's fair share, and keys without a verified history share one bucket, which starts
empty (docs/security.md)."""

from __future__ import annotations

import math

import pytest

from murmur.gossip.cpubudget import ACTIVE_S, PROVEN_BATCHES, PROVEN_S, RECOUNT_S, CpuBudget


def prove(budget: CpuBudget, *keys: str) -> CpuBudget:
    """Give `keys` a verified history (PROVEN_BATCHES accepted batches, the first PROVEN_S before time 0),
    so each has a share of its own."""
    for k in keys:
        for _ in range(PROVEN_BATCHES):
            budget.verified(k, -PROVEN_S - 1.0)
    return budget


def test_keys_whose_batches_keep_being_refused_do_not_dilute_the_fair_share() -> None:
    """64 minted keys each get one costly batch verified, then keep sending while in debt: once their one
    spend is ACTIVE_S old they no longer count, though every later batch of theirs was refused."""
    keys = [f"minted{i}" for i in range(64)]
    budget = prove(CpuBudget(), "honest", *keys)  # with a history each: unproven keys share one bucket anyway
    for k in keys:  # one batch at the verifier's time limit each (a new key's first is admitted)
        assert budget.admit(k, 0.0) is None
        budget.spend(k, 2.0, 0.0)
    honest_spent = 0
    t = 0.5
    while t <= ACTIVE_S + 2.0:
        assert all(budget.admit(k, t) is not None for k in keys), t
        if budget.admit("honest", t) is None:
            budget.spend("honest", 0.01, t)
            honest_spent += 1
        t += 0.5
    assert honest_spent > 0
    # only the honest producer spent within ACTIVE_S: its share is the per-peer cap, not 1/65 of the node
    assert budget.share(t) == pytest.approx(min(budget.peer_rate, budget.node_rate))


def test_a_new_keys_bucket_starts_empty_even_while_the_node_is_busy() -> None:
    """A key without a history draws on the one bucket all such keys share, which starts empty: one batch,
    then debt; a second fresh key gets no free batch of its own (keys are free to mint)."""
    budget = prove(CpuBudget(), "busy")
    assert budget.admit("busy", 0.0) is None
    budget.spend("busy", 6.0, 0.0)  # the node's bucket (4 s) is in debt for seconds
    assert budget.admit("fresh", 0.5) is None  # one batch on an empty bucket
    budget.spend("fresh", 0.3, 0.5)
    assert budget.admit("fresh", 0.6) is not None  # then in debt: refused while the node is busy
    assert budget.admit("other-fresh", 0.6) is not None  # the same shared bucket: no batch of its own


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, -math.inf])
def test_rates_and_burst_must_be_positive_numbers(bad: float) -> None:
    for kw in ("node_cpu_per_s", "peer_cpu_per_s", "burst_s"):
        with pytest.raises(ValueError):
            CpuBudget(**{kw: bad})
    assert CpuBudget(1e-6, 1e-6, 1e-6).node_rate == 1e-6


def test_the_fair_share_divides_among_peers_that_spent_within_active_s() -> None:
    budget = prove(CpuBudget(node_cpu_per_s=1.0, peer_cpu_per_s=0.5), "a", "b", "c")
    t = 100.0
    assert budget.share(t) == 0.5
    for k in ("a", "b", "c"):
        budget.spend(k, 0.1, t)
    assert budget.share(t + 0.5) == 0.5  # the count is recomputed at most every RECOUNT_S
    assert budget.share(t + RECOUNT_S) == pytest.approx(1 / 3)
    assert budget.share(t + ACTIVE_S) == pytest.approx(1 / 3)  # a spend exactly ACTIVE_S ago still counts
    assert budget.share(t + ACTIVE_S + RECOUNT_S) == 0.5


def test_the_node_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    budget = CpuBudget(node_cpu_per_s=1.0, peer_cpu_per_s=0.5, burst_s=4.0)
    assert budget.admit("a", 0.0) is None
    budget.spend("a", 6.0, 0.0)  # node: 4 - 6 = -2; a: -6
    assert budget.admit("a", 1.0) is not None  # node -1: busy
    assert budget.admit("a", 2.5) is None  # node +0.5: spare capacity, though a is in debt
    # after a long idle time the node holds its burst (4 s), not everything it was owed
    budget.spend("a", 0.5, 2.5)
    assert budget.admit("a", 1000.0) is None
    budget.spend("a", 3.0, 1000.0)  # a: its own burst (2 s) less 3; the node: 4 less 3
    assert budget.admit("a", 1000.0) is None  # a is in debt: the node's spare admits it
    budget.spend("a", 2.0, 1000.0)  # the node: 4 - 5 = -1 (with all it was owed it would not be in debt)
    assert budget.admit("a", 1000.0) is not None


def test_a_peer_in_debt_is_admitted_again_once_its_share_repaid_it_while_the_node_is_busy() -> None:
    budget = prove(CpuBudget(node_cpu_per_s=1.0, peer_cpu_per_s=0.5), "a", "busy")
    budget.spend("a", 1.0, 0.0)
    budget.spend("busy", 10.0, 0.0)  # the node: 4 - 11 = -7 for seconds
    assert budget.admit("a", 1.0) is not None  # a: -1 + 0.5
    assert budget.admit("a", 2.5) is None  # a: -1 + 1.25 > 0 while the node is still in debt


def test_a_node_bucket_at_exactly_zero_is_not_in_debt() -> None:
    budget = CpuBudget(node_cpu_per_s=1.0, burst_s=4.0)
    budget.spend("a", 4.0, 0.0)  # the node's whole burst: 0 left, a: -4
    assert budget.admit("a", 0.0) is None


@pytest.mark.parametrize("cost", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_a_cost_that_is_not_a_positive_number_is_not_spent(cost: float) -> None:
    budget = CpuBudget(node_cpu_per_s=1.0, peer_cpu_per_s=1.0)
    budget.spend("a", cost, 0.0)
    budget.spend("b", 0.1, 0.0)
    assert budget.spent_s == pytest.approx(0.1)
    assert budget.share(0.0) == 1.0  # a does not count as active: b alone
    assert budget.admit("a", 0.0) is None and budget.admit("c", 0.0) is None
