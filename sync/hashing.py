"""Content hashes for lineages and model states.

The state hash must be bit-exact (it is what a publisher signs and what a
follower proves it holds) and cheap enough to compute after every patch, so it
is a two-level BLAKE3 tree: one digest per tensor over its name, dtype, shape
and raw bytes, then one digest over the per-tensor digests in sorted name
order. A follower caches the per-tensor digests and, after a patch, rehashes
only the tensors the patch touched (see `StateHasher`). BLAKE3 runs at about
4 GB/s on one core here (blake2b: ~0.6 GB/s), so a full 100M-parameter bf16
state (200 MB) hashes in ~0.05 s.

The lineage id and the chunk hashes use blake2b-256, as `gossip.wire` does.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import blake3
import numpy as np
import torch

from murmur.sync.errors import PatchError

STATE_DOMAIN = b"murmur/state/v1\x00"
TENSOR_DOMAIN = b"murmur/tensor/v1\x00"

# torch dtype <-> the unsigned integer numpy dtype of the same width used to compare bit patterns
_BITS: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {
    torch.bfloat16: (torch.int16, np.dtype(np.uint16)),
    torch.float16: (torch.int16, np.dtype(np.uint16)),
    torch.float32: (torch.int32, np.dtype(np.uint32)),
    torch.float64: (torch.int64, np.dtype(np.uint64)),
    torch.int8: (torch.int8, np.dtype(np.uint8)),
    torch.uint8: (torch.uint8, np.dtype(np.uint8)),
    torch.bool: (torch.uint8, np.dtype(np.uint8)),
    torch.int16: (torch.int16, np.dtype(np.uint16)),
    torch.int32: (torch.int32, np.dtype(np.uint32)),
    torch.int64: (torch.int64, np.dtype(np.uint64)),
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in _BITS}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float64"})


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise PatchError(f"unsupported tensor dtype {dtype}") from None


def bits_view(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view sharing memory with `t` (writes go to the tensor)."""
    if t.device.type != "cpu":
        raise PatchError(f"tensor on {t.device}: patches apply to CPU tensors")
    if not t.is_contiguous():
        raise PatchError("tensor is not contiguous")
    bits = _BITS.get(t.dtype)
    if bits is None:
        raise PatchError(f"unsupported tensor dtype {t.dtype}")
    int_dtype, np_dtype = bits
    flat = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(int_dtype).numpy().view(np_dtype)


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """BLAKE3 of (name, dtype, shape, raw little-endian bytes)."""
    dn = dtype_name(t.dtype).encode()
    nb = name.encode()
    h = blake3.blake3(TENSOR_DOMAIN)
    h.update(struct.pack("<H", len(nb)) + nb + bytes([len(dn)]) + dn + bytes([t.dim()]))
    h.update(struct.pack(f"<{t.dim()}Q", *t.shape))
    h.update(bits_view(t).data.cast("B"))
    return h.digest()


def combine_digests(digests: Mapping[str, bytes]) -> bytes:
    h = blake3.blake3(STATE_DOMAIN)
    h.update(struct.pack("<I", len(digests)))
    for name in sorted(digests):
        h.update(digests[name])
    return h.digest()


def state_hash(state: Mapping[str, torch.Tensor]) -> bytes:
    """32-byte hash of a whole state dict (names, dtypes, shapes, bytes)."""
    return combine_digests({n: tensor_digest(n, t) for n, t in state.items()})


class StateHasher:
    """Per-tensor digest cache so a patch costs a rehash of only the tensors it touched."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.digests: dict[str, bytes] = {n: tensor_digest(n, t) for n, t in state.items()}
        self.hash = combine_digests(self.digests)

    def preview(self, state: Mapping[str, torch.Tensor], changed: Iterable[str]) -> tuple[bytes, dict[str, bytes]]:
        """State hash if the tensors named in `changed` now hold what `state` holds (no commit)."""
        new = {n: tensor_digest(n, state[n]) for n in changed}
        merged = dict(self.digests)
        merged.update(new)
        return combine_digests(merged), new

    def commit(self, new_digests: Mapping[str, bytes], state_hash_value: bytes) -> None:
        self.digests.update(new_digests)
        self.hash = state_hash_value


def canonical_state(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a lineage versions: a module's state dict with tied aliases dropped.

    Tied weights (e.g. lm_head sharing the embedding) appear twice in a state
    dict with one storage; the first name in state-dict order is kept, which is
    the name transformers expects when it re-ties on load. The tensors returned
    share memory with the module, so a patch applied to them updates the model.
    """
    sd = source.state_dict(keep_vars=True) if isinstance(source, torch.nn.Module) else dict(source)
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out
