"""Every change Murmur makes to py-libp2p 0.8.1's own code, installed by one explicit `install()`.

`gossip.host.open_transport` calls `install()` before it builds a host; `install_webrtc()` adds the
WebRTC-direct fixes once aiortc imports (`gossip.webrtc` calls it before any WebRTC connection), and
`install_dcutr()` the DCUtR one (`gossip.holepunch` calls it before it starts the service). Each
fix replaces a py-libp2p function or method that misbehaves in 0.8.1 (docs/architecture.md lists
them, one line each: what py-libp2p does wrong, what the fix does). They were written against that
release's internals, so both refuse any other installed version with `UnsupportedLibp2p` rather than
patching code they were not written for. `_replace` is the one place that assigns into py-libp2p; it
keeps each replaced original under the fix's name, so `original(name)` lets a test show the
unpatched behaviour on the same input. Where a fix's policy is larger than the hook (the stream
budget, WebRTC backpressure) it is a plain function in `gossip.hostlimits` or `gossip.webrtc`.

Installing is process-wide (the patched classes are py-libp2p's) and idempotent. The fixes that
need a host's state (its `StreamFaults`, its `StreamBudget`) find it on the host or its swarm
(`_murmur_faults`, `_murmur_budget`, set by `gossip.host`) and do nothing on a host without it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import trio

from murmur.gossip import hostlimits, webrtc
from murmur.gossip.errors import MurmurError
from murmur.gossip.transport import FrameError

log = logging.getLogger("murmur.gossip.host")

SUPPORTED_VERSION: Final = "0.8.1"


class UnsupportedLibp2p(MurmurError):
    """The installed py-libp2p is not the release these fixes were written for."""


def check_version(installed: str) -> None:
    """Refuse a py-libp2p release other than `SUPPORTED_VERSION` (its internals differ)."""
    if installed != SUPPORTED_VERSION:
        raise UnsupportedLibp2p(
            f"py-libp2p {installed} is installed, but gossip/libp2p_fixes.py patches the internals of "
            f"py-libp2p {SUPPORTED_VERSION} only: install libp2p=={SUPPORTED_VERSION}, or port each fix "
            "and raise SUPPORTED_VERSION"
        )


_originals: dict[str, Any] = {}
_installed: set[Callable[[], None]] = set()


def original(name: str) -> Any:
    """The py-libp2p function or method that fix `name` replaced (once installed); None for
    `yamux_window_limit`, which puts a property where py-libp2p has only an instance attribute."""
    return _originals[name]


def _replace(name: str, owner: Any, attr: str, new: Any, imported_by: tuple[str, ...] = ()) -> None:
    """Put `new` in place of `owner.attr` (a py-libp2p class's method or a module's function), keeping what
    was there as `original(name)`. `imported_by`: modules that imported the function by name (`from m import
    f`), whose own name for it is replaced too. The only assignment into py-libp2p in the project."""
    old = getattr(owner, attr, None)
    for module in imported_by:
        mod = importlib.import_module(module)
        if getattr(mod, attr, None) is old:
            setattr(mod, attr, new)
    setattr(owner, attr, new)
    _originals[name] = old


def _fix_go_yamux_credit() -> None:
    """Yamux credit: py-libp2p 0.8.1 returns receive-window credit on (nearly) every read, so each small
    control frame we read sends a WINDOW_UPDATE frame back: one more yamux frame, Noise message and
    socket write per message. go-yamux's rule instead: credit goes back once at least half of the
    window has been consumed. A reader that keeps reading never stalls a writer (the writer still
    has the other half when the update leaves)."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    # not a wrapper: py-libp2p's method sends the update itself, and the fix is to send fewer
    async def _go_yamux_credit(self: Any, *, bytes_read: int = 0) -> None:
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            consumed = self.target_recv_window - (self.recv_window + buffered)
            if consumed <= 0 or consumed < self.target_recv_window // 2:
                return
            delta = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        if delta > 0:
            await self.send_window_update(delta, skip_lock=True)

    _replace("go_yamux_credit", YamuxStream, "_auto_tune_and_send_window_update", _go_yamux_credit)


READ_AHEAD_BYTES = 256 * 1024


