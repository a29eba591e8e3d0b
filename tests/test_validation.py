"""The sans-IO verification pipeline: every rejection reason, scoring, graylist and blacklist."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.scoring import ScoreParams
from murmur.gossip.validation import PENALTIES, Pending, Pipeline, PipelineConfig, Reason
from murmur.simulations.bench.gossip import SWARM, make_batch, make_rollout, registry, resign_with
from murmur.training.schedule import PAST_ROUNDS, ScheduleBook, round_at
from murmur.training.verifiers import score
from tests.samples import Clock

ALICE = Identity.from_seed(b"\x01" * 32)
MALLORY = Identity.from_seed(b"\x02" * 32)
OTHER = Identity.from_seed(b"\x03" * 32)


@pytest.fixture(scope="module")
def reg():
    return registry()


def _documented_penalties() -> dict[str, tuple[float, bool]]:
    """reason -> (penalty, ban) from the stage table of docs/gossip.md: what operators are told each
    rejection costs. A row may name two reasons with two penalties (`malformed` / `signer_mismatch`,
    10 / 30); a reason in parentheses is named by another row of its own."""
    table: dict[str, tuple[float, bool]] = {}
    text = (Path(__file__).resolve().parents[1] / "docs" / "gossip.md").read_text()
    for line in text.split("| # | stage | reason | penalty | ban |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        reason, penalty, ban = line.strip().strip("|").split("|")[-3:]  # a stage may contain a `|`
        names = re.findall(r"`([a-z_]+)`", reason.split("(or")[0])
        amounts = [a.strip() for a in penalty.split("/")]
        if not names or len(names) != len(amounts) or not all(re.fullmatch(r"\d+", a) for a in amounts):
            continue  # `accepted` (a reward) and "the earlier reason"
        for name, amount in zip(names, amounts):
            entry = (float(amount), ban.strip() == "yes")
            assert table.setdefault(name, entry) == entry, f"{name}: two penalties in docs/gossip.md"
    return table


DOCUMENTED = _documented_penalties()


def test_every_reason_costs_what_the_docs_say() -> None:
    assert set(DOCUMENTED) == {r.value for r in Reason} - {"accepted"}
    for reason, (penalty, ban) in PENALTIES.items():
        if reason is not Reason.ACCEPTED:
            assert (penalty, ban) == DOCUMENTED[reason.value], reason


def pipe(reg, heads=None, swarm: str = SWARM, **cfg) -> tuple[Pipeline, Clock]:
    clock = Clock()
    config = PipelineConfig(swarm=swarm, **cfg)
    p = Pipeline(
        config,
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: (heads or {}).get(lin),
        task_set_trusted=reg.__contains__,
        schedule=ScheduleBook.of(reg),
    )
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


def test_a_gossip_service_refuses_a_pipeline_of_another_swarm(reg) -> None:
    """The service's topics and the pipeline's envelope check must name the same swarm, or every batch
    on the service's topics would be refused as a cross-swarm replay."""
    from murmur.gossip.service import GossipService

    p, _ = pipe(reg, swarm="swarm-a")
    with pytest.raises(ValueError, match="swarm-b"):
        GossipService(None, p, "swarm-b")
    assert GossipService(None, p, "swarm-a").swarm == "swarm-a"


