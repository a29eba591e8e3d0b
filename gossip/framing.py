"""Length-prefixed frames over a byte stream: 4-byte big-endian length, then the payload.

Long-lived bulk streams (patch chunks, large payload fetches) carry many frames
each; the reader enforces a per-protocol maximum before allocating.
"""

from __future__ import annotations

import struct

from gossip.transport import FrameError, Stream, StreamError

_LEN = struct.Struct(">I")


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