def _fix_buffered_tcp_reads() -> None:
    """TCP reads: py-libp2p 0.8.1 reads each Noise message with two socket reads (its 2-byte length,
    then its body), each a `recv` system call, a lock and a trio checkpoint. Here the socket is read
    up to `READ_AHEAD_BYTES` ahead and both are served from that buffer, so a burst of small messages
    costs one `recv`. The connection has a single reader (the muxer's loop, or the handshake before
    it), so the buffer needs no lock of its own."""
    from libp2p.io.trio import TrioTCPStream

    unbuffered = TrioTCPStream.read

    async def read(self: Any, n: int | None = None) -> bytes:
        buf: bytes = getattr(self, "_murmur_buf", b"")
        if buf:
            off: int = self._murmur_off
            end = len(buf) if n is None else min(len(buf), off + n)
            if end == len(buf):
                self._murmur_buf = b""
            else:
                self._murmur_off = end
            return buf[off:end]
        if n == 0:
            return b""
        data = await unbuffered(self, READ_AHEAD_BYTES if n is None or n < READ_AHEAD_BYTES else n)
        if n is None or len(data) <= n:
            return data
        self._murmur_buf, self._murmur_off = data, n
        return data[:n]

    _replace("buffered_tcp_reads", TrioTCPStream, "read", read)


def _fix_lean_yamux_writes() -> None:
    """Yamux DATA writes without per-frame debug formatting and context-manager objects.

    Same rules as py-libp2p 0.8.1's `YamuxStream.write`: frames of at most 64 KiB within the send
    window, the stream's writer semaphore held while a frame is cut (not while it is sent), a zero
    window waited for up to 5 s, then an error. One difference: a whole `write` holds the stream's
    message lock, so two writers on one stream never interleave their frames. py-libp2p's
    `write` cuts frames one at a time and lets other writers cut theirs in between; its pubsub
    writes to a peer's stream from its queue task and, concurrently, from the recent-message replay
    and pending flush, so an honest RPC split over several frames (over 64 KiB, or a send window
    partly used) reached the peer with another RPC's bytes inside it, and the peer's reader failed
    with a protobuf DecodeError. Its per-frame header parse, flag-name list, f-string
    log line and context-manager objects are pure overhead when debug logging is off (the
    measurement of this and the TCP read-ahead together is in docs/gossip.md).
    """
    import struct

    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux import yamux as ym

    # not wrappers: the per-frame work they do is what this fix removes
    header = struct.Struct(ym.YAMUX_HEADER_FORMAT)
    max_payload = ym.MAX_MESSAGE_SIZE - ym.HEADER_SIZE

    async def write_frame(self: Any, data: bytes) -> None:
        async with self._write_lock:
            await self.secured_conn.write(data)
        await trio.lowlevel.checkpoint()

    async def write(self: Any, data: bytes) -> None:
        lock = self.__dict__.get("_murmur_message_lock")
        if lock is None:
            lock = self._murmur_message_lock = trio.Lock()
        async with lock:
            await write_message(self, data)

    async def write_message(self: Any, data: bytes) -> None:
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data)
        sent, total = 0, len(data)
        writers = self.rw_lock._writer_lock
        while sent < total:
            frame = None
            await writers.acquire()
            try:
                if self.send_closed:
                    raise MuxedStreamError("Stream is closed for sending")
                async with self.window_lock:
                    if self.closed:
                        raise MuxedStreamError("Stream is closed")
                    if self.send_window > 0:
                        n = min(self.send_window, max_payload, total - sent)
                        self.send_window -= n
                        frame = header.pack(0, ym.TYPE_DATA, 0, self.stream_id, n) + view[sent : sent + n]
            finally:
                writers.release()
            if frame is None:
                with trio.move_on_after(5.0) as scope:
                    while self.send_window <= 0 and not self.closed:
                        await trio.sleep(0.01)
                if scope.cancelled_caught:
                    raise MuxedStreamError("Timed out waiting for window update after 5 seconds.")
                continue
            await self.conn._write_frame(frame)
            sent += len(frame) - ym.HEADER_SIZE

    _replace("lean_yamux_writes.frame", ym.Yamux, "_write_frame", write_frame)
    _replace("lean_yamux_writes", ym.YamuxStream, "write", write)


