"""Fuzzing every decoder: only `DecodeError` may come out of hostile bytes (the mutation runs leave this
file out: it takes tens of seconds; see docs/testing.md)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError
from tests.samples import bodies

KINDS = list(wire.BODY_TYPES)
SWARM = "test-wire"


_VALID: dict[str, bytes] = {}


def _valid(kind: str) -> bytes:
    if kind not in _VALID:
        from murmur.gossip.identity import Identity

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
            yield _mutate(
                valid, [(rng.randint(0, 3), rng.randint(0, 1 << 20), byte()) for _ in range(rng.randint(1, 4))]
            )


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
    for data in itertools.chain(
        _single_byte_sweep(_valid(kind)), _seeded_inputs(_valid(kind), seed=KINDS.index(kind), n=PRNG_INPUTS)
    ):
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
    for data in itertools.chain(
        _single_byte_sweep(body), _seeded_inputs(body, seed=100 + KINDS.index(kind), n=PRNG_INPUTS)
    ):
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
