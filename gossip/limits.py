"""What one peer may hold open on this node: inbound streams and bytes of incomplete frames (sans-IO).

py-libp2p 0.8.1 limits streams for the whole host only (one semaphore shared by inbound and
outbound streams, which queues rather than refuses), and its readers buffer a frame's body
for as long as the sender takes to finish it. So one key could fill what every peer shares:
thousands of idle streams, or dozens of streams each holding all but the last byte of a large
frame. `StreamBudget` is the accounting, in the style of libp2p's resource manager (a peer
scope below a node scope; every reservation must fit both):

- inbound streams open at once, per peer and per node: a stream over either cap is reset on
  arrival, before any handler or negotiation runs (counted, not charged: caps are local);
  keys are free, so peers the node does not count as `proven` (the node says which: a verified
  history or an established announce) draw on one pool of `unproven_streams` below the node's
  cap, and proven peers always find room;
- bytes buffered for frames not yet complete, per peer and per node: a reader reserves each
  part as it arrives (never a frame's claimed length up front) and releases it when the frame
  is handed on; a part that does not fit resets that stream;
- a deadline per frame, from its first byte to its last: a frame still incomplete when it
  passes resets the stream.

Holding a frame past its deadline, or more buffered bytes than the peer's share, is an
offence of the peer that owns the stream; `offences` of them within `offence_window_s`
call `on_charge` (the node lowers the peer's score). Running out of the node-wide share is
no one peer's provable fault, so it resets the stream uncharged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from murmur.gossip.transport import StreamError

MiB = 1 << 20


class StreamLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    peer_streams: int = 64  # inbound streams one peer may hold open at once
    node_streams: int = 4096  # all peers together; py-libp2p's own cap (10,000) is shared with outbound
    unproven_streams: int = 1024  # all peers not (yet) proven together: the rest is kept for proven ones
    peer_buffer_bytes: int = 32 * MiB  # four of the largest chunk frames at once
    node_buffer_bytes: int = 256 * MiB
    frame_deadline_s: float = 60.0  # a frame's first byte to its last: 8 MiB at ~140 KB/s
    offences: int = 3  # held frames or overdrawn buffers within the window before the peer is charged
    offence_window_s: float = 600.0
    ip_connections: int = 8  # inbound connections from one IPv4 address or IPv6 /56 (gossip.iprange)
    ip_unlimited: tuple[str, ...] = ("127.0.0.0/8", "::1/128")  # networks not counted per range


class BufferFull(StreamError):
    """A frame's bytes would exceed a buffer budget: the stream is reset."""


class FrameTimeout(StreamError):
    """A frame was still incomplete at its deadline: the stream is reset."""


