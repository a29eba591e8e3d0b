"""The sparse patch codec ("sparse-v1" / "union-v1" payloads): lossless, per tensor.

Why it looks like this (docs/patches.md has the byte layout):
- Changed positions come from comparing bit patterns, never float values
  (NaN != NaN, -0.0 == 0.0 would both lose bits).
- Between two RL steps ~1% of bf16 elements change and most by one ULP, so
  positions dominate the size. Positions are gaps between changed indices,
  stored fixed-width and byte-split into planes (low bytes, high bytes): the
  high planes are almost all zero and the low plane is close to uniform, so
  zstd's Huffman stage gets near the entropy of the gap distribution. When a
  tensor is dense a bitmask is smaller; when every element changed, nothing.
- Values are coded three ways and the smallest wins per tensor: absolute
  (new bits), XOR against the base, or the difference of the two values in
  the float total order ("ULP steps", zigzagged) which turns +-1 ULP into the
  symbols 1 and 2. Each is byte-split and zstd-compressed.
- Every stream is stored raw when zstd does not help (tiny tensors).
- A 16-byte BLAKE3 trailer over the whole payload makes any corruption a
  clean `PatchError` before anything is decoded; structure is still checked
  field by field so a well-formed lie cannot crash the decoder.
Everything is vectorised numpy; there are no per-element Python loops.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Final

import blake3
import msgspec
import numpy as np
import torch
import zstandard
from msgspec import Meta, Struct

from murmur.sync.errors import PatchError
from murmur.sync.hashing import DTYPES_BY_NAME, FLOAT_DTYPES, bits_view, dtype_name

if sys.byteorder != "little":  # byte planes are taken from native-order views
    raise ImportError("the patch codec needs a little-endian machine")

MAGIC: Final = b"MRP1"
TRAILER_BYTES: Final = 16
FORMAT: Final = 1
MAX_TENSORS: Final = 1 << 16
MAX_DIMS: Final = 8
MAX_NUMEL: Final = 1 << 34
DEFAULT_LEVEL: Final = 3

# position modes
POS_ALL: Final = 0  # every element changed: no position streams
POS_GAPS: Final = 1  # gaps (idx[i] - idx[i-1] - 1, first = idx[0]) fixed-width, byte-split
POS_BITMASK: Final = 2  # one bit per element, little-endian bit order
POS_GAPS_ESC: Final = 3  # gaps as one byte each, 255 = escape; escaped (gap - 255) fixed-width, byte-split
# value modes
VAL_ABS: Final = 0  # the new bit pattern
VAL_XOR: Final = 1  # new XOR old
VAL_DELTA: Final = 2  # zigzag(ord(new) - ord(old) mod 2^W), ord = float total order bijection
# value layouts (bits 2-3 of val_mode; bits 0-1 hold the transform above)
VAL_PLANES: Final = 0  # byte-split planes
VAL_ESCAPED: Final = 4  # one byte per value, 255 = escape, escaped (value - 255) in side planes
VAL_PACKED: Final = 8  # 2-bit codes, four per byte: code = min(value - off, 3); 3 = escape to an escaped side stream
VAL_LAYOUT: Final = 12
VAL_SORTED: Final = 16  # flag: values stored in stable order of the base element's float exponent
_EXP = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "float32": (23, 0xFF), "float64": (52, 0x7FF)}
# stream methods
RAW: Final = 0
ZSTD: Final = 1

U8 = Annotated[int, Meta(ge=0, le=255)]
Count = Annotated[int, Meta(ge=0, le=MAX_NUMEL)]


class TensorEntry(Struct, array_like=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=1024)]
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[list[Count], Meta(max_length=MAX_DIMS)]
    count: Count  # changed elements
    pos_mode: U8
    pos_width: U8  # bytes per gap (or escaped gap residual) in POS_GAPS/POS_GAPS_ESC (1, 2, 4, 8), else 0
    val_mode: U8
    streams: Annotated[list[tuple[U8, Count]], Meta(max_length=16)]  # (method, stored length)


class PatchHeader(Struct, array_like=True, forbid_unknown_fields=True):
    v: Annotated[int, Meta(ge=0, lt=2**32)]
    base_hash: Annotated[bytes, Meta(max_length=32)]
    target_hash: Annotated[bytes, Meta(max_length=32)]
    tensors: Annotated[list[TensorEntry], Meta(max_length=MAX_TENSORS)]


_header_decoder = msgspec.msgpack.Decoder(PatchHeader)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ---------------------------------------------------------------- helpers


def _ord(x: np.ndarray, kind: str) -> np.ndarray:
    """A bijection on W-bit patterns that is monotonic in the value, so nearby values are nearby ints."""
    w = x.dtype.itemsize * 8
    sign = x.dtype.type(1 << (w - 1))
    if kind == "float":
        neg = (x & sign) != 0
        return np.where(neg, ~x, x ^ sign)
    if kind == "int":
        return x ^ sign
    return x


def _unord(o: np.ndarray, kind: str) -> np.ndarray:
    w = o.dtype.itemsize * 8
    sign = o.dtype.type(1 << (w - 1))
    if kind == "float":
        pos = (o & sign) != 0
        return np.where(pos, o ^ sign, ~o)
    if kind == "int":
        return o ^ sign
    return o


def _order_kind(dtype: str) -> str:
    if dtype in FLOAT_DTYPES:
        return "float"
    if dtype in ("int8", "int16", "int32", "int64"):
        return "int"
    return "plain"


def _zigzag(d: np.ndarray) -> np.ndarray:
    w = d.dtype.itemsize * 8
    s = d.view(np.dtype(f"i{d.dtype.itemsize}"))
    return ((s << 1) ^ (s >> (w - 1))).view(d.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> z.dtype.type(1)) ^ np.negative(z & z.dtype.type(1))


def _planes(a: np.ndarray) -> list[bytes]:
    """Byte-split: plane k holds byte k of every element (little-endian)."""
    w = a.dtype.itemsize
    if w == 1:
        return [a.tobytes()]
    m = a.view(np.uint8).reshape(-1, w)
    return [m[:, k].tobytes() for k in range(w)]


def _unplanes(planes: list[bytes], width: int, count: int) -> np.ndarray:
    if width == 1:
        return np.frombuffer(planes[0], dtype=np.uint8).copy()
    m = np.empty((count, width), dtype=np.uint8)
    for k, p in enumerate(planes):
        m[:, k] = np.frombuffer(p, dtype=np.uint8)
    return m.reshape(-1).view(_UINT[width])


def _escaped(a: np.ndarray, width: int) -> list[bytes]:
    """Escape coding: most symbols fit one byte; the rare large ones go to side planes.

    Huffman (zstd's literal coder) spends at least one bit per byte, so a
    byte-split plane that is ~all zero still costs ~1 bit per element; a
    single byte stream with rare escapes avoids that.
    """
    main = np.minimum(a, 255).astype(np.uint8)
    big = a[main == 255] - a.dtype.type(255)
    return [main.tobytes()] + _planes(big.astype(_UINT[width]))


def _unescaped(main: bytes, side: list[bytes], width: int, out_dtype: np.dtype) -> np.ndarray:
    m = np.frombuffer(main, dtype=np.uint8)
    out = m.astype(out_dtype)
    esc = m == 255
    n_esc = int(np.count_nonzero(esc))
    out[esc] = _unplanes(side, width, n_esc).astype(out_dtype) + out_dtype.type(255)
    return out


def _packed(v: np.ndarray, off: int) -> list[bytes]:
    """Four 2-bit codes per byte: Huffman then sees 4 symbols at once and gets under 1 bit each."""
    r = v - v.dtype.type(off)
    c = np.minimum(r, 3).astype(np.uint8)
    pad = (-c.size) % 4
    if pad:
        c = np.concatenate([c, np.zeros(pad, np.uint8)])
    c = c.reshape(-1, 4)
    main = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    side = r[r >= 3] - r.dtype.type(3)
    return [main.tobytes()] + _escaped(side, v.dtype.itemsize)


def _sort_key(old: np.ndarray, dtype: str) -> np.ndarray:
    shift, mask = _EXP[dtype]
    return (old >> old.dtype.type(shift)) & old.dtype.type(mask)


class _Packer:
    def __init__(self, level: int) -> None:
        self.z = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)

    def pack(self, raw: bytes) -> tuple[int, bytes]:
        if len(raw) < 32:
            return RAW, raw
        c = self.z.compress(raw)
        return (ZSTD, c) if len(c) < len(raw) else (RAW, raw)

    def pack_all(self, raws: list[bytes]) -> list[tuple[int, bytes]]:
        return [self.pack(r) for r in raws]


def _size(streams: list[tuple[int, bytes]]) -> int:
    return sum(len(s) for _, s in streams)


def _gap_width(max_gap: int) -> int:
    for w in (1, 2, 4, 8):
        if max_gap < 1 << (8 * w):
            return w
    raise AssertionError("gap over 64 bits")


# ---------------------------------------------------------------- encode


@dataclass
class TensorChange:
    """What changed in one tensor: flat indices and the new bit patterns (publisher bookkeeping)."""

    name: str
    idx: np.ndarray  # int64, strictly increasing
    new: np.ndarray  # unsigned ints of the tensor's width


def check_layout(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    if set(base) != set(target):
        missing = sorted(set(base) ^ set(target))[:3]
        raise PatchError(f"states differ in tensor names (e.g. {missing})")
    for n in base:
        b, t = base[n], target[n]
        if b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
            raise PatchError(f"tensor {n}: {b.dtype}{tuple(b.shape)} vs {t.dtype}{tuple(t.shape)}")


def diff_tensor(b: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.flatnonzero(b != t)


def _value_tries(mode: int, arr: np.ndarray, perm: np.ndarray | None) -> list[tuple[int, Callable[[], list[bytes]]]]:
    """The value encodings tried for one candidate, each built only when it is measured."""
    tries: list[tuple[int, Callable[[], list[bytes]]]] = [(mode, lambda: _planes(arr))]
    if arr.dtype.itemsize > 1:
        tries.append((mode | VAL_ESCAPED, lambda: _escaped(arr, arr.dtype.itemsize)))
        if mode == VAL_DELTA:
            off = 1
            tries.append((mode | VAL_PACKED, lambda: _packed(arr, off)))
            if perm is not None:
                tries.append((mode | VAL_PACKED | VAL_SORTED, lambda: _packed(arr[perm], off)))
                tries.append((mode | VAL_ESCAPED | VAL_SORTED, lambda: _escaped(arr[perm], arr.dtype.itemsize)))
    return tries


def encode_tensor(
    name: str, dtype: str, shape: tuple[int, ...], b: np.ndarray, t: np.ndarray, idx: np.ndarray, packer: _Packer
) -> tuple[TensorEntry, list[bytes], TensorChange]:
    n = b.size
    count = int(idx.size)
    old = b[idx]
    new = t[idx]
    # positions
    if count == n:
        pos_mode, pos_width, pos_streams = POS_ALL, 0, []
    else:
        gaps = np.diff(idx, prepend=-1) - 1
        pos_width = _gap_width(int(gaps.max()))
        pos_mode, pos_streams = POS_GAPS, packer.pack_all(_planes(gaps.astype(_UINT[pos_width])))
        if pos_width > 1:
            esc = packer.pack_all(_escaped(gaps.astype(_UINT[pos_width]), pos_width))
            if _size(esc) < _size(pos_streams):
                pos_mode, pos_streams = POS_GAPS_ESC, esc
        if count * 64 > n:  # a bitmask can only win above ~1/64 density
            mask = np.zeros(n, dtype=bool)
            mask[idx] = True
            bm = packer.pack_all([np.packbits(mask, bitorder="little").tobytes()])
            if _size(bm) < _size(pos_streams):
                pos_mode, pos_width, pos_streams = POS_BITMASK, 0, bm
    # values: smallest of absolute, XOR and ULP-step
    kind = _order_kind(dtype)
    candidates = [
        (VAL_DELTA, _zigzag(_ord(new, kind) - _ord(old, kind))),
        (VAL_XOR, old ^ new),
        (VAL_ABS, new),
    ]
    val_mode = -1
    val_streams: list[tuple[int, bytes]] = []
    perm = np.argsort(_sort_key(old, dtype), kind="stable") if dtype in _EXP and count > 1 else None
    for mode, arr in candidates:
        for m, make in _value_tries(mode, arr, perm):
            s = packer.pack_all(make())
            if val_mode < 0 or _size(s) < _size(val_streams):
                val_mode, val_streams = m, s
    streams = pos_streams + val_streams
    entry = TensorEntry(
        name, dtype, list(shape), count, pos_mode, pos_width, val_mode, [(m, len(s)) for m, s in streams]
    )
    return entry, [s for _, s in streams], TensorChange(name, idx, new)


def encode_patch(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    base_hash: bytes = b"",
    target_hash: bytes = b"",
    level: int = DEFAULT_LEVEL,
) -> tuple[bytes, dict[str, TensorChange]]:
    """Payload turning `base` into `target` bit-exactly, and the per-tensor changes."""
    check_layout(base, target)
    packer = _Packer(level)
    entries: list[TensorEntry] = []
    blobs: list[bytes] = []
    changes: dict[str, TensorChange] = {}
    for name in sorted(base):
        bt, tt = base[name], target[name]
        b, t = bits_view(bt), bits_view(tt)
        idx = diff_tensor(b, t)
        if idx.size == 0:
            continue
        entry, streams, change = encode_tensor(name, dtype_name(bt.dtype), tuple(bt.shape), b, t, idx, packer)
        entries.append(entry)
        blobs.extend(streams)
        changes[name] = change
    return assemble(PatchHeader(FORMAT, base_hash, target_hash, entries), blobs), changes


def assemble(header: PatchHeader, blobs: list[bytes]) -> bytes:
    hb = msgspec.msgpack.encode(header)
    body = b"".join([MAGIC, struct.pack("<I", len(hb)), hb, *blobs])
    return body + blake3.blake3(body).digest(length=TRAILER_BYTES)


# ---------------------------------------------------------------- decode


@dataclass
class StagedTensor:
    """One tensor's part of a decoded patch: positions and coded values, ready to apply."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    idx: np.ndarray  # int64 flat indices, strictly increasing
    val_mode: int
    vals: np.ndarray  # unsigned ints of the tensor's width

    def new_values(self, old: np.ndarray) -> np.ndarray:
        """New bit patterns given the base's bit patterns at `idx`."""
        vals = self.vals
        if self.val_mode & VAL_SORTED:
            vals = np.empty_like(self.vals)
            vals[np.argsort(_sort_key(old, self.dtype), kind="stable")] = self.vals
        mode = self.val_mode & 3
        if mode == VAL_ABS:
            return vals
        if mode == VAL_XOR:
            return old ^ vals
        kind = _order_kind(self.dtype)
        return _unord(_ord(old, kind) + _unzigzag(vals), kind)


# Exponent bits of each float dtype: a value is NaN or +-inf exactly when all of them are set.
_EXPONENT_MASK = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000, "float64": 0x7FF0000000000000}


