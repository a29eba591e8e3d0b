"""Attacks on the rollout verification pipeline by peers that hold valid keys (issue 15).

Each test is the attack first, then what the defence must guarantee: the fault
costs only the peer that provably committed it, and honest peers keep their score.
"""

from __future__ import annotations

import math
import struct

import msgspec
import pytest

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError
from murmur.gossip.identity import Identity
from murmur.gossip.validation import Pending, Pipeline, PipelineConfig, Reason
from murmur.simulations.bench.gossip import SWARM, make_batch, make_rollout, registry, seal_rollouts
from murmur.training import tokencheck
from murmur.training.tasksets import BUILTIN_TRAIN, sign_task_set
from murmur.training.verifiers import VerifierPool, score
from tests.samples import Clock, bodies

ALICE = Identity.from_seed(b"\x01" * 32)
MALLORY = Identity.from_seed(b"\x02" * 32)
EVE = Identity.from_seed(b"\x03" * 32)
COORD = Identity.from_seed(b"\x0c" * 32)
SLOW_ANSWER = "\\boxed{9^{9^{9^{9}}}}"  # math-verify's sympy works on this for seconds


@pytest.fixture(scope="module")
def reg():
    r = registry()
    m = wire.TaskSetManifest(
        v=wire.FORMAT_VERSION,
        name="mv",
        version=1,
        coordinator=COORD.public,
        created_ms=1,
        verifier="math_verify",
        tolerance=0.0,
        generators=[
            wire.GeneratorSpec(
                name=BUILTIN_TRAIN,
                generator="arithmetic",
                config={"digits": 1, "ops": "+"},
                seed_start=0,
                seed_end=10**6,
            )
        ],
    )
    r.mv_id = wire.content_id(wire.decode_envelope(env := sign_task_set(COORD, m, swarm=SWARM), swarm=SWARM).body)
    r.add(env, {COORD.public})
    return r


@pytest.fixture(scope="module")
def tiny():
    check = tokencheck.for_model("murmur-tiny")
    assert check is not None
    return check


def pipe(reg, **kw) -> tuple[Pipeline, Clock]:
    clock = Clock()
    deps = dict(
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        task_set_trusted=reg.__contains__,
    )
    deps.update({k: kw.pop(k) for k in ("reward", "reward_batch", "check_tokens", "head_version") if k in kw})
    return Pipeline(PipelineConfig(swarm=SWARM, **kw), **deps), clock


def seal(ident: Identity, rollouts: list[wire.Rollout], seq: int) -> bytes:
    return seal_rollouts(ident, rollouts, seq, SWARM)


# ------------------------------------------------------------ penalties land on the sender of the fault


def test_front_running_relay_cannot_get_the_producer_punished(reg) -> None:
    p, clock = pipe(reg)
    for seq in (1, 2, 3):
        data = make_batch(ALICE, reg, seq)
        # Mallory publishes Alice's batch first, under its own origin (graylisted after two) ...
        assert p.check(data, MALLORY.peer_id).reason in (Reason.SIGNER_MISMATCH, Reason.GRAYLISTED)
        # ... and the honest copy still gets in, at no cost to Alice
        assert p.check(data, ALICE.peer_id).accepted
    assert p.scores.record(ALICE.peer_id).rejections == {}
    assert p.scores.score(ALICE.peer_id, clock()) > 0
    assert p.scores.is_graylisted(MALLORY.peer_id, clock())


def test_relay_of_a_signed_fault_costs_the_relay_not_the_verdict(reg) -> None:
    """Bytes rejected for their signer's fault are charged to that signer on every copy it sends,
    while a relay republishing them under its own origin is charged for the mismatch only."""
    p, clock = pipe(reg)
    forged = make_batch(MALLORY, reg, 1, forge=True)
    assert p.check(forged, MALLORY.peer_id).reason is Reason.FORGED_REWARD
    other = Identity.from_seed(b"\x05" * 32)
    assert p.check(forged, other.peer_id).reason is Reason.SIGNER_MISMATCH
    assert "forged_reward" not in p.scores.record(other.peer_id).rejections


