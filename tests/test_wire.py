"""Wire formats: round trips, signing domains and limits (every decoder is fuzzed in test_wire_fuzz.py)."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError, SignatureError
from tests.samples import bodies, rollout

KINDS = list(wire.BODY_TYPES)
SWARM = "test-wire"


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(identity, kind):
    body = bodies(identity)[kind]
    data = wire.seal(identity, kind, body, swarm=SWARM)
    env, decoded = wire.open_envelope(data, kind, swarm=SWARM)
    assert env.signer == identity.public
    assert decoded == body


@pytest.mark.parametrize("kind", KINDS)
def test_every_flipped_bit_fails(identity, kind):
    data = wire.seal(identity, kind, bodies(identity)[kind], swarm=SWARM)
    for i in range(len(data) * 8):
        mutated = bytearray(data)
        mutated[i // 8] ^= 1 << (i % 8)
        with pytest.raises(DecodeError):
            wire.open_envelope(bytes(mutated), kind, swarm=SWARM)


def test_domain_separation(identity):
    """A body signed as one kind never verifies as another."""
    data = wire.seal(identity, wire.ROLLOUT_BATCH, bodies(identity)[wire.ROLLOUT_BATCH], swarm=SWARM)
    env = wire.decode_envelope(data, swarm=SWARM)
    for other in KINDS:
        if other == env.kind:
            continue
        forged = wire.encode(wire.Envelope(env.v, other, env.swarm, env.body, env.signer, env.sig))
        with pytest.raises(DecodeError):
            wire.open_envelope(forged, swarm=SWARM)


def test_signature_by_other_key(identity, other_identity):
    body = bodies(identity)[wire.ROLLOUT_BATCH]
    data = wire.seal(other_identity, wire.ROLLOUT_BATCH, body, swarm=SWARM)  # producer field names `identity`
    with pytest.raises(SignatureError, match="producer"):
        wire.open_envelope(data, swarm=SWARM)
    env = wire.decode_envelope(data, swarm=SWARM)
    swapped = wire.encode(wire.Envelope(env.v, env.kind, env.swarm, env.body, identity.public, env.sig))
    with pytest.raises(SignatureError):
        wire.open_envelope(swapped, swarm=SWARM)


def test_kind_size_limits(identity):
    big = wire.RolloutBatch(
        v=wire.FORMAT_VERSION,
        swarm="t",
        producer=identity.public,
        seq=1,
        created_ms=1,
        rollouts=[rollout(n_tokens=4096) for _ in range(64)],
    )
    with pytest.raises(ValueError, match="over its limit"):
        wire.seal(identity, wire.ROLLOUT_BATCH, big, swarm=SWARM)
    with pytest.raises(DecodeError, match="over the"):
        wire.decode_envelope(b"\x00" * (wire.MAX_ENVELOPE_BYTES + 1), swarm=SWARM)


def test_semantic_checks(identity):
    bad = rollout()
    bad.logprobs = bad.logprobs[:-4]
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm="t", producer=identity.public, seq=1, created_ms=1, rollouts=[bad]
    )
    with pytest.raises(DecodeError, match="logprob bytes"):
        wire.open_envelope(wire.seal(identity, wire.ROLLOUT_BATCH, batch, swarm=SWARM), swarm=SWARM)
    m = bodies(identity)[wire.PATCH_MANIFEST]
    m.total_bytes = 301
    with pytest.raises(DecodeError, match="add up"):
        wire.open_envelope(wire.seal(identity, wire.PATCH_MANIFEST, m, swarm=SWARM), swarm=SWARM)


def test_swarm_is_signed_and_checked(identity):
    """An envelope signed in one swarm is refused in another, and relabelling it breaks the signature."""
    data = wire.seal(identity, wire.NODE_ANNOUNCE, bodies(identity)[wire.NODE_ANNOUNCE], swarm="swarm-a")
    env, _ = wire.open_envelope(data, swarm="swarm-a")
    assert env.swarm == "swarm-a" and env.v == 2
    with pytest.raises(wire.WrongSwarm):
        wire.open_envelope(data, swarm="swarm-b")
    relabelled = wire.encode(wire.Envelope(env.v, env.kind, "swarm-b", env.body, env.signer, env.sig))
    with pytest.raises(SignatureError):
        wire.open_envelope(relabelled, swarm="swarm-b")
    # the swarm is length-prefixed in the signing domain: no (swarm, body) re-split verifies
    assert wire.signing_domain("k", 2, "a\x00b") != wire.signing_domain("k", 2, "a") + b"b"
    for bad in ("", "x" * (wire.MAX_NAME + 1)):
        with pytest.raises(ValueError):
            wire.seal(identity, wire.NODE_ANNOUNCE, bodies(identity)[wire.NODE_ANNOUNCE], swarm=bad)


def test_wrong_format_version(identity):
    data = wire.seal(identity, wire.NODE_ANNOUNCE, bodies(identity)[wire.NODE_ANNOUNCE], swarm=SWARM)
    env = wire.decode_envelope(data, swarm=SWARM)
    future = wire.encode(wire.Envelope(wire.FORMAT_VERSION + 1, env.kind, env.swarm, env.body, env.signer, env.sig))
    with pytest.raises(DecodeError, match="format version"):
        wire.decode_envelope(future, swarm=SWARM)


def test_huge_length_prefix_does_not_allocate():
    # msgpack bin32 header claiming 4 GiB, array32 claiming 2^32 entries
    import tracemalloc

    tracemalloc.start()
    for data in (b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff\x01", b"\x95\x01\xa1x\xc6\xff\xff\xff\xf0"):
        with pytest.raises(DecodeError):
            wire.open_envelope(data, swarm=SWARM)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


# ---------------------------------------------------------------- the documented limits, at and past each edge


def _set_rollout(**fields):
    def apply(body):
        body.rollouts = [msgspec.structs.replace(body.rollouts[0], **fields)]

    return apply


def _tokens(n: int):
    return _set_rollout(completion_ids=[1] * n, logprobs=struct.pack(f"<{n}f", *([-0.5] * n)), token_versions=[(0, 3)])


def _segments(n: int):
    return _set_rollout(
        completion_ids=[1] * 64, logprobs=struct.pack("<64f", *([-0.5] * 64)), token_versions=[(i, 3) for i in range(n)]
    )


def _logprob(x: float):
    return _set_rollout(completion_ids=[1, 2], logprobs=struct.pack("<2f", -0.5, x), token_versions=[(0, 3)])


def _sampling(**kw):
    return _set_rollout(sampling=wire.SamplingParams(**{"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, **kw}))


def _generator(**kw):
    def apply(body):
        body.generators = [msgspec.structs.replace(body.generators[0], **kw)]

    return apply


def _attr(name: str, value):
    def apply(body):
        setattr(body, name, value)

    return apply


def _chunks(n: int, size: int, chunk_bytes: int):
    def apply(body):
        body.chunks, body.total_bytes, body.chunk_bytes = [wire.ChunkRef(b"\x08" * 32, size)] * n, n * size, chunk_bytes

    return apply


def _demand(**kw):
    fields = dict(
        lineage=b"\x01" * 32, name="main", head_version=1, rollouts_per_step=8, step_time_s=1.0, max_staleness=4
    )
    return _attr("owned", [wire.LineageDemand(**{**fields, **kw})])


R, T, P, A = wire.ROLLOUT_BATCH, wire.TASK_SET, wire.PATCH_MANIFEST, wire.NODE_ANNOUNCE
# (kind, what docs/protocol.md states, the edge that decodes, the value just past it, which does not)
LIMITS = [
    (R, "rollouts 1-64", _attr("rollouts", [rollout()] * 64), _attr("rollouts", [rollout()] * 65)),
    (R, "rollouts 1-64 (none)", _attr("rollouts", [rollout()]), _attr("rollouts", [])),
    (R, "completion_ids <= 4096", _tokens(4096), _tokens(4097)),
    (R, "text <= 32 Ki chars", _set_rollout(text="x" * 32 * 1024), _set_rollout(text="x" * (32 * 1024 + 1))),
    (R, "token_versions <= 64", _segments(64), _segments(65)),
    (R, "log-prob >= -1000", _logprob(-1000.0), _logprob(-1000.1)),
    (R, "log-prob <= 0.001", _logprob(0.0009), _logprob(0.0011)),
    (R, "temperature 0 (greedy)", _sampling(temperature=0.0), _sampling(temperature=0.0099)),
    (R, "temperature >= 0.01", _sampling(temperature=0.01), _sampling(temperature=0.0099)),
    (R, "temperature <= 10", _sampling(temperature=10.0), _sampling(temperature=10.001)),
    (R, "top_p (0, 1]", _sampling(top_p=1.0), _sampling(top_p=1.001)),
    (R, "top_p > 0", _sampling(top_p=1e-9), _sampling(top_p=0.0)),
    (R, "max_new_tokens 1-4096", _sampling(max_new_tokens=4096), _sampling(max_new_tokens=4097)),
    (R, "max_new_tokens >= 1", _sampling(max_new_tokens=1), _sampling(max_new_tokens=0)),
    (R, "reward |x| <= 1e30", _set_rollout(reward=-1e30), _set_rollout(reward=-1.01e30)),
    (R, "schedule_round u32", _set_rollout(schedule_round=2**32 - 1), _set_rollout(schedule_round=2**32)),
    (R, "schedule_round u32 (>= 0)", _set_rollout(schedule_round=0), _set_rollout(schedule_round=-1)),
    (R, "swarm 1-128 chars", _attr("swarm", "s" * 128), _attr("swarm", "s" * 129)),
    (R, "swarm 1-128 chars (empty)", _attr("swarm", "s"), _attr("swarm", "")),
    (R, "seq u64", _attr("seq", 2**63 - 1), _attr("seq", -1)),
    (
        R,
        "token_versions: versions >= version",
        _set_rollout(
            version=1000,
            completion_ids=[1] * 4,
            logprobs=struct.pack("<4f", *([-0.5] * 4)),
            token_versions=[(0, 1000), (2, 1001)],
        ),
        _set_rollout(
            version=1000, completion_ids=[1] * 4, logprobs=struct.pack("<4f", *([-0.5] * 4)), token_versions=[(0, 999)]
        ),
    ),
    (R, "v = 2", _attr("v", 2), _attr("v", 1)),
    (R, "v = 2 (a later format)", _attr("v", 2), _attr("v", 3)),
    (
        R,
        "task_set 32 bytes",
        _set_rollout(task=wire.TaskRef(b"\x01" * 32, "add", 7)),
        _set_rollout(task=wire.TaskRef(b"\x01" * 31, "add", 7)),
    ),
    (
        R,
        "completion_ids u32",
        _set_rollout(completion_ids=[2**32 - 1], logprobs=struct.pack("<f", -0.5), token_versions=[(0, 3)]),
        _set_rollout(completion_ids=[2**32], logprobs=struct.pack("<f", -0.5), token_versions=[(0, 3)]),
    ),
    (
        R,
        "segment index <= token count",
        _set_rollout(token_versions=[(0, 3), (8, 3)]),
        _set_rollout(token_versions=[(0, 3), (9, 3)]),
    ),
    (
        R,
        "segment indices increasing",
        _set_rollout(token_versions=[(0, 3), (2, 3)]),
        _set_rollout(token_versions=[(0, 3), (2, 3), (1, 3)]),
    ),
    (
        R,
        "generator <= 128 chars",
        _set_rollout(task=wire.TaskRef(b"\x01" * 32, "g" * 128, 7)),
        _set_rollout(task=wire.TaskRef(b"\x01" * 32, "g" * 129, 7)),
    ),
    (
        T,
        "generators 1-64",
        _attr("generators", [wire.GeneratorSpec(f"g{i}", "arithmetic", {}, 0, 10) for i in range(64)]),
        _attr("generators", [wire.GeneratorSpec(f"g{i}", "arithmetic", {}, 0, 10) for i in range(65)]),
    ),
    (T, "tolerance 0-1e6", _attr("tolerance", 0.0), _attr("tolerance", -0.001)),
    (T, "tolerance <= 1e6", _attr("tolerance", 1e6), _attr("tolerance", 1e6 + 0.5)),
    (T, "seed range non-empty", _generator(seed_start=5, seed_end=6), _generator(seed_start=5, seed_end=5)),
    (T, "description <= 4096", _attr("description", "d" * 4096), _attr("description", "d" * 4097)),
    (
        T,
        "config <= 32 entries",
        _generator(config={f"k{i}": i for i in range(32)}),
        _generator(config={f"k{i}": i for i in range(33)}),
    ),
    (T, "weight > 0", _generator(weight=1e-9), _generator(weight=0.0)),
    (T, "a config float |x| <= 1e30", _generator(config={"x": 1e30}), _generator(config={"x": 1.01e30})),
    (P, "chunks <= 8192", _chunks(8192, 1, 256), _chunks(8193, 1, 256)),
    (P, "chunk_bytes <= 8 MiB", _chunks(1, 8 << 20, 8 << 20), _chunks(1, 1, (8 << 20) + 1)),
    (P, "chunk size >= 1", _chunks(1, 1, 256), _chunks(1, 0, 256)),
    (P, "target_hash 16-32 bytes", _attr("target_hash", b"\x07" * 32), _attr("target_hash", b"\x07" * 33)),
    (P, "target_hash >= 16 bytes", _attr("target_hash", b"\x07" * 16), _attr("target_hash", b"\x07" * 15)),
    (P, "base_hash <= 32 bytes", _attr("base_hash", b"\x06" * 32), _attr("base_hash", b"\x06" * 33)),
    (P, "lineage_name 1-128", _attr("lineage_name", "n" * 128), _attr("lineage_name", "n" * 129)),
    (A, "memory_bytes >= 0", _attr("memory_bytes", 0), _attr("memory_bytes", -1)),
    (A, "roles <= 8", _attr("roles", ["trainer"] * 8), _attr("roles", ["trainer"] * 9)),
    (
        A,
        "lineages_followed <= 64",
        _attr("lineages_followed", [b"\x01" * 32] * 64),
        _attr("lineages_followed", [b"\x01" * 32] * 65),
    ),
    (
        A,
        "owned <= 16",
        lambda b: _demand()(b) or setattr(b, "owned", b.owned * 16),
        lambda b: _demand()(b) or setattr(b, "owned", b.owned * 17),
    ),
    (A, "addrs <= 16", _attr("addrs", ["/ip4/127.0.0.1/tcp/1"] * 16), _attr("addrs", ["/ip4/127.0.0.1/tcp/1"] * 17)),
    (A, "standby <= 256", _demand(standby=["p"] * 256), _demand(standby=["p"] * 257)),
    (A, "step_time_s 0-1e6", _demand(step_time_s=1e6), _demand(step_time_s=1e6 + 0.5)),
    (A, "memory_bytes <= 2^50", _attr("memory_bytes", 2**50), _attr("memory_bytes", 2**50 + 1)),
    (A, "rollouts_per_step <= 1e6", _demand(rollouts_per_step=1_000_000), _demand(rollouts_per_step=1_000_001)),
    (A, "publish_batches_per_s 0-1e6", _attr("publish_batches_per_s", 1e6), _attr("publish_batches_per_s", 1e6 + 0.5)),
    (A, "publish_batches_per_s >= 0", _attr("publish_batches_per_s", 0.0), _attr("publish_batches_per_s", -0.001)),
]


@pytest.mark.parametrize("kind,rule,at,past", LIMITS, ids=[f"{k}:{r}" for k, r, _, _ in LIMITS])
def test_every_documented_limit_holds_at_its_edge(identity, kind, rule, at, past):
    """docs/protocol.md's limits, exactly: the edge decodes, one step past it is a DecodeError."""
    body = bodies(identity)[kind]
    at(body)
    wire.open_envelope(wire.seal(identity, kind, body, swarm=SWARM), kind, swarm=SWARM)
    body = bodies(identity)[kind]
    past(body)
    with pytest.raises(DecodeError):
        wire.open_envelope(wire.seal(identity, kind, body, swarm=SWARM), kind, swarm=SWARM)