# Reasons with a test of their own below (they need a tokenizer, a verifier pool or an announce).
OWN_TESTS = (
    Reason.ACCEPTED,
    Reason.BAD_TOKENS,
    Reason.TEXT_MISMATCH,
    Reason.VERIFIER_TIMEOUT,
    Reason.VERIFIER_UNAVAILABLE,
    Reason.VERIFIER_ERROR,
    Reason.OVER_ANNOUNCED_RATE,
)


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
        data = wire.seal(
            MALLORY,
            wire.ROLLOUT_BATCH,
            wire.RolloutBatch(
                v=wire.FORMAT_VERSION,
                swarm=SWARM,
                producer=MALLORY.public,
                seq=1,
                created_ms=wire.now_ms(),
                rollouts=[r],
            ),
            swarm=SWARM,
        )
    elif reason in (Reason.SCHEDULE_WINDOW, Reason.MISSCHEDULED):
        # a claim for the round before the window, or for this round with a prompt that is not one of its
        rnd = round_at(int(clock() * 1000)) - (PAST_ROUNDS + 1 if reason is Reason.SCHEDULE_WINDOW else 0)
        prompts = ScheduleBook.of(reg).prompts(reg.builtin_id, rnd)
        due, taken = prompts[0], {(q.generator, q.seed) for q in prompts}
        seed = (
            due.seed
            if reason is Reason.SCHEDULE_WINDOW
            else next(s for s in range(due.seed + 1, due.seed + 99) if (due.generator, s % 1_000_000) not in taken)
            % 1_000_000
        )
        r = make_rollout(reg, seed, tokens=8, version=20, generator=due.generator)
        data = wire.seal(
            MALLORY,
            wire.ROLLOUT_BATCH,
            wire.RolloutBatch(
                v=wire.FORMAT_VERSION,
                swarm=SWARM,
                producer=MALLORY.public,
                seq=1,
                created_ms=wire.now_ms(),
                rollouts=[msgspec.structs.replace(r, schedule_round=rnd)],
            ),
            swarm=SWARM,
        )
    else:  # pragma: no cover
        raise AssertionError(reason)
    before = p.scores.score(origin, clock())
    v = p.check(data, origin)
    assert v.reason is reason, v.detail
    assert not v.accepted
    assert p.counts[reason.value] == 1 and p.per_peer[origin][reason.value] == 1  # each message counted once
    penalty, ban = DOCUMENTED[reason.value]
    assert before - p.scores.score(origin, clock()) == pytest.approx(penalty)  # the clock stands: no decay
    assert p.scores.is_blacklisted(origin, clock()) == (ban or reason is Reason.BLACKLISTED)
    assert v.newly_banned == ban  # what the service acts on (a libp2p blacklist): only a fresh ban


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


def test_a_default_pipeline_judges_as_a_default_node(reg) -> None:
    """The simulator and the benchmarks build pipelines without a node config: they must judge with a
    default node's limits (staleness bound, rates, caches, score thresholds)."""
    from murmur.node.config import Config

    cfg = Config()
    assert PipelineConfig(swarm=SWARM) == PipelineConfig.from_config(SWARM, cfg.gossip, cfg.sync.max_staleness)


def test_the_originator_is_compared_by_value(reg) -> None:
    """The I/O layer's originator is a string it decoded from libp2p's peer id: equal to the signer's
    peer id, never the same object."""
    p, _ = pipe(reg)
    origin = ALICE.peer_id.encode().decode()
    assert origin == ALICE.peer_id and origin is not ALICE.peer_id
    assert p.check(make_batch(ALICE, reg, 1), origin).accepted


def test_a_version_not_yet_known_passes_once_its_head_arrives(reg) -> None:
    """`unknown_version` is this node's own lag, so the refusal is not cached: the same bytes pass once the
    publisher's head reaches it. `future_version` is provably false, so it is cached and charged again."""
    heads = {b"\x4c" * 32: 20}
    p, _ = pipe(reg, heads=heads)
    data = make_batch(ALICE, reg, 1, version=21)
    assert p.check(data, ALICE.peer_id).reason is Reason.UNKNOWN_VERSION
    heads[b"\x4c" * 32] = 21
    assert p.check(data, ALICE.peer_id).accepted

    own, clock = pipe(reg, heads={b"\x4c" * 32: 20})
    own.own_lineage = lambda lin: True
    forged = make_batch(MALLORY, reg, 1, version=21)
    assert own.check(forged, MALLORY.peer_id).reason is Reason.FUTURE_VERSION
    before = own.scores.score(MALLORY.peer_id, clock())
    v = own.check(forged, MALLORY.peer_id)
    assert v.reason is Reason.FUTURE_VERSION and v.detail == "same bytes rejected before"
    assert before - own.scores.score(MALLORY.peer_id, clock()) == pytest.approx(PENALTIES[Reason.FUTURE_VERSION][0])