class StreamBudget:
    """Per-peer and node-wide counts of open inbound streams and of buffered frame bytes."""

    def __init__(self, limits: StreamLimits | None = None, on_charge: Callable[[str, str], None] | None = None) -> None:
        self.limits = limits or StreamLimits()
        self.on_charge = on_charge  # (peer, what): repeated offences
        self.proven: Callable[[str], bool] = lambda peer: False  # set by the node: who may leave the pool
        self.streams: dict[str, int] = {}
        self.node_streams = 0
        self.pooled: dict[str, int] = {}  # streams each peer holds from the unproven pool
        self.pool_streams = 0
        self.buffered: dict[str, int] = {}
        self.node_buffered = 0
        self._offences: dict[str, deque[float]] = {}
        self.counters: dict[str, int] = {
            "streams_refused_peer": 0,
            "streams_refused_node": 0,
            "streams_refused_unproven": 0,
            "buffer_full_peer": 0,
            "buffer_full_node": 0,
            "frame_timeouts": 0,
            "charged": 0,
            "connections_refused_ip": 0,
        }

    # ------------------------------------------------------------ streams
    def open_stream(self, peer: str) -> bool:
        """Count an inbound stream of `peer`; False (nothing counted) when a cap is reached."""
        if self.streams.get(peer, 0) >= self.limits.peer_streams:
            self.counters["streams_refused_peer"] += 1
            return False
        if self.node_streams >= self.limits.node_streams:
            self.counters["streams_refused_node"] += 1
            return False
        if not self.proven(peer):
            if self.pool_streams >= self.limits.unproven_streams:
                self.counters["streams_refused_unproven"] += 1
                return False
            self.pooled[peer] = self.pooled.get(peer, 0) + 1
            self.pool_streams += 1
        self.streams[peer] = self.streams.get(peer, 0) + 1
        self.node_streams += 1
        return True

    def close_stream(self, peer: str) -> None:
        n = self.streams.get(peer, 0)
        if n <= 0:
            return
        k = self.pooled.get(peer, 0)
        if k > 0:  # a peer proven since it opened them gives its pooled streams back first
            if k == 1:
                del self.pooled[peer]
            else:
                self.pooled[peer] = k - 1
            self.pool_streams -= 1
        if n == 1:
            del self.streams[peer]
        else:
            self.streams[peer] = n - 1
        self.node_streams -= 1

    # ------------------------------------------------------------ bytes
    def reserve(self, peer: str, n: int, now: float) -> None:
        """Reserve `n` more buffered bytes for `peer`; BufferFull (nothing reserved) when they do not fit."""
        held = self.buffered.get(peer, 0)
        if held + n > self.limits.peer_buffer_bytes:
            self.counters["buffer_full_peer"] += 1
            self.offence(peer, "buffered bytes over the peer's share", now)
            raise BufferFull(
                f"{peer} would hold {held + n} buffered bytes, over its {self.limits.peer_buffer_bytes}-byte share"
            )
        if self.node_buffered + n > self.limits.node_buffer_bytes:
            self.counters["buffer_full_node"] += 1
            raise BufferFull(f"node-wide frame buffers full ({self.node_buffered} bytes)")
        self.buffered[peer] = held + n
        self.node_buffered += n

    def release(self, peer: str, n: int) -> None:
        held = self.buffered.get(peer, 0)
        n = min(n, held)
        if held - n <= 0:
            self.buffered.pop(peer, None)
        else:
            self.buffered[peer] = held - n
        self.node_buffered -= n

    # ------------------------------------------------------------ offences
    def timed_out(self, peer: str, now: float) -> None:
        self.counters["frame_timeouts"] += 1
        self.offence(peer, "frame held past its deadline", now)

    def offence(self, peer: str, what: str, now: float) -> None:
        """One offence of `peer`; the `offences`-th within the window charges it (and starts over)."""
        q = self._offences.setdefault(peer, deque())
        q.append(now)
        while q and q[0] <= now - self.limits.offence_window_s:
            q.popleft()
        if len(q) >= self.limits.offences:
            q.clear()
            self.counters["charged"] += 1
            if self.on_charge is not None:
                self.on_charge(peer, what)
        if len(self._offences) > 4 * self.limits.node_streams:  # bounded: forget peers with no recent offence
            for p in [p for p, d in self._offences.items() if not d]:
                del self._offences[p]


class Lease:
    """The bytes one reader holds for frames not yet handed on, reserved from a budget as they arrive."""

    __slots__ = ("budget", "peer", "held", "clock")

    def __init__(self, budget: StreamBudget, peer: str, clock: Callable[[], float]) -> None:
        self.budget, self.peer, self.held, self.clock = budget, peer, 0, clock

    @property
    def deadline_s(self) -> float:
        return self.budget.limits.frame_deadline_s

    def grow(self, n: int) -> None:
        self.budget.reserve(self.peer, n, self.clock())
        self.held += n

    def release(self, n: int) -> None:
        n = min(n, self.held)
        self.budget.release(self.peer, n)
        self.held -= n

    def timed_out(self) -> None:
        self.budget.timed_out(self.peer, self.clock())

    def free(self) -> None:
        if self.held:
            self.budget.release(self.peer, self.held)
            self.held = 0
