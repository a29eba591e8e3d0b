"""The sans-IO verification pipeline: every rejection reason, scoring, graylist and blacklist."""

from __future__ import annotations

import msgspec
import pytest

from gossip import wire
from simulations.bench.gossip import SWARM, make_batch, make_rollout, registry, resign_with
from gossip.scoring import ScoreParams
from gossip.validation import PENALTIES, Pipeline, PipelineConfig, Reason
from gossip.identity import Identity
from training.verifiers import score
from tests.samples import Clock

ALICE = Identity.from_seed(b"\x01" * 32)
MALLORY = Identity.from_seed(b"\x02" * 32)
OTHER = Identity.from_seed(b"\x03" * 32)


@pytest.fixture(scope="module")
def reg():
    return registry()


def pipe(reg, heads=None, swarm: str = SWARM, **cfg) -> tuple[Pipeline, Clock]:
    clock = Clock()
    config = PipelineConfig(swarm=swarm, **cfg)
    p = Pipeline(config, clock=clock, resolve_task=reg.resolve, reward=score,
                 head_version=lambda lin: (heads or {}).get(lin), task_set_trusted=reg.__contains__)
    return p, clock


def test_accepts_honest_batch_once(reg) -> None:
    p, _ = pipe(reg)
    data = make_batch(ALICE, reg, 1)
    v = p.check(data, ALICE.peer_id)
    assert v.accepted and v.batch is not None and len(v.batch.rollouts) == 4
    again = p.check(data, ALICE.peer_id)
    assert again.reason is Reason.DUPLICATE
    assert p.scores.score(ALICE.peer_id, p.clock()) > 0  # duplicates (late-joiner replays) cost nothing


def test_one_process_holds_two_swarms(reg) -> None:
    """Nothing process-wide names the swarm: two pipelines of two swarms side by side each accept
    their own swarm's batches and refuse (and charge, as any cross-swarm replay) the other's."""
    a, clock_a = pipe(reg, swarm="swarm-a")
    b, clock_b = pipe(reg, swarm="swarm-b")
    for_a = make_batch(ALICE, reg, 1, swarm="swarm-a")
    for_b = make_batch(MALLORY, reg, 1, swarm="swarm-b")
    assert wire.decode_envelope(for_a, swarm="swarm-a").swarm == "swarm-a"
    with pytest.raises(wire.WrongSwarm):
        wire.open_envelope(for_a, swarm="swarm-b")
    assert a.check(for_a, ALICE.peer_id).accepted
    assert b.check(for_b, MALLORY.peer_id).accepted
    own = (a.scores.score(ALICE.peer_id, clock_a()), b.scores.score(MALLORY.peer_id, clock_b()))
    for p, clock, data, origin in ((a, clock_a, for_b, MALLORY.peer_id), (b, clock_b, for_a, ALICE.peer_id)):
        before = p.scores.score(origin, clock())
        v = p.check(data, origin)
        assert v.reason is Reason.WRONG_SWARM and not v.accepted, v.detail
        assert p.scores.score(origin, clock()) == pytest.approx(before - PENALTIES[Reason.WRONG_SWARM][0])
    # each swarm's scores are its own: a refusal in one does not touch the sender's standing in the other
    assert (a.scores.score(ALICE.peer_id, clock_a()), b.scores.score(MALLORY.peer_id, clock_b())) == own


# Reasons with a test of their own below (they need a tokenizer, a verifier pool or an announce).
OWN_TESTS = (Reason.ACCEPTED, Reason.BAD_TOKENS, Reason.TEXT_MISMATCH, Reason.VERIFIER_TIMEOUT,
             Reason.VERIFIER_UNAVAILABLE, Reason.VERIFIER_ERROR, Reason.OVER_ANNOUNCED_RATE)


