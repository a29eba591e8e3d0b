"""Property tests of the sparse patch codec: bit-exact round trips, every mutation caught, no crash."""

from __future__ import annotations

import math
import struct

import blake3
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.sync.codec import (
    FORMAT,
    POS_BITMASK,
    POS_GAPS,
    POS_GAPS_ESC,
    RAW,
    TRAILER_BYTES,
    VAL_ABS,
    ZSTD,
    PatchHeader,
    TensorEntry,
    assemble,
    decode_patch,
    encode_patch,
    read_header,
)
from murmur.sync.errors import PatchError
from murmur.sync.hashing import bits_view, state_hash

torch.set_num_threads(1)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _random(dtype: torch.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    n = int(np.prod(shape))
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_)).reshape(shape)
    if dtype.is_floating_point:
        return (torch.from_numpy(rng.standard_normal(n)) * 0.02).to(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.from_numpy(rng.integers(info.min, info.max, n, endpoint=True)).to(dtype).reshape(shape)


def _mutate(t: torch.Tensor, density: float, style: str, rng: np.random.Generator) -> torch.Tensor:
    """A copy of `t` with about `density` of its elements changed: ULP nudges, random bits or big jumps."""
    out = t.clone()
    v = bits_view(out)
    n = v.size
    k = int(round(density * n))
    if k == 0:
        return out
    idx = rng.choice(n, size=k, replace=False)
    if style == "ulp":
        step = rng.choice([1, 1, 1, 1, 2, 3, 200], size=k).astype(v.dtype)
        up = rng.integers(0, 2, k).astype(bool)
        v[idx] = np.where(up, v[idx] + step, v[idx] - step)
    else:
        width = v.dtype.itemsize * 8
        v[idx] = rng.integers(0, 2 ** min(width, 63), k, dtype=np.uint64).astype(v.dtype)
        if t.dtype == torch.bool:
            v[idx] &= 1
    return out


def _apply(base: dict[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in base.items()}
    _, staged = decode_patch(payload, {n: (t.dtype, tuple(t.shape)) for n, t in base.items()})
    for s in staged:
        view = bits_view(out[s.name])
        view[s.idx] = s.new_values(view[s.idx])
    return out


state_pairs = st.builds(
    lambda dtypes, shapes, densities, styles, seed: (dtypes, shapes, densities, styles, seed),
    st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=4, max_size=4),
    st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 0.7, 1.0]), min_size=4, max_size=4),
    st.lists(st.sampled_from(["ulp", "random"]), min_size=4, max_size=4),
    st.integers(0, 2**32 - 1),
)


def _make(spec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    dtypes, shapes, densities, styles, seed = spec
    rng = np.random.default_rng(seed)
    base, target = {}, {}
    for i, dt in enumerate(dtypes):
        name = f"t{i}.weight"
        base[name] = _random(dt, tuple(shapes[i]), rng)
        target[name] = _mutate(base[name], densities[i], styles[i], rng)
    return base, target


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_pairs)
def test_round_trip_is_bit_exact(spec) -> None:
    base, target = _make(spec)
    payload, changes = encode_patch(base, target)
    out = _apply(base, payload)
    assert state_hash(out) == state_hash(target)
    for n in base:
        assert np.array_equal(bits_view(out[n]), bits_view(target[n]))
        expected = np.flatnonzero(bits_view(base[n]) != bits_view(target[n]))
        got = changes[n].idx if n in changes else np.array([], dtype=np.int64)
        assert np.array_equal(got, expected)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_pairs, st.data())
def test_every_mutation_or_truncation_is_detected(spec, data) -> None:
    base, target = _make(spec)
    payload, _ = encode_patch(base, target)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in base.items()}
    pos = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(payload)
    bad[pos] ^= flip
    with pytest.raises(PatchError):
        decode_patch(bytes(bad), layout)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(PatchError):
        decode_patch(payload[:cut], layout)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_pairs, st.data())
