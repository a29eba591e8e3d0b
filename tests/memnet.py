"""An in-memory network of `gossip.transport.Transport`s, for running `node.shell.runtime.Node`s in one trio run.

Everything is trio memory channels and memory streams, nothing waits on a socket or a thread, so a test
may run under `trio.testing.MockClock(autojump_threshold=...)`: virtual time jumps whenever every task
waits. It keeps the libp2p transport's contract where the node depends on it: a publish with no
connected subscriber raises `PublishError`; a message is validated by the receiver's topic validator
before any subscriber sees it, and a publisher's own subscribers get its message too (as in py-libp2p);
streams read b"" at EOF and raise `StreamError` after a reset; a stream handler's protocol fault is
reset, counted per protocol and reported to `faults.on_fault`. Gossip goes one hop: every connected
subscriber of the topic gets the message (a full mesh, which is what a test's few nodes form anyway).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.identity import Identity
from murmur.gossip.transport import FrameError, PublishError, StreamError

log = logging.getLogger("tests.memnet")
INBOUND = 1024  # messages queued for a transport's validators; more are dropped and counted
INBOX = 256  # per subscriber channel, as the libp2p transport's inboxes

Validator = Callable[[str, str, bytes], Awaitable[bool]]  # (forwarder, origin, data) -> deliver?
_ids = itertools.count(1)


class Faults:
    """`gossip.host.StreamFaults` as the node reads it: counts per protocol and the `on_fault` hook."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.on_fault: Callable[[str, str, str], None] | None = None

    def record(self, peer: str, protocol: str, error: BaseException) -> None:
        self.counts[protocol] = self.counts.get(protocol, 0) + 1
        if self.on_fault is not None:
            self.on_fault(peer, protocol, f"{type(error).__name__}: {error}"[:300])


class MemStream:
    """One end of a bidirectional in-memory stream."""

    def __init__(self, tx: Any, rx: Any, peer: str, conn_key: int, state: dict[str, bool]) -> None:
        self._tx, self._rx, self._state = tx, rx, state
        self.peer = peer
        self.conn_key = conn_key

    async def read(self, n: int) -> bytes:
        try:
            data = await self._rx.receive_some(n)
        except (trio.ClosedResourceError, trio.BrokenResourceError) as e:
            raise StreamError(f"stream read failed: {type(e).__name__}") from None
        if not data and self._state["reset"]:
            raise StreamError("stream reset by peer")
        return data

    async def write(self, data: bytes) -> None:
        if self._state["reset"]:
            raise StreamError("stream was reset")
        try:
            await self._tx.send_all(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError) as e:
            raise StreamError(f"stream write failed: {type(e).__name__}") from None

    async def close(self) -> None:
        await self._tx.aclose()  # the peer reads b"" once it has read what we wrote

    async def reset(self) -> None:
        self._state["reset"] = True
        await self._tx.aclose()
        await self._rx.aclose()


class Inbox:
    def __init__(self) -> None:
        self.send, self.recv = trio.open_memory_channel[tuple[str, bytes]](INBOX)
        self.dropped = 0

    async def receive(self) -> tuple[str, bytes]:
        return await self.recv.receive()


class MemNet:
    """The network: transports by peer id, and which pairs are connected."""

    def __init__(self) -> None:
        self.hosts: dict[str, MemTransport] = {}
        self.links: dict[frozenset[str], int] = {}  # connected pair -> connection key

    @asynccontextmanager
    async def transport(self, identity: Identity) -> AsyncIterator[MemTransport]:
        async with trio.open_nursery() as nursery:
            t = MemTransport(self, identity, nursery)
            self.hosts[t.peer_id] = t
            nursery.start_soon(t._pump)
            try:
                yield t
            finally:
                for p in t.peers():
                    self.links.pop(frozenset((t.peer_id, p)), None)
                del self.hosts[t.peer_id]
                nursery.cancel_scope.cancel()