def test_the_size_limit_of_any_message_and_a_swarm_name_are_the_documented_ones(identity):
    """900 KiB for any message, checked before decoding: a frame over it is refused as such, unread.
    A swarm name of 128 characters is one (129 is refused: test_swarm_is_signed_and_checked)."""
    data = wire.seal(identity, wire.NODE_ANNOUNCE, bodies(identity)[wire.NODE_ANNOUNCE], swarm="s" * 128)
    assert wire.open_envelope(data, swarm="s" * 128)[0].swarm == "s" * 128
    with pytest.raises(DecodeError, match="over the 921600-byte limit"):
        wire.decode_envelope(b"\x00" * (900 * 1024 + 1), swarm=SWARM)
    with pytest.raises(DecodeError, match="malformed envelope"):  # read, and found not to be an envelope
        wire.decode_envelope(b"\x00" * (900 * 1024), swarm=SWARM)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_size_limit_is_the_documented_one(identity, kind):
    """docs/protocol.md: 512 KiB for a rollout batch or a patch manifest, 128 KiB for a task set, 16 KiB for an
    announce, checked on the raw bytes before the body is read."""
    limit = {wire.ROLLOUT_BATCH: 512, wire.PATCH_MANIFEST: 512, wire.TASK_SET: 128, wire.NODE_ANNOUNCE: 16}[kind] * 1024

    def envelope_of(size: int) -> bytes:  # an envelope of exactly `size` bytes (its body is padding)
        pad = size - len(wire.encode(wire.Envelope(2, kind, SWARM, b"", identity.public, b"\x00" * 64)))
        for n in range(pad, pad - 6, -1):  # the body's length prefix grows with it
            data = wire.encode(wire.Envelope(2, kind, SWARM, b"\x00" * n, identity.public, b"\x00" * 64))
            if len(data) == size:
                return data
        raise AssertionError(size)

    assert wire.decode_envelope(envelope_of(limit), kind, swarm=SWARM).kind == kind
    with pytest.raises(DecodeError, match="over its limit"):
        wire.decode_envelope(envelope_of(limit + 1), kind, swarm=SWARM)


