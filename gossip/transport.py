"""The small network interface the rest of Murmur uses, so the libp2p backend can be replaced.

`gossip.host.Libp2pTransport` implements it over py-libp2p; simulators drive
the sans-IO cores directly instead. Peer identities are libp2p peer ID strings.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from murmur.gossip.errors import MurmurError


class PublishError(MurmurError):
    """A gossip publish could not go out (too big, no peers, queue full): the caller learns it."""


class StreamError(MurmurError):
    """A bulk stream broke, was reset, or sent a malformed frame."""


class FrameError(StreamError):
    """A peer sent a frame that breaks the protocol (over the size limit): a fault of that peer."""


class Stream(Protocol):
    async def read(self, n: int) -> bytes: ...
    async def write(self, data: bytes | bytearray) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


StreamHandler = Callable[[Stream, str], Awaitable[None]]  # (stream, remote peer id)


class Transport(Protocol):
    peer_id: str

    def listen_addrs(self) -> list[str]: ...
    def peers(self) -> list[str]: ...
    async def connect(self, multiaddr: str) -> str: ...
    async def disconnect(self, peer_id: str) -> None: ...
    async def publish(self, topic: str, data: bytes) -> None: ...
    async def subscribe(self, topic: str) -> MessageChannel: ...
    async def unsubscribe(self, topic: str) -> None: ...
    async def open_stream(self, peer_id: str, protocol: str) -> Stream: ...
    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None: ...


class MessageChannel(Protocol):
    """Received gossip: yields (from_peer_id, data); drained at once into the app's own queue."""

    async def receive(self) -> tuple[str, bytes]: ...
