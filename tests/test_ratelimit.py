"""Token buckets, announced-rate buckets and the sender's rate meter (gossip/ratelimit.py), on an injected clock."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from murmur.gossip.ratelimit import (
    BURST_WINDOW_S,
    HEADROOM,
    MAX_BATCHES_PER_S,
    MIN_SPAN_S,
    NEW_KEYS_BURST,
    NEW_KEYS_PER_S,
    AnnouncedRates,
    Bucket,
    NewKeys,
    RateMeter,
    TokenBuckets,
)


def test_bucket_starts_full_refills_at_its_rate_and_caps_at_its_burst() -> None:
    b = Bucket(rate=2.0, burst=3.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.tokens == 0.0
    assert not b.take(0.4)  # 0.8 tokens: not enough, and nothing spent
    assert b.tokens == pytest.approx(0.8) and b.last == 0.4
    assert b.take(0.5) and b.tokens == pytest.approx(0.0)  # 1.0 token exactly is enough
    assert b.take(100.0, cost=3.0) and not b.take(100.0)  # a long idle refills only up to the burst
    assert not b.take(100.0, cost=0.5)


def test_bucket_ignores_a_clock_that_goes_back() -> None:
    b = Bucket(rate=1.0, burst=2.0, now=10.0)
    assert b.take(10.0, cost=2.0)
    assert not b.take(5.0)  # earlier than the last take: no refill, no negative refill
    assert b.tokens == 0.0 and b.last == 10.0
    assert b.take(11.0)  # one second after the latest time seen


def test_token_buckets_refuse_bad_parameters() -> None:
    for rate, burst in ((0.0, 5.0), (-1.0, 5.0), (1.0, 0.5), (math.inf, 5.0), (1.0, math.inf), (math.nan, 5.0)):
        with pytest.raises(ValueError):
            TokenBuckets(rate, burst)
    tb = TokenBuckets(1.0, 1.0)  # the smallest allowed: one message per second
    assert tb.take("a", 0.0) and not tb.take("a", 0.5) and tb.take("a", 1.0)


def test_token_buckets_are_per_peer_and_forget_the_least_recent_peer() -> None:
    tb = TokenBuckets(rate_per_s=1.0, burst=1.0, max_peers=2)
    assert tb.take("a", 0.0) and tb.take("b", 0.0)
    assert not tb.take("a", 0.0) and not tb.take("b", 0.0)  # each spent its own token
    assert not tb.take("a", 0.5)  # "a" is now the most recent
    assert tb.take("c", 0.5)  # evicts "b", the least recently seen
    assert len(tb._b) == 2 and "b" not in tb._b and "a" in tb._b
    assert tb.take("b", 0.5)  # forgotten: a new, full bucket
    assert "a" not in tb._b


def test_announced_limits_have_headroom_a_floor_and_a_ceiling() -> None:
    ar = AnnouncedRates(floor_rate=20.0, floor_burst=40.0)
    assert ar.limits(1.0) == (20.0, max(40.0, HEADROOM * 1.0 * BURST_WINDOW_S))  # the floor rate
    assert ar.limits(15.0) == (HEADROOM * 15.0, HEADROOM * 15.0 * BURST_WINDOW_S)
    assert ar.limits(10.0) == (20.0, 20.0 * BURST_WINDOW_S)  # exactly at the floor
    assert ar.limits(1e9) == (MAX_BATCHES_PER_S, MAX_BATCHES_PER_S * BURST_WINDOW_S)
    assert ar.limits(0.0001) == (20.0, 40.0)  # the floor burst


def _ann(seq: int, rate: float | None) -> SimpleNamespace:
    return SimpleNamespace(seq=seq) if rate is None else SimpleNamespace(seq=seq, publish_batches_per_s=rate)


def test_announced_bucket_follows_the_latest_promise() -> None:
    ar = AnnouncedRates(floor_rate=1.0, floor_burst=2.0)
    assert ar.bucket("p") is None
    ar.update("p", _ann(1, 1.0), now=0.0)
    b = ar.bucket("p")
    assert b is not None and (b.rate, b.burst) == ar.limits(1.0) and b.tokens == b.burst
    assert b.last == -math.inf  # runs on the producer's clock from its first batch
    assert b.take(5.0, cost=b.burst) and b.tokens == 0.0
    ar.update("p", _ann(2, 0.5), now=6.0)  # a lower promise: the same bucket
    assert ar.bucket("p") is b and (b.rate, b.burst) == ar.limits(0.5) and b.tokens == 0.0
    b.tokens = 500.0
    ar.update("p", _ann(3, 0.5), now=7.0)
    assert b.tokens == b.burst  # never more tokens than the new burst
    ar.update("p", _ann(3, 9.0), now=8.0)  # a replayed or older announce changes nothing, and is counted
    ar.update("p", _ann(1, 9.0), now=8.0)
    assert (b.rate, b.burst) == ar.limits(0.5) and ar.stale == 2
    for i, broken in enumerate((0.0, -3.0, math.nan, math.inf, None)):
        ar.update("q", _ann(2 * i + 1, 1.0), now=0.0)
        ar.update("q", _ann(2 * i + 2, broken), now=0.0)
        assert ar.bucket("q") is None  # no (sane) promise: back to the default, uncharged bucket


def test_announced_rates_are_bounded() -> None:
    ar = AnnouncedRates(max_peers=2)
    for p in ("a", "b"):
        ar.update(p, _ann(1, 1.0), now=0.0)
    ar.update("a", _ann(2, 2.0), now=1.0)  # "a" refreshed: "b" is the oldest
    ar.update("c", _ann(1, 1.0), now=2.0)
    assert ar.bucket("b") is None and ar.bucket("a") is not None and ar.bucket("c") is not None
    assert len(ar._newest) == 2 and "b" not in ar._newest  # the seq table is bounded too


def test_rate_meter_counts_over_its_window_and_the_span_it_saw() -> None:
    m = RateMeter(window_s=10.0)
    assert m.rate(0.0) == 0.0
    m.tick(0.0)
    assert m.rate(0.0) == 1.0 / MIN_SPAN_S  # a fresh meter divides by at least MIN_SPAN_S
    for t in (1.0, 2.0, 3.0):
        m.tick(t)
    assert m.rate(4.0) == pytest.approx(4 / 4.0)  # 4 events over the 4 s since the first
    assert m.rate(9.5) == pytest.approx(4 / 9.5)
    assert m.rate(10.0) == pytest.approx(3 / 9.0)  # the event at 0.0 left the window at exactly 10 s
    assert m.rate(20.0) == 0.0 and len(m._t) == 0
    many = RateMeter(window_s=100.0, max_events=5)
    for t in range(10):
        many.tick(float(t))
    assert len(many._t) == 5 and many.rate(10.0) == pytest.approx(5 / 5.0)  # bounded: the newest 5, since t=5


def test_the_limits_are_the_documented_ones() -> None:
    """docs/protocol.md: an announced rate r allows min(50, max(rate_limit_per_s, 2r)) batches/s with a burst of a
    minute of that (at least rate_burst); the floors default to the node's [gossip] defaults."""
    from murmur.node.config import GossipSection

    g = GossipSection()
    ar = AnnouncedRates()
    assert (ar.floor_rate, ar.floor_burst) == (g.rate_limit_per_s, g.rate_burst)
    assert ar.limits(1e6) == (50.0, 50.0 * 60)
    assert ar.limits(12.5) == (25.0, 25.0 * 60)
    assert TokenBuckets(2.0, 5.0).burst == 5.0  # any burst of at least one message


