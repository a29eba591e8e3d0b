"""Patch transfer between nodes: catalog + get over one libp2p stream per request.

Interim transport for patches and anchors until the swarming broadcast
(`sync.broadcast`) is wired in: a follower asks any peer that holds a lineage
(its publisher first) for the catalog of stored items, plans the cheapest
route with `sync.catchup.choose` (its own held items cost nothing), and gets
the missing items one per stream. Every item is verified (publisher
signature, lineage, chunk hashes) before it is stored, and stored atomically
before the worker is told, so a restart never downloads it again.

Frames (gossip.framing, 4-byte length prefix):
  request  PatchRequest (msgpack, <= 1 KiB)
  reply    PatchReply (msgpack, <= 1 MiB); for `get` then the manifest envelope
           (<= 512 KiB) and the payload (<= MAX_PAYLOAD) as two more frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta, Struct

from gossip import wire
from gossip.framing import read_frame, write_frame
from node.errors import DecodeError, PatchError
from sync.patchstore import LineageStore, StoredItem, open_manifest

PROTOCOL = "/murmur/patch/1"
MAX_REQUEST = 1024
MAX_REPLY = 1024 * 1024
MAX_PAYLOAD = 512 * 1024 * 1024
KINDS = ("patch", "union", "anchor")


class PatchRequest(Struct, array_like=True, forbid_unknown_fields=True):
    op: Annotated[str, Meta(max_length=16)]  # catalog | get
    lineage: Annotated[bytes, Meta(min_length=32, max_length=32)]
    kind: Annotated[str, Meta(max_length=16)] = ""
    base: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    target: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0


class PatchReply(Struct, array_like=True, forbid_unknown_fields=True):
    ok: bool
    error: Annotated[str, Meta(max_length=512)] = ""
    items: Annotated[list[tuple[str, int, int, int]], Meta(max_length=4096)] = []


def held_store(home: Path, lineage: bytes) -> LineageStore | None:
    """The lineage store in `home`, or None when this node holds nothing of that lineage."""
    if not (Path(home) / "lineages" / lineage.hex()).is_dir():
        return None
    return LineageStore(home, lineage)


def _items(store: LineageStore) -> list[StoredItem]:
    return store.items()


async def serve(stream: Any, home: Path, counters: dict[str, int]) -> None:
    """Answer one request on `stream` from what `home` holds (runs on the trio loop; file I/O in a thread)."""
    import trio

    raw = await read_frame(stream, MAX_REQUEST)
    try:
        req = wire.decode_struct(raw, PatchRequest, MAX_REQUEST)
    except DecodeError as e:
        await write_frame(stream, wire.encode(PatchReply(False, f"bad request: {e}"[:500])))
        return
    store = held_store(home, bytes(req.lineage))
    if store is None:
        await write_frame(stream, wire.encode(PatchReply(False, "lineage not held here")))
        return
    if req.op == "catalog":
        items = await trio.to_thread.run_sync(_items, store)
        await write_frame(stream, wire.encode(PatchReply(True, "", [(i.kind, i.base, i.target, i.bytes)
                                                                    for i in items[-4096:]])))
        return
    if req.op != "get" or req.kind not in KINDS:
        await write_frame(stream, wire.encode(PatchReply(False, f"unknown op {req.op!r}/{req.kind!r}")))
        return

    def _read() -> tuple[bytes, bytes]:
        if req.kind == "anchor":
            return store.read_anchor(req.target)
        return store.read_patch(req.base, req.target)

    try:
        env, payload = await trio.to_thread.run_sync(_read)
    except PatchError as e:
        await write_frame(stream, wire.encode(PatchReply(False, str(e)[:500])))
        return
    await write_frame(stream, wire.encode(PatchReply(True)))
    await write_frame(stream, env)
    await write_frame(stream, payload)
    counters["bytes_up"] = counters.get("bytes_up", 0) + len(env) + len(payload)


async def catalog(transport: Any, peer: str, lineage: bytes) -> list[StoredItem]:
    stream = await transport.open_stream(peer, PROTOCOL)
    try:
        await write_frame(stream, wire.encode(PatchRequest("catalog", lineage)))
        rep = wire.decode_struct(await read_frame(stream, MAX_REPLY), PatchReply, MAX_REPLY)
    finally:
        await stream.close()
    if not rep.ok:
        raise PatchError(f"{peer[-8:]}: {rep.error}")
    return [StoredItem(k, b, t, n) for k, b, t, n in rep.items if k in KINDS]


async def get(transport: Any, peer: str, lineage: bytes, item: StoredItem) -> tuple[bytes, bytes]:
    """(manifest envelope, payload) of one item; the caller verifies before storing."""
    stream = await transport.open_stream(peer, PROTOCOL)
    try:
        await write_frame(stream, wire.encode(PatchRequest("get", lineage, item.kind, item.base, item.target)))
        rep = wire.decode_struct(await read_frame(stream, MAX_REPLY), PatchReply, MAX_REPLY)
        if not rep.ok:
            raise PatchError(f"{peer[-8:]}: {rep.error}")
        env = await read_frame(stream, wire.KIND_LIMITS[wire.PATCH_MANIFEST])
        payload = await read_frame(stream, MAX_PAYLOAD)
    finally:
        await stream.close()
    return env, payload


def verify_and_store(home: Path, lineage: bytes, publisher: bytes, item: StoredItem, env: bytes,
                     payload: bytes) -> wire.PatchManifest:
    """Check signature, publisher, lineage, range and every chunk, then store atomically (manifest last)."""
    from sync import chunks as chunking

    m = open_manifest(env)
    if bytes(m.publisher) != publisher or bytes(m.lineage) != lineage:
        raise PatchError("manifest is not from this lineage's publisher")
    if (m.base_version, m.target_version) != (item.base, item.target):
        raise PatchError(f"asked for {item.base}->{item.target}, got {m.base_version}->{m.target_version}")
    chunking.join_verified(m, chunking.split(payload, m.chunk_bytes))
    store = LineageStore(home, lineage)
    if m.codec == "anchor-v1":
        store.put_anchor(m.target_version, payload, env)
    else:
        store.put_patch(m, env, payload)
    return m