def test_claimed_versions_do_not_move_anyones_head(reg) -> None:
    """Staleness is judged against the publisher-signed head only: a huge claimed version of
    someone else's lineage, accepted or not, never makes honest rollouts stale."""
    p, _ = pipe(reg)
    assert p.check(make_batch(MALLORY, reg, 1, version=10**12), MALLORY.peer_id).accepted
    assert p.check(make_batch(ALICE, reg, 1, version=0), ALICE.peer_id).accepted


def test_soft_rejections_cost_nothing(reg) -> None:
    """What follows from this node's own view (a lagging version, a task set it does not hold)
    is counted, never charged."""
    p, clock = pipe(reg, head_version=lambda lin: 100, max_staleness=4)
    assert p.check(make_batch(ALICE, reg, 1, version=10), ALICE.peer_id).reason is Reason.STALE_VERSION
    assert p.check(make_batch(ALICE, reg, 2, task_set=b"\xee" * 32), ALICE.peer_id).reason is Reason.UNKNOWN_TASK_SET
    assert p.scores.score(ALICE.peer_id, clock()) == 0.0
    assert p.counts["stale_version"] == 1 and p.counts["unknown_task_set"] == 1


# ------------------------------------------------------------ what is learned is what was verified


def tiny_rollout(reg, check: tokencheck.TokenCheck, seed: int, ids: list[int] | None = None) -> wire.Rollout:
    """A correct answer to a built-in task, as murmur-tiny would send it (or with other `ids`)."""
    r = make_rollout(reg, seed * 2, tokens=1)  # even seeds: the text is the right answer, reward 1
    true_ids = check.tokenizer.encode(r.text, add_special_tokens=False)
    ids = true_ids if ids is None else ids
    assert r.reward == 1.0
    return msgspec.structs.replace(
        r,
        completion_ids=ids,
        tokenizer_hash=check.hash,
        logprobs=b"\x00\x00\x80\xbe" * len(ids),
        token_versions=[(0, 0)],
        sampling=wire.SamplingParams(max_new_tokens=max(1, len(ids))),
    )


def test_model_directory_check_is_the_engines_tokenizer(reg, tmp_path) -> None:
    """A node started on a model directory (config.json names qwen2) checks the hash its producers
    send: the check loads the tokenizer as the engine does, or every rollout looks foreign to it."""
    from murmur.training.engine_hf import HFEngine, load_causal_lm
    from murmur.training.tiny import new_tiny_engine

    built = new_tiny_engine()
    built.model.save_pretrained(tmp_path)
    built.tokenizer.save_pretrained(tmp_path)
    engine = HFEngine(*load_causal_lm(tmp_path, device="cpu"))
    check = tokencheck.for_model(str(tmp_path))
    assert check is not None and check.hash == engine.tokenizer_hash == built.tokenizer_hash
    p, _ = pipe(reg, check_tokens=check)
    forged = [tiny_rollout(reg, check, s, ids=[check.vocab - 1] * 3) for s in range(4)]
    assert p.check(seal(MALLORY, forged, 1), MALLORY.peer_id).reason is Reason.TEXT_MISMATCH
    outside = [tiny_rollout(reg, check, 0, ids=[5, check.vocab + 1000])]
    assert p.check(seal(EVE, outside, 1), EVE.peer_id).reason is Reason.BAD_TOKENS


def test_forged_token_ids_with_a_correct_text_are_rejected(reg, tiny) -> None:
    p, clock = pipe(reg, check_tokens=tiny)
    honest = [tiny_rollout(reg, tiny, s) for s in range(4)]
    assert p.check(seal(ALICE, honest, 1), ALICE.peer_id).accepted
    # 24 rollouts whose text is the right answer but whose ids say something else
    forged = [tiny_rollout(reg, tiny, s, ids=[tiny.vocab - 1] * 3) for s in range(24)]
    verdicts = [p.check(seal(MALLORY, forged[i : i + 4], 1 + i), MALLORY.peer_id) for i in range(0, 24, 4)]
    assert not any(v.accepted for v in verdicts)
    assert verdicts[0].reason is Reason.TEXT_MISMATCH and verdicts[0].newly_banned
    assert all(v.reason is Reason.BLACKLISTED for v in verdicts[1:])
    assert p.scores.score(MALLORY.peer_id, clock()) < 0
    assert p.scores.score(ALICE.peer_id, clock()) > 0


