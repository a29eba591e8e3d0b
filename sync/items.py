"""What a lineage store holds, as pure values: the item kinds, their codecs, `StoredItem`, and the patch
accept rule of a follower's broadcast. No I/O: the node core, the lineage store, the catalog protocol and the
simulator import the same definitions."""

from __future__ import annotations

from dataclasses import dataclass

from murmur.gossip import wire
from murmur.sync.ids import lineage_id

KINDS = ("patch", "union", "anchor")
CODEC_KIND = {"sparse-v1": "patch", "union-v1": "union", "anchor-v1": "anchor"}
KIND_CODEC = {kind: codec for codec, kind in CODEC_KIND.items()}
MAX_ITEMS = 4096  # items a catalog lists (and a planner reads from one reply)


@dataclass(frozen=True)
class StoredItem:
    kind: str  # "patch" (sparse-v1), "union" (union-v1) or "anchor" (anchor-v1)
    base: int  # == target for an anchor
    target: int
    bytes: int  # payload size (what a receiver downloads)


def diff_kind(base: int, target: int) -> str:
    """The kind of a stored diff from `base` to `target`: one version is a patch, more a union."""
    return "patch" if target == base + 1 else "union"


def item_of(m: wire.PatchManifest) -> StoredItem:
    return StoredItem(CODEC_KIND.get(m.codec, m.codec), m.base_version, m.target_version, m.total_bytes)


def wanted(
    m: wire.PatchManifest,
    serving: bytes | None,
    publisher: bytes,
    held: int,
    need_anchor: bool,
    have: set[tuple[str, int, int]],
) -> bool:
    """The accept rule of a follower's broadcast node (the signature was already checked).

    Only the lineage it serves, only from that lineage's publisher (whose key
    the lineage id commits to), only what moves it forward and is not stored
    yet. An anchor is wanted when it is ahead or when the node cannot use
    patches at all (its base model differs from the lineage's).
    """
    if serving is None or bytes(m.lineage) != serving or bytes(m.publisher) != publisher:
        return False
    if lineage_id(bytes(m.publisher), bytes(m.base_model_hash), m.lineage_name) != serving:
        return False
    it = item_of(m)
    if (it.kind, it.base, it.target) in have:
        return False
    return it.target > held or (need_anchor and it.kind == "anchor")