@pytest.mark.parametrize("kind", KINDS)
def test_every_body_is_a_msgpack_array_of_its_fields_in_order(identity, kind):
    """The wire format other implementations read: each body (and the envelope) a msgpack array, its
    fields in the order docs/protocol.md lists them."""

    def same_shape(obj, raw) -> None:  # every Struct, nested too, an array of its fields in order
        if isinstance(obj, msgspec.Struct):
            assert isinstance(raw, list) and len(raw) == len(obj.__struct_fields__), type(obj).__name__
            for name, item in zip(obj.__struct_fields__, raw):
                same_shape(getattr(obj, name), item)
        elif isinstance(obj, (list, tuple)):
            assert len(obj) == len(raw)
            for o, r in zip(obj, raw):
                same_shape(o, r)

    body = bodies(identity)[kind]
    if kind == wire.NODE_ANNOUNCE:
        _demand()(body)
    raw = msgspec.msgpack.decode(wire.encode(body))
    same_shape(body, raw)
    assert raw[0] == wire.FORMAT_VERSION  # `v` first
    env = msgspec.msgpack.decode(wire.seal(identity, kind, body, swarm=SWARM))
    assert isinstance(env, list) and env[:3] == [wire.FORMAT_VERSION, kind, SWARM]


def test_omitted_sampling_fields_decode_to_the_documented_defaults():
    """A sender that omits SamplingParams' fields (an array cut short) means temperature 1, top_p 1 and
    64 new tokens (docs/protocol.md), which a spot check then samples with."""
    s = msgspec.msgpack.decode(b"\x90", type=wire.SamplingParams)
    assert (s.temperature, s.top_p, s.max_new_tokens) == (1.0, 1.0, 64)


