"""Live driver of the broadcast: streams, framing and disk around the sans-IO `sync.transfers.BroadcastCore`.

Every decision (which patches are tracked, which manifests are asked for, who
is banned, which chunk goes next and when) is the core's; this module turns
streams, gossip and timers into its events and its actions into writes.

One long-lived stream (protocol `/murmur/chunks/1`) per peer pair carries
length-prefixed frames (`gossip.framing`) for every patch in flight; the
peer with the smaller peer id opens it (the other opens one too if none has
arrived after a grace period; duplicates are harmless, both are read). Each
peer has one writer task, so frames never interleave on a stream: control
frames first, then the chunk uploads the core schedules and paces. Chunks are
served from memory and persisted to `<partial root>/<pid hex>/<i>.chunk`
(`sync.chunks.ChunkAssembly`) as they verify, so a restarted node resumes
from what it had. Manifests arrive by gossip on the swarm's announce topic,
or, for a node that hears of a patch id it does not know, over the stream
(ManifestRequest/Manifest).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from murmur.gossip import topics
from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.framing import FrameReader, encode_frames
from murmur.gossip.transport import FrameError, PublishError, Stream, StreamError, Transport
from murmur.gossip.wire import PATCH_MANIFEST, PatchManifest, content_id, decode_envelope
from murmur.sync.chunks import ChunkAssembly
from murmur.sync.swarm import MAX_FRAME_BYTES, Frame, Penalise, Send, ServeReady, SwarmConfig, decode_frame
from murmur.sync.transfers import (
    Action,
    Added,
    BroadcastCore,
    Complete,
    Disconnect,
    Evicted,
    Load,
    Stored,
    Transfer,
    Wake,
)

log = logging.getLogger("murmur.sync.broadcast")

PROTOCOL = "/murmur/chunks/1"


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
        swarm: str,
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
        self.swarm = swarm
        self.core = BroadcastCore(
            config,
            swarm=swarm,
            upload_bytes_per_s=upload_bytes_per_s,
            accept=accept,
            seed=seed,
            manifest_retry_s=manifest_retry_s,
            now=trio.current_time(),
        )
        self.partial_root = partial_root
        self.on_penalty = on_penalty
        self.on_complete = on_complete
        self.tick_s = tick_s
        self.open_grace_s = open_grace_s
        self.write_timeout_s = write_timeout_s
        self.conns: dict[str, _Conn] = {}
        self._stores: dict[bytes, ChunkAssembly] = {}  # partial chunk directories of the transfers we receive
        self._adding: dict[bytes, trio.Event] = {}  # chunks on disk being read for an accepted manifest
        self._first_seen: dict[str, float] = {}
        self._opening: set[str] = set()  # stream opens in progress (one at a time per peer)
        self._open_backoff: dict[str, tuple[float, float]] = {}  # peer -> (retry at, current backoff)
        self._rng = random.Random(seed)
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()  # set (and replaced) whenever a transfer is added
        self._progress = trio.Event()  # set (and replaced) whenever a chunk verifies or a transfer completes
        self._conns_changed = trio.Event()
        self._tick_wake = trio.Event()  # set when the ticker may have work again (it sleeps when idle)
        self._io = {"frames_in": 0, "frames_out": 0, "bytes_up": 0, "writes": 0}

    # ------------------------------------------------------------ state (the core's)

    @property
    def transfers(self) -> dict[bytes, Transfer]:
        return self.core.transfers

    @property
    def banned(self) -> set[str]:
        return self.core.banned

    @property
    def counters(self) -> dict[str, int]:
        """The core's decision counters and this driver's I/O counters."""
        return {**self._io, **self.core.counters}

    @property
    def frames_by_type(self) -> dict[str, int]:
        return self.core.frames_by_type

    @property
    def ticking(self) -> bool:
        return self.core.ticking

    def stats(self, pid: bytes) -> dict[str, Any]:
        return self.core.stats(pid)

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
        pid, actions = self.core.publish(envelope, chunks, trio.current_time(), time.time())
        self._apply(actions)
        if gossip:
            try:
                await self.t.publish(self.topic, envelope)
            except PublishError as e:
                # not fatal: every peer on a chunk stream sees the patch id in our Have and asks for
                # the manifest (ManifestRequest); gossip only reaches the others sooner
                log.warning(
                    "patch %s: manifest gossip failed (%s); peers learn it over chunk streams", pid.hex()[:12], e
                )
        return pid

    async def add_manifest(self, envelope: bytes) -> bytes | None:
        """Follow a patch announced elsewhere; the signature is checked first. Returns its id, or None if declined.

        Idempotent and safe to call concurrently (gossip and a `Manifest` reply often race): a
        second caller waits for the first, so there is only ever one `Transfer` per patch id.
        """
        pid = content_id(envelope)
        self._apply(self.core.offer(envelope, trio.current_time()))
        pending = self._adding.get(pid)
        if pending is not None:
            await pending.wait()
        return pid if pid in self.core.transfers else None

    async def wait_complete(self, pid: bytes, timeout_s: float) -> Transfer:
        """StreamError when the transfer is not (or no longer) tracked: evicted by the transfer limit."""
        tr = self.core.transfers.get(pid)
        if tr is None:
            raise StreamError(f"patch {pid.hex()[:12]} is not being transferred (unknown or evicted)")
        with trio.fail_after(timeout_s):
            while not tr.session.complete:
                await self._progress.wait()
        return tr

    async def wait_have(self, pid: bytes, n: int, timeout_s: float) -> None:
        """Until at least `n` chunks of the tracked patch `pid` are held (TooSlowError after `timeout_s`)."""
        tr = self.core.transfers[pid]
        with trio.fail_after(timeout_s):
            while tr.session.nhave < n:
                await self._progress.wait()

    async def wait_for_transfer(self, timeout_s: float, pred: Callable[[Transfer], bool] = lambda t: True) -> Transfer:
        """The first transfer matching `pred` (waits for a manifest to arrive)."""
        with trio.fail_after(timeout_s):
            while True:
                for tr in self.core.transfers.values():
                    if pred(tr):
                        return tr
                await self._changed.wait()

    async def wait_conns(self, n: int, timeout_s: float) -> None:
        """Until chunk streams are up with at least `n` peers (TooSlowError after `timeout_s`)."""
        with trio.fail_after(timeout_s):
            while len(self.conns) < n:
                await self._conns_changed.wait()

    def ban(self, peer: str, reason: str) -> None:
        """Node-wide ban: every session drops the peer and the connection is closed."""
        self._apply(self.core.ban(peer, reason, trio.current_time()))

    # ------------------------------------------------------------ actions out

    def _apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send(a.peer, a.frame)
            elif isinstance(a, ServeReady):
                conn = self.conns.get(a.peer)
                if conn is not None:
                    conn.kick()
            elif isinstance(a, Stored):
                store = self._stores.get(a.pid)
                if store is not None:
                    self._persist(store, a.pid, a.index, a.data)
                self._progressed()
            elif isinstance(a, Complete):
                tr = self.core.transfers.get(a.pid)
                if tr is None:
                    continue
                log.info("patch %s complete (%d chunks)", a.pid.hex()[:12], tr.session.n)
                self._progressed()
                if self.on_complete:
                    self.on_complete(tr)
            elif isinstance(a, Penalise):
                if self.on_penalty:
                    self.on_penalty(a.peer, a.reason, a.amount)
            elif isinstance(a, Disconnect):
                self._disconnect(a.peer, a.reason)
            elif isinstance(a, Load):
                self._load(a)
            elif isinstance(a, Added):
                self._changed.set()
                self._changed = trio.Event()
            elif isinstance(a, Evicted):
                self._stores.pop(a.pid, None)
            elif isinstance(a, Wake):
                self._tick_wake.set()

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def _persist(self, store: ChunkAssembly, pid: bytes, index: int, data: bytes) -> None:
        """Keep a verified chunk for a restart to resume from (see `ChunkAssembly.put_verified`)."""
        try:
            store.put_verified(index, data)
        except (MurmurError, OSError) as e:
            log.warning("could not persist chunk %d of %s: %s", index, pid.hex()[:12], e)

    def _load(self, a: Load) -> None:
        if self.partial_root is None:  # nothing kept on disk: follow at once
            self._apply(self.core.follow(a.pid, {}, trio.current_time(), time.time()))
            return
        self._adding[a.pid] = trio.Event()
        self._nursery.start_soon(self._load_partial, a)  # type: ignore[union-attr]  # only while run() holds the nursery

    async def _load_partial(self, a: Load) -> None:
        """Reopen the patch's partial directory (files are re-verified) and start from what it holds."""

        def read() -> tuple[ChunkAssembly, dict[int, bytes]]:
            store = ChunkAssembly(self.partial_root / a.pid.hex(), a.manifest)  # type: ignore[operator]  # started only when partial_root is set
            held = {}
            for i in range(len(a.manifest.chunks)):
                data = store.get(i)
                if data is not None:
                    held[i] = data
            return store, held

        try:
            try:
                store, held = await trio.to_thread.run_sync(read)
            except (MurmurError, OSError) as e:
                log.warning("patch %s: partial chunks unreadable (%s); not following it", a.pid.hex()[:12], e)
                self.core.abandon(a.pid)
                return
            self._stores[a.pid] = store
            self._apply(self.core.follow(a.pid, held, trio.current_time(), time.time()))
            if a.pid not in self.core.transfers:
                self._stores.pop(a.pid, None)
        finally:
            self._adding.pop(a.pid).set()

    def _send(self, peer: str, frame: Frame) -> None:
        conn = self.conns.get(peer)
        if conn is None or conn.closed:
            return
        conn.control.append(frame)
        if len(conn.control) == 1:
            conn.kick()

    def _disconnect(self, peer: str, reason: str) -> None:
        log.warning("banning %s: %s", peer, reason)
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

    # ------------------------------------------------------------ peers and streams

    def _conns_change(self) -> None:
        self._conns_changed.set()
        self._conns_changed = trio.Event()

    async def _peer_watch(self) -> None:
        """Open a stream to every newly connected peer (smaller peer id first) and notice departures.

        A failed open is retried with a backoff (0.5 s doubling to 8 s, jittered): on a loaded
        host a stream negotiation can time out, and hammering makes it worse.
        """
        while True:
            now = trio.current_time()
            connected = set(self.t.peers())
            for peer in connected:
                if peer in self.conns or peer in self.core.banned or peer in self._opening:
                    continue
                retry = self._open_backoff.get(peer)
                if retry is not None and now < retry[0]:
                    continue
                first = self._first_seen.setdefault(peer, now)
                if self.me < peer or now - first > self.open_grace_s:
                    self._first_seen.pop(peer, None)
                    self._opening.add(peer)
                    self._nursery.start_soon(self._open_to, peer)  # type: ignore[union-attr]  # only while run() holds the nursery
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
        if peer in self.core.banned:
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
            self._nursery.start_soon(self._writer, conn)  # type: ignore[union-attr]  # only while run() holds the nursery
            self._apply(self.core.peer_connected(peer, trio.current_time()))
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
        self._apply(self.core.peer_gone(conn.peer, trio.current_time()))

    def _close_conn(self, conn: _Conn) -> None:
        conn.closed = True
        conn.kick_send.close()
        for s in conn.streams:
            if self._nursery is not None:
                self._nursery.start_soon(s.reset)

    async def _reader(self, conn: _Conn, stream: Stream) -> None:
        with FrameReader(stream, MAX_FRAME_BYTES) as reader:  # frees its buffer budget however the loop ends
            await self._read_frames(conn, reader)

    async def _read_frames(self, conn: _Conn, reader: FrameReader) -> None:
        peer = conn.peer
        while not conn.closed:
            try:
                data = await reader.next()
            except FrameError as e:
                self._apply(self.core.bad_frame(peer, str(e)))
                return  # a peer that breaks the framing loses the stream
            except StreamError as e:
                log.debug("stream from %s ended: %s", peer, e)
                return
            if data is None:
                log.debug("stream from %s closed", peer)
                return
            self._io["frames_in"] += 1
            try:
                frame = decode_frame(data)
            except DecodeError as e:
                self._apply(self.core.bad_frame(peer, str(e)))
                return  # a peer that sends garbage loses the stream
            if peer in self.core.banned:
                return
            self._apply(self.core.on_frame(peer, frame, trio.current_time()))

    async def _writer(self, conn: _Conn) -> None:
        """The only task writing to this peer: control frames, then the chunk uploads the core paces."""
        try:
            await self._write_loop(conn)
        finally:
            self._drop_conn(conn)  # a writer that gives up takes the connection with it

    async def _write_loop(self, conn: _Conn) -> None:
        try:
            async for _ in conn.kick_recv:
                while not conn.closed:
                    if not await self._flush_control(conn):
                        return
                    slot = self.core.next_upload(conn.peer, trio.current_time())
                    if slot is None:
                        break
                    while trio.current_time() < slot.at:  # keep control frames flowing while paced
                        with trio.move_on_at(slot.at):
                            await conn.kick_recv.receive()
                        if not await self._flush_control(conn):
                            return
                    chunk, actions = self.core.take_upload(conn.peer, slot, trio.current_time())
                    self._apply(actions)
                    if chunk is None:
                        continue
                    # pending control frames ride in the same write as the chunk
                    frames: list[Frame] = conn.control
                    conn.control = []
                    frames.append(chunk)
                    buf = encode_frames(frames)
                    if not await self._write(conn, buf, len(frames)):
                        return
                    self._io["bytes_up"] += len(buf)
        except (trio.ClosedResourceError, trio.EndOfChannel):
            return

    async def _flush_control(self, conn: _Conn) -> bool:
        """Every queued control frame in one write (frames queued meanwhile go in the next)."""
        while conn.control:
            frames = conn.control
            conn.control = []
            if not await self._write(conn, encode_frames(frames), len(frames)):
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
        self._io["frames_out"] += nframes
        self._io["writes"] += 1
        return True

    # ------------------------------------------------------------ gossip and clock

    async def _gossip_loop(self, inbox: Any) -> None:
        while True:
            _origin, data = await inbox.receive()
            try:
                if decode_envelope(data, swarm=self.swarm).kind != PATCH_MANIFEST:
                    continue
                self._apply(self.core.offer(data, trio.current_time()))
            except (DecodeError, MurmurError) as e:
                log.info("patch manifest from gossip rejected: %s", e)

    async def _ticker(self) -> None:
        """Every `tick_s` while the core needs it (stalls, back-offs, super-seeding, manifests asked
        for); asleep otherwise: an idle node should not wake 20 times a second."""
        while True:
            if not self.core.ticking:
                self._tick_wake = trio.Event()
                await self._tick_wake.wait()
            await trio.sleep(self.tick_s)
            self._apply(self.core.tick(trio.current_time()))