def count_non_finite(bits: np.ndarray, dtype: str, was: np.ndarray | None = None) -> int:
    """NaN and +-inf among bit patterns of a float dtype (as its unsigned view); 0 for other dtypes.
    With `was` (the old bit patterns at the same positions), only those that were finite before."""
    mask = _EXPONENT_MASK.get(dtype)
    if mask is None or bits.size == 0:
        return 0
    m = bits.dtype.type(mask)
    bad = (bits & m) == m
    if was is not None:
        bad &= (was & m) != m
    return int(np.count_nonzero(bad))


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unpack(method: int, data: bytes, raw_len: int, what: str) -> bytes:
    if method == RAW:
        if len(data) != raw_len:
            raise PatchError(f"{what}: raw stream is {len(data)} bytes, expected {raw_len}")
        return data
    if method != ZSTD:
        raise PatchError(f"{what}: unknown stream method {method}")
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise PatchError(f"{what}: not a zstd frame") from None
    if size != raw_len:
        raise PatchError(f"{what}: stream declares {size} bytes, expected {raw_len}")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise PatchError(f"{what}: corrupt zstd stream: {e}") from None
    if len(out) != raw_len:
        raise PatchError(f"{what}: stream decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def read_header(payload: bytes | memoryview) -> tuple[PatchHeader, int]:
    """Check the trailer and decode the header; returns (header, offset of the first stream)."""
    mv = memoryview(payload)
    if len(mv) < len(MAGIC) + 4 + TRAILER_BYTES:
        raise PatchError(f"patch payload truncated ({len(mv)} bytes)")
    if bytes(mv[:4]) != MAGIC:
        raise PatchError("patch payload has a bad magic number")
    if blake3.blake3(mv[:-TRAILER_BYTES]).digest(length=TRAILER_BYTES) != bytes(mv[-TRAILER_BYTES:]):
        raise PatchError("patch payload checksum mismatch (corrupt or truncated)")
    (hlen,) = struct.unpack_from("<I", mv, 4)
    if 8 + hlen > len(mv) - TRAILER_BYTES:
        raise PatchError("patch header length runs past the payload")
    try:
        header = _header_decoder.decode(mv[8 : 8 + hlen])
    except (msgspec.MsgspecError, ValueError, OverflowError, RecursionError) as e:
        raise PatchError(f"malformed patch header: {e}") from None
    if header.v != FORMAT:
        raise PatchError(f"unsupported patch format version {header.v}")
    return header, 8 + hlen


def decode_patch(
    payload: bytes | memoryview,
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
    max_elements: int = 1 << 31,
) -> tuple[PatchHeader, list[StagedTensor]]:
    """Decode and check a payload into staged tensors; nothing is applied.

    `layout` (name -> (dtype, shape) of the state it will be applied to) is
    checked before any stream is decompressed, so a lying header cannot make
    the decoder allocate more than the live model's size.
    """
    header, off = read_header(payload)
    mv = memoryview(payload)
    end = len(mv) - TRAILER_BYTES
    staged: list[StagedTensor] = []
    prev = ""
    total = 0
    for e in header.tensors:
        what = f"tensor {e.name}"
        if e.name <= prev:
            raise PatchError(f"{what}: tensors out of order or duplicated")
        prev = e.name
        if e.dtype not in DTYPES_BY_NAME:
            raise PatchError(f"{what}: unknown dtype {e.dtype!r}")
        shape = tuple(e.shape)
        n = _numel(e.shape)
        if layout is not None:
            if e.name not in layout:
                raise PatchError(f"{what}: not in the target model")
            ldt, lshape = layout[e.name]
            if dtype_name(ldt) != e.dtype or tuple(lshape) != shape:
                raise PatchError(
                    f"{what}: {e.dtype}{shape} does not match the model's {dtype_name(ldt)}{tuple(lshape)}"
                )
        if n > MAX_NUMEL or not 1 <= e.count <= n:
            raise PatchError(f"{what}: bad changed count {e.count} for {n} elements")
        total += e.count
        if total > max_elements:
            raise PatchError(f"patch changes more than {max_elements} elements")
        width = DTYPES_BY_NAME[e.dtype].itemsize
        reader = _StreamReader(mv, off, end, e.streams, what)
        idx = _decode_positions(e, n, reader, what)
        layout_bits = e.val_mode & VAL_LAYOUT
        if e.val_mode & 3 not in (VAL_ABS, VAL_XOR, VAL_DELTA) or e.val_mode & ~31 or layout_bits == 12:
            raise PatchError(f"{what}: unknown value mode {e.val_mode}")
        if e.val_mode & VAL_SORTED and e.dtype not in _EXP:
            raise PatchError(f"{what}: sorted values for a non-float dtype")
        udt = np.dtype(_UINT[width])
        if layout_bits and width == 1:
            raise PatchError(f"{what}: escaped or packed values for a one-byte dtype")
        if layout_bits == VAL_ESCAPED:
            main = reader.take(e.count)
            vals = _unescaped(main, [reader.take(main.count(255)) for _ in range(width)], width, udt)
        elif layout_bits == VAL_PACKED:
            vals = _unpacked(reader, e.count, width, 0 if e.val_mode & 3 == VAL_ABS else 1, udt, what)
        else:
            vals = _unplanes([reader.take(e.count) for _ in range(width)], width, e.count)
        off = reader.finish()
        staged.append(StagedTensor(e.name, e.dtype, shape, idx, e.val_mode, vals))
    if off != end:
        raise PatchError(f"patch payload has {end - off} unexplained bytes")
    return header, staged


def _unpacked(reader: _StreamReader, count: int, width: int, off: int, udt: np.dtype, what: str) -> np.ndarray:
    b = np.frombuffer(reader.take((count + 3) // 4), dtype=np.uint8)
    codes = np.stack([b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6], axis=1).reshape(-1)
    if codes[count:].any():
        raise PatchError(f"{what}: packed padding codes set")
    codes = codes[:count]
    esc = codes == 3
    n_esc = int(np.count_nonzero(esc))
    main = reader.take(n_esc)
    side = _unescaped(main, [reader.take(main.count(255)) for _ in range(width)], width, udt)
    vals = codes.astype(udt)
    vals[esc] = side + udt.type(3)
    return vals + udt.type(off)


class _StreamReader:
    """Hands out one tensor's streams in order, each checked against the raw length the decoder expects."""

    def __init__(self, mv: memoryview, off: int, end: int, streams: list[tuple[int, int]], what: str) -> None:
        self.mv, self.off, self.end, self.streams, self.what, self.i = mv, off, end, streams, what, 0

    def take(self, raw_len: int) -> bytes:
        if self.i >= len(self.streams):
            raise PatchError(f"{self.what}: fewer streams than its modes need")
        method, length = self.streams[self.i]
        self.i += 1
        if self.off + length > self.end:
            raise PatchError(f"{self.what}: stream runs past the payload (truncated)")
        data = _unpack(method, bytes(self.mv[self.off : self.off + length]), raw_len, self.what)
        self.off += length
        return data

    def finish(self) -> int:
        if self.i != len(self.streams):
            raise PatchError(f"{self.what}: {len(self.streams)} streams, its modes use {self.i}")
        return self.off


def _decode_positions(e: TensorEntry, n: int, reader: _StreamReader, what: str) -> np.ndarray:
    if e.pos_mode == POS_ALL:
        if e.count != n:
            raise PatchError(f"{what}: all-changed mode with {e.count} of {n}")
        return np.arange(n, dtype=np.int64)
    if e.pos_mode == POS_BITMASK:
        packed = np.frombuffer(reader.take((n + 7) // 8), dtype=np.uint8)
        if n % 8 and int(packed[-1]) >> (n % 8):
            raise PatchError(f"{what}: bitmask padding bits set")
        idx = np.flatnonzero(np.unpackbits(packed, count=n, bitorder="little"))
        if idx.size != e.count:
            raise PatchError(f"{what}: bitmask has {idx.size} bits set, header says {e.count}")
        return idx.astype(np.int64, copy=False)
    if e.pos_mode not in (POS_GAPS, POS_GAPS_ESC):
        raise PatchError(f"{what}: unknown position mode {e.pos_mode}")
    if e.pos_width not in _UINT:
        raise PatchError(f"{what}: bad gap width {e.pos_width}")
    if e.pos_mode == POS_GAPS:
        gaps = _unplanes([reader.take(e.count) for _ in range(e.pos_width)], e.pos_width, e.count)
    else:
        main = reader.take(e.count)
        n_esc = main.count(255)
        side = [reader.take(n_esc) for _ in range(e.pos_width)]
        gaps = _unescaped(main, side, e.pos_width, np.dtype(np.uint64))
    # guard int64 overflow before the exact check: the sum of gaps must stay below n
    if float(gaps.sum(dtype=np.float64)) + e.count > n + 1:
        raise PatchError(f"{what}: positions run past the tensor end")
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if int(idx[-1]) >= n:
        raise PatchError(f"{what}: position {int(idx[-1])} past the tensor end {n}")
    return idx
