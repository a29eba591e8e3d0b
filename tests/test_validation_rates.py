"""Rate limits from announcements: a peer is held to the publishing rate it states itself, counted on its
own signed clock, and only publishing faster than that is charged (sans-IO, no worker processes)."""

from __future__ import annotations

import itertools

import pytest

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.ratelimit import HEADROOM, RateMeter
from murmur.gossip.validation import Pipeline, PipelineConfig, Reason
from murmur.simulations.bench.gossip import SWARM, make_batch, registry
from murmur.training.verifiers import score
from tests.samples import Clock

ALICE = Identity.from_seed(b"\x01" * 32)
MALLORY = Identity.from_seed(b"\x02" * 32)


@pytest.fixture(scope="module")
def reg():
    return registry()


def pipe(reg, **kw) -> tuple[Pipeline, Clock]:
    clock = Clock()
    return Pipeline(
        PipelineConfig(swarm=SWARM, **kw),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        task_set_trusted=reg.__contains__,
    ), clock


_announce_seqs = itertools.count(1)


def announce(ident: Identity, rate: float, seq: int | None = None) -> wire.NodeAnnounce:
    """`ident`'s announce of `rate`, newer than every one made before unless `seq` says otherwise."""
    seq = next(_announce_seqs) if seq is None else seq
    return wire.NodeAnnounce(
        v=wire.FORMAT_VERSION,
        peer_id=ident.peer_id,
        seq=seq,
        created_ms=wire.now_ms(),
        hardware="cpu",
        gen_tokens_per_s=0.0,
        rollout_latency_s=0.0,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["trainer"],
        lineages_followed=[],
        publish_batches_per_s=rate,
    )


def test_honest_rate_is_never_throttled_and_excess_is_charged(reg) -> None:
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    p.announced(ALICE.peer_id, announce(ALICE, 5.0))
    p.announced(MALLORY.peer_id, announce(MALLORY, 0.5))
    seq = 0
    for _ in range(60 * 5):  # a minute at Alice's announced 5 batches/s: all accepted
        seq += 1
        clock.t += 0.2
        assert p.check(
            make_batch(ALICE, reg, seq, n=1, tokens=4, created_ms=int(clock() * 1000)), ALICE.peer_id
        ).accepted
    reasons = []
    for i in range(200):  # Mallory announced 0.5/s and sends 20/s
        clock.t += 0.05
        fresh = make_batch(MALLORY, reg, 1 + i, n=1, tokens=4, created_ms=int(clock() * 1000))
        reasons.append(p.check(fresh, MALLORY.peer_id).reason)
    assert Reason.OVER_ANNOUNCED_RATE in reasons
    assert p.scores.record(MALLORY.peer_id).rejections["over_announced_rate"] >= 50
    assert reasons[-1] is Reason.GRAYLISTED  # charged until its score fell below the threshold
    assert p.scores.record(ALICE.peer_id).rejections == {}


def test_a_relayed_backlog_costs_the_producer_nothing(reg) -> None:
    """Gossip names the producer as a batch's origin whoever forwards it, so a relay that replays a
    producer's backlog to a late joiner (or re-sends batches the receiver already has) arrives far above
    the producer's announced rate. Only fresh batches above the rate prove the producer published too
    fast; the rest is dropped, uncharged, and copies of accepted batches spend no tokens at all."""
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    p.announced(ALICE.peer_id, announce(ALICE, 0.5))  # rate max(1, 2*0.5) = 1/s, burst max(2, 60)
    now_ms = int(clock() * 1000)
    backlog = [
        make_batch(ALICE, reg, seq, n=1, tokens=4, created_ms=now_ms - (300 - seq) * 2000) for seq in range(1, 200)
    ]  # made at 0.5/s over the last 400 s, all arriving at once
    reasons = [p.check(data, ALICE.peer_id).reason for data in backlog]
    assert set(reasons) == {Reason.ACCEPTED}  # made at the announced rate: arrival speed is not hers
    bucket = p.announced_rates.bucket(ALICE.peer_id)
    tokens = bucket.tokens
    again = [p.check(data, ALICE.peer_id).reason for data in backlog * 3]  # copies via three more relays
    assert set(again) == {Reason.DUPLICATE} and bucket.tokens == tokens  # ... which took no tokens
    # out of order (older than the last batch spent): the default, uncharged bucket
    late = [
        p.check(make_batch(ALICE, reg, 1000 + i, n=1, tokens=4, created_ms=now_ms - 700_000), ALICE.peer_id)
        for i in range(5)
    ]
    assert [v.reason for v in late].count(Reason.RATE_LIMITED) == 3
    assert p.scores.record(ALICE.peer_id).rejections == {}


def test_a_replayed_old_announce_changes_nothing(reg) -> None:
    """A relay re-sends Alice's old announce (0.5 batches/s) after her newer one (20/s): applied, it would
    cut her bucket to the floor and charge her for publishing at the rate she now states."""
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    old, new = announce(ALICE, 0.5, seq=7), announce(ALICE, 20.0, seq=8)
    p.announced(ALICE.peer_id, new)
    p.announced(ALICE.peer_id, new)  # a copy of the newest changes nothing
    p.announced(ALICE.peer_id, old)  # nor does the old one, arriving later via a relay or gossip's replay
    assert p.announced_rates.stale == 2
    reasons = []
    for seq in range(1, 20 * 90):  # 90 s at the announced 20 batches/s
        clock.t += 0.05
        reasons.append(
            p.check(make_batch(ALICE, reg, seq, n=1, tokens=4, created_ms=int(clock() * 1000)), ALICE.peer_id).reason
        )
    assert set(reasons) == {Reason.ACCEPTED}, {r.value: reasons.count(r) for r in set(reasons)}
    assert p.scores.record(ALICE.peer_id).rejections == {}


