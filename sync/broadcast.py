"""Live driver: runs `sync.swarm.SwarmSession`s over a `gossip.transport.Transport`.

One long-lived stream (protocol `/murmur/chunks/1`) per peer pair carries
length-prefixed frames (`gossip.framing`) for every patch in flight; the
peer with the smaller peer id opens it (the other opens one too if none has
arrived after a grace period; duplicates are harmless, both are read). Each
peer has one writer task, so frames never interleave on a stream: control
frames first, then chunk uploads, each paid for in advance from the node's
single upload token bucket (`network.upload_bytes_per_s`), so the limit
holds across all peers and patches. Chunks are served from memory and
persisted to `<partial root>/<pid hex>/<i>.chunk` (`sync.chunks.ChunkAssembly`)
in a worker thread as they verify, so a restarted node resumes from what it
had. Manifests arrive by gossip on the swarm's announce topic, or, for a node
that hears of a patch id it does not know, over the stream
(ManifestRequest/Manifest); either way the publisher's signature is checked
(`gossip.wire.open_envelope`) before a single chunk is requested.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from gossip import topics
from gossip.framing import read_frame, write_frame
from gossip.transport import Stream, StreamError, Transport
from gossip.wire import PATCH_MANIFEST, PatchManifest, content_id, decode_envelope, open_envelope
from node.errors import DecodeError, MurmurError
from sync.chunks import ChunkAssembly
from sync.ratelimit import UploadLimiter
from sync.swarm import (MAX_FRAME_BYTES, Ban, Chunk, Completed, Frame, Have, Manifest, ManifestRequest, Penalise,
                        Send, ServeReady, SwarmConfig, SwarmSession, Verified, decode_frame, encode_frame)

log = logging.getLogger("murmur.sync.broadcast")

PROTOCOL = "/murmur/chunks/1"
MAX_TRANSFERS = 64  # patches a node swarms at once; the oldest completed one is dropped beyond this
MAX_MANIFEST_ASKS = 256  # unknown patch ids we ask peers about, remembered to ask only once


class Transfer:
    """One patch at this node: its manifest, the core session, and the chunks held."""

    def __init__(self, pid: bytes, envelope: bytes, manifest: PatchManifest, session: SwarmSession,
                 chunks: list[bytes | None], store: ChunkAssembly | None, started: float) -> None:
        self.pid = pid
        self.envelope = envelope
        self.manifest = manifest
        self.session = session
        self.chunks = chunks
        self.store = store
        self.started = started  # wall clock
        self.completed_wall: float | None = time.time() if session.complete else None
        self.done = trio.Event()
        if session.complete:
            self.done.set()

    def payload(self) -> bytes:
        if not self.session.complete:
            raise MurmurError("patch not complete yet")
        return b"".join(self.chunks)  # type: ignore[arg-type]


class _Conn:
    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.streams: list[Stream] = []
        self.control: deque[bytes] = deque()
        self.kick_send, self.kick_recv = trio.open_memory_channel[None](1)
        self.closed = False

    def kick(self) -> None:
        try:
            self.kick_send.send_nowait(None)
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass


class BroadcastNode:
    """Sends and receives patches for one node. Run `run()` in a nursery, then publish/await."""

    def __init__(
        self,
        transport: Transport,
        *,
        swarm: str = "murmur-default",
        upload_bytes_per_s: int = 0,
        config: SwarmConfig | None = None,
        partial_root: Path | None = None,
        accept: Callable[[PatchManifest], bool] | None = None,
        on_penalty: Callable[[str, str, float], None] | None = None,
        on_complete: Callable[[Transfer], None] | None = None,
        tick_s: float = 0.05,
        open_grace_s: float = 1.0,
        write_timeout_s: float = 15.0,
        seed: int | None = None,
    ) -> None:
        self.t = transport
        self.me = transport.peer_id
        self.topic = topics.announce(swarm)
        self.limiter = UploadLimiter(upload_bytes_per_s)
        self.cfg = config or SwarmConfig()
        self.partial_root = partial_root
        self.accept = accept or (lambda m: True)
        self.on_penalty = on_penalty
        self.on_complete = on_complete
        self.tick_s = tick_s
        self.open_grace_s = open_grace_s
        self.write_timeout_s = write_timeout_s
        self.seed = seed
        self.transfers: dict[bytes, Transfer] = {}
        self.conns: dict[str, _Conn] = {}
        self.banned: set[str] = set()
        self._asked: dict[bytes, float] = {}
        self._first_seen: dict[str, float] = {}
        self._opening: set[str] = set()  # stream opens in progress (one at a time per peer)
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.counters = {"frames_in": 0, "frames_out": 0, "bytes_up": 0, "bad_frames": 0, "manifests_rejected": 0}

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            self.t.set_stream_handler(PROTOCOL, self._on_inbound)
            inbox = await self.t.subscribe(self.topic)
            n.start_soon(self._gossip_loop, inbox)
            n.start_soon(self._peer_watch)
            n.start_soon(self._ticker)
            task_status.started()

    # ------------------------------------------------------------ public API

    async def publish(self, envelope: bytes, chunks: list[bytes], *, gossip: bool = True) -> bytes:
        """Become the origin of a signed patch whose chunk bytes are `chunks`; returns its patch id."""
        manifest = self._open(envelope)
        if len(chunks) != len(manifest.chunks):
            raise MurmurError(f"{len(chunks)} chunks for a manifest listing {len(manifest.chunks)}")
        pid = content_id(envelope)
        session = SwarmSession(pid, [c.hash for c in manifest.chunks], [c.size for c in manifest.chunks],
                               have=range(len(chunks)), origin=True, config=self.cfg, now=trio.current_time(),
                               seed=self.seed)
        self._add(Transfer(pid, envelope, manifest, session, list(chunks), None, time.time()))
        if gossip:
            await self.t.publish(self.topic, envelope)
        return pid

    async def add_manifest(self, envelope: bytes) -> bytes | None:
        """Follow a patch announced elsewhere; the signature is checked first. Returns its id, or None if declined."""
        pid = content_id(envelope)
        if pid in self.transfers:
            return pid
        manifest = self._open(envelope)
        if not self.accept(manifest):
            return None
        store = None
        have: list[int] = []
        chunks: list[bytes | None] = [None] * len(manifest.chunks)
        if self.partial_root is not None:
            store = await trio.to_thread.run_sync(ChunkAssembly, self.partial_root / pid.hex(), manifest)
            for i in range(len(chunks)):
                data = store.get(i)
                if data is not None:
                    chunks[i] = data
                    have.append(i)
        session = SwarmSession(pid, [c.hash for c in manifest.chunks], [c.size for c in manifest.chunks],
                               have=have, config=self.cfg, now=trio.current_time(), seed=self.seed)
        tr = Transfer(pid, envelope, manifest, session, chunks, store, time.time())
        self._add(tr)
        if session.complete and self.on_complete:
            self.on_complete(tr)
        return pid

    async def wait_complete(self, pid: bytes, timeout_s: float) -> Transfer:
        tr = self.transfers[pid]
        with trio.fail_after(timeout_s):
            await tr.done.wait()
        return tr

    async def wait_for_transfer(self, timeout_s: float, pred: Callable[[Transfer], bool] = lambda t: True) -> Transfer:
        """The first transfer matching `pred` (waits for a manifest to arrive)."""
        with trio.fail_after(timeout_s):
            while True:
                for tr in self.transfers.values():
                    if pred(tr):
                        return tr
                await self._changed.wait()

    def ban(self, peer: str, reason: str) -> None:
        """Node-wide ban: every session drops the peer and the connection is closed."""
        if peer in self.banned:
            return
        self.banned.add(peer)
        log.warning("banning %s: %s", peer, reason)
        now = trio.current_time()
        for tr in self.transfers.values():
            out: list[Any] = []
            tr.session.ban(peer, now, out)
            self._apply(tr, out)
        conn = self.conns.pop(peer, None)
        if conn is not None:
            self._close_conn(conn)
        blacklist = getattr(self.t, "blacklist", None)
        if blacklist is not None:
            try:
                blacklist(peer)
            except Exception as e:  # the host may not know the peer any more
                log.debug("blacklist %s: %s", peer, e)
        if self._nursery is not None:
            self._nursery.start_soon(self.t.disconnect, peer)

    def stats(self, pid: bytes) -> dict[str, Any]:
        tr = self.transfers[pid]
        s = tr.session
        return {"pid": pid.hex(), "chunks": s.n, "have": s.nhave, "complete": s.complete,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "wasted_in": s.wasted_in,
                "started": tr.started, "completed": tr.completed_wall, "peers": s.peer_stats()}

    # ------------------------------------------------------------ internals: transfers

    def _open(self, envelope: bytes) -> PatchManifest:
        try:
            _, manifest = open_envelope(envelope, expect=PATCH_MANIFEST)
        except DecodeError:
            self.counters["manifests_rejected"] += 1
            raise
        return manifest

    def _add(self, tr: Transfer) -> None:
        if len(self.transfers) >= MAX_TRANSFERS:
            old = next((p for p, t in self.transfers.items() if t.session.complete), None)
            if old is None:
                raise MurmurError(f"{MAX_TRANSFERS} patches already in flight")
            del self.transfers[old]
        self.transfers[tr.pid] = tr
        now = trio.current_time()
        for peer in self.conns:
            self._apply(tr, tr.session.peer_joined(peer, now))
        self._changed.set()
        self._changed = trio.Event()

    def _apply(self, tr: Transfer, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send(a.peer, a.frame)
            elif isinstance(a, ServeReady):
                conn = self.conns.get(a.peer)
                if conn is not None:
                    conn.kick()
            elif isinstance(a, Verified):
                tr.chunks[a.index] = a.data
                if tr.store is not None and self._nursery is not None:
                    self._nursery.start_soon(self._persist, tr, a.index, a.data)
            elif isinstance(a, Completed):
                tr.completed_wall = time.time()
                tr.done.set()
                log.info("patch %s complete (%d chunks)", tr.pid.hex()[:12], tr.session.n)
                if self.on_complete:
                    self.on_complete(tr)
            elif isinstance(a, Penalise):
                if self.on_penalty:
                    self.on_penalty(a.peer, a.reason, a.amount)
            elif isinstance(a, Ban):
                self.ban(a.peer, a.reason)

    async def _persist(self, tr: Transfer, index: int, data: bytes) -> None:
        try:
            await trio.to_thread.run_sync(tr.store.put, index, data)  # type: ignore[union-attr]
        except (MurmurError, OSError) as e:
            log.warning("could not persist chunk %d of %s: %s", index, tr.pid.hex()[:12], e)

    def _send(self, peer: str, frame: Frame) -> None:
        conn = self.conns.get(peer)
        if conn is None or conn.closed:
            return
        conn.control.append(encode_frame(frame))
        conn.kick()

    # ------------------------------------------------------------ internals: peers and streams

    async def _peer_watch(self) -> None:
        """Open a stream to every newly connected peer (smaller peer id first) and notice departures."""
        while True:
            now = trio.current_time()
            connected = set(self.t.peers())
            for peer in connected:
                if peer in self.conns or peer in self.banned or peer in self._opening:
                    continue
                first = self._first_seen.setdefault(peer, now)
                if self.me < peer or now - first > self.open_grace_s:
                    self._first_seen.pop(peer, None)
                    self._nursery.start_soon(self._open_to, peer)  # type: ignore[union-attr]
            for peer in list(self._first_seen):
                if peer not in connected:
                    del self._first_seen[peer]
            await trio.sleep(0.2)

    async def _open_to(self, peer: str) -> None:
        if peer in self.conns or peer in self._opening:
            return
        self._opening.add(peer)
        try:
            stream = await self.t.open_stream(peer, PROTOCOL)
        except (StreamError, MurmurError) as e:
            log.debug("open %s to %s: %s", PROTOCOL, peer, e)
            return
        finally:
            self._opening.discard(peer)
        await self._serve_stream(stream, peer)

    async def _on_inbound(self, stream: Stream, peer: str) -> None:
        if peer in self.banned:
            await stream.reset()
            return
        await self._serve_stream(stream, peer)

    async def _serve_stream(self, stream: Stream, peer: str) -> None:
        conn = self.conns.get(peer)
        fresh = conn is None
        if conn is None:
            conn = self.conns[peer] = _Conn(peer)
        conn.streams.append(stream)
        if fresh:
            self._nursery.start_soon(self._writer, conn)  # type: ignore[union-attr]
            now = trio.current_time()
            for tr in list(self.transfers.values()):
                self._apply(tr, tr.session.peer_joined(peer, now))
        try:
            await self._reader(conn, stream)
        finally:
            if stream in conn.streams:
                conn.streams.remove(stream)
            if not conn.streams:
                self._drop_conn(conn)
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await stream.close()

    def _drop_conn(self, conn: _Conn) -> None:
        """The peer is gone (streams ended or a write stalled): every session forgets it. Idempotent."""
        if self.conns.get(conn.peer) is not conn:
            return
        del self.conns[conn.peer]
        self._close_conn(conn)
        now = trio.current_time()
        for tr in list(self.transfers.values()):
            self._apply(tr, tr.session.peer_left(conn.peer, now))

    def _close_conn(self, conn: _Conn) -> None:
        conn.closed = True
        conn.kick_send.close()
        for s in conn.streams:
            if self._nursery is not None:
                self._nursery.start_soon(s.reset)

    async def _reader(self, conn: _Conn, stream: Stream) -> None:
        peer = conn.peer
        while not conn.closed:
            try:
                data = await read_frame(stream, MAX_FRAME_BYTES)
            except StreamError as e:
                log.debug("stream from %s ended: %s", peer, e)
                return
            self.counters["frames_in"] += 1
            try:
                frame = decode_frame(data)
            except DecodeError as e:
                self.counters["bad_frames"] += 1
                if self.on_penalty:
                    self.on_penalty(peer, str(e), self.cfg.penalty_protocol)
                return  # a peer that sends garbage loses the stream
            if peer in self.banned:
                return
            await self._dispatch(peer, frame)

    async def _dispatch(self, peer: str, frame: Frame) -> None:
        now = trio.current_time()
        if isinstance(frame, ManifestRequest):
            tr = self.transfers.get(frame.pid)
            if tr is not None:
                self._send(peer, Manifest(frame.pid, tr.envelope))
            return
        if isinstance(frame, Manifest):
            if frame.pid not in self.transfers and frame.pid in self._asked:
                if content_id(frame.envelope) != frame.pid:
                    if self.on_penalty:
                        self.on_penalty(peer, "manifest does not match its patch id", self.cfg.penalty_protocol)
                    return
                try:
                    await self.add_manifest(frame.envelope)
                except (DecodeError, MurmurError) as e:
                    if self.on_penalty:
                        self.on_penalty(peer, f"bad manifest: {e}", self.cfg.penalty_protocol)
            return
        tr = self.transfers.get(frame.pid)
        if tr is None:
            if isinstance(frame, Have) and frame.pid not in self._asked:
                if len(self._asked) >= MAX_MANIFEST_ASKS:
                    self._asked.pop(next(iter(self._asked)))
                self._asked[frame.pid] = now
                self._send(peer, ManifestRequest(frame.pid))
            return
        self._apply(tr, tr.session.on_frame(peer, frame, now))

    async def _writer(self, conn: _Conn) -> None:
        """The only task writing to this peer: control frames, then rate-limited chunk uploads."""
        rr: deque[bytes] = deque()
        try:
            await self._write_loop(conn, rr)
        finally:
            self._drop_conn(conn)  # a writer that gives up takes the connection with it

    async def _write_loop(self, conn: _Conn, rr: deque[bytes]) -> None:
        try:
            async for _ in conn.kick_recv:
                while not conn.closed:
                    if not await self._flush_control(conn):
                        return
                    tr = self._next_upload(conn.peer, rr)
                    if tr is None:
                        break
                    reserve = tr.manifest.chunk_bytes
                    deadline = self.limiter.reserve(reserve)
                    while trio.current_time() < deadline:  # keep control frames flowing while paced
                        with trio.move_on_at(deadline):
                            await conn.kick_recv.receive()
                        if not await self._flush_control(conn):
                            return
                    idx, acts = tr.session.take_upload(conn.peer, trio.current_time())
                    self._apply(tr, acts)
                    if idx is None:
                        self.limiter.refund(reserve)
                        continue
                    data = tr.chunks[idx]
                    assert data is not None
                    if len(data) < reserve:
                        self.limiter.refund(reserve - len(data))
                    if not await self._flush_control(conn):
                        return
                    frame = encode_frame(Chunk(tr.pid, idx, data))
                    if not await self._write(conn, frame):
                        return
                    self.counters["bytes_up"] += len(frame)
        except (trio.ClosedResourceError, trio.EndOfChannel):
            return

    def _next_upload(self, peer: str, rr: deque[bytes]) -> Transfer | None:
        """Round-robin over this peer's patches with queued requests."""
        for pid in list(self.transfers):
            if pid not in rr:
                rr.append(pid)
        for _ in range(len(rr)):
            pid = rr[0]
            rr.rotate(-1)
            tr = self.transfers.get(pid)
            if tr is None:
                rr.remove(pid)
                continue
            if tr.session.has_pending(peer):
                return tr
        return None

    async def _flush_control(self, conn: _Conn) -> bool:
        while conn.control:
            if not await self._write(conn, conn.control.popleft()):
                return False
        return True

    async def _write(self, conn: _Conn, frame: bytes) -> bool:
        if not conn.streams or conn.closed:
            return False
        stream = conn.streams[-1]
        try:
            with trio.move_on_after(self.write_timeout_s) as scope:
                await write_frame(stream, frame)
        except StreamError as e:
            log.debug("write to %s failed: %s", conn.peer, e)
            return False
        if scope.cancelled_caught:
            # a peer that stops reading (dead without a reset, or wedged) must not hold our upload
            # slot forever: drop the stream; its reader then ends and the sessions forget the peer
            log.info("write to %s stalled for %.0f s; dropping the stream", conn.peer, self.write_timeout_s)
            await stream.reset()
            return False
        self.counters["frames_out"] += 1
        return True

    # ------------------------------------------------------------ internals: gossip and clock

    async def _gossip_loop(self, inbox: Any) -> None:
        while True:
            _origin, data = await inbox.receive()
            try:
                if decode_envelope(data).kind != PATCH_MANIFEST:
                    continue
                await self.add_manifest(data)
            except (DecodeError, MurmurError) as e:
                log.info("patch manifest from gossip rejected: %s", e)

    async def _ticker(self) -> None:
        while True:
            await trio.sleep(self.tick_s)
            now = trio.current_time()
            for tr in list(self.transfers.values()):
                self._apply(tr, tr.session.tick(now))