def test_forged_payload_with_valid_checksum_never_crashes(spec, data) -> None:
    """A structurally lying payload (checksum recomputed) decodes to PatchError or to something the
    target hash then rejects: the decoder itself never raises anything else."""
    base, target = _make(spec)
    payload, _ = encode_patch(base, target)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in base.items()}
    body = bytearray(payload[:-TRAILER_BYTES])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(body) - 1))
        body[pos] = data.draw(st.integers(0, 255))
    forged = bytes(body) + blake3.blake3(bytes(body)).digest(length=TRAILER_BYTES)
    try:
        _, staged = decode_patch(forged, layout)
    except PatchError:
        return
    # it decoded: every staged change must stay inside its tensor, so applying it cannot write out of bounds
    # or grow the state; what it writes is then for the target hash to reject
    for s in staged:
        numel = int(np.prod(layout[s.name][1]))
        assert s.idx.dtype == np.int64 and s.idx.size == s.vals.size >= 1
        assert int(s.idx[0]) >= 0 and int(s.idx[-1]) < numel
        assert np.all(np.diff(s.idx) > 0)
        assert s.vals.dtype.itemsize == layout[s.name][0].itemsize
    out = _apply(base, forged)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in out.items()} == layout


def test_garbage_is_a_patch_error() -> None:
    for junk in (b"", b"MRP1", b"\x00" * 100, b"MRP1" + b"\xff" * 60):
        with pytest.raises(PatchError):
            decode_patch(junk)
    payload, _ = encode_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)})
    body = payload[:-TRAILER_BYTES]
    for magic in (b"MRP0", b"MRP2"):  # another format's payload, its checksum intact
        other = magic + body[4:]
        with pytest.raises(PatchError, match="magic"):
            decode_patch(other + blake3.blake3(other).digest(length=TRAILER_BYTES))


def test_layout_mismatch_is_rejected_before_decoding() -> None:
    base = {"w": torch.zeros(10, dtype=torch.bfloat16)}
    target = {"w": torch.ones(10, dtype=torch.bfloat16)}
    payload, _ = encode_patch(base, target)
    with pytest.raises(PatchError, match="does not match"):
        decode_patch(payload, {"w": (torch.bfloat16, (11,))})
    with pytest.raises(PatchError, match="not in the target model"):
        decode_patch(payload, {"v": (torch.bfloat16, (10,))})


def test_special_float_bit_patterns_survive() -> None:
    """NaN payloads, -0.0, infinities: compared and restored as bits, not values."""
    raw = np.array([0x7FC0, 0x7FC1, 0xFFC0, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001], dtype=np.uint16)
    base = {"w": torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)}
    tgt_raw = raw[::-1].copy()
    target = {"w": torch.from_numpy(tgt_raw.view(np.int16).copy()).view(torch.bfloat16)}
    payload, _ = encode_patch(base, target)
    out = _apply(base, payload)
    assert np.array_equal(bits_view(out["w"]), tgt_raw)


def test_sparse_bf16_is_small() -> None:
    """1% of a bf16 tensor moved by one ULP costs well under 2 bytes per changed element."""
    rng = np.random.default_rng(0)
    base = {"w": _random(torch.bfloat16, (1000, 1000), rng)}
    target = {"w": _mutate(base["w"], 0.01, "ulp", rng)}
    payload, changes = encode_patch(base, target)
    assert len(payload) / changes["w"].idx.size < 2.0


def test_a_model_of_many_tensors_round_trips() -> None:
    """A real state has dozens of tensors (murmur-tiny: over 30), all in one patch."""
    rng = np.random.default_rng(1)
    base = {f"layers.{i}.weight": _random(torch.bfloat16, (8, 8), rng) for i in range(40)}
    target = {n: _mutate(t, 0.05, "ulp", rng) for n, t in base.items()}
    payload, changes = encode_patch(base, target)
    assert len(changes) == 40
    out = _apply(base, payload)
    assert state_hash(out) == state_hash(target)


