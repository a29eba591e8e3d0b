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
import random
import struct
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

from gossip import topics
from gossip.transport import FrameError, PublishError, Stream, StreamError, Transport
from gossip.wire import PATCH_MANIFEST, PatchManifest, content_id, decode_envelope, open_envelope
from gossip.errors import DecodeError, MurmurError
from sync.chunks import ChunkAssembly
from sync.ratelimit import UploadLimiter
from sync.swarm import (MAX_FRAME_BYTES, Ban, Chunk, Completed, Frame, Have, HaveChunk, Manifest, ManifestRequest,
                        Penalise, Send, ServeReady, SwarmConfig, SwarmSession, Verified, decode_frame)

log = logging.getLogger("murmur.sync.broadcast")

PROTOCOL = "/murmur/chunks/1"
MAX_TRANSFERS = 64  # patches a node tracks at once; beyond this the oldest finished one, else the oldest, goes
MAX_MANIFEST_ASKS = 256  # unknown patch ids we ask peers about (and who advertised them)
READ_SIZE = 1 << 20  # one stream read takes whatever the muxer holds, up to this
_LEN = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()


def frame_bytes(frames: list[Frame]) -> bytearray:
    """Length-prefixed encodings of `frames`, back to back, for one stream write.

    Coalescing matters on py-libp2p: every write is one yamux frame and one Noise message with
    a fixed Python cost, so a burst of control frames costs one write, not one each, and a chunk
    is encoded straight into the write buffer (no extra copy of its bytes).
    """
    buf = bytearray()
    for f in frames:
        at = len(buf)
        buf += b"\0\0\0\0"
        _encoder.encode_into(f, buf, at + 4)
        _LEN.pack_into(buf, at, len(buf) - at - 4)
    return buf