def _fix_pubsub_message_guard() -> None:
    """Pubsub runs each received message in its own service task; one that raises ends the service.

    The guard catches it, counts it and drops the message. The message passed strict signing and our
    validators (which never raise) before it could fail, so what fails here is local (a closed
    verifier pool at shutdown raised OSError) and no one is charged.
    """
    from libp2p.pubsub.pubsub import Pubsub

    unguarded = Pubsub.push_msg

    async def push_msg(self: Any, msg_forwarder: Any, msg: Any) -> None:
        try:
            await unguarded(self, msg_forwarder, msg)
        except Exception as e:  # the guard's purpose: whatever a message task raises must not end pubsub
            faults = getattr(self.host, "_murmur_faults", None)
            if faults is None:
                raise
            log.warning("pubsub message from %s dropped: %s: %s", msg_forwarder, type(e).__name__, e)
            faults.count("pubsub-message (error)")

    _replace("pubsub_message_guard", Pubsub, "push_msg", push_msg)


def _fix_pubsub_oversize_charge() -> None:
    """Pubsub's reader swallows an RPC length prefix over its limit (it logs and resets the stream), so
    the stream guard never saw the fault: the length is raised as our `FrameError` instead, which
    leaves the reader through the guard like any other malformed frame (counted, charged, closed)."""
    import libp2p.pubsub.pubsub as ps
    from libp2p.io.exceptions import MessageTooLarge

    read = ps.read_varint_prefixed_bytes_limited

    async def read_limited(stream: Any, max_length: int) -> bytes:
        try:
            return await hostlimits.read_varint_frame(stream, max_length, read)
        except MessageTooLarge as e:
            raise FrameError(f"pubsub RPC over {max_length} bytes: {e}") from None

    _replace("pubsub_oversize_charge", ps, "read_varint_prefixed_bytes_limited", read_limited)


def _fix_pubsub_stream_retry() -> None:
    """Pubsub opens its outbound stream to a new peer in a loop that retries transport errors while the
    peer stays connected, but gives up for good on two failures that leave the peer connected: a failed
    protocol negotiation (`StreamFailure`, e.g. a multiselect handshake that timed out under load), and
    a hello write that failed because the stream was reset (`StreamError`: the connection it was opened
    on closed, while the peer's other connection, from a simultaneous dial, stays). Either way the peer
    keeps sending to us and we never send to it again, a one-way partition nothing repairs. Both are
    made retryable like the others, so the loop keeps trying (backing off to one attempt per 10 s) for
    as long as the peer is connected; a fresh connection starts it over."""
    from libp2p.host.exceptions import StreamFailure
    from libp2p.network.exceptions import SwarmException
    from libp2p.network.stream.exceptions import StreamError
    from libp2p.pubsub.pubsub import Pubsub

    once = Pubsub._handle_new_peer

    async def handle_new_peer(self: Any, peer_id: Any) -> None:
        try:
            await once(self, peer_id)
        except (StreamFailure, StreamError) as e:
            faults = getattr(self.host, "_murmur_faults", None)
            if faults is not None:
                faults.count("pubsub stream open (retried)")
            raise SwarmException(f"{type(e).__name__}: {e}") from e

    _replace("pubsub_stream_retry", Pubsub, "_handle_new_peer", handle_new_peer)


def _fix_pubsub_keep_subscriptions() -> None:
    """When our outbound pubsub stream to a peer dies (a write stalled past yamux's 5 s window wait while
    the peer was paused, a reset) but the connection stays, py-libp2p opens a new outbound stream, as it
    should, and forgets the peer's subscriptions, which it should not: they came over the peer's own
    stream to us, which is still open, so the peer never sends them again. Every publish then found "no
    connected peer subscribes" for as long as the connection lasted. Here a still-connected peer keeps
    the subscriptions it told us (it would send an unsubscribe if one changed)."""
    from libp2p.pubsub.pubsub import Pubsub

    forget = Pubsub._handle_dead_peer

    def handle_dead_peer(self: Any, peer_id: Any) -> None:
        keep = (
            [t for t, peers in self.peer_topics.items() if peer_id in peers] if self._peer_is_connected(peer_id) else []
        )
        count = self._peer_subscription_count.get(peer_id)
        forget(self, peer_id)
        if keep and self._peer_is_connected(peer_id):
            for t in keep:
                self.peer_topics.setdefault(t, set()).add(peer_id)
            if count is not None:
                self._peer_subscription_count[peer_id] = count
            faults = getattr(self.host, "_murmur_faults", None)
            if faults is not None:
                faults.count("pubsub stream replaced (subscriptions kept)")

    _replace("pubsub_keep_subscriptions", Pubsub, "_handle_dead_peer", handle_dead_peer)


def _on_closed_connection(stream: Any) -> bool:
    """Whether a pubsub stream ran on a connection that has closed (py-libp2p net stream; None: no stream)."""
    if stream is None:
        return False
    conn = getattr(stream, "swarm_conn", None)
    return bool(getattr(conn, "is_closed", False) or getattr(stream.muxed_conn, "is_closed", False))