def test_ids_outside_the_vocabulary_never_reach_a_model(reg, tiny) -> None:
    p, _ = pipe(reg, check_tokens=tiny)
    bad = [tiny_rollout(reg, tiny, 0, ids=[5, tiny.vocab + 1000])]
    v = p.check(seal(MALLORY, bad, 1), MALLORY.peer_id)
    assert v.reason is Reason.BAD_TOKENS and v.newly_banned


# ------------------------------------------------------------ verifiers are bounded


def slow_batch(reg, ident: Identity, seq: int) -> bytes:
    r = make_rollout(reg, 3, tokens=4, task_set=reg.mv_id)
    slow = msgspec.structs.replace(r, text="reasoning...\n" + SLOW_ANSWER, reward=0.0)
    return seal(
        ident,
        [
            msgspec.structs.replace(
                slow, task=wire.TaskRef(task_set=reg.mv_id, generator=BUILTIN_TRAIN, seed=3 + 2 * i)
            )
            for i in range(16)
        ],
        seq,
    )


def honest_mv_batch(reg, seq: int) -> bytes:
    """Right answers (even seeds) that the fast path settles in microseconds, even on a loaded machine."""
    return seal(ALICE, [make_rollout(reg, 2 * (seq * 10 + i), tokens=4, task_set=reg.mv_id) for i in range(4)], seq)


def test_a_hostile_completion_cannot_hold_the_verifier(reg) -> None:
    # the limit is verifier CPU time (honest batches here need milliseconds of it), with a wall-clock
    # backstop far enough out that a loaded test machine cannot turn the timeout into "unavailable"
    with VerifierPool(workers=1, time_limit_s=0.3, wall_factor=300) as pool:
        p, clock = pipe(reg, reward_batch=pool.score_batch)
        assert p.check(honest_mv_batch(reg, 1), ALICE.peer_id).accepted
        data = slow_batch(reg, MALLORY, 1)
        v = p.check(data, MALLORY.peer_id)
        assert v.reason is Reason.VERIFIER_TIMEOUT and pool.timeouts == 1
        # the verdict is cached: the same bytes again are charged without a second try
        before = p.scores.score(MALLORY.peer_id, clock())
        assert p.check(data, MALLORY.peer_id).reason is Reason.VERIFIER_TIMEOUT
        assert pool.timeouts == 1 and p.scores.score(MALLORY.peer_id, clock()) < before
        # the killed worker was replaced: honest work goes on
        assert p.check(honest_mv_batch(reg, 2), ALICE.peer_id).accepted
        assert p.scores.score(ALICE.peer_id, clock()) > 0


def test_a_verifier_that_cannot_run_costs_the_sender_nothing(reg) -> None:
    """Our own failure (no verifier process, an overloaded machine) is not the producer's fault:
    the batch is dropped unjudged, uncharged and uncached, so a later copy is judged."""
    pool = VerifierPool(workers=1)
    pool.close()
    p, clock = pipe(reg, reward_batch=pool.score_batch)
    data = make_batch(ALICE, reg, 1)
    v = p.check(data, ALICE.peer_id)
    assert v.reason is Reason.VERIFIER_UNAVAILABLE and "closed" in v.detail
    assert p.scores.score(ALICE.peer_id, clock()) == 0.0 and p.seen.get(v.msg_id, clock()) is None
    p.reward_batch = None
    assert p.check(data, ALICE.peer_id).accepted


def test_pool_scores_equal_inline_scores(reg) -> None:
    items = []
    for seed in range(40):
        for ts in (reg.builtin_id, reg.mv_id):
            r = make_rollout(reg, seed, tokens=1, task_set=ts)
            task = reg.resolve(r.task)
            for text in (r.text, f"so the sum is\n<answer>{task.answer}</answer>", "\\boxed{\\frac{1}{2}}", ""):
                items.append((task, text))
    with VerifierPool(workers=1, time_limit_s=30) as pool:
        assert pool.score_batch(items) == [score(t, x) for t, x in items]
        assert pool.cpu_s > 0