class MemTransport:
    def __init__(self, net: MemNet, identity: Identity, nursery: trio.Nursery) -> None:
        self.net = net
        self.identity = identity
        self.peer_id = identity.peer_id
        self.faults = Faults()
        self._nursery = nursery
        self._validators: dict[str, Validator] = {}
        self._inboxes: dict[str, list[Inbox]] = {}
        self._handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = {}
        self._refuse: Callable[[str], bool] | None = None
        self.blacklisted: set[str] = set()
        self._in_send, self._in_recv = trio.open_memory_channel[tuple[str, str, bytes]](INBOUND)
        self.counters: dict[str, int] = {"published": 0, "publish_errors": 0, "inbound_dropped": 0}

    # ------------------------------------------------------------ peers
    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}/p2p/{self.peer_id}"]

    def peers(self) -> list[str]:
        return [p for pair in self.net.links for p in pair if self.peer_id in pair and p != self.peer_id]

    def peer_addrs(self, peer_id: str) -> list[str]:
        t = self.net.hosts.get(peer_id)
        return t.listen_addrs() if t is not None else []

    async def connect(self, addr: str) -> str:
        await trio.lowlevel.checkpoint()
        peer = addr.rsplit("/p2p/", 1)[-1]
        other = self.net.hosts.get(peer)
        if other is None or peer == self.peer_id:
            raise MurmurError(f"cannot connect to {addr}")
        for a, b in ((self, other), (other, self)):
            if a._refuse is not None and a._refuse(b.peer_id):
                raise MurmurError(f"{a.peer_id} refuses {b.peer_id}")
        self.net.links.setdefault(frozenset((self.peer_id, peer)), next(_ids))
        return peer

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self.net.links.pop(frozenset((self.peer_id, peer_id)), None)

    def refuse_connections(self, refuse: Callable[[str], bool] | None) -> None:
        self._refuse = refuse

    def blacklist(self, peer_id: str) -> None:
        self.blacklisted.add(peer_id)

    # ------------------------------------------------------------ gossip
    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        targets = [self.net.hosts[p] for p in self.peers() if topic in self.net.hosts[p]._inboxes]
        if not targets:
            self.counters["publish_errors"] += 1
            raise PublishError(f"no connected peer subscribes to {topic}")
        for t in [self, *targets]:
            t._inbound(topic, self.peer_id, data)
        self.counters["published"] += 1

    def _inbound(self, topic: str, origin: str, data: bytes) -> None:
        try:
            self._in_send.send_nowait((topic, origin, data))
        except trio.WouldBlock:
            self.counters["inbound_dropped"] += 1

    async def _pump(self) -> None:
        async for topic, origin, data in self._in_recv:
            if origin in self.blacklisted or topic not in self._inboxes:
                continue
            v = self._validators.get(topic)
            if origin != self.peer_id and v is not None and not await v(origin, origin, data):
                continue
            for inbox in self._inboxes.get(topic, ()):
                try:
                    inbox.send.send_nowait((origin, data))
                except trio.WouldBlock:
                    inbox.dropped += 1

    async def subscribe(self, topic: str) -> Inbox:
        await trio.lowlevel.checkpoint()
        inbox = Inbox()
        self._inboxes.setdefault(topic, []).append(inbox)
        return inbox

    async def unsubscribe(self, topic: str) -> None:
        await trio.lowlevel.checkpoint()
        self._inboxes.pop(topic, None)

    def set_validator(self, topic: str, validator: Validator) -> None:
        self._validators[topic] = validator

    # ------------------------------------------------------------ streams
    def set_stream_handler(self, protocol: str, handler: Callable[[Any, str], Awaitable[None]]) -> None:
        self._handlers[protocol] = handler

    async def open_stream(self, peer_id: str, protocol: str) -> MemStream:
        await trio.lowlevel.checkpoint()
        key = self.net.links.get(frozenset((self.peer_id, peer_id)))
        other = self.net.hosts.get(peer_id)
        if key is None or other is None or protocol not in other._handlers:
            raise StreamError(f"cannot open {protocol} to {peer_id}")
        state = {"reset": False}
        a_tx, b_rx = trio.testing.memory_stream_one_way_pair()
        b_tx, a_rx = trio.testing.memory_stream_one_way_pair()
        mine = MemStream(a_tx, a_rx, peer_id, key, state)
        other._nursery.start_soon(other._serve, protocol, MemStream(b_tx, b_rx, self.peer_id, key, state))
        return mine

    async def _serve(self, protocol: str, stream: MemStream) -> None:
        """As the libp2p transport runs a handler: a protocol fault is the peer's, a bug of ours is not."""
        try:
            await self._handlers[protocol](stream, stream.peer)
        except (DecodeError, FrameError) as e:
            await stream.reset()
            self.faults.record(stream.peer, protocol, e)
        except (MurmurError, trio.TooSlowError) as e:
            log.info("%s handler for %s: %s", protocol, stream.peer, e)
            await stream.reset()
        except Exception:
            log.exception("%s handler for %s crashed", protocol, stream.peer)
            self.faults.counts[protocol + " (handler bug)"] = self.faults.counts.get(protocol + " (handler bug)", 0) + 1
            await stream.reset()
