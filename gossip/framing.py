"""Length-prefixed frames over a byte stream: 4-byte big-endian length, then the payload.

The one framing of every Murmur stream protocol. Request/response protocols
(catalog, dial-back) move one frame at a time (`read_frame`, `write_frame`);
long-lived bulk streams (patch chunks) carry many frames each, written
coalesced (`encode_frames`) and parsed through a buffer (`FrameReader`). Every
reader enforces a per-protocol maximum length before it buffers a frame's body, and on a
libp2p peer's stream the budget of `gossip.limits` (bytes reserved as they arrive, a deadline
per frame).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import msgspec
import trio

from murmur.gossip.limits import FrameTimeout, Lease
from murmur.gossip.transport import FrameError, Stream, StreamError

_LEN = struct.Struct(">I")
READ_SIZE = 1 << 20  # one buffered read takes whatever the muxer holds, up to this
_encoder = msgspec.msgpack.Encoder()


def frame_lease(stream: Stream) -> Lease | None:
    """The budget lease of a stream that has one (a libp2p peer's stream, `gossip.host`); None otherwise."""
    make = getattr(stream, "frame_lease", None)
    return make() if make is not None else None


async def read_exactly(stream: Stream, n: int, lease: Lease | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = await stream.read(n - len(buf))
        if not part:
            raise StreamError(f"stream closed after {len(buf)} of {n} bytes")
        if lease is not None:
            lease.grow(len(part))
        buf += part
    return bytes(buf)


async def read_frame(stream: Stream, max_len: int) -> bytes:
    """One frame. On a budgeted stream its bytes are reserved as they arrive and the frame must be
    complete within the deadline counted from its first byte (`gossip.limits`)."""
    lease = frame_lease(stream)
    if lease is None:
        (n,) = _LEN.unpack(await read_exactly(stream, 4))
        if n > max_len:
            raise FrameError(f"frame of {n} bytes exceeds the {max_len}-byte limit")
        return await read_exactly(stream, n) if n else b""
    first = await stream.read(4)
    if not first:
        raise StreamError("stream closed before a frame")
    try:
        with trio.move_on_after(lease.deadline_s):
            (n,) = _LEN.unpack(first + await read_exactly(stream, 4 - len(first)))
            if n > max_len:
                raise FrameError(f"frame of {n} bytes exceeds the {max_len}-byte limit")
            return await read_exactly(stream, n, lease) if n else b""
        lease.timed_out()
        raise FrameTimeout(f"frame from {lease.peer} incomplete after {lease.deadline_s:g} s")
    finally:
        lease.free()


async def write_frame(stream: Stream, data: bytes) -> None:
    if len(data) >= 2**32:
        raise StreamError("frame too large")
    await stream.write(_LEN.pack(len(data)) + data)


def encode_frames(items: Iterable[msgspec.Struct]) -> bytearray:
    """The msgpack encodings of `items` as frames, back to back, for one stream write.

    Coalescing matters on py-libp2p: every write is one yamux frame and one Noise message with
    a fixed Python cost, so a burst of small frames costs one write, not one each, and a large
    item (a patch chunk) is encoded straight into the write buffer, without an extra copy.
    """
    buf = bytearray()
    for item in items:
        at = len(buf)
        buf += b"\0\0\0\0"
        _encoder.encode_into(item, buf, at + 4)
        _LEN.pack_into(buf, at, len(buf) - at - 4)
    return buf


class FrameReader:
    """Reads frames through a buffer, so one stream read serves every frame it holds.

    Each `stream.read` on py-libp2p costs a lock round and a window update; small frames
    arriving together are parsed from one read. A length over `max_len` is refused before
    anything is buffered for that frame's body. On a budgeted stream (`frame_lease`) the
    buffered bytes are reserved as they arrive, and a frame must be complete within the
    deadline counted from its first byte; the reader is a context manager that frees its
    reservation when the stream is done with.
    """

    def __init__(self, stream: Stream, max_len: int) -> None:
        self.stream = stream
        self.max_len = max_len
        self.buf = bytearray()
        self.pos = 0
        self.lease = frame_lease(stream)
        self.started = 0.0  # when the first byte of the frame now buffered arrived

    def __enter__(self) -> FrameReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.buf = bytearray()
        self.pos = 0
        if self.lease is not None:
            self.lease.free()

    async def next(self) -> bytes | None:
        """The next frame's payload; None on a clean end of stream.

        FrameError for a length over the limit, StreamError for a stream that breaks or ends
        inside a frame (BufferFull and FrameTimeout on a budgeted stream).
        """
        try:
            data = await self._next()
        except BaseException:
            self.close()
            raise
        if data is None:
            self.close()
        return data

    async def _next(self) -> bytes | None:
        while True:
            avail = len(self.buf) - self.pos
            if avail >= 4:
                (n,) = _LEN.unpack_from(self.buf, self.pos)
                if n > self.max_len:
                    raise FrameError(f"frame of {n} bytes exceeds the {self.max_len}-byte limit")
                if avail >= 4 + n:
                    start = self.pos + 4
                    data = bytes(self.buf[start : start + n])
                    self.pos = start + n
                    if self.pos == len(self.buf):
                        self.buf.clear()
                        self.pos = 0
                    if self.lease is not None:
                        self.lease.release(4 + n)
                        self.started = trio.current_time()  # what is left begins the next frame
                    return data
            if self.pos:
                del self.buf[: self.pos]
                self.pos = 0
            part = await self._read()
            if not part:
                if self.buf:
                    raise StreamError(f"stream closed inside a frame ({len(self.buf)} bytes buffered)")
                return None
            if self.lease is not None:
                if not self.buf:
                    self.started = trio.current_time()
                self.lease.grow(len(part))
            self.buf += part

    async def _read(self) -> bytes:
        lease = self.lease
        if lease is None or not self.buf:  # between frames a stream may idle
            return await self.stream.read(READ_SIZE)
        with trio.move_on_at(self.started + lease.deadline_s):
            return await self.stream.read(READ_SIZE)
        lease.timed_out()
        raise FrameTimeout(
            f"frame from {lease.peer} incomplete after {lease.deadline_s:g} s ({len(self.buf)} bytes buffered)"
        )