@pytest.mark.parametrize("reason", [r for r in Reason if r not in OWN_TESTS])
def test_every_rejection_reason(reg, reason: Reason) -> None:
    p, clock = pipe(reg, heads={b"\x4c" * 32: 20}, max_staleness=4)
    origin = MALLORY.peer_id
    if reason is Reason.BLACKLISTED:
        p.scores.penalise(origin, "test", 0, clock(), ban=True)
        data = make_batch(MALLORY, reg, 1, version=20)
    elif reason is Reason.GRAYLISTED:
        p.scores.penalise(origin, "test", 1000, clock())
        data = make_batch(MALLORY, reg, 1, version=20)
    elif reason is Reason.RATE_LIMITED:
        p.buckets = type(p.buckets)(1.0, 1)
        assert p.check(make_batch(MALLORY, reg, 1, version=20), origin).accepted
        data = make_batch(MALLORY, reg, 2, version=20)
    elif reason is Reason.OVERSIZED:
        data = b"\x00" * (wire.KIND_LIMITS[wire.ROLLOUT_BATCH] + 1)
    elif reason is Reason.MALFORMED:
        data = b"\x93garbage that is not msgpack\xc1\xff"
    elif reason is Reason.BAD_SIGNATURE:
        # claims Mallory (the originator) as signer, but the signature is another key's
        data = resign_with(OTHER, MALLORY, make_batch(MALLORY, reg, 1, version=20))
    elif reason is Reason.SIGNER_MISMATCH:
        data = make_batch(OTHER, reg, 1, version=20)  # validly signed by another key
    elif reason is Reason.WRONG_SWARM:
        data = make_batch(MALLORY, reg, 1, version=20, swarm="elsewhere")  # replayed from another swarm
    elif reason is Reason.EXPIRED:
        data = make_batch(MALLORY, reg, 1, version=20, created_ms=int((clock() - 10_000) * 1000))
    elif reason is Reason.DUPLICATE:
        data = make_batch(MALLORY, reg, 1, version=20)
        assert p.check(data, origin).accepted
    elif reason is Reason.REPLAY:
        assert p.check(make_batch(MALLORY, reg, 1, version=20), origin).accepted
        data = make_batch(MALLORY, reg, 1, version=21)  # same seq, other content
    elif reason is Reason.UNKNOWN_TASK_SET:
        data = make_batch(MALLORY, reg, 1, version=20, task_set=b"\xee" * 32)
    elif reason is Reason.BAD_TASK:
        data = make_batch(MALLORY, reg, 1, version=20, generator="no-such-generator")
    elif reason is Reason.FORGED_REWARD:
        data = make_batch(MALLORY, reg, 1, version=20, forge=True)
    elif reason is Reason.STALE_VERSION:
        data = make_batch(MALLORY, reg, 1, version=15)  # head 20, bound 4
    elif reason is Reason.BAD_NUMBER:
        good = make_batch(MALLORY, reg, 1, version=20)
        batch = wire.decode_body(wire.decode_envelope(good, swarm=SWARM))
        batch.rollouts[0].logprobs = b"\x00\x00\xc0\x7f" + batch.rollouts[0].logprobs[4:]  # float32 NaN
        data = wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM)
    elif reason is Reason.FUTURE_VERSION:
        p.own_lineage = lambda lin: lin == b"\x4c" * 32  # the receiver publishes this lineage: head 20
        data = make_batch(MALLORY, reg, 1, version=21)
    elif reason is Reason.UNKNOWN_VERSION:
        data = make_batch(MALLORY, reg, 1, version=21)  # someone else's lineage, known head 20
    elif reason is Reason.CPU_BUDGET:  # its earlier batch cost far more CPU than its share and the node's spare
        step = p.admit(make_batch(MALLORY, reg, 1, version=20), origin)
        p.verify(step)
        p.spent(step, 100.0)
        assert p.commit(step).accepted
        data = make_batch(MALLORY, reg, 2, version=20)
    elif reason is Reason.TOO_LONG:
        p.config.max_completion_tokens = 32
        data = make_batch(MALLORY, reg, 1, version=20, tokens=64)
    elif reason is Reason.OVER_OWN_SAMPLING:
        r = make_rollout(reg, 2, tokens=64, version=20)
        r = msgspec.structs.replace(r, sampling=wire.SamplingParams(max_new_tokens=16))
        data = wire.seal(MALLORY, wire.ROLLOUT_BATCH, wire.RolloutBatch(
            v=wire.FORMAT_VERSION, swarm=SWARM, producer=MALLORY.public, seq=1, created_ms=wire.now_ms(), rollouts=[r]), swarm=SWARM)
    else:  # pragma: no cover
        raise AssertionError(reason)
    before = p.scores.score(origin, clock())
    v = p.check(data, origin)
    assert v.reason is reason, v.detail
    assert not v.accepted
    assert p.counts[reason.value] >= 1 and p.per_peer[origin][reason.value] >= 1
    penalty, ban = PENALTIES[reason]
    if penalty:
        assert p.scores.score(origin, clock()) < before
    assert p.scores.is_blacklisted(origin, clock()) == (ban or reason is Reason.BLACKLISTED)