def test_an_exception_in_verification_is_a_charged_cached_rejection(reg) -> None:
    calls = []

    def broken(task, text):  # stands for any verifier bug that hostile text could reach
        calls.append(1)
        raise RuntimeError("boom")

    p, clock = pipe(reg, reward=broken)
    data = make_batch(MALLORY, reg, 1)
    v = p.check(data, MALLORY.peer_id)
    assert v.reason is Reason.VERIFIER_ERROR and "boom" in v.detail
    assert p.check(data, MALLORY.peer_id).reason is Reason.VERIFIER_ERROR
    assert len(calls) == 1 and p.scores.record(MALLORY.peer_id).rejections["verifier_error"] == 2


def test_verifier_workers_run_under_a_memory_budget(reg) -> None:
    """A completion that makes a verifier build a huge object must fail inside the worker's address-space
    budget (MemoryError: a charged `verifier_error`), not swap the volunteer's machine."""
    import psutil

    from murmur.training.verifiers import MEMORY_HEADROOM_MB

    with VerifierPool(workers=1) as pool:
        p, clock = pipe(reg, reward_batch=pool.score_batch)
        assert p.check(honest_mv_batch(reg, 1), ALICE.peer_id).accepted  # a worker is up and judged a batch
        (w,) = pool._idle
        proc = psutil.Process(w.proc.pid)
        soft, _ = proc.rlimit(psutil.RLIMIT_AS)
        vms = proc.memory_info().vms
        assert soft != psutil.RLIM_INFINITY and vms < soft <= vms + MEMORY_HEADROOM_MB * 2**20


def loaded_verifier_modules() -> list[str]:
    """Run inside a pool worker: which of the slow verifier imports it has made."""
    import sys

    return sorted(m for m in ("sympy", "math_verify", "reasoning_gym") if m in sys.modules)


def test_a_verifier_worker_imports_only_what_its_batches_need(reg) -> None:
    """Exact and numeric verdicts need neither sympy nor reasoning-gym, so a node on such task sets never
    pays for them; the first math_verify batch makes the worker import math-verify first, and that
    import is charged to nobody: the batch still fits a limit far below the import's cost."""
    from murmur.training.tasks import generate
    from murmur.training.verifiers import WARM_MATH, WARM_RG, _Call

    def imported(pool: VerifierPool) -> list[str]:  # a bare call: `call` itself would import everything
        return pool._run(_Call(loaded_verifier_modules, (), {}), 5.0, frozenset())

    with VerifierPool(workers=1, time_limit_s=0.3, wall_factor=300) as pool:
        p, clock = pipe(reg, reward_batch=pool.score_batch)
        assert p.check(make_batch(ALICE, reg, 1), ALICE.peer_id).accepted  # the built-in set: exact, numeric
        assert imported(pool) == []
        charged = pool.thread_cpu_s()
        assert p.check(honest_mv_batch(reg, 2), ALICE.peer_id).accepted
        assert pool._idle[0].warmed == {WARM_MATH}
        assert "math_verify" in imported(pool) and "reasoning_gym" not in imported(pool)
        assert pool.thread_cpu_s() - charged < 0.3  # the import (about a CPU-second) was not charged
        # a reasoning-gym task: its import too comes before the batch, and the verdicts are the inline ones
        rg = generate("rg:basic_arithmetic", {}, 7)
        items = [(rg, f"<answer>{rg.answer}</answer>"), (rg, "<answer>no</answer>")]
        assert pool.score_batch(items) == [score(t, x) for t, x in items] == [1.0, 0.0]
        assert pool._idle[0].warmed == {WARM_MATH, WARM_RG} and "reasoning_gym" in imported(pool)
        assert pool.timeouts == 0


# ------------------------------------------------------------ poisoned numbers (issue 26)

NAN_F32 = bytes.fromhex("0000c07f")  # float32 0x7fc00000, little-endian: the quiet NaN


def poisoned(reg, ident: Identity, seq: int, logprob: bytes, at: int = 3) -> bytes:
    """A well-formed, correctly rewarded batch whose one behaviour log-prob is `logprob`."""
    rollouts = [make_rollout(reg, seq * 10 + i * 2, tokens=8) for i in range(4)]
    lps = bytearray(rollouts[2].logprobs)
    lps[4 * at : 4 * at + 4] = logprob
    rollouts[2] = msgspec.structs.replace(rollouts[2], logprobs=bytes(lps))
    return seal(ident, rollouts, seq)


