"""Staleness admission: a follower pauses beyond the bound and resumes after catching up."""

from __future__ import annotations

import dataclasses

import pytest

from murmur.sync.staleness import Admission, StalenessEvent, StalenessGuard

L = b"l" * 32


def test_follower_pauses_beyond_bound_and_resumes_after_catch_up() -> None:
    g = StalenessGuard(max_staleness=2)
    assert not g.may_generate(L)
    assert g.observe_head(L, 5, now=0.5) == []  # a head but nothing held: still unknown
    ev = g.applied(L, 5, now=1.0)
    assert [(e.previous, e.state) for e in ev] == [(Admission.UNKNOWN, Admission.FRESH)] and g.may_generate(L)
    assert g.observe_head(L, 7, now=2.0) == []  # 2 behind: still within the bound
    ev = g.observe_head(L, 8, now=3.0)
    assert [e.state for e in ev] == [Admission.STALE] and not g.may_generate(L)
    assert "paused" in ev[0].message and "3 versions behind" in ev[0].message
    ev = g.applied(L, 8, now=4.0)
    assert [e.state for e in ev] == [Admission.FRESH] and "resumed" in ev[0].message and g.may_generate(L)


def test_old_heads_do_not_move_the_head_back() -> None:
    g = StalenessGuard(1)
    g.applied(L, 3, 0.0)
    assert [e.state for e in g.observe_head(L, 10, 0.0)] == [Admission.STALE]
    assert g.observe_head(L, 4, 0.0) == []  # an older head changes nothing
    assert not g.may_generate(L)
    assert [e.state for e in g.applied(L, 9, 0.0)] == [Admission.FRESH]


def test_the_bound_is_inclusive_and_zero_means_the_head_only() -> None:
    g = StalenessGuard(max_staleness=0)
    assert [e.state for e in g.applied(L, 4, 1.0)] == [Admission.FRESH]
    assert [e.state for e in g.observe_head(L, 5, 2.0)] == [Admission.STALE]  # one behind is too many at K = 0
    g2 = StalenessGuard(max_staleness=3)
    g2.applied(L, 10, 0.0)
    assert g2.observe_head(L, 13, 0.0) == [] and g2.may_generate(L)  # exactly K behind: still fresh
    ev = g2.observe_head(L, 14, 5.5)
    assert [(e.previous, e.state, e.local, e.head, e.at) for e in ev] == [
        (Admission.FRESH, Admission.STALE, 10, 14, 5.5)
    ]
    with pytest.raises(ValueError):
        StalenessGuard(-1)


def test_applied_past_the_known_head_raises_the_head_and_lineages_are_separate() -> None:
    g = StalenessGuard(max_staleness=1)
    ev = g.applied(L, 7, 0.0)  # no head heard yet: the version held is the newest known
    assert [(e.state, e.local, e.head) for e in ev] == [(Admission.FRESH, 7, 7)]
    assert g.observe_head(L, 8, 0.0) == [] and g.observe_head(L, 6, 0.0) == []
    assert [e.head for e in g.observe_head(L, 9, 0.0)] == [9]
    other = b"m" * 32
    assert not g.may_generate(other) and g.observe_head(other, 3, 0.0) == [] and not g.may_generate(other)
    assert not g.may_generate(L)  # L is stale (9 - 7 > 1); the other lineage's news changed nothing
    assert [e.state for e in g.applied(L, 8, 0.0)] == [Admission.FRESH] and g.may_generate(L)
    assert g.applied(L, 9, 0.0) == []  # fresh to fresh: no event


def test_event_messages_say_what_happened() -> None:
    lin = bytes.fromhex("ab" * 32)
    stale = StalenessEvent(lin, Admission.STALE, Admission.FRESH, 3, 10, 1.0)
    assert stale.message == (f"lineage {'ab' * 6}: 7 versions behind (local 3, head 10); rollouts paused, catching up")
    assert StalenessEvent(lin, Admission.STALE, Admission.UNKNOWN, None, 4, 1.0).message.startswith(
        f"lineage {'ab' * 6}: 4 versions"
    )
    assert StalenessEvent(lin, Admission.STALE, Admission.FRESH, 3, None, 1.0).message.startswith(
        f"lineage {'ab' * 6}: ? versions"
    )
    assert (
        StalenessEvent(lin, Admission.FRESH, Admission.STALE, 10, 10, 1.0).message
        == f"lineage {'ab' * 6}: caught up to 10 (head 10); rollouts resumed"
    )
    assert (
        StalenessEvent(lin, Admission.FRESH, Admission.UNKNOWN, 2, 5, 1.0).message
        == f"lineage {'ab' * 6}: unknown -> fresh (local 2, head 5)"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        stale.state = Admission.FRESH  # type: ignore[misc]
    assert not hasattr(stale, "__dict__")  # slots: one per transition, many lineages


def test_a_partial_catch_up_stays_paused_and_one_past_the_head_resumes_at_it() -> None:
    g = StalenessGuard(max_staleness=1)
    g.applied(L, 7, 0.0)
    assert [e.state for e in g.observe_head(L, 10, 1.0)] == [Admission.STALE]
    assert g.applied(L, 8, 2.0) == [] and not g.may_generate(L)  # 2 behind: an older version never lowers the head
    ev = g.applied(L, 12, 3.0)  # an anchor past the head we knew
    assert [(e.previous, e.state, e.local, e.head) for e in ev] == [(Admission.STALE, Admission.FRESH, 12, 12)]