def test_unannounced_peers_are_limited_without_charge(reg) -> None:
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    reasons = [p.check(make_batch(ALICE, reg, i, n=1, tokens=4), ALICE.peer_id).reason for i in range(1, 6)]
    assert reasons.count(Reason.RATE_LIMITED) == 3
    assert (
        p.scores.score(ALICE.peer_id, clock()) > 0 and "rate_limited" not in p.scores.record(ALICE.peer_id).rejections
    )
    # an announce for someone else's peer id changes nothing
    p.announced(MALLORY.peer_id, announce(ALICE, 100.0))
    assert p.announced_rates.bucket(MALLORY.peer_id) is None


def test_rate_meter_measures_what_is_announced() -> None:
    meter = RateMeter(window_s=60.0)
    for i in range(120):
        meter.tick(1000.0 + i * 0.5)
    assert meter.rate(1060.0) == pytest.approx(2.0, rel=0.02)
    assert meter.rate(2000.0) == 0.0
    assert HEADROOM >= 1.0


def test_an_honest_producer_is_never_charged_while_its_announced_rate_catches_up(reg) -> None:
    """A producer that starts publishing at a steady 25 batches/s (a fast follower, one batch per group)
    and announces every 2 s what its meter measured must never be charged for publishing above its
    announced rate: its first announces come before its meter has seen a whole window."""
    p, clock = pipe(reg)
    meter = RateMeter()
    reasons = []
    next_announce = clock() + 2.0
    for seq in range(1, 751):  # 30 s
        clock.t += 0.04
        if clock() >= next_announce:
            next_announce += 2.0
            p.announced(ALICE.peer_id, announce(ALICE, meter.rate(clock())))
        meter.tick(clock())
        data = make_batch(ALICE, reg, seq, n=1, tokens=4, created_ms=int(clock() * 1000))
        reasons.append(p.check(data, ALICE.peer_id).reason)
    assert Reason.OVER_ANNOUNCED_RATE not in reasons and Reason.GRAYLISTED not in reasons, {
        r.value: reasons.count(r) for r in set(reasons)
    }
    assert p.scores.record(ALICE.peer_id).rejections == {}
    assert reasons[-100:] == [Reason.ACCEPTED] * 100


@pytest.mark.parametrize("allowed", [1.0005, 0.9995])
def test_the_announced_bucket_runs_on_the_producers_signed_milliseconds(reg, allowed) -> None:
    """One batch a second, signed 1000 ms apart: within a rate of 1.0005/s every batch passes; at 0.9995/s
    every other one is over (a bucket of one). The bucket is spent at the signed `created_ms`, exactly."""
    p, clock = pipe(reg, rate_per_s=allowed, burst=1)
    p.announced(ALICE.peer_id, announce(ALICE, 0.005))  # below the floor: held to rate_per_s, burst 1
    t0 = int(clock() * 1000)
    reasons = []
    for i in range(5):
        clock.t = (t0 + 1000 * i) / 1000.0
        data = make_batch(ALICE, reg, i + 1, n=1, tokens=4, created_ms=t0 + 1000 * i)
        reasons.append(p.check(data, ALICE.peer_id).reason)
    ok, over = Reason.ACCEPTED, Reason.OVER_ANNOUNCED_RATE
    assert reasons == ([ok] * 5 if allowed > 1 else [ok, over, ok, over, ok])


def test_a_burst_relayed_late_does_not_count_against_the_producers_fresh_burst(reg) -> None:
    """A late joiner gets Alice's burst made 61 s ago from a relay, then her new burst made now: each is
    within her rate on her own clock (a minute of refill between them), so neither is charged."""
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    p.announced(ALICE.peer_id, announce(ALICE, 0.5))  # 1 batch/s, burst 60
    burst = int(p.announced_rates.bucket(ALICE.peer_id).burst)
    now_ms = int(clock() * 1000)
    for made, first_seq in ((now_ms - 61_000, 1), (now_ms, 1000)):
        reasons = [
            p.check(make_batch(ALICE, reg, first_seq + i, n=1, tokens=4, created_ms=made), ALICE.peer_id).reason
            for i in range(burst)
        ]
        assert set(reasons) == {Reason.ACCEPTED}, {r.value: reasons.count(r) for r in set(reasons)}
    assert p.scores.record(ALICE.peer_id).rejections == {}


def test_more_than_the_burst_made_in_one_millisecond_is_charged(reg) -> None:
    """Batches signed with the same creation time as the last one spent are held to the announced bucket,
    not passed to the default one (which would drop them uncharged)."""
    p, clock = pipe(reg, rate_per_s=1.0, burst=2)
    p.announced(MALLORY.peer_id, announce(MALLORY, 0.5))
    burst = int(p.announced_rates.bucket(MALLORY.peer_id).burst)
    made = int(clock() * 1000)
    reasons = [
        p.check(make_batch(MALLORY, reg, seq, n=1, tokens=4, created_ms=made), MALLORY.peer_id).reason
        for seq in range(1, burst + 11)
    ]
    assert reasons.count(Reason.ACCEPTED) == burst
    assert Reason.OVER_ANNOUNCED_RATE in reasons and Reason.RATE_LIMITED not in reasons