@pytest.mark.parametrize(
    "logprob",
    [
        NAN_F32,
        struct.pack("<f", math.inf),
        struct.pack("<f", -math.inf),
        struct.pack("<f", 0.5),
        struct.pack("<f", -3e38),
    ],
    ids=["nan", "+inf", "-inf", "positive", "huge-negative"],
)
def test_non_finite_or_positive_logprobs_are_refused_and_charged(reg, logprob) -> None:
    """One poisoned log-prob in a well-formed, correctly rewarded batch: refused before any
    arithmetic, charged to its signer as a provable fault, and the verdict sticks to the bytes."""
    p, clock = pipe(reg)
    data = poisoned(reg, MALLORY, 1, logprob)
    v = p.check(data, MALLORY.peer_id)
    assert v.reason is Reason.BAD_NUMBER, v.detail
    assert p.counts["bad_number"] == 1
    assert p.scores.record(MALLORY.peer_id).rejections == {"bad_number": 1}
    assert p.scores.is_blacklisted(MALLORY.peer_id, clock())
    # a relay of the same bytes pays for the mismatch only, and the signer's verdict is unchanged
    assert p.check(data, EVE.peer_id).reason is Reason.SIGNER_MISMATCH
    assert "bad_number" not in p.scores.record(EVE.peer_id).rejections
    # honest log-probs at the edge of the range pass
    edge = poisoned(reg, ALICE, 2, struct.pack("<f", 0.0))
    assert p.check(edge, ALICE.peer_id).accepted
    assert p.check(poisoned(reg, ALICE, 3, struct.pack("<f", -104.0)), ALICE.peer_id).accepted


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 0.009])
def test_a_temperature_receivers_would_divide_into_infinity_is_refused(reg, temperature) -> None:
    """Spot checks divide logits by the claimed temperature: one that is finite but tiny would turn
    them into infinities. 0 (greedy) and the usual range stay valid."""
    p, clock = pipe(reg)
    r = make_rollout(reg, 2, tokens=8)
    bad = msgspec.structs.replace(r, sampling=wire.SamplingParams(temperature=temperature))
    assert p.check(seal(MALLORY, [bad], 1), MALLORY.peer_id).reason is Reason.BAD_NUMBER
    for i, t in enumerate((0.0, 0.01, 0.7, 10.0)):
        ok = msgspec.structs.replace(r, sampling=wire.SamplingParams(temperature=t))
        assert p.check(seal(ALICE, [ok], i + 1), ALICE.peer_id).accepted


def test_every_float_field_of_every_kind_refuses_non_finite_values() -> None:
    """The wire decoder refuses NaN and +-inf in every float field of every message kind."""
    ident = Identity.from_seed(b"\x07" * 32)
    base = bodies(ident)
    ann = base[wire.NODE_ANNOUNCE]
    ann.owned = [
        wire.LineageDemand(
            lineage=b"\x01" * 32, name="l", head_version=1, rollouts_per_step=8, step_time_s=2.0, max_staleness=4
        )
    ]
    ts = base[wire.TASK_SET]
    ts.generators[0].config["scale"] = 1.5
    paths = {
        wire.ROLLOUT_BATCH: [
            lambda b, x: setattr(b.rollouts[0], "reward", x),
            lambda b, x: setattr(b.rollouts[0].sampling, "temperature", x),
            lambda b, x: setattr(b.rollouts[0].sampling, "top_p", x),
        ],
        wire.TASK_SET: [
            lambda b, x: setattr(b, "tolerance", x),
            lambda b, x: setattr(b.generators[0], "weight", x),
            lambda b, x: b.generators[0].config.__setitem__("scale", x),
        ],
        wire.NODE_ANNOUNCE: [
            lambda b, x: setattr(b, "gen_tokens_per_s", x),
            lambda b, x: setattr(b, "rollout_latency_s", x),
            lambda b, x: setattr(b, "upload_bytes_per_s", x),
            lambda b, x: setattr(b, "publish_batches_per_s", x),
            lambda b, x: setattr(b.owned[0], "step_time_s", x),
        ],
    }
    for kind, setters in paths.items():
        body = base[kind]
        wire.open_envelope(wire.seal(ident, kind, body, swarm=SWARM), swarm=SWARM)  # the unmodified body is valid
        for set_field in setters:
            for x in (math.nan, math.inf, -math.inf):
                bad = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=type(body))
                set_field(bad, x)
                domain = wire.signing_domain(kind, wire.FORMAT_VERSION, SWARM)
                data = wire.encode(
                    wire.Envelope(
                        wire.FORMAT_VERSION,
                        kind,
                        SWARM,
                        wire.encode(bad),
                        ident.public,
                        ident.sign(domain + wire.encode(bad)),
                    )
                )
                with pytest.raises(DecodeError):
                    wire.open_envelope(data, swarm=SWARM)