class FrameReader:
    """Reads length-prefixed swarm frames through a buffer: one stream read serves many frames.

    Each `stream.read` on py-libp2p costs a lock round and a window update; small control frames
    arriving together are parsed from one read. The length is checked against the limit before
    anything is buffered for the frame body.
    """

    def __init__(self, stream: Stream, max_len: int = MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self.max_len = max_len
        self.buf = bytearray()
        self.pos = 0

    async def next(self) -> bytes | None:
        """The next frame's payload; None on a clean end of stream. StreamError on a broken one."""
        while True:
            avail = len(self.buf) - self.pos
            if avail >= 4:
                (n,) = _LEN.unpack_from(self.buf, self.pos)
                if n > self.max_len:
                    raise FrameError(f"frame of {n} bytes exceeds the {self.max_len}-byte limit")
                if avail >= 4 + n:
                    start = self.pos + 4
                    data = bytes(self.buf[start:start + n])
                    self.pos = start + n
                    if self.pos == len(self.buf):
                        self.buf.clear()
                        self.pos = 0
                    return data
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            part = await self.stream.read(READ_SIZE)
            if not part:
                if self.buf:
                    raise StreamError(f"stream closed inside a frame ({len(self.buf)} bytes buffered)")
                return None
            self.buf += part


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
        self._progress = trio.Event()  # set (and replaced) whenever a chunk verifies
        if session.complete:
            self.done.set()

    async def wait_have(self, n: int, timeout_s: float) -> None:
        """Until at least `n` chunks are held (TooSlowError after `timeout_s`)."""
        with trio.fail_after(timeout_s):
            while self.session.nhave < n:
                await self._progress.wait()

    def _verified(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def payload(self) -> bytes:
        if not self.session.complete:
            raise MurmurError("patch not complete yet")
        return b"".join(self.chunks)  # type: ignore[arg-type]


class _Conn:
    """Our side of one peer: its streams (all on one libp2p connection), its writer's queue."""

    def __init__(self, peer: str, key: int | None) -> None:
        self.peer = peer
        self.key = key  # the libp2p connection the streams run on (Stream.conn_key), if known
        self.streams: list[Stream] = []
        self.control: list[Frame] = []
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
        open_grace_s: float = 3.0,
        write_timeout_s: float = 15.0,
        seed: int | None = None,
        manifest_retry_s: float = 2.0,
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
        self.manifest_retry_s = manifest_retry_s
        self.transfers: dict[bytes, Transfer] = {}
        self.conns: dict[str, _Conn] = {}
        self.banned: set[str] = set()
        # unknown patch ids seen in peers' have-maps: when we last asked for the manifest, who has it
        self._asked: dict[bytes, float] = {}
        self._advertisers: dict[bytes, set[str]] = {}
        self._adding: dict[bytes, trio.Event] = {}  # add_manifest in progress per patch id
        self._first_seen: dict[str, float] = {}
        self._opening: set[str] = set()  # stream opens in progress (one at a time per peer)
        self._open_backoff: dict[str, tuple[float, float]] = {}  # peer -> (retry at, current backoff)
        self._rng = random.Random(seed)
        self.frames_by_type: dict[str, int] = {}  # frames received, by type (diagnostics)
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._conns_changed = trio.Event()
        self._tick_wake = trio.Event()  # set when the ticker may have work again (it sleeps when idle)
        self.counters = {"frames_in": 0, "frames_out": 0, "bytes_up": 0, "bad_frames": 0, "manifests_rejected": 0,
                         "writes": 0, "transfers_evicted": 0}

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
            try:
                await self.t.publish(self.topic, envelope)
            except PublishError as e:
                # not fatal: every peer on a chunk stream sees the patch id in our Have and asks for
                # the manifest (ManifestRequest); gossip only reaches the others sooner
                log.warning("patch %s: manifest gossip failed (%s); peers learn it over chunk streams",
                            pid.hex()[:12], e)
        return pid

    async def add_manifest(self, envelope: bytes) -> bytes | None:
        """Follow a patch announced elsewhere; the signature is checked first. Returns its id, or None if declined.

        Idempotent and safe to call concurrently (gossip and a `Manifest` reply often race): a
        second caller waits for the first, so there is only ever one `Transfer` per patch id.
        """
        pid = content_id(envelope)
        if pid in self.transfers:
            return pid
        pending = self._adding.get(pid)
        if pending is not None:
            await pending.wait()
            return pid if pid in self.transfers else None
        manifest = self._open(envelope)
        if not self.accept(manifest):
            return None
        done = self._adding[pid] = trio.Event()
        try:
            return await self._add_follower(pid, envelope, manifest)
        finally:
            del self._adding[pid]
            done.set()

    async def _add_follower(self, pid: bytes, envelope: bytes, manifest: PatchManifest) -> bytes:
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
        """StreamError when the transfer is not (or no longer) tracked: evicted by the transfer limit."""
        tr = self.transfers.get(pid)
        if tr is None:
            raise StreamError(f"patch {pid.hex()[:12]} is not being transferred (unknown or evicted)")
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

    async def wait_conns(self, n: int, timeout_s: float) -> None:
        """Until chunk streams are up with at least `n` peers (TooSlowError after `timeout_s`)."""
        with trio.fail_after(timeout_s):
            while len(self.conns) < n:
                await self._conns_changed.wait()

    def _conns_change(self) -> None:
        self._conns_changed.set()
        self._conns_changed = trio.Event()

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
            self._conns_change()
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
            # A transfer whose chunks nobody serves would otherwise hold its slot forever, and a full
            # table of them would refuse every later patch: the oldest unfinished one gives way.
            old = next((p for p, t in self.transfers.items() if t.session.complete), None)
            if old is None:
                old = min(self.transfers, key=lambda p: self.transfers[p].started)
                self.counters["transfers_evicted"] += 1
            del self.transfers[old]
        self.transfers[tr.pid] = tr
        self._asked.pop(tr.pid, None)
        self._advertisers.pop(tr.pid, None)
        now = trio.current_time()
        for peer in self.conns:
            self._apply(tr, tr.session.peer_joined(peer, now))
        self._changed.set()
        self._changed = trio.Event()
        self._tick_wake.set()

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
                tr._verified()
                if tr.store is not None:
                    self._persist(tr, a.index, a.data)
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

    def _persist(self, tr: Transfer, index: int, data: bytes) -> None:
        """Keep a verified chunk for a restart to resume from (see `ChunkAssembly.put_verified`)."""
        try:
            tr.store.put_verified(index, data)  # type: ignore[union-attr]
        except (MurmurError, OSError) as e:
            log.warning("could not persist chunk %d of %s: %s", index, tr.pid.hex()[:12], e)

    def _send(self, peer: str, frame: Frame) -> None:
        conn = self.conns.get(peer)
        if conn is None or conn.closed:
            return
        conn.control.append(frame)
        if len(conn.control) == 1:
            conn.kick()

    # ------------------------------------------------------------ internals: peers and streams

    async def _peer_watch(self) -> None:
        """Open a stream to every newly connected peer (smaller peer id first) and notice departures.

        A failed open is retried with a backoff (0.5 s doubling to 8 s, jittered): on a loaded
        host a stream negotiation can time out, and hammering makes it worse.
        """
        while True:
            now = trio.current_time()
            connected = set(self.t.peers())
            for peer in connected:
                if peer in self.conns or peer in self.banned or peer in self._opening:
                    continue
                retry = self._open_backoff.get(peer)
                if retry is not None and now < retry[0]:
                    continue
                first = self._first_seen.setdefault(peer, now)
                if self.me < peer or now - first > self.open_grace_s:
                    self._first_seen.pop(peer, None)
                    self._opening.add(peer)
                    self._nursery.start_soon(self._open_to, peer)  # type: ignore[union-attr]
            for table in (self._first_seen, self._open_backoff):
                for peer in [p for p in table if p not in connected]:
                    del table[peer]
            await trio.sleep(0.25)

    async def _open_to(self, peer: str) -> None:
        try:
            stream = await self.t.open_stream(peer, PROTOCOL)
        except (StreamError, MurmurError) as e:
            back = min(8.0, 2 * self._open_backoff.get(peer, (0.0, 0.25))[1])
            self._open_backoff[peer] = (trio.current_time() + back * (0.5 + self._rng.random()), back)
            log.debug("open %s to %s failed (retry in ~%.1f s): %s", PROTOCOL, peer, back, e)
            return
        finally:
            self._opening.discard(peer)
        self._open_backoff.pop(peer, None)
        await self._serve_stream(stream, peer)

    async def _on_inbound(self, stream: Stream, peer: str) -> None:
        if peer in self.banned:
            await stream.reset()
            return
        await self._serve_stream(stream, peer)

    async def _serve_stream(self, stream: Stream, peer: str) -> None:
        key = getattr(stream, "conn_key", None)
        conn = self.conns.get(peer)
        if conn is not None and key is not None and conn.key is not None and conn.key != key:
            # a stream on a new connection: the peer restarted or redialled and forgot our sessions,
            # so the old state (its have-maps, our requests to it) goes, and the sessions start over
            log.info("%s is on a new connection; restarting its sessions", peer)
            self._drop_conn(conn)
            conn = None
        fresh = conn is None
        if conn is None:
            conn = self.conns[peer] = _Conn(peer, key)
            self._conns_change()
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
        self._conns_change()
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
        reader = FrameReader(stream, MAX_FRAME_BYTES)
        while not conn.closed:
            try:
                data = await reader.next()
            except FrameError as e:
                self.counters["bad_frames"] += 1
                if self.on_penalty:
                    self.on_penalty(peer, str(e), self.cfg.penalty_protocol)
                return  # a peer that breaks the framing loses the stream
            except StreamError as e:
                log.debug("stream from %s ended: %s", peer, e)
                return
            if data is None:
                log.debug("stream from %s closed", peer)
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
            name = type(frame).__name__
            self.frames_by_type[name] = self.frames_by_type.get(name, 0) + 1
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
            if isinstance(frame, (Have, HaveChunk)) and frame.pid not in self._adding:
                self._advertised(peer, frame.pid, now)
            return
        self._apply(tr, tr.session.on_frame(peer, frame, now))

    def _advertised(self, peer: str, pid: bytes, now: float) -> None:
        """`peer` holds a patch we have no manifest for: ask it, unless someone was asked just now.

        The ticker asks another advertiser every `manifest_retry_s` until the manifest arrives, so
        a request lost with a dying stream cannot leave a follower without the patch forever.
        """
        if pid not in self._advertisers:
            if len(self._advertisers) >= MAX_MANIFEST_ASKS:
                old = next(iter(self._advertisers))
                del self._advertisers[old]
                self._asked.pop(old, None)
            self._advertisers[pid] = set()
            self._tick_wake.set()
        self._advertisers[pid].add(peer)
        if now - self._asked.get(pid, -1e9) >= self.manifest_retry_s:
            self._asked[pid] = now
            self._send(peer, ManifestRequest(pid))

    def _retry_manifests(self, now: float) -> None:
        for pid, peers in list(self._advertisers.items()):
            if pid in self.transfers or pid in self._adding:
                continue
            if now - self._asked.get(pid, -1e9) < self.manifest_retry_s:
                continue
            live = [p for p in peers if p in self.conns]
            peers.intersection_update(live)
            if live:
                self._asked[pid] = now
                self._send(self._rng.choice(sorted(live)), ManifestRequest(pid))

    async def _writer(self, conn: _Conn) -> None:
        """The only task writing to this peer: control frames, then rate-limited chunk uploads."""
        rr: deque[bytes] = deque()
        try:
            await self._write_loop(conn, rr)
        finally:
            self._drop_conn(conn)  # a writer that gives up takes the connection with it

    async def _write_loop(self, conn: _Conn, rr: deque[bytes]) -> None:  # noqa: C901
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
                    # pending control frames ride in the same write as the chunk
                    frames: list[Frame] = conn.control
                    conn.control = []
                    frames.append(Chunk(tr.pid, idx, data))
                    buf = frame_bytes(frames)
                    if not await self._write(conn, buf, len(frames)):
                        return
                    self.counters["bytes_up"] += len(buf)
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
        """Every queued control frame in one write (frames queued meanwhile go in the next)."""
        while conn.control:
            frames = conn.control
            conn.control = []
            if not await self._write(conn, frame_bytes(frames), len(frames)):
                return False
        return True

    async def _write(self, conn: _Conn, data: bytearray, nframes: int = 1) -> bool:
        if not conn.streams or conn.closed:
            return False
        stream = conn.streams[-1]
        try:
            with trio.move_on_after(self.write_timeout_s) as scope:
                await stream.write(data)
        except StreamError as e:
            log.debug("write to %s failed: %s", conn.peer, e)
            return False
        if scope.cancelled_caught:
            # a peer that stops reading (dead without a reset, or wedged) must not hold our upload
            # slot forever: drop the stream; its reader then ends and the sessions forget the peer
            log.info("write to %s stalled for %.0f s; dropping the stream", conn.peer, self.write_timeout_s)
            await stream.reset()
            return False
        self.counters["frames_out"] += nframes
        self.counters["writes"] += 1
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

    @property
    def ticking(self) -> bool:
        """Whether the ticker has work: a session that needs ticks, or a manifest still asked for."""
        return bool(self._advertisers) or any(tr.session.needs_tick for tr in self.transfers.values())

    async def _ticker(self) -> None:
        """Every `tick_s` while a session needs it (stalls, back-offs, super-seeding) or a manifest is
        still being asked for; asleep otherwise: an idle node should not wake 20 times a second."""
        while True:
            if not self.ticking:
                self._tick_wake = trio.Event()
                await self._tick_wake.wait()
            await trio.sleep(self.tick_s)
            now = trio.current_time()
            for tr in list(self.transfers.values()):
                if tr.session.needs_tick:  # a node keeps up to MAX_TRANSFERS finished ones: skip those
                    self._apply(tr, tr.session.tick(now))
            if self._advertisers:
                self._retry_manifests(now)