def test_a_token_check_finding_is_the_verdict(reg) -> None:
    """Whatever the injected token check finds in any rollout of a batch is the batch's verdict, charged,
    with the check's explanation in the detail (what an operator reads in the log)."""
    vocab = 50

    def check(r: wire.Rollout) -> tuple[Reason, str] | None:
        return (
            (Reason.BAD_TOKENS, f"token id {max(r.completion_ids)} outside the vocabulary of {vocab}")
            if max(r.completion_ids, default=0) >= vocab
            else None
        )

    clock = Clock()
    p = Pipeline(
        PipelineConfig(swarm=SWARM),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        task_set_trusted=reg.__contains__,
        check_tokens=check,
    )
    r = make_rollout(reg, 2, tokens=4)
    ok = msgspec.structs.replace(r, completion_ids=[1, 2, 3, 4])
    bad = msgspec.structs.replace(r, completion_ids=[1, 2, 3, 77])
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION,
        swarm=SWARM,
        producer=MALLORY.public,
        seq=1,
        created_ms=wire.now_ms(),
        rollouts=[ok, ok, bad],
    )
    v = p.check(wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM), MALLORY.peer_id)
    assert v.reason is Reason.BAD_TOKENS and v.newly_banned
    assert v.detail == "rollout 2: token id 77 outside the vocabulary of 50"


def test_the_per_peer_counters_are_bounded_like_the_score_table(reg) -> None:
    from murmur.gossip.scoring import PeerScores

    clock = Clock()
    p = Pipeline(
        PipelineConfig(swarm=SWARM),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        scores=PeerScores(max_peers=5),
    )
    peers = [f"peer-{i}" for i in range(12)]
    for peer in peers:
        assert p.check(b"junk", peer).reason is Reason.MALFORMED
    assert list(p.per_peer) == peers[-5:]  # the newest five
    assert p.counts[Reason.MALFORMED.value] == 12
    # no trust predicate (the simulator's nodes): every task set that resolves is judged
    assert p.check(make_batch(ALICE, reg, 1), ALICE.peer_id).accepted


def _producer_is_not_signer(reg) -> bytes:
    """Signed by Mallory, whose body names Alice as its producer."""
    batch = wire.decode_body(wire.decode_envelope(make_batch(ALICE, reg, 1), swarm=SWARM))
    return wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM)


def _body_of_another_swarm(reg, seq: int, swarm: str) -> bytes:
    """Signed for this swarm, its body naming another."""
    batch = wire.decode_body(wire.decode_envelope(make_batch(MALLORY, reg, seq), swarm=SWARM))
    batch.swarm = swarm
    return wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM)


def _signed_garbage() -> bytes:
    """A well-signed envelope of Mallory's whose body is not a rollout batch."""
    body = b"\x93garbage that is not msgpack\xc1\xff"
    sig = MALLORY.sign(wire.signing_domain(wire.ROLLOUT_BATCH, wire.FORMAT_VERSION, SWARM) + body)
    return wire.encode(wire.Envelope(wire.FORMAT_VERSION, wire.ROLLOUT_BATCH, SWARM, body, MALLORY.public, sig))


def test_a_signed_fault_is_judged_once_and_charged_again_from_the_cache(reg) -> None:
    """The same bytes again cost no second decode: the cached verdict answers, and charges again."""
    for data, reason in (
        (_signed_garbage(), Reason.MALFORMED),
        (_producer_is_not_signer(reg), Reason.SIGNER_MISMATCH),
        (_body_of_another_swarm(reg, 1, "aaa-some-other-swarm"), Reason.WRONG_SWARM),
        (_body_of_another_swarm(reg, 2, "zzz-some-other-swarm"), Reason.WRONG_SWARM),
    ):
        p, clock = pipe(reg)
        first = p.check(data, MALLORY.peer_id)
        assert first.reason is reason and first.detail != "same bytes rejected before"
        before = p.scores.score(MALLORY.peer_id, clock())
        again = p.check(data, MALLORY.peer_id)
        assert again.reason is reason and again.detail == "same bytes rejected before"
        assert before - p.scores.score(MALLORY.peer_id, clock()) == pytest.approx(PENALTIES[reason][0])