def test_the_dialback_frames_only_float_refuses_non_finite_values() -> None:
    from murmur.gossip.dialback import DialbackResponse, DialResult, MalformedDialback, _decode

    ok = DialbackResponse(1, b"\x00" * 16, "", [DialResult("/ip4/127.0.0.1/tcp/1", True, "", 12.5)])
    assert _decode(msgspec.msgpack.encode(ok), DialbackResponse).results[0].ms == 12.5
    for x in (math.nan, math.inf, -1.0):
        ok.results[0].ms = x
        with pytest.raises(MalformedDialback):
            _decode(msgspec.msgpack.encode(ok), DialbackResponse)


# ------------------------------------------------------------ versions beyond the head (issue 26)

OWN = b"\x0a" * 32  # the receiving trainer's own lineage


def test_a_version_beyond_our_own_published_head_is_provably_false(reg) -> None:
    """Only this node publishes its own lineage and knows its head before any manifest leaves:
    a rollout claiming a later version is fabricated (its tokens would escape the stale mask)."""
    p, clock = pipe(reg, head_version=lambda lin: 7, max_staleness=4)
    p.own_lineage = lambda lin: lin == OWN
    assert p.check(make_batch(ALICE, reg, 1, version=7, lineage=OWN), ALICE.peer_id).accepted
    v = p.check(make_batch(MALLORY, reg, 1, version=8, lineage=OWN), MALLORY.peer_id)
    assert v.reason is Reason.FUTURE_VERSION, v.detail
    assert p.scores.record(MALLORY.peer_id).rejections == {"future_version": 1}
    # a later segment counts too: a partial rollout cannot hide a future version in token_versions
    r = make_rollout(reg, 2, tokens=8, version=6, lineage=OWN)
    r = msgspec.structs.replace(r, token_versions=[(0, 6), (4, 9)])
    assert p.check(seal(MALLORY, [r], 2), MALLORY.peer_id).reason is Reason.FUTURE_VERSION
    assert p.scores.record(MALLORY.peer_id).rejections == {"future_version": 2}


def test_a_version_beyond_the_known_head_of_anothers_lineage_is_refused_uncharged(reg) -> None:
    """Of another publisher's lineage the producer may hold a manifest that has not reached us:
    refused, never charged, and not remembered (the same bytes pass once the head arrives)."""
    heads = {b"\x0b" * 32: 7}
    p, clock = pipe(reg, head_version=heads.get, max_staleness=4)
    p.own_lineage = lambda lin: lin == OWN
    data = make_batch(ALICE, reg, 1, version=8, lineage=b"\x0b" * 32)
    assert p.check(data, ALICE.peer_id).reason is Reason.UNKNOWN_VERSION
    assert p.scores.score(ALICE.peer_id, clock()) == 0.0
    heads[b"\x0b" * 32] = 8
    assert p.check(data, ALICE.peer_id).accepted


# ------------------------------------------------------------ work out of proportion (issue 26)


