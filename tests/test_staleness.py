"""Staleness admission: a follower pauses beyond the bound and resumes after catching up."""

from __future__ import annotations

from sync.staleness import FRESH, STALE, UNKNOWN, StalenessGuard

L = b"l" * 32


def test_follower_pauses_beyond_bound_and_resumes_after_catch_up() -> None:
    g = StalenessGuard(max_staleness=2)
    assert not g.may_generate(L)
    assert g.observe_head(L, 5, now=0.5) == []  # a head but nothing held: still unknown
    ev = g.applied(L, 5, now=1.0)
    assert [(e.previous, e.state) for e in ev] == [(UNKNOWN, FRESH)] and g.may_generate(L)
    assert g.observe_head(L, 7, now=2.0) == []  # 2 behind: still within the bound
    ev = g.observe_head(L, 8, now=3.0)
    assert [e.state for e in ev] == [STALE] and not g.may_generate(L)
    assert "paused" in ev[0].message and "3 versions behind" in ev[0].message
    ev = g.applied(L, 8, now=4.0)
    assert [e.state for e in ev] == [FRESH] and "resumed" in ev[0].message and g.may_generate(L)


def test_old_heads_do_not_move_the_head_back() -> None:
    g = StalenessGuard(1)
    g.applied(L, 3, 0.0)
    assert [e.state for e in g.observe_head(L, 10, 0.0)] == [STALE]
    assert g.observe_head(L, 4, 0.0) == []  # an older head changes nothing
    assert not g.may_generate(L)
    assert [e.state for e in g.applied(L, 9, 0.0)] == [FRESH]
