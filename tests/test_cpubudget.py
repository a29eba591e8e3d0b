"""Verification CPU per peer (gossip/cpubudget.py, sans-IO, explicit time): minted keys that stay in debt do
not shrink an honest producer's fair share, and a new key starts with an empty bucket (docs/security.md)."""

from __future__ import annotations

import pytest

from gossip.cpubudget import ACTIVE_S, CpuBudget


def test_keys_whose_batches_keep_being_refused_do_not_dilute_the_fair_share() -> None:
    """64 minted keys each get one costly batch verified, then keep sending while in debt: once their one
    spend is ACTIVE_S old they no longer count, though every later batch of theirs was refused."""
    budget = CpuBudget()
    keys = [f"minted{i}" for i in range(64)]
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
    budget = CpuBudget()
    assert budget.admit("busy", 0.0) is None
    budget.spend("busy", 6.0, 0.0)  # the node's bucket (4 s) is in debt for seconds
    assert budget.admit("fresh", 0.5) is None  # one batch on an empty bucket
    budget.spend("fresh", 0.3, 0.5)
    assert budget.admit("fresh", 0.6) is not None  # then in debt: refused while the node is busy
    assert budget.admit("other-fresh", 0.6) is None  # another new key gets its one batch too