def test_a_completion_longer_than_this_nodes_budget_is_refused_before_verification(reg) -> None:
    """Valid, correct rollouts of 4,096 tokens cost a trainer that samples 64 far more per step than its
    own: refused before any token check or reward, uncharged (an honest node configured with a larger
    `max_new_tokens` produces them); a completion longer than its own signed `max_new_tokens` is
    provably not what it claims, and charged."""
    verified: list[int] = []

    def counting(t, text: str) -> float:
        verified.append(1)
        return score(t, text)

    p, clock = pipe(reg, reward=counting, max_completion_tokens=64)
    long = make_batch(ALICE, reg, 1, tokens=wire.MAX_COMPLETION_TOKENS)
    v = p.check(long, ALICE.peer_id)
    assert v.reason is Reason.TOO_LONG and verified == []
    assert p.check(make_batch(ALICE, reg, 2, tokens=64), ALICE.peer_id).accepted and verified
    assert p.scores.record(ALICE.peer_id).rejections == {}  # the long batch was not charged
    verified.clear()
    r = make_rollout(reg, 3, tokens=48)
    lying = msgspec.structs.replace(r, sampling=wire.SamplingParams(max_new_tokens=16))
    v = p.check(seal(MALLORY, [lying, lying], 5), MALLORY.peer_id)
    assert v.reason is Reason.OVER_OWN_SAMPLING and verified == []
    assert "over_own_sampling" in p.scores.record(MALLORY.peer_id).rejections
    # the default budget is the protocol's limit: nothing valid is too long
    q, _ = pipe(reg)
    assert q.check(long, ALICE.peer_id).accepted


def _give_a_history(p: Pipeline, clock: Clock, reg, ident: Identity, batches: int = 8, every_s: float = 6.0) -> int:
    """`ident`'s batches accepted for a while before the test: an established producer's verified history.
    Returns the last seq used."""
    for seq in range(1, batches + 1):
        clock.t += every_s
        assert p.check(
            make_batch(ident, reg, seq, n=2, tokens=8, created_ms=int(clock.t * 1000)), ident.peer_id
        ).accepted
    clock.t += every_s
    return batches


def test_a_few_keys_sending_costly_batches_cannot_crowd_out_an_honest_producer(reg) -> None:
    """Within the per-key batch rate, three keys send batches that each cost a CPU-second to verify (the I/O
    layer measures and reports it, `Pipeline.spent`): the node's verification stays within its CPU budget,
    an established producer's cheap batches are all verified, and the refusals cost the attackers nothing."""
    from murmur.gossip.cpubudget import BURST_S, NODE_CPU_PER_S

    p, clock = pipe(reg)
    seq = _give_a_history(p, clock, reg, ALICE)
    attackers = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(3)]
    cpu = {k.peer_id: 0.0 for k in attackers}
    honest_ok, refused = 0, 0
    start, steps = clock.t, 160
    for i in range(steps):  # 40 s: each attacker 4 batches/s, the honest producer one a second
        clock.t = start + i * 0.25
        senders = [(k, 1.0) for k in attackers] + ([(ALICE, 0.02)] if i % 4 == 0 else [])
        for k, cost in senders:
            seq += 1
            step = p.admit(make_batch(k, reg, seq, n=2, tokens=8, created_ms=int(clock.t * 1000)), k.peer_id)
            if not isinstance(step, Pending):
                assert step.reason is Reason.CPU_BUDGET and k is not ALICE
                refused += 1
                continue
            p.verify(step)
            p.spent(step, cost)
            assert p.commit(step).accepted
            if k is ALICE:
                honest_ok += 1
            else:
                cpu[k.peer_id] += cost
    assert honest_ok == steps // 4  # every honest batch verified
    elapsed = steps * 0.25
    assert sum(cpu.values()) <= NODE_CPU_PER_S * (elapsed + BURST_S) + len(attackers)  # + one overdraft each
    assert sum(cpu.values()) >= 0.5 * NODE_CPU_PER_S * elapsed  # what no one else uses, they may use
    assert refused > 0 and p.counts["cpu_budget"] == refused
    for k in attackers:
        rec = p.scores.record(k.peer_id)
        assert rec is None or "cpu_budget" not in rec.rejections