def test_a_local_structure_is_read_up_to_its_limit_and_no_further():
    data = wire.encode(wire.TaskRef(b"\x01" * 32, "add", 7))
    assert wire.decode_struct(data, wire.TaskRef, len(data)).seed == 7
    assert wire.decode_struct(data, wire.TaskRef, 1024).seed == 7
    with pytest.raises(DecodeError, match="over its limit"):
        wire.decode_struct(data, wire.TaskRef, len(data) - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_message_of_another_kind_than_expected_is_refused(identity, kind):
    data = wire.seal(identity, kind, bodies(identity)[kind], swarm=SWARM)
    for expected in KINDS:
        if expected != kind:
            with pytest.raises(DecodeError, match="expected a"):
                wire.open_envelope(data, expected, swarm=SWARM)


def test_a_signature_of_the_wrong_length_is_malformed_not_forged(identity):
    """A receiver charges a bad signature as forgery; a signature field that is not 64 bytes is garbage."""
    data = wire.seal(identity, wire.NODE_ANNOUNCE, bodies(identity)[wire.NODE_ANNOUNCE], swarm=SWARM)
    env = wire.decode_envelope(data, swarm=SWARM)
    for sig in (env.sig + b"\x00", env.sig[:63]):
        bad = wire.encode(wire.Envelope(env.v, env.kind, env.swarm, env.body, env.signer, sig))
        with pytest.raises(DecodeError) as caught:
            wire.decode_envelope(bad, swarm=SWARM)
        assert not isinstance(caught.value, SignatureError)


def _sealed_raw(identity, kind: str, raw) -> bytes:
    """`raw` (the body as plain msgpack values) signed as a `kind` body."""
    body = msgspec.msgpack.encode(raw)
    sig = identity.sign(wire.signing_domain(kind, wire.FORMAT_VERSION, SWARM) + body)
    return wire.encode(wire.Envelope(wire.FORMAT_VERSION, kind, SWARM, body, identity.public, sig))


@pytest.mark.parametrize("kind", KINDS)
def test_an_element_past_a_structs_last_field_is_refused(identity, kind):
    """Fields are positional: an extra element, at the top or in a nested Struct, is not ignored."""
    raw = msgspec.msgpack.decode(wire.encode(bodies(identity)[kind]))
    wire.open_envelope(_sealed_raw(identity, kind, raw), kind, swarm=SWARM)
    nested = {
        wire.ROLLOUT_BATCH: lambda r: r[5][0][0],
        wire.TASK_SET: lambda r: r[7][0],
        wire.PATCH_MANIFEST: lambda r: r[12][0],
        wire.NODE_ANNOUNCE: lambda r: r,
    }[kind]
    for grow in (lambda r: r, nested):
        raw = msgspec.msgpack.decode(wire.encode(bodies(identity)[kind]))
        grow(raw).append(1)
        with pytest.raises(DecodeError):
            wire.open_envelope(_sealed_raw(identity, kind, raw), kind, swarm=SWARM)


def test_an_announce_that_omits_its_trailing_fields_states_nothing_for_them(identity):
    """`serving`, `owned`, `addrs` and `publish_batches_per_s` may be left off the end: no lineage served
    or owned, no address, no publishing rate stated (0)."""
    raw = msgspec.msgpack.decode(wire.encode(bodies(identity)[wire.NODE_ANNOUNCE]))[:11]
    _, a = wire.open_envelope(_sealed_raw(identity, wire.NODE_ANNOUNCE, raw), swarm=SWARM)
    assert (a.serving, a.owned, a.addrs, a.publish_batches_per_s) == (b"", [], [], 0.0)


def _logprobs(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1000.5, 0.5])
def test_a_non_finite_logprob_is_refused_in_a_rollout_longer_than_256_tokens(bad: float) -> None:
    for n in (300, 4096):
        for j in (0, n // 2, n - 1):
            values = [-0.25] * n
            values[j] = bad
            fault = wire.logprob_fault(_logprobs(values))
            assert fault and f"at token {j} " in fault, (n, j, fault)
        assert wire.logprob_fault(_logprobs([-0.25] * n)) == ""


_MAX_F32 = struct.unpack("<f", struct.pack("<f", wire.LOGPROB_MAX))[0]
_EDGES = [
    math.nan,
    math.inf,
    -math.inf,
    wire.LOGPROB_MIN,
    _MAX_F32,
    math.nextafter(wire.LOGPROB_MIN, -math.inf),
    float(struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", _MAX_F32))[0] + 1))[0]),
    -0.0,
    0.0,
    -104.0,
]


def _in_range(x: float) -> bool:
    return wire.LOGPROB_MIN <= x <= _MAX_F32


@settings(max_examples=200, deadline=None)
@given(n=st.sampled_from([255, 256, 257]), data=st.data())
def test_both_forms_of_the_logprob_check_agree_at_their_boundary(n: int, data: Any) -> None:
    """Up to 256 values are checked in Python, more with numpy: at 255, 256 and 257 values, with NaN, +-inf,
    the bounds and the float32 just past each, both forms refuse exactly the out-of-range values and name
    the first one."""
    f32 = st.floats(min_value=wire.LOGPROB_MIN, max_value=_MAX_F32, width=32)
    values = [data.draw(f32)] * n
    for _ in range(data.draw(st.integers(0, 4))):
        values[data.draw(st.integers(0, n - 1))] = data.draw(st.one_of(st.sampled_from(_EDGES), f32))
    values = list(struct.unpack(f"<{n}f", _logprobs(values)))  # as the receiver reads them
    fault = wire.logprob_fault(_logprobs(values))
    bad = [j for j, x in enumerate(values) if not _in_range(x)]
    if not bad:
        assert fault == ""
    else:
        assert f"at token {bad[0]} " in fault, (bad, fault)


def test_a_message_of_exactly_its_kinds_limit_is_sealed(identity, monkeypatch):
    body = bodies(identity)[wire.NODE_ANNOUNCE]
    n = len(wire.seal(identity, wire.NODE_ANNOUNCE, body, swarm=SWARM))
    monkeypatch.setitem(wire.KIND_LIMITS, wire.NODE_ANNOUNCE, n)
    assert len(wire.seal(identity, wire.NODE_ANNOUNCE, body, swarm=SWARM)) == n
    monkeypatch.setitem(wire.KIND_LIMITS, wire.NODE_ANNOUNCE, n - 1)
    with pytest.raises(ValueError, match="over its limit"):
        wire.seal(identity, wire.NODE_ANNOUNCE, body, swarm=SWARM)


def test_two_segments_may_not_start_at_one_index(identity):
    body = bodies(identity)[wire.ROLLOUT_BATCH]
    _set_rollout(token_versions=[(0, 3), (2, 3), (2, 4)])(body)
    with pytest.raises(DecodeError, match="token_versions"):
        wire.open_envelope(wire.seal(identity, wire.ROLLOUT_BATCH, body, swarm=SWARM), swarm=SWARM)


def test_a_patch_may_target_its_own_base_but_not_one_before_it(identity):
    m = bodies(identity)[wire.PATCH_MANIFEST]
    for base, target, ok in ((5, 5, True), (5, 6, True), (6, 5, False)):
        data = wire.seal(
            identity,
            wire.PATCH_MANIFEST,
            msgspec.structs.replace(m, base_version=base, target_version=target),
            swarm=SWARM,
        )
        if ok:
            assert wire.open_envelope(data, swarm=SWARM)[1].target_version == target
        else:
            with pytest.raises(DecodeError, match="precedes its base"):
                wire.open_envelope(data, swarm=SWARM)
