"""Property tests: the validation pipeline driven with arbitrary well-signed bodies.

An attacker holds a valid key, so everything below is correctly signed; the
content is anything the wire bounds allow (and, for raw bodies, anything at
all). Whatever arrives: no exception escapes `check`, each call runs a bounded
number of Python lines (tests/workbound.py: counted, not timed), and every table
the pipeline keeps stays within its budget.
"""

from __future__ import annotations

import struct
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.scoring import ScoreParams
from murmur.gossip.validation import TASK_CACHE, Pipeline, PipelineConfig, Verdict
from murmur.simulations.bench.gossip import SWARM, registry
from murmur.training import tokencheck
from murmur.training.tasksets import BUILTIN_EVAL, BUILTIN_TRAIN
from murmur.training.verifiers import score
from tests.workbound import lines_run

MALLORY = Identity.from_seed(b"\x02" * 32)
REG = registry()
TINY = tokencheck.for_model("murmur-tiny")
CAP = 64  # replay cache entries: small, so the budget is exercised
# Python lines one check may run: some twenty times what the costliest well-formed check runs; work that
# grew with a claimed number would run millions.
CALL_BOUND_LINES = 20_000
PROPS = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**63 - 1)
hash32 = st.one_of(st.binary(min_size=32, max_size=32), st.just(REG.builtin_id))


def _now_ms() -> int:
    return wire.now_ms()


@st.composite
def rollouts(draw: st.DrawFn) -> wire.Rollout:
    ids = draw(st.lists(st.one_of(st.integers(0, TINY.vocab + 5), u32), max_size=48))
    n_lp = draw(st.sampled_from([len(ids), len(ids), max(0, len(ids) - 1)]))
    text = draw(
        st.one_of(
            st.text(max_size=300),
            st.sampled_from(["7", "<answer>3</answer>", "\\boxed{9^{9^{9}}}", "\\boxed{" * 50, TINY.decode(ids)]),
        )
    )
    return wire.Rollout(
        task=wire.TaskRef(
            task_set=draw(hash32),
            generator=draw(st.sampled_from([BUILTIN_TRAIN, BUILTIN_EVAL, "nope"])),
            seed=draw(st.one_of(st.integers(0, 2_000_000), u64)),
        ),
        lineage=draw(st.binary(min_size=32, max_size=32)),
        version=draw(u64),
        completion_ids=ids,
        text=text,
        tokenizer_hash=draw(st.one_of(st.just(TINY.hash), st.binary(min_size=32, max_size=32))),
        logprobs=struct.pack(f"<{n_lp}f", *([-0.5] * n_lp)),
        token_versions=draw(st.lists(st.tuples(u32, u64), max_size=3)),
        sampling=wire.SamplingParams(),
        reward=draw(st.sampled_from([0.0, 1.0, 0.5, -1e30, 1e30])),
        created_ms=draw(u64),
    )


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION,
        swarm=draw(st.sampled_from([SWARM, "x"])),
        producer=MALLORY.public,
        seq=draw(u64),
        created_ms=draw(st.one_of(st.just(_now_ms()), u64)),
        rollouts=draw(st.lists(rollouts(), min_size=1, max_size=4)),
    )
    return wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM)


def signed_raw(body: bytes) -> bytes:
    """Any body bytes at all, correctly signed by a key the attacker holds."""
    sig = MALLORY.sign(wire.signing_domain(wire.ROLLOUT_BATCH, wire.FORMAT_VERSION, SWARM) + body)
    return wire.encode(wire.Envelope(wire.FORMAT_VERSION, wire.ROLLOUT_BATCH, SWARM, body, MALLORY.public, sig))


def _pipeline() -> Pipeline:
    # a neutral score policy so the attacker is never graylisted and every stage keeps running
    cfg = PipelineConfig(
        swarm=SWARM,
        rate_per_s=1e9,
        burst=10**9,
        replay_entries=CAP,
        score=ScoreParams(graylist_threshold=-1e18, blacklist_s=1e-9),
    )
    return Pipeline(
        cfg,
        clock=time.time,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lin: 5,
        task_set_trusted=REG.__contains__,
        check_tokens=TINY,
    )


PIPE = _pipeline()


def _drive(data: bytes) -> None:
    v, _ = lines_run(PIPE.check, data, MALLORY.peer_id, limit=CALL_BOUND_LINES)
    assert isinstance(v, Verdict), v
    assert len(PIPE.seen) <= CAP and len(PIPE.seqs) <= CAP
    assert len(PIPE._tasks) <= TASK_CACHE and not PIPE._inflight
    assert len(PIPE.per_peer) <= PIPE.scores.max_peers


@PROPS
@given(batches())
def test_arbitrary_well_signed_batches(data: bytes) -> None:
    _drive(data)


@PROPS
@given(st.binary(max_size=4096))
def test_arbitrary_well_signed_body_bytes(body: bytes) -> None:
    _drive(signed_raw(body))


def test_budgets_hold_after_the_run() -> None:
    for i in range(3 * CAP):  # distinct accepted-or-rejected messages past every cache's size
        batch = wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=SWARM,
            producer=MALLORY.public,
            seq=10**9 + i,
            created_ms=_now_ms(),
            rollouts=[
                wire.Rollout(
                    task=wire.TaskRef(task_set=REG.builtin_id, generator=BUILTIN_TRAIN, seed=i),
                    lineage=b"\x01" * 32,
                    version=5,
                    completion_ids=[],
                    text="1",
                    tokenizer_hash=b"\x02" * 32,
                    logprobs=b"",
                    token_versions=[],
                    sampling=wire.SamplingParams(),
                    reward=0.0,
                    created_ms=_now_ms(),
                )
            ],
        )
        _drive(wire.seal(MALLORY, wire.ROLLOUT_BATCH, batch, swarm=SWARM))
    assert len(PIPE.seen) == CAP