def test_verification_cpu_is_measured_in_the_verifying_thread_and_the_pool(reg) -> None:
    """What the I/O layer charges to a sender's share: the verifying thread's CPU plus what the verifier
    processes spent on that thread's calls (and only that thread's)."""
    import threading

    from murmur.gossip.service import verify_timed

    with VerifierPool(workers=1, time_limit_s=30) as pool:
        p, clock = pipe(reg, reward_batch=pool.score_batch)
        step = p.admit(make_batch(ALICE, reg, 1, n=32), ALICE.peer_id)
        before = pool.thread_cpu_s()
        cost = verify_timed(p.verify, step, pool.thread_cpu_s)
        used = pool.thread_cpu_s() - before
        assert used > 0 and cost >= used
        p.spent(step, cost)
        assert p.commit(step).accepted and p.cpu.spent_s == cost
        other: list[float] = []
        t = threading.Thread(target=lambda: other.append(pool.thread_cpu_s()))
        t.start()
        t.join()
        assert other == [0.0]


@pytest.mark.parametrize("keys", [1, 32, 64])
def test_minted_keys_cannot_dilute_an_established_producers_verification_share(reg, keys: int) -> None:
    """Keys are free: with a share per key, an attack at a fixed CPU volume spread over 32 or 64 fresh keys
    shrank an honest producer's guaranteed share to 1/33 or 1/65 of the node's and refused most of its
    batches. Keys without a verified history share one bucket, so however many keys carry the attack, the
    established producer keeps half the node's verification CPU and none of its batches is refused."""
    from murmur.gossip.cpubudget import NODE_CPU_PER_S

    p, clock = pipe(reg)
    _give_a_history(p, clock, reg, ALICE)  # accepted batches for 48 s before the attack
    cpu, honest, t = p.cpu, ALICE.peer_id, clock.t
    attackers = [f"minted-{i}" for i in range(keys)]
    volume, cost = 4.0 * NODE_CPU_PER_S, 1.0  # CPU-s/s the attack offers in all, and what one batch costs
    refused = honest_sent = attack_spent = 0
    dt, next_attack = 0.05, [t + i * cost * keys / volume / keys for i in range(keys)]
    for step in range(int(60 / dt)):  # 60 s: the honest producer sends a 0.2 CPU-s batch every second
        now = t + step * dt
        if step % 20 == 0:
            honest_sent += 1
            if cpu.admit(honest, now) is None:
                cpu.spend(honest, 0.2, now)
            else:
                refused += 1
        for i, k in enumerate(attackers):  # each key offers a batch every keys * cost / volume seconds
            if now >= next_attack[i]:
                next_attack[i] += keys * cost / volume
                if cpu.admit(k, now) is None:
                    cpu.spend(k, cost, now)
                    attack_spent += cost
    assert honest_sent == 60 and refused <= 1, f"{refused} of the honest producer's {honest_sent} batches refused"
    assert attack_spent <= NODE_CPU_PER_S * 60 + keys  # the node stays within its rate (+ one overdraft each)


def test_a_verified_history_takes_enough_batches_over_enough_time_and_stays_bounded() -> None:
    """`CpuBudget.proven`: at least PROVEN_BATCHES accepted batches, the first PROVEN_S ago; until then the
    key's batches draw on the bucket all unproven keys share (one refusal there refuses every one of them)."""
    from murmur.gossip.cpubudget import PROVEN_BATCHES, PROVEN_S, UNPROVEN, CpuBudget

    cpu = CpuBudget(max_peers=3)
    for i in range(PROVEN_BATCHES - 1):
        cpu.verified("p", float(i))
    assert not cpu.proven("p", 1e6)  # enough time, too few batches
    cpu.verified("p", 5.0)
    assert not cpu.proven("p", PROVEN_S - 1e-3) and cpu.proven("p", PROVEN_S)  # counted from the first
    assert not cpu.proven("never", 1e6)
    cpu.spend("fresh-1", 10.0, PROVEN_S)  # an unproven key's cost lands on the shared bucket ...
    assert cpu.admit("fresh-2", PROVEN_S) is not None  # ... so another fresh key waits while the node is busy
    assert set(cpu._peers) == {UNPROVEN} and cpu.admit("p", PROVEN_S) is None  # the proven one has its own
    for k in ("a", "b", "c"):  # the history table is bounded: the least recently verified forgotten first
        cpu.verified(k, 0.0)
    assert len(cpu._history) == 3 and "p" not in cpu._history
