"""Wire formats: round trips, signing domains, limits, and fuzzing every decoder."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossip import wire
from gossip.errors import DecodeError, SignatureError
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
    big = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm="t", producer=identity.public, seq=1, created_ms=1,
                            rollouts=[rollout(n_tokens=4096) for _ in range(64)])
    with pytest.raises(ValueError, match="over its limit"):
        wire.seal(identity, wire.ROLLOUT_BATCH, big, swarm=SWARM)
    with pytest.raises(DecodeError, match="over the"):
        wire.decode_envelope(b"\x00" * (wire.MAX_ENVELOPE_BYTES + 1), swarm=SWARM)


def test_semantic_checks(identity):
    bad = rollout()
    bad.logprobs = bad.logprobs[:-4]
    batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm="t", producer=identity.public, seq=1, created_ms=1, rollouts=[bad])
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


# ---------------------------------------------------------------- fuzzing

_VALID: dict[str, bytes] = {}


def _valid(kind: str) -> bytes:
    if kind not in _VALID:
        from gossip.identity import Identity

        ident = Identity.from_seed(b"\x11" * 32)
        _VALID[kind] = wire.seal(ident, kind, bodies(ident)[kind], swarm=SWARM)
    return _VALID[kind]


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, val in ops:
        if not buf:
            break
        p = pos % len(buf)
        if op == 0:
            buf[p] = val
        elif op == 1:
            del buf[p : p + 1 + val % 8]
        elif op == 2:
            buf[p:p] = bytes([val]) * (1 + val % 5)
        else:
            buf = buf[:p]
    return bytes(buf)


def _mutations():
    return st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4)


def _inputs(kind: str):
    return st.one_of(st.binary(max_size=2048), _mutations().map(lambda ops: _mutate(_valid(kind), ops)))


def _only_decode_errors(fn, data: bytes) -> None:
    try:
        fn(data)
    except DecodeError:
        pass


def _seeded_inputs(valid: bytes, seed: int, n: int):
    """The same mix as `_inputs` (random bytes or 1-4 mutations of a valid frame), drawn by a seeded PRNG."""
    rng = random.Random(seed)

    def byte() -> int:  # msgpack's boundaries (fixint/fixmap edges, nil, sign bit) as often as hypothesis draws them
        return rng.choice(_EDGE_BYTES) if rng.random() < 0.5 else rng.randint(0, 255)

    for _ in range(n):
        if rng.random() < 0.5:
            yield bytes(byte() for _ in range(rng.choice((rng.randint(0, 16), rng.randint(0, 2048)))))
        else:
            yield _mutate(valid, [(rng.randint(0, 3), rng.randint(0, 1 << 20), byte()) for _ in range(rng.randint(1, 4))])


_EDGE_BYTES = (0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xC0, 0xFF)


def _single_byte_sweep(valid: bytes):
    """Every position of a valid frame set to each edge byte and to its neighbours, deleted, and cut there: the
    one-field changes (a version to 0, a count to -1, a length off by one) a random draw finds only by luck."""
    for p in range(len(valid)):
        for v in {*_EDGE_BYTES, (valid[p] + 1) & 0xFF, (valid[p] - 1) & 0xFF}:
            yield valid[:p] + bytes([v]) + valid[p + 1 :]
        yield valid[:p] + valid[p + 1 :]
        yield valid[:p]


# Three parts per decoder: hypothesis' edge-biased inputs (empty, boundary lengths, repeated bytes), its
# per-example draw cost spent on few examples; every single-byte change of a valid frame; and 10,000 seeded
# PRNG inputs of the same mix as hypothesis', which cost microseconds each. All deterministic, so a failure
# reproduces.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
PRNG_INPUTS = 10_000


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_open_envelope(kind):
    @FUZZ
    @given(_inputs(kind))
    def run(data):
        _only_decode_errors(lambda d: wire.open_envelope(d, kind, swarm=SWARM), data)

    run()
    for data in itertools.chain(_single_byte_sweep(_valid(kind)),
                                _seeded_inputs(_valid(kind), seed=KINDS.index(kind), n=PRNG_INPUTS)):
        _only_decode_errors(lambda d: wire.open_envelope(d, kind, swarm=SWARM), data)


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_body_decoders(kind):
    """Bodies fuzzed directly, past the signature check, as a verified-but-malicious signer could send."""
    body = wire.decode_envelope(_valid(kind), swarm=SWARM).body
    signer = wire.decode_envelope(_valid(kind), swarm=SWARM).signer

    def decode(data: bytes) -> None:
        _only_decode_errors(wire.decode_body, wire.Envelope(wire.FORMAT_VERSION, kind, "t", data, signer, b"\x00" * 64))

    @FUZZ
    @given(st.one_of(st.binary(max_size=2048), _mutations().map(lambda ops: _mutate(body, ops))))
    def run(data):
        decode(data)

    run()
    for data in itertools.chain(_single_byte_sweep(body), _seeded_inputs(body, seed=100 + KINDS.index(kind), n=PRNG_INPUTS)):
        decode(data)


def test_fuzz_decode_struct():
    @FUZZ
    @given(st.binary(max_size=4096))
    def run(data):
        _only_decode_errors(lambda d: wire.decode_struct(d, wire.TaskRef, 1024), data)

    run()
    rng = random.Random(7)
    for _ in range(PRNG_INPUTS):
        _only_decode_errors(lambda d: wire.decode_struct(d, wire.TaskRef, 1024), rng.randbytes(rng.randint(0, 4096)))


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