def _fix_pubsub_stream_on_closed_connection() -> None:
    """When one of a peer's connections closes, py-libp2p's dead-peer queue leaves pubsub alone as long as
    another connection to the peer stays, even when our pubsub stream to the peer ran on the one that
    closed: the dead stream stays the peer's pubsub stream, replaced only once a write to it fails. Two
    hosts that dial each other at once hold two connections, and when the one under their pubsub
    streams closes as they open (their hellos, which carry the subscriptions, lost with it), neither
    knows the other subscribes, so neither writes, and gossip between them stays dead for as long as
    the other connection lasts. Here a peer whose pubsub stream ran on a closed connection is handled
    as its stream dying (`_handle_dead_peer`): it is still connected, so the stream is re-opened on a
    surviving connection, and the new stream's hello tells the peer our subscriptions (the peer, doing
    the same, tells us its own)."""
    from libp2p.pubsub.pubsub import Pubsub

    # not a wrapper: the loop's filter is what changes, and py-libp2p's loop has no hook for it
    async def handle_dead_peer_queue(self: Any) -> None:
        async with self.dead_peer_receive_channel:
            self.event_handle_dead_peer_queue_started.set()
            async for peer_id in self.dead_peer_receive_channel:
                if self._peer_is_connected(peer_id):
                    if not _on_closed_connection(self.peers.get(peer_id)):
                        continue
                    faults = getattr(self.host, "_murmur_faults", None)
                    if faults is not None:
                        faults.count("pubsub stream re-opened (its connection closed)")
                self._handle_dead_peer(peer_id)

    _replace("pubsub_stream_on_closed_connection", Pubsub, "handle_dead_peer_queue", handle_dead_peer_queue)


# How long our own signed peer record is reused before py-libp2p re-checks our addresses.
OWN_RECORD_REUSE_S = 1.0
# Peer records already checked, per host, and how long a checked record skips the check.
RECORD_MEMO_SIZE = 4096
RECORD_MEMO_TTL_S = 600.0


def _fix_peer_record_memo() -> None:
    """py-libp2p attaches this host's signed peer record to every pubsub RPC it sends, rebuilding the
    host's address list (multiaddr parsing) to see whether the cached record is still current, and
    verifies and stores the record that comes with every RPC it receives. Both run per RPC, so a peer
    that sends many small RPCs buys a signature check and a peerstore update with each one.

    Our record is reused for `OWN_RECORD_REUSE_S` (an address change still goes out within that), and
    a record already checked from the same peer is not checked again for `RECORD_MEMO_TTL_S` (well
    inside the peerstore's two-hour TTL, so re-storing it keeps it alive), in a bounded per-host
    table keyed by the record's digest. An invalid record is remembered too: the RPC is still
    ignored, as py-libp2p does, without paying for the check again, and every such RPC is counted
    (`pubsub signed record (invalid)`)."""
    import libp2p.peer.peerstore as peerstore
    import libp2p.pubsub.utils as pubsub_utils

    own_record = peerstore.env_to_send_in_RPC
    check_record = pubsub_utils.maybe_consume_signed_record

    def env_to_send_in_rpc(host: Any) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = getattr(host, "_murmur_own_record", None)
        if hit is not None and now - hit[0] < OWN_RECORD_REUSE_S:
            return hit[1], False
        env, fresh = own_record(host)
        host._murmur_own_record = (now, env)
        return env, fresh

    def maybe_consume_signed_record(msg: Any, host: Any, peer_id: Any) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        memo: OrderedDict[tuple[bytes, bytes], tuple[float, bool]] | None = getattr(host, "_murmur_records", None)
        if memo is None:
            memo = host._murmur_records = OrderedDict()
        # a digest, not the record: a record can be as large as the RPC, and the table keeps thousands
        key = (peer_id.to_bytes(), hashlib.blake2b(msg.senderRecord, digest_size=16).digest())
        now = time.monotonic()
        hit = memo.get(key)
        if hit is not None and now - hit[0] < RECORD_MEMO_TTL_S:
            memo.move_to_end(key)
            ok = hit[1]
        else:
            ok = check_record(msg, host, peer_id)
            memo[key] = (now, ok)
            memo.move_to_end(key)
            while len(memo) > RECORD_MEMO_SIZE:
                memo.popitem(last=False)
        if not ok:
            faults = getattr(host, "_murmur_faults", None)
            if faults is not None:
                faults.count("pubsub signed record (invalid)")
        return ok

    per_rpc = ("libp2p.pubsub.pubsub", "libp2p.pubsub.gossipsub", "libp2p.pubsub.floodsub")  # pubsub's users only
    _replace("peer_record_memo.own", peerstore, "env_to_send_in_RPC", env_to_send_in_rpc, per_rpc)
    _replace("peer_record_memo", pubsub_utils, "maybe_consume_signed_record", maybe_consume_signed_record, per_rpc)


