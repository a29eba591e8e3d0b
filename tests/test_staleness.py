"""Staleness admission: follower pause/catch-up/resume, trainer rejection, AReaL's bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sync.patchstore import StoredItem
from sync.staleness import (FRESH, STALE, UNKNOWN, AReaLAdmission, StalenessGuard, admit_rollout,
                            areal_may_submit, rollout_staleness_error)

L = b"l" * 32


def test_follower_pauses_beyond_bound_and_resumes_after_catch_up() -> None:
    g = StalenessGuard(max_staleness=2)
    assert g.state(L) == UNKNOWN and not g.may_generate(L)
    ev = g.applied(L, 5, now=1.0)
    assert [e.state for e in ev] == [FRESH] and g.may_generate(L)
    assert g.observe_head(L, 7, now=2.0) == []  # 2 behind: still within the bound
    assert g.version_for_generation(L) == 5
    ev = g.observe_head(L, 8, now=3.0)
    assert [e.state for e in ev] == [STALE] and not g.may_generate(L)
    assert "paused" in ev[0].message and g.lag(L) == 3
    assert g.version_for_generation(L) is None
    plan = g.plan_catch_up(L, [StoredItem("patch", v, v + 1, 100) for v in range(5, 8)]
                           + [StoredItem("union", 5, 8, 150)])
    assert plan.kind == "union" and plan.total_bytes == 150
    ev = g.applied(L, 8, now=4.0)
    assert [e.state for e in ev] == [FRESH] and "resumed" in ev[0].message
    snap = g.snapshot()[L.hex()]
    assert snap["state"] == FRESH and snap["lag"] == 0 and snap["head"] == 8


def test_old_heads_do_not_move_the_head_back() -> None:
    g = StalenessGuard(1)
    g.applied(L, 3, 0.0)
    g.observe_head(L, 10, 0.0)
    g.observe_head(L, 4, 0.0)
    assert g.lag(L) == 7 and g.state(L) == STALE


def test_trainer_rejects_stale_and_future_rollouts() -> None:
    assert admit_rollout(8, 10, 2) and admit_rollout(10, 10, 0)
    assert not admit_rollout(7, 10, 2)
    assert "behind" in (rollout_staleness_error(7, 10, 2) or "")
    assert "ahead" in (rollout_staleness_error(11, 10, 2) or "")


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 10))
def test_admit_matches_definition(v: int, head: int, k: int) -> None:
    assert admit_rollout(v, head, k) == (v <= head and head - v <= k)


def test_areal_rule() -> None:
    # eta=0, v=0, B=4: at most 4 accepted+running at version 0
    assert areal_may_submit(8, 3, 0, 0, 4, 0)
    assert not areal_may_submit(8, 4, 0, 0, 4, 0)
    assert not areal_may_submit(8, 2, 0, 0, 4, 2)
    assert areal_may_submit(8, 2, 1, 0, 4, 2)  # eta=1 allows a batch more
    assert not areal_may_submit(3, 3, 5, 5, 4, 0)  # capacity C bound


def test_areal_admission_never_exceeds_staleness_budget() -> None:
    a = AReaLAdmission(eta=1, batch=4, max_in_flight=6)
    started = 0
    for _ in range(100):
        if not a.try_submit():
            break
        started += 1
    assert started == 6  # capacity-bound first
    for _ in range(6):
        a.finished(accepted=True)
    assert sum(a.try_submit() for _ in range(100)) == 2  # (1+0+1)*4 - 6 accepted
    a.set_version(1)
    assert a.may_submit()
    with pytest.raises(ValueError):
        a.set_version(0)