def test_forgery_blacklists_for_configured_time(reg) -> None:
    p, clock = pipe(reg, score=ScoreParams(blacklist_s=100.0))
    v = p.check(make_batch(MALLORY, reg, 1, forge=True), MALLORY.peer_id)
    assert v.reason is Reason.FORGED_REWARD and v.newly_banned
    assert p.check(make_batch(MALLORY, reg, 2), MALLORY.peer_id).reason is Reason.BLACKLISTED
    clock.t += 101
    assert not p.scores.is_blacklisted(MALLORY.peer_id, clock())


def test_graylisted_peer_is_dropped_before_decoding(reg) -> None:
    p, clock = pipe(reg)
    for i in range(1, 3):  # two signature-by-another-key messages: 2 x 30 > 50
        assert p.check(make_batch(OTHER, reg, i), MALLORY.peer_id).reason is Reason.SIGNER_MISMATCH
    assert p.scores.is_graylisted(MALLORY.peer_id, clock())
    v = p.check(b"anything at all", MALLORY.peer_id)
    assert v.reason is Reason.GRAYLISTED
    # a graylisted forwarder's relays are dropped too, while others still get through
    assert p.check(make_batch(ALICE, reg, 1), ALICE.peer_id, forwarder=MALLORY.peer_id).reason is Reason.GRAYLISTED
    assert p.check(make_batch(ALICE, reg, 1), ALICE.peer_id).accepted


def test_score_decays_back(reg) -> None:
    p, clock = pipe(reg, score=ScoreParams(half_life_s=10.0))
    p.check(b"junk", MALLORY.peer_id)
    s0 = p.scores.score(MALLORY.peer_id, clock())
    clock.t += 10
    assert p.scores.score(MALLORY.peer_id, clock()) == pytest.approx(s0 / 2)


def test_split_stages_mark_in_flight_duplicates(reg) -> None:
    p, _ = pipe(reg)
    data = make_batch(ALICE, reg, 7)
    pending = p.admit(data, ALICE.peer_id)
    assert not isinstance(pending, type(p.check(b"x", "z")))
    assert p.admit(data, ALICE.peer_id).reason is Reason.DUPLICATE  # second copy while the first verifies
    assert p.commit(p.verify(pending)).accepted


def test_rate_limit_refills(reg) -> None:
    p, clock = pipe(reg, rate_per_s=2.0, burst=2)
    results = [p.check(make_batch(ALICE, reg, i), ALICE.peer_id).reason for i in range(1, 5)]
    assert results == [Reason.ACCEPTED, Reason.ACCEPTED, Reason.RATE_LIMITED, Reason.RATE_LIMITED]
    clock.t += 1.0
    assert p.check(make_batch(ALICE, reg, 9), ALICE.peer_id).accepted