def _fix_stream_caps() -> None:
    """py-libp2p 0.8.1 limits inbound streams per host only, with a semaphore that queues: one peer's idle
    streams fill it and every other peer's new streams wait behind them. Each inbound stream is held to the
    peer's and the node's caps of the host's `StreamBudget` first (`hostlimits.admit_inbound_stream`): one
    over a cap is reset before py-libp2p's semaphore and before negotiation."""
    from libp2p.network.connection.swarm_connection import SwarmConn

    handle = SwarmConn._handle_muxed_stream

    async def _handle_muxed_stream(self: Any, muxed_stream: Any) -> None:
        await hostlimits.admit_inbound_stream(self, muxed_stream, handle)

    _replace("stream_caps", SwarmConn, "_handle_muxed_stream", _handle_muxed_stream)


def _fix_yamux_window_limit() -> None:
    """py-libp2p 0.8.1 logs a DATA frame beyond a stream's receive window and buffers it anyway, so a peer
    can push unbounded bytes into a stream nobody reads. Here it is what go-yamux makes it, a protocol error:
    `hostlimits.WindowExceeded` (a TooSlowError, which py-libp2p's muxer loop answers by closing the
    connection), the sender charged. An honest sender never exceeds the credit we granted.

    A property in place of the stream's plain `recv_window` attribute: the window is checked inline in
    `Yamux.handle_incoming`, a 400-line loop, so the only smaller override is the assignment it makes."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    def get(self: Any) -> int:
        return self.__dict__["_murmur_recv_window"]

    def set_(self: Any, value: int) -> None:
        if value < 0 and "_murmur_recv_window" in self.__dict__:
            self.__dict__["_murmur_recv_window"] = 0
            raise hostlimits.window_exceeded(self, -value)
        self.__dict__["_murmur_recv_window"] = value

    _replace("yamux_window_limit", YamuxStream, "recv_window", property(get, set_))


def _fix_connection_refusal() -> None:
    """py-libp2p 0.8.1 adds every connection that completes its handshake: a graylisted or banned key that
    reconnects starts afresh, and one machine's many keys can take every connection a node accepts. A
    connection the host refuses (`hostlimits.refuse_connection`: its peer refused, or inbound from a source
    range already holding `StreamLimits.ip_connections`) is closed as it is added."""
    from libp2p.network.swarm import Swarm

    add = Swarm.add_conn

    async def add_conn(self: Any, muxed_conn: Any, *args: Any, **kw: Any) -> Any:
        await hostlimits.refuse_connection(self, muxed_conn, str(kw.get("direction", args[0] if args else "unknown")))
        return await add(self, muxed_conn, *args, **kw)

    _replace("connection_refusal", Swarm, "add_conn", add_conn)


def _fix_webrtc_forget_closed_streams() -> None:
    """py-libp2p 0.8.1 never removes a closed WebRTC stream from its connection's registry
    (`WebRTCConnection.remove_stream` exists, nothing calls it), so every stream a connection ever opened
    counts against its 256-stream limit and the 253rd fails at once. A stream's cleanup (close, reset)
    removes it (`webrtc.forget_stream`)."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    cleanup = WebRTCStream._cleanup

    def _cleanup(self: Any) -> None:
        cleanup(self)
        webrtc.forget_stream(self)

    _replace("webrtc_forget_closed_streams", WebRTCStream, "_cleanup", _cleanup)


