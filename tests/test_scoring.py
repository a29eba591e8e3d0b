"""Peer scores (gossip/scoring.py) on an injected clock: decay, cap, graylist, ban, bounded table."""

from __future__ import annotations

import dataclasses

import pytest

from murmur.gossip.scoring import PeerRecord, PeerScores, Penalise, ScoreParams


def test_defaults_are_the_documented_policy() -> None:
    p = ScoreParams()
    assert (p.graylist_threshold, p.blacklist_s, p.half_life_s, p.max_score, p.accept_reward) == (
        -50.0,
        3600.0,
        600.0,
        20.0,
        0.5,
    )
    r = PeerRecord()
    assert (r.score, r.updated, r.banned_until, r.rejections, r.accepted, r.charged) == (0.0, 0.0, 0.0, {}, 0, 0.0)
    assert PeerScores().max_peers == 10_000


def test_penalty_decays_with_the_half_life_and_counts_its_reason() -> None:
    s = PeerScores(ScoreParams(half_life_s=10.0))
    assert s.score("p", 0.0) == 0.0 and s.record("p") is None  # an unknown peer is neutral and not stored
    assert s.penalise("p", "forged", 8.0, now=100.0) is False
    s.penalise("p", "forged", 8.0, now=100.0)
    s.penalise("p", "garbage", 1.0, now=100.0)
    rec = s.record("p")
    assert rec is not None and rec.score == -17.0 and rec.charged == 17.0
    assert rec.rejections == {"forged": 2, "garbage": 1}
    assert s.score("p", 110.0) == pytest.approx(-8.5)  # one half-life later
    assert s.score("p", 105.0) == pytest.approx(-8.5)  # an earlier time never undoes decay already applied
    assert s.score("p", 130.0) == pytest.approx(-8.5 / 4)
    assert rec.charged == 17.0  # what was charged neither decays nor heals
    assert s.snapshot(130.0) == {
        "p": dict(score=-2.125, banned=False, accepted=0, rejections={"forged": 2, "garbage": 1}, charged=17.0)
    }
    s.penalise("q", "x", 1.0 / 3, now=0.0)
    assert s.snapshot(0.0)["q"]["score"] == -0.333 and s.snapshot(0.0)["q"]["charged"] == 0.333


def test_rewards_are_capped_and_counted() -> None:
    s = PeerScores(ScoreParams(max_score=2.0, accept_reward=0.75))
    for _ in range(5):
        s.reward("p", 0.0)
    rec = s.record("p")
    assert rec is not None and rec.accepted == 5 and rec.score == 2.0


def test_graylist_is_strictly_below_the_threshold() -> None:
    s = PeerScores(ScoreParams(graylist_threshold=-10.0, half_life_s=1e9))
    assert not s.is_graylisted("p", 0.0)
    s.penalise("p", "x", 10.0, 0.0)
    assert s.score("p", 0.0) == -10.0 and not s.is_graylisted("p", 0.0)
    s.penalise("p", "x", 0.5, 0.0)
    assert s.is_graylisted("p", 0.0)


def test_a_ban_lasts_blacklist_s_and_reports_only_a_new_ban() -> None:
    seen: list[tuple[str, float]] = []
    s = PeerScores(ScoreParams(blacklist_s=100.0), on_change=lambda peer, rec: seen.append((peer, rec.score)))
    assert not s.is_blacklisted("p", 0.0)
    assert s.penalise("p", "forged", 1.0, now=10.0, ban=True) is True
    assert s.penalise("p", "forged", 1.0, now=50.0, ban=True) is False  # already banned: extended, not new
    assert s.is_blacklisted("p", 149.0) and not s.is_blacklisted("p", 150.0)
    assert s.penalise("p", "forged", 1.0, now=150.0, ban=True) is True  # the ban ran out at 150: a new one
    assert s.penalise("p", "garbage", 1.0, now=151.0) is False  # no ban asked
    assert [peer for peer, _ in seen] == ["p"] * 4 and seen[0][1] == -1.0


def test_the_table_forgets_the_most_neutral_peer() -> None:
    s = PeerScores(ScoreParams(half_life_s=1e12), max_peers=3)
    s.penalise("bad", "x", 30.0, 0.0)
    s.reward("good", 0.0)
    s.reward("good", 0.0)
    s.penalise("banned", "x", 0.1, 0.0, ban=True)
    s.penalise("new", "x", 0.5, 0.0)  # the table is full: "good" (|1.0|) is the most neutral
    assert set(s._peers) == {"bad", "banned", "new"}
    s.penalise("newer", "x", 0.2, 0.0)  # "banned" is near 0 but banned: "new" (0.5) goes
    assert set(s._peers) == {"bad", "banned", "newer"}


def test_penalise_actions_are_frozen_and_slotted() -> None:
    a = Penalise("p", "why", 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.amount = 2.0  # type: ignore[misc]
    assert not hasattr(a, "__dict__")


def test_decay_is_continuous_and_measured_from_the_last_update() -> None:
    s = PeerScores(ScoreParams(half_life_s=10.0))
    s.penalise("p", "x", 16.0, now=50.0)
    assert s.score("p", 55.0) == pytest.approx(-16.0 * 0.5**0.5)  # half a half-life: not rounded down
    assert s.score("p", 120.0) == pytest.approx(-16.0 * 0.5**7)  # 70 s after the penalty at 50


def test_a_large_table_stays_at_its_bound() -> None:
    s = PeerScores(max_peers=300)
    for i in range(310):
        s.penalise(f"p{i}", "x", 1.0 + i, 0.0)
    assert len(s._peers) == 300


def test_a_peer_keeps_at_most_max_reasons_distinct_reasons() -> None:
    from murmur.gossip.scoring import MAX_REASONS

    s = PeerScores()
    for i in range(MAX_REASONS + 50):  # reasons that carry a number the peer chose ("chunk index 12345 ...")
        s.penalise("p", f"chunk index {i} out of range", 0.01, now=0.0)
    rec = s.record("p")
    assert rec is not None and len(rec.rejections) == MAX_REASONS + 1
    assert rec.rejections["other"] == 50 and sum(rec.rejections.values()) == MAX_REASONS + 50