def test_the_meter_states_batches_per_second_over_the_last_minute() -> None:
    m = RateMeter()
    m.tick(100.0)
    assert m.rate(100.0) == 1.0  # one batch just now: 1/s (divided by at least one second)
    assert m.rate(159.9) == pytest.approx(1 / 59.9) and m.rate(160.0) == 0.0  # a minute later it is gone


def test_new_keys_share_one_bucket_and_admitted_keys_pass_freely() -> None:
    nk = NewKeys(rate_per_s=2.0, burst=3.0, max_known=4)
    assert [nk.admit(f"k{i}", 10.0) for i in range(4)] == [True, True, True, False]  # the burst, then refused
    assert nk.refused == 1
    assert all(nk.admit(f"k{i}", 10.0) for i in range(3))  # admitted once: no token needed again
    assert not nk.admit("k3", 10.4) and nk.refused == 2  # 0.8 tokens are not one, and nothing is spent
    assert nk.admit("k3", 10.5)  # one token exactly is enough
    assert not nk.admit("k4", 10.5) and nk.refused == 3
    assert nk.admit("direct", 10.5, direct=True) and nk.refused == 3  # its own connection: no token ...
    assert nk.admit("direct", 10.5)  # ... and remembered
    assert not nk.admit("k4", 10.5)  # the direct key spent nothing
    assert [nk.admit(f"k{i}", 100.0) for i in range(4, 8)] == [True, True, True, False]  # refilled to the burst
    assert nk.admit("k7", 100.5) and not nk.admit("k8", 100.5)  # then at its rate


def test_new_keys_forget_the_least_recently_heard_and_refuse_bad_parameters() -> None:
    nk = NewKeys(rate_per_s=1.0, burst=10.0, max_known=2)
    assert nk.admit("a", 0.0) and nk.admit("b", 0.0)
    assert nk.admit("a", 0.0)  # "a" is now the most recently heard
    assert nk.admit("c", 0.0)  # forgets "b"
    assert set(nk._known) == {"a", "c"}
    before = nk._bucket.tokens
    assert nk.admit("b", 0.0) and nk._bucket.tokens == before - 1  # a new key again: it takes a token
    for rate, burst in ((0.0, 5.0), (-1.0, 5.0), (1.0, 0.5), (math.inf, 5.0), (1.0, math.inf), (math.nan, 5.0)):
        with pytest.raises(ValueError):
            NewKeys(rate, burst)
    one = NewKeys(1.0, 1.0)  # the smallest allowed: one new key per second
    assert one.admit("x", 0.0) and not one.admit("y", 0.5) and one.admit("y", 1.0)
    d = NewKeys()
    assert (d.rate, d.burst, d.max_known) == (NEW_KEYS_PER_S, NEW_KEYS_BURST, 10_000) == (4.0, 64.0, 10_000)