def test_bytes_that_are_no_envelope_take_no_room_in_the_verdict_cache(reg) -> None:
    """Undecodable bytes fail again before the cache is read: caching them would only let a flood of
    distinct junk evict the verdicts that are read."""
    p, clock = pipe(reg)
    data = make_batch(ALICE, reg, 1)
    assert p.check(data, ALICE.peer_id).accepted
    for i in range(50):
        assert p.check(b"junk %d" % i, f"peer-{i}").reason is Reason.MALFORMED
    assert len(p.seen) == 1
    assert p.check(data, ALICE.peer_id).reason is Reason.DUPLICATE


def test_a_rejection_from_this_nodes_own_view_is_not_cached(reg) -> None:
    """An unknown task set, a spent CPU share, a batch that went stale while it was verified: the
    same bytes are judged afresh, and pass once this node's view has changed."""
    trusted: set[bytes] = set()
    clock = Clock()
    p = Pipeline(
        PipelineConfig(swarm=SWARM),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        task_set_trusted=trusted.__contains__,
    )
    data = make_batch(ALICE, reg, 1)
    assert p.check(data, ALICE.peer_id).reason is Reason.UNKNOWN_TASK_SET
    trusted.add(reg.builtin_id)
    assert p.check(data, ALICE.peer_id).accepted

    p, clock = pipe(reg)
    step = p.admit(make_batch(ALICE, reg, 1), ALICE.peer_id)
    p.spent(p.verify(step), 10.0)
    assert p.commit(step).accepted
    data = make_batch(ALICE, reg, 2)
    assert p.check(data, ALICE.peer_id).reason is Reason.CPU_BUDGET
    clock.t += 60  # the share refills (well within the replay TTL)
    assert p.check(data, ALICE.peer_id).accepted

    heads = {b"\x4c" * 32: 20}
    p, clock = pipe(reg, heads=heads, max_staleness=4)
    data = make_batch(ALICE, reg, 1, version=20)
    step = p.admit(data, ALICE.peer_id)
    heads[b"\x4c" * 32] = 30  # the publisher moved on while the batch was verified
    v = p.commit(p.verify(step))
    assert v.reason is Reason.STALE_VERSION and p.scores.score(ALICE.peer_id, clock()) == 0
    again = p.check(data, ALICE.peer_id)
    assert again.reason is Reason.STALE_VERSION and again.detail != "same bytes rejected before"


def test_the_staleness_bound_and_the_clock_skew_are_inclusive(reg) -> None:
    """A version exactly max_staleness behind the head is used; a batch made up to 60 s in the future
    (clock skew) is accepted, one made later than that cannot be proven fresh (docs/gossip.md)."""
    p, clock = pipe(reg, heads={b"\x4c" * 32: 20}, max_staleness=4)
    assert p.check(make_batch(ALICE, reg, 1, version=16), ALICE.peer_id).accepted
    assert p.check(make_batch(ALICE, reg, 2, version=15), ALICE.peer_id).reason is Reason.STALE_VERSION
    clock.t = float(int(clock.t))  # whole seconds, so the half seconds below are exact
    made = int(clock.t * 1000)
    assert p.check(make_batch(ALICE, reg, 3, version=20, created_ms=made + 59_500), ALICE.peer_id).accepted
    assert (
        p.check(make_batch(ALICE, reg, 4, version=20, created_ms=made + 60_500), ALICE.peer_id).reason is Reason.EXPIRED
    )


PARTIAL_LINEAGE = b"\x4c" * 32
PRODUCER = Identity.from_seed(b"\x41" * 32)


