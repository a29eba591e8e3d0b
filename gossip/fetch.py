"""Big payloads by hash over a stream: what does not fit in one gossip message.

A payload over the gossip limit is announced by its blake2b-256 content id
(e.g. inside a signed manifest) and fetched from a peer that has it over the
stream protocol `/murmur/fetch/1`, one request per stream:

  request  frame: 32 bytes, the content id wanted
  response frame: 1 status byte (0 = found, 1 = not found) + the payload when found

Frames are `gossip.framing` frames (4-byte big-endian length). Limits: request
exactly 32 bytes; response at most `MAX_FETCH_BYTES` + 1. The fetcher checks
the hash before returning anything, so a lying server yields `StreamError`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import trio

from gossip.framing import read_frame, write_frame
from gossip.transport import Stream, StreamError

PROTOCOL = "/murmur/fetch/1"
MAX_FETCH_BYTES = 64 * 1024 * 1024
FOUND, NOT_FOUND = 0, 1


def payload_id(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


class PayloadStore:
    """Payloads this node serves, by content id; bounded in bytes, oldest dropped first."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._d: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    def put(self, data: bytes) -> bytes:
        if len(data) > MAX_FETCH_BYTES:
            raise ValueError(f"payload of {len(data)} bytes exceeds the {MAX_FETCH_BYTES}-byte fetch limit")
        pid = payload_id(data)
        if pid not in self._d:
            self._d[pid] = bytes(data)
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._d) > 1:
                _, old = self._d.popitem(last=False)
                self._bytes -= len(old)
        return pid

    def get(self, pid: bytes) -> bytes | None:
        return self._d.get(pid)


def serve(transport: Any, store: PayloadStore) -> None:
    """Answer fetch requests from `store`."""

    async def handler(stream: Stream, peer: str) -> None:
        with trio.fail_after(30):
            pid = await read_frame(stream, 32)
            if len(pid) != 32:
                raise StreamError(f"fetch request of {len(pid)} bytes, expected 32")
            data = store.get(pid)
            await write_frame(stream, bytes([FOUND]) + data if data is not None else bytes([NOT_FOUND]))
            await stream.close()

    transport.set_stream_handler(PROTOCOL, handler)


async def fetch(transport: Any, peer_id: str, pid: bytes, max_bytes: int = MAX_FETCH_BYTES,
                timeout_s: float = 60.0) -> bytes | None:
    """The payload with content id `pid` from `peer_id`; None if it does not have it; StreamError if it lies."""
    if len(pid) != 32:
        raise ValueError("content id must be 32 bytes")
    stream = await transport.open_stream(peer_id, PROTOCOL)
    try:
        with trio.fail_after(timeout_s):
            await write_frame(stream, pid)
            resp = await read_frame(stream, min(max_bytes, MAX_FETCH_BYTES) + 1)
    except trio.TooSlowError:
        await stream.reset()
        raise StreamError(f"fetch from {peer_id} timed out after {timeout_s} s") from None
    except BaseException:
        await stream.reset()
        raise
    await stream.close()
    if not resp or resp[0] not in (FOUND, NOT_FOUND):
        raise StreamError(f"malformed fetch response from {peer_id}")
    if resp[0] == NOT_FOUND:
        return None
    data = resp[1:]
    if payload_id(data) != pid:
        raise StreamError(f"{peer_id} served bytes that do not match the requested hash")
    return data