def test_an_unknown_stream_method_is_a_patch_error() -> None:
    """A well-formed header (checksum recomputed) naming a stream method the decoder does not know."""
    base = {"w": torch.zeros(100, 100, dtype=torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"].view(-1)[::10] = 1.0  # regular gaps: a stream zstd shrinks
    payload, _ = encode_patch(base, target)
    header, off = read_header(payload)
    entry = header.tensors[0]
    k = next(i for i, (m, _) in enumerate(entry.streams) if m == ZSTD)  # a zstd frame: would decode as one
    for method in (ZSTD + 1, 255):
        streams = [(method if i == k else m, n) for i, (m, n) in enumerate(entry.streams)]
        forged = assemble(
            msgspec.structs.replace(header, tensors=[msgspec.structs.replace(entry, streams=streams)]),
            [payload[off:-TRAILER_BYTES]],
        )
        with pytest.raises(PatchError, match="unknown stream method"):
            decode_patch(forged, {"w": (torch.bfloat16, (100, 100))})


@pytest.mark.parametrize("density,bits_per_element", [(0.5, 1.0), (0.9, 0.6)])
def test_dense_changes_cost_at_most_a_bitmask(density: float, bits_per_element: float) -> None:
    """When most elements change, positions cost about a bit per element or less (a bitmask), not the
    byte or so per changed element that gaps take."""
    n = 100_000
    base = torch.zeros(n, dtype=torch.uint8)
    target = base.clone()
    target[torch.from_numpy(np.random.default_rng(3).random(n) < density)] = 1
    payload, _ = encode_patch({"w": base}, {"w": target})
    assert len(payload) < n * bits_per_element / 8 + 200


def test_values_turning_non_finite_are_counted_whatever_they_were() -> None:
    """Only positions that were finite count with `was`: a zero (all bits clear) or a negative value that
    becomes NaN or infinite counts, one that was already NaN does not."""
    from murmur.sync.codec import count_non_finite

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        name = str(dtype).split(".")[1]
        now = bits_view(torch.tensor([math.nan, math.inf, -math.inf, math.nan, 2.0], dtype=dtype))
        was = bits_view(torch.tensor([0.0, -0.0, -3.0, math.nan, math.nan], dtype=dtype))
        assert count_non_finite(now, name, was=was) == 3, name
        each = [count_non_finite(now[i : i + 1], name, was=was[i : i + 1]) for i in range(5)]
        assert each == [1, 1, 1, 0, 0], name
        assert count_non_finite(now, name) == 4, name
        assert count_non_finite(now[:0], name) == 0, name
    assert count_non_finite(bits_view(torch.tensor([-1, 2**31 - 1], dtype=torch.int32)), "int32") == 0


def test_a_header_length_past_the_body_is_refused_before_decoding() -> None:
    payload, _ = encode_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)})
    body = bytearray(payload[:-TRAILER_BYTES])
    for hlen in range(len(body) - 8 + 1, len(body) + 17):  # from one byte past the body into the trailer and on
        body[4:8] = struct.pack("<I", hlen)
        with pytest.raises(PatchError, match="header length runs past"):
            decode_patch(bytes(body) + blake3.blake3(bytes(body)).digest(length=TRAILER_BYTES))


def test_the_changed_element_budget_admits_exactly_its_size() -> None:
    base = {"a": torch.zeros(10), "b": torch.zeros(6)}
    payload, _ = encode_patch(base, {"a": torch.ones(10), "b": torch.ones(6)})
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in base.items()}
    assert len(decode_patch(payload, layout, max_elements=16)[1]) == 2
    with pytest.raises(PatchError, match="more than 15 elements"):
        decode_patch(payload, layout, max_elements=15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_sorted_values_follow_the_base_exponent_as_documented(dtype: torch.dtype) -> None:
    """docs/patches.md: with the sorted flag, values are stored in the stable order of the base element's
    exponent field. A payload written from that text alone (not by the encoder) decodes as it says."""
    from murmur.sync.codec import POS_ALL, VAL_SORTED

    base = {"w": torch.tensor([4.0, 1.0, 2.0, 1.5], dtype=dtype)}  # exponents 2, 0, 1, 0 above the bias
    target = {"w": torch.tensor([40.0, 10.0, 20.0, 15.0], dtype=dtype)}
    new = bits_view(target["w"])
    stored = new[[1, 3, 2, 0]]  # base exponent order, ties in place order
    width = new.dtype.itemsize
    planes = [stored.view(np.uint8).reshape(-1, width)[:, k].tobytes() for k in range(width)]
    name = str(dtype).split(".")[1]
    entry = TensorEntry("w", name, [4], 4, POS_ALL, 0, VAL_ABS | VAL_SORTED, [(RAW, 4)] * width)
    payload = assemble(PatchHeader(FORMAT, b"", b"", [entry]), planes)
    out = _apply(base, payload)
    assert np.array_equal(bits_view(out["w"]), new)


def _one_tensor(entry: TensorEntry, blobs: list[bytes]) -> bytes:
    """A payload of one hand-built tensor entry (checksum recomputed): what a hostile publisher can sign."""
    return assemble(PatchHeader(FORMAT, b"", b"", [entry]), blobs)


U8_12 = {"w": (torch.uint8, (12,))}


def test_set_bitmask_padding_bits_are_refused() -> None:
    """A bitmask of 12 elements has 4 padding bits in its last byte; any of them set is a forgery, even
    though the 12 bits read are consistent with the header's count."""
    entry = TensorEntry("w", "uint8", [12], 2, POS_BITMASK, 0, VAL_ABS, [(RAW, 2), (RAW, 2)])
    for last, ok in ((0b0000_0001, True), (0b0001_0001, False), (0b1000_0001, False)):
        payload = _one_tensor(entry, [bytes([0b0000_0001, last]), bytes([7, 9])])
        if ok:
            assert [s.idx.tolist() for s in decode_patch(payload, U8_12)[1]] == [[0, 8]]
        else:
            with pytest.raises(PatchError, match="bitmask padding bits set"):
                decode_patch(payload, U8_12)


def test_a_position_past_the_tensor_end_is_named() -> None:
    """Gaps 5 and 6 put the second change at index 12 of a 12-element tensor: refused, naming it."""
    entry = TensorEntry("w", "uint8", [12], 2, POS_GAPS, 1, VAL_ABS, [(RAW, 2), (RAW, 2)])
    with pytest.raises(PatchError, match="position 12 past the tensor end 12"):
        decode_patch(_one_tensor(entry, [bytes([5, 6]), bytes([7, 9])]), U8_12)
    assert [s.idx.tolist() for s in decode_patch(_one_tensor(entry, [bytes([5, 5]), bytes([7, 9])]), U8_12)[1]] == [
        [5, 11]
    ]


def test_bytes_after_the_last_stream_are_counted_in_the_refusal() -> None:
    payload, _ = encode_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)})
    header, off = read_header(payload)
    with pytest.raises(PatchError, match="has 3 unexplained bytes"):
        decode_patch(assemble(header, [payload[off:-TRAILER_BYTES] + b"xyz"]))