def test_a_partial_rollout_whose_first_tokens_are_too_old_is_refused_whatever_its_later_tokens() -> None:
    """Head 20, bound 4: a rollout begun at version 15 and continued at 20 is stale, alone or after a fresh
    rollout of the same lineage in its batch; begun at 16 it is used."""
    reg = registry()
    clock = Clock()
    p = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: 20 if lin == PARTIAL_LINEAGE else None,
        task_set_trusted=reg.__contains__,
    )

    def partial(seed: int, first: int) -> wire.Rollout:
        r = make_rollout(reg, seed, 16, version=first, lineage=PARTIAL_LINEAGE)
        return msgspec.structs.replace(r, token_versions=[(0, first), (4, 18), (8, 20)])

    def batch(seq: int, rollouts: list[wire.Rollout]) -> bytes:
        b = wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=SWARM,
            producer=PRODUCER.public,
            seq=seq,
            created_ms=int(clock() * 1000),
            rollouts=rollouts,
        )
        return wire.seal(PRODUCER, wire.ROLLOUT_BATCH, b, swarm=SWARM)

    fresh = make_rollout(reg, 2, 16, version=20, lineage=PARTIAL_LINEAGE)
    for seq, rollouts in enumerate(([partial(4, 15)], [fresh, partial(6, 15)], [partial(8, 15), fresh]), 1):
        step = p.admit(batch(seq, rollouts), PRODUCER.peer_id)
        assert getattr(step, "reason", None) is Reason.STALE_VERSION, (seq, step)
    assert p.check(batch(9, [fresh, partial(10, 16)]), PRODUCER.peer_id).accepted


def test_the_byte_length_ttl_and_token_budget_edges_are_inclusive(reg) -> None:
    """Exactly the byte limit is read (and fails to decode, not for its size); a batch made exactly the
    replay TTL ago, or exactly MAX_FUTURE_S ahead, is fresh; a completion of exactly this node's budget is
    verified."""
    from murmur.gossip.validation import MAX_FUTURE_S

    p, clock = pipe(reg, max_completion_tokens=64)
    limit = wire.KIND_LIMITS[wire.ROLLOUT_BATCH]
    assert p.check(b"\x00" * limit, MALLORY.peer_id).reason is Reason.MALFORMED
    assert p.check(b"\x00" * (limit + 1), MALLORY.peer_id).reason is Reason.OVERSIZED
    clock.t = float(int(clock.t))
    made = int(clock.t * 1000)
    ttl_ms = int(p.config.replay_ttl_s * 1000)
    assert p.check(make_batch(ALICE, reg, 1, created_ms=made - ttl_ms), ALICE.peer_id).accepted
    assert p.check(make_batch(ALICE, reg, 2, created_ms=made - ttl_ms - 1), ALICE.peer_id).reason is Reason.EXPIRED
    assert p.check(make_batch(ALICE, reg, 3, created_ms=made + int(MAX_FUTURE_S * 1000)), ALICE.peer_id).accepted
    assert p.check(make_batch(ALICE, reg, 4, tokens=64), ALICE.peer_id).accepted
    assert p.check(make_batch(ALICE, reg, 5, tokens=65), ALICE.peer_id).reason is Reason.TOO_LONG


def test_an_abandoned_batch_can_be_verified_again(reg) -> None:
    p, _ = pipe(reg)
    data = make_batch(ALICE, reg, 1)
    step = p.admit(data, ALICE.peer_id)
    assert isinstance(step, Pending)
    p.abandon(step)  # the I/O layer was cancelled between stages
    assert p.check(data, ALICE.peer_id).accepted


def test_a_reward_within_the_tolerance_is_accepted_and_a_nan_recomputation_never_is(reg) -> None:
    from murmur.gossip.validation import REWARD_TOLERANCE

    def claiming(reward: float, seq: int) -> bytes:
        r = msgspec.structs.replace(make_rollout(reg, 3, 8), reward=reward)
        b = wire.RolloutBatch(
            v=wire.FORMAT_VERSION, swarm=SWARM, producer=ALICE.public, seq=seq, created_ms=wire.now_ms(), rollouts=[r]
        )
        return wire.seal(ALICE, wire.ROLLOUT_BATCH, b, swarm=SWARM)

    p, clock = pipe(reg)
    p.reward = lambda task, text: 0.0
    assert p.check(claiming(REWARD_TOLERANCE, 1), ALICE.peer_id).accepted
    assert p.check(claiming(2 * REWARD_TOLERANCE, 2), ALICE.peer_id).reason is Reason.FORGED_REWARD
    p, clock = pipe(reg)  # a fresh pipeline: the forgery above banned Alice
    p.reward = lambda task, text: float("nan")
    assert not p.check(claiming(0.0, 3), ALICE.peer_id).accepted