def _fix_webrtc_backpressure() -> None:
    """py-libp2p 0.8.1 completes a WebRTC stream write once aiortc queued it, so a bulk writer runs megabytes
    ahead of the wire and a stream opened meanwhile waits behind that backlog past the negotiation timeout.
    Each send on a wired connection then waits while the association's queue is over
    `webrtc.SEND_QUEUE_HIGH` (`webrtc.drain_send_queue`)."""
    from libp2p.transport.webrtc import _aiortc_helpers as helpers

    wire = helpers.wire_pc_to_connection

    def wire_pc_to_connection(pc: Any, conn: Any) -> None:
        wire(pc, conn)
        send = conn._send_on_channel_cb

        async def send_then_drain(channel_id: int, data: bytes) -> None:
            await send(channel_id, data)
            await webrtc.drain_send_queue(pc)

        conn._send_on_channel_cb = send_then_drain

    # py-libp2p's dialler and listener import it from the module when they wire a connection
    _replace("webrtc_backpressure", helpers, "wire_pc_to_connection", wire_pc_to_connection)


def _fix_webrtc_bytes_like_writes() -> None:
    """py-libp2p 0.8.1's WebRTC stream writes `bytes` only (each slice goes into a protobuf field that
    rejects a bytearray: TypeError), where yamux streams take any bytes-like object; the chunk broadcast
    writes one bytearray. A non-`bytes` write is copied to `bytes` once."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    write = WebRTCStream.write

    async def write_bytes_like(self: Any, data: Any) -> None:
        await write(self, data if type(data) is bytes else bytes(data))

    _replace("webrtc_bytes_like_writes", WebRTCStream, "write", write_bytes_like)


def _fix_webrtc_read_overflow_reset() -> None:
    """py-libp2p 0.8.1 queues 64 incoming data-channel messages for a WebRTC stream's reader and drops the
    next with a log line: the stream goes on with a hole. Each new stream gets a queue of
    `webrtc.READ_QUEUE_MESSAGES` whose overflow resets the stream (`webrtc.reset_on_overflow`)."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    init = WebRTCStream.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        webrtc.reset_on_overflow(self)

    _replace("webrtc_read_overflow_reset", WebRTCStream, "__init__", __init__)


def _fix_dcutr_manual_drive() -> None:
    """py-libp2p 0.8.1's DCUtR service always runs its auto-drive loop (a hole punch toward every relayed peer,
    checked every 2 s) and has no option to turn it off; a node whose reachability decides when to punch
    (`gossip.holepunch.attach_holepunch(auto=False)`) needs it off. A service with `_murmur_manual` set
    waits instead; any other drives as py-libp2p does."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    drive = DCUtRProtocol._auto_drive_loop

    async def _auto_drive_loop(self: Any) -> None:
        if getattr(self, "_murmur_manual", False):
            await trio.sleep_forever()
        await drive(self)

    _replace("dcutr_manual_drive", DCUtRProtocol, "_auto_drive_loop", _auto_drive_loop)


FIXES: Final = (
    _fix_go_yamux_credit,
    _fix_buffered_tcp_reads,
    _fix_lean_yamux_writes,
    _fix_pubsub_message_guard,
    _fix_pubsub_oversize_charge,
    _fix_pubsub_stream_retry,
    _fix_pubsub_keep_subscriptions,
    _fix_pubsub_stream_on_closed_connection,
    _fix_peer_record_memo,
    _fix_stream_caps,
    _fix_yamux_window_limit,
    _fix_connection_refusal,
)
# py-libp2p's WebRTC transport imports aiortc, so these are installed apart, once it imports
WEBRTC_FIXES: Final = (
    _fix_webrtc_forget_closed_streams,
    _fix_webrtc_backpressure,
    _fix_webrtc_bytes_like_writes,
    _fix_webrtc_read_overflow_reset,
)
# py-libp2p's DCUtR module takes half a second to import, so its fix waits for the first hole puncher
DCUTR_FIXES: Final = (_fix_dcutr_manual_drive,)


def _install(fixes: tuple[Callable[[], None], ...]) -> None:
    check_version(importlib.metadata.version("libp2p"))
    for fix in fixes:
        if fix not in _installed:
            fix()
            _installed.add(fix)


def install() -> None:
    """Check the py-libp2p version, then install every fix but the WebRTC-direct ones (once per process)."""
    _install(FIXES)


def install_webrtc() -> bool:
    """Check the py-libp2p version, then install the WebRTC-direct fixes (once per process), if aiortc
    imports; False, with nothing installed, where it does not. Importing aiortc takes a while: a caller on
    a running event loop imports it in a thread first (`gossip.webrtc.attach_webrtc` does)."""
    try:
        importlib.import_module("aiortc")
    except ImportError:
        return False
    _install(WEBRTC_FIXES)
    return True


def install_dcutr() -> None:
    """Check the py-libp2p version, then install the DCUtR fix (once per process)."""
    _install(DCUTR_FIXES)