def test_the_header_format_version_is_a_u32_and_must_be_this_format() -> None:
    payload, _ = encode_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)})
    header, off = read_header(payload)
    streams = payload[off:-TRAILER_BYTES]
    for v, why in (
        (2, "unsupported patch format version 2"),
        (100, "unsupported patch format version 100"),
        (2**32 - 1, "unsupported patch format version"),
        (2**32, "malformed patch header"),
        (2**33, "malformed patch header"),
    ):
        with pytest.raises(PatchError, match=why):
            decode_patch(assemble(msgspec.structs.replace(header, v=v), [streams]))


def test_a_tensor_named_twice_is_refused() -> None:
    payload, _ = encode_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)})
    header, off = read_header(payload)
    twice = msgspec.structs.replace(header, tensors=header.tensors * 2)
    with pytest.raises(PatchError, match="out of order or duplicated"):
        decode_patch(assemble(twice, [payload[off:-TRAILER_BYTES]] * 2))


def test_a_tensor_has_at_most_eight_dimensions() -> None:
    for dims, ok in ((8, True), (9, False)):
        shape = (1,) * (dims - 1) + (3,)
        base = {"w": torch.zeros(shape)}
        payload, _ = encode_patch(base, {"w": torch.ones(shape)})
        if ok:
            assert state_hash(_apply(base, payload)) == state_hash({"w": torch.ones(shape)})
        else:
            with pytest.raises(PatchError, match="malformed patch header"):
                decode_patch(payload)


def test_wide_gaps_that_are_mostly_small_are_escape_coded() -> None:
    """Changes mostly a few elements apart, one after a gap past 16 bits: gaps need 4 bytes each, but
    escape coding (a byte per gap, the one wide gap on the side) is smaller, so the encoder picks it."""
    n = 300_000
    rng = np.random.default_rng(5)
    idx = np.cumsum(rng.integers(1, 11, size=2000))
    idx = np.append(idx, n - 1)  # the last gap is over 2**16
    base = torch.zeros(n, dtype=torch.uint8)
    target = base.clone()
    target[torch.from_numpy(idx)] = 1
    payload, _ = encode_patch({"w": base}, {"w": target})
    entry = read_header(payload)[0].tensors[0]
    assert (entry.pos_mode, entry.pos_width) == (POS_GAPS_ESC, 4)
    assert state_hash(_apply({"w": base}, payload)) == state_hash({"w": target})
