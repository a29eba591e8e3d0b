"""Length-prefixed frames over a byte stream: 4-byte big-endian length, then the payload.

The one framing of every Murmur stream protocol. Request/response protocols
(catalog, dial-back) move one frame at a time (`read_frame`, `write_frame`);
long-lived bulk streams (patch chunks) carry many frames each, written
coalesced (`encode_frames`) and parsed through a buffer (`FrameReader`). Every
reader enforces a per-protocol maximum length before it buffers a frame's body.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import msgspec

from gossip.transport import FrameError, Stream, StreamError

_LEN = struct.Struct(">I")
READ_SIZE = 1 << 20  # one buffered read takes whatever the muxer holds, up to this
_encoder = msgspec.msgpack.Encoder()


async def read_exactly(stream: Stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = await stream.read(n - len(buf))
        if not part:
            raise StreamError(f"stream closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


async def read_frame(stream: Stream, max_len: int) -> bytes:
    (n,) = _LEN.unpack(await read_exactly(stream, 4))
    if n > max_len:
        raise FrameError(f"frame of {n} bytes exceeds the {max_len}-byte limit")
    return await read_exactly(stream, n) if n else b""


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
    anything is buffered for that frame's body.
    """

    def __init__(self, stream: Stream, max_len: int) -> None:
        self.stream = stream
        self.max_len = max_len
        self.buf = bytearray()
        self.pos = 0

    async def next(self) -> bytes | None:
        """The next frame's payload; None on a clean end of stream.

        FrameError for a length over the limit, StreamError for a stream that breaks or ends
        inside a frame.
        """
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
