"""Patches in the live node: which broadcast manifests a follower takes, storing what completes, catch-up catalog.

Steady state runs on the swarming broadcast (`sync.broadcast.BroadcastNode`,
protocol `/murmur/chunks/1`): the publisher's signed manifest travels by
gossip on the announce topic, a follower's `accept` callback (`sync.items.wanted`) takes
it only for the lineage it serves and only when it does not hold it yet, the
chunks swarm over long-lived streams (every follower serves what it has
verified), and a completed transfer is stored atomically in the lineage
store (`store_complete`) before the worker is told.

Catch-up (a node that joins late, restarts or fell behind) needs items that
are no longer being announced. A small request/response protocol,
`/murmur/catalog/1`, lists what a peer holds (`catalog`) and asks it to seed
one stored item into its broadcast node (`offer`); the answer is the signed
manifest envelope, which the asker hands to its own broadcast node, so even
catch-up bytes move over the chunk swarm (and several followers catching up
share them). The asker plans with `sync.catchup.choose` over what it holds
(cost 0), what is already in flight (cost 0) and what the peer offers, so it
never downloads what it has.

Frames (gossip.framing, 4-byte length prefix), one request per stream:
  request  CatalogRequest (msgpack, <= 1 KiB)
  reply    CatalogReply   (msgpack, <= 1 MiB: <= 4096 items, or one envelope <= 512 KiB)
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta, Struct

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError
from murmur.gossip.framing import read_frame, write_frame
from murmur.sync.errors import PatchError
from murmur.sync.items import KINDS, MAX_ITEMS, StoredItem, item_of
from murmur.sync.patchstore import LineageStore

PROTOCOL = "/murmur/catalog/1"
MAX_REQUEST = 1024
MAX_REPLY = 1024 * 1024


class CatalogRequest(Struct, array_like=True, forbid_unknown_fields=True):
    op: Annotated[str, Meta(max_length=16)]  # catalog | offer
    lineage: Annotated[bytes, Meta(min_length=32, max_length=32)]
    kind: Annotated[str, Meta(max_length=16)] = ""
    base: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    target: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0


class CatalogReply(Struct, array_like=True, forbid_unknown_fields=True):
    ok: bool
    error: Annotated[str, Meta(max_length=512)] = ""
    items: Annotated[list[tuple[str, int, int, int]], Meta(max_length=MAX_ITEMS)] = []
    envelope: Annotated[bytes, Meta(max_length=512 * 1024)] = b""  # `offer`: the signed manifest


def held_store(home: Path, lineage: bytes) -> LineageStore | None:
    """The lineage store in `home`, or None when this node holds nothing of that lineage."""
    if not (Path(home) / "lineages" / lineage.hex()).is_dir():
        return None
    return LineageStore(home, lineage)


def store_complete(home: Path, m: wire.PatchManifest, envelope: bytes, payload: bytes) -> StoredItem:
    """Store a completed, chunk-verified transfer atomically (manifest last)."""
    store = LineageStore(home, bytes(m.lineage))
    if m.codec == "anchor-v1":
        store.put_anchor(m.target_version, payload, envelope)
    elif m.codec in ("sparse-v1", "union-v1"):
        store.put_patch(m, envelope, payload)
    else:
        raise PatchError(f"unknown patch codec {m.codec!r}")
    return item_of(m)


def drop_item(home: Path, lineage: bytes, base: int, target: int) -> None:
    """Remove a stored patch the worker could not apply, so that it is fetched again (from another peer)."""
    store = held_store(home, lineage)
    if store is not None:
        for suffix in (".env", ".bin"):
            (store.root / "patches" / f"{base:012d}-{target:012d}{suffix}").unlink(missing_ok=True)


def sweep_partials(root: Path, in_flight: set[str], done: set[str], keep_s: float) -> list[str]:
    """Remove chunk directories of finished downloads (`done`) and of ones abandoned more than `keep_s` ago.

    Completed patches live in the lineage store; their chunks are dropped
    here rather than at completion, when the broadcast may still be writing
    the last one.
    """
    import time

    removed: list[str] = []
    if not root.is_dir():
        return removed
    now = time.time()
    for d in root.iterdir():
        if d.name in in_flight or not d.is_dir():
            continue
        try:
            age = now - d.stat().st_mtime
        except OSError:
            continue
        if d.name in done or age > keep_s or not any(d.iterdir()):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def read_item(home: Path, lineage: bytes, item: StoredItem, *, swarm: str) -> tuple[bytes, list[bytes]]:
    """(manifest envelope, chunks) of a stored item (signed for `swarm`), ready for `BroadcastNode.publish`."""
    from murmur.sync import chunks as chunking
    from murmur.sync.patchstore import open_manifest

    store = held_store(home, lineage)
    if store is None:
        raise PatchError("lineage not held here")
    env, payload = store.read_anchor(item.target) if item.kind == "anchor" else store.read_patch(item.base, item.target)
    m = open_manifest(env, swarm=swarm)
    return env, chunking.split(payload, m.chunk_bytes)


async def serve(stream: Any, home: Path, bcast: Any) -> None:
    """Answer one request on `stream` from what `home` holds (file I/O in a thread)."""
    import trio

    raw = await read_frame(stream, MAX_REQUEST)
    try:
        req = wire.decode_struct(raw, CatalogRequest, MAX_REQUEST)
    except DecodeError as e:
        await write_frame(stream, wire.encode(CatalogReply(False, f"bad request: {e}"[:500])))
        raise  # the asker broke the protocol: the host scores it
    lineage = bytes(req.lineage)
    store = held_store(home, lineage)
    if store is None:
        await write_frame(stream, wire.encode(CatalogReply(False, "lineage not held here")))
        return
    if req.op == "catalog":
        items = await trio.to_thread.run_sync(store.items)
        await write_frame(
            stream,
            wire.encode(CatalogReply(True, "", [(i.kind, i.base, i.target, i.bytes) for i in items[-MAX_ITEMS:]])),
        )
        return
    if req.op != "offer" or req.kind not in KINDS:
        await write_frame(stream, wire.encode(CatalogReply(False, f"unknown op {req.op!r}/{req.kind!r}")))
        return
    item = StoredItem(req.kind, req.base, req.target, 0)
    try:
        env, chunks = await trio.to_thread.run_sync(partial(read_item, swarm=bcast.swarm), home, lineage, item)
    except PatchError as e:
        await write_frame(stream, wire.encode(CatalogReply(False, str(e)[:500])))
        return
    if wire.content_id(env) not in bcast.transfers:
        await bcast.publish(env, chunks, gossip=False)  # we seed it; the asker swarms it like any patch
    await write_frame(stream, wire.encode(CatalogReply(True, envelope=env)))


async def _ask(transport: Any, peer: str, req: CatalogRequest) -> CatalogReply:
    stream = await transport.open_stream(peer, PROTOCOL)
    try:
        await write_frame(stream, wire.encode(req))
        rep = wire.decode_struct(await read_frame(stream, MAX_REPLY), CatalogReply, MAX_REPLY)
    finally:
        await stream.close()
    if not rep.ok:
        raise PatchError(f"{peer[-8:]}: {rep.error}")
    return rep


async def catalog(transport: Any, peer: str, lineage: bytes) -> list[StoredItem]:
    rep = await _ask(transport, peer, CatalogRequest("catalog", lineage))
    return [StoredItem(k, b, t, n) for k, b, t, n in rep.items if k in KINDS]


async def offer(transport: Any, peer: str, lineage: bytes, item: StoredItem) -> bytes:
    """Ask `peer` to seed a stored item over the broadcast; returns its signed manifest envelope."""
    rep = await _ask(transport, peer, CatalogRequest("offer", lineage, item.kind, item.base, item.target))
    if not rep.envelope:
        raise PatchError(f"{peer[-8:]}: offer without a manifest")
    return bytes(rep.envelope)
