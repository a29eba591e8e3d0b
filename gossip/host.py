"""The py-libp2p host behind Murmur's `Transport` interface.

Configured from measured limits of py-libp2p 0.8.1 (docs/gossip.md): TCP
(+ optional WebSocket), Noise only (no plaintext fallback), yamux only, one
connection per peer (no 250 ms dial wait), GossipSub with a 1 s heartbeat,
adaptive gossip, spam protection and IP-diversity grafting off (loopback
swarms are one IP), strict signing on. Pubsub and GossipSub start before the
network listens (an early inbound pubsub stream would otherwise crash the
host). Subscriptions are drained at once into our own bounded channels, and a
publish that cannot go out raises `PublishError` instead of vanishing.

The libp2p key is the node's ed25519 identity, so `transport.peer_id ==
Identity.peer_id`.

py-libp2p 0.8.1's own defects are fixed in `gossip/libp2p_fixes.py`, which
`open_transport` installs (and which refuses any other py-libp2p version)
before it builds a host; this module is the adapter only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import multiaddr
import trio

from murmur.gossip import libp2p_fixes
from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.identity import Identity
from murmur.gossip.limits import Lease, StreamBudget, StreamLimits
from murmur.gossip.transport import FrameError, MessageChannel, PublishError, Stream, StreamError, StreamHandler

log = logging.getLogger("murmur.gossip.host")

# Peers disconnected for a stream fault waiting for the transport's task; more are counted and dropped.
FAULT_QUEUE = 256
# A stream whose handler failed is reset within this long, or abandoned (its connection is closed anyway).
RESET_TIMEOUT_S = 2.0


class StreamFaults:
    """Exceptions that escaped a py-libp2p handler of a peer's stream or message, counted per protocol.

    Everything py-libp2p runs for a remote peer (multistream negotiation, then the handler of
    pubsub, identify, Kademlia, circuit relay, DCUtR, ping, ... and our own protocols) is called
    through `guard_stream`, and pubsub's per-message task through the `push_msg` guard: an
    exception there would otherwise reach the host's service nursery and end the process. Every
    such exception is counted per protocol and its stream reset. When it proves malformed input
    (`_is_peer_fault`), the bytes came over a Noise session, so the peer is who sent them: the
    connection is closed (the protocol's state for that peer may be half-updated) and `on_fault`
    (set by the node: a score penalty) is told.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.total = 0
        self.dropped = 0
        self.on_fault: Callable[[str, str, str], None] | None = None  # (peer id, protocol, error)
        self.to_close, self._pending = trio.open_memory_channel[str](FAULT_QUEUE)

    def count(self, key: str) -> None:
        self.total += 1
        self.counts[key] = self.counts.get(key, 0) + 1

    def record(self, peer: str, protocol: str, error: BaseException, close: bool = True) -> None:
        """A fault of `peer` on `protocol`: counted, reported to `on_fault`, and (`close`) its connection closed."""
        self.count(protocol)
        what = f"{type(error).__name__}: {error}"[:300]
        log.info("stream fault from %s on %s: %s", peer, protocol, what)
        log.debug("stream fault traceback", exc_info=error)
        if self.on_fault is not None:
            try:
                self.on_fault(peer, protocol, what)
            except Exception:  # the node's callback: a bug there must not stop the stream's reset and close
                log.exception("stream fault callback failed")
        if not close:
            return
        try:
            self.to_close.send_nowait(peer)
        except trio.WouldBlock:
            self.dropped += 1

    async def closer(self, disconnect: Callable[[str], Awaitable[None]]) -> None:
        """Close the connections of faulty peers (run in the transport's nursery, not the failed handler's)."""
        async for peer in self._pending:
            with trio.move_on_after(RESET_TIMEOUT_S * 2):
                await disconnect(peer)


def _net_errors() -> tuple[type[BaseException], ...]:
    """What a py-libp2p call raises when the network, the peer or the connection fails: py-libp2p's own
    error hierarchy, trio's on a closed or broken stream, the OS's, and a timeout (imported late:
    importing py-libp2p costs most of a second)."""
    from libp2p.exceptions import BaseLibp2pError

    return BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError


def _is_peer_fault(error: BaseException) -> bool:
    """Whether `error` proves the peer sent bytes that break the protocol (then it is charged).

    Malformed input only: undecodable protobuf or varints, a length over the limit, our own
    decode and frame errors. Anything else (a local OSError, a py-libp2p bug, a peer that went
    away mid-message) is counted and the stream reset, but no one is charged for it.
    """
    from google.protobuf.message import DecodeError as ProtobufDecodeError
    from libp2p.exceptions import ParseError
    from libp2p.io.exceptions import MessageTooLarge

    return isinstance(
        error, (ProtobufDecodeError, ParseError, MessageTooLarge, DecodeError, FrameError, UnicodeDecodeError)
    )


# py-libp2p handlers that return without closing their stream: pubsub's reader when a peer's RPC is
# cut short by EOF, the circuit relay HOP handler after answering MALFORMED_MESSAGE. The guard closes
# the stream, or it would stay half-open in the connection's table for as long as the connection
# lives. Not for every protocol: the relay STOP handler hands its stream over to the relayed
# connection it carries.
_CLOSE_AFTER_HANDLER = frozenset(
    {"/libp2p/circuit/relay/0.2.0/hop", "/meshsub/1.0.0", "/meshsub/1.1.0", "/meshsub/1.2.0"}
)


def _guard_stream_handlers(host: Any, faults: StreamFaults) -> None:
    """Route every inbound stream of `host` through a handler that no exception escapes."""
    inner = host._swarm_stream_handler

    async def guard_stream(net_stream: Any) -> None:
        try:
            await inner(net_stream)
            if net_stream.get_protocol() in _CLOSE_AFTER_HANDLER:
                with trio.move_on_after(RESET_TIMEOUT_S):
                    try:
                        await net_stream.close()
                    except _net_errors():
                        pass
        except Exception as e:  # the guard's purpose: nothing from a peer's stream reaches the host's nursery
            try:
                peer = net_stream.muxed_conn.peer_id.to_base58()
            except AttributeError:  # a stream whose connection is already gone
                peer = "?"
            protocol = str(net_stream.get_protocol() or "multistream")
            with trio.move_on_after(RESET_TIMEOUT_S):
                try:
                    await net_stream.reset()
                except _net_errors():
                    pass
            if _is_peer_fault(e):
                faults.record(peer, protocol, e)
            else:
                log.warning("%s handler for %s failed: %s: %s", protocol, peer, type(e).__name__, e)
                faults.count(f"{protocol} (error)")

    host._murmur_faults = faults
    host.get_network().set_stream_handler(guard_stream)


# Largest payload one gossip message may carry. py-libp2p drops >1 MiB silently
# and closes the pubsub stream of a peer sending an RPC >1 MiB; keep well under.
MAX_PUBLISH_BYTES = 512 * 1024 + 4096
# Our per-topic inbox: py-libp2p's own subscription buffer (32) is drained into it at once.
INBOX_SIZE = 4096
GOSSIP_D, GOSSIP_D_LOW, GOSSIP_D_HIGH = 6, 4, 12
HEARTBEAT_S = 1
# Every this often each pubsub peer is told our subscriptions again. py-libp2p sends them only in a new
# stream's hello and on a change, so a hello lost with a connection that closed as it was written (two hosts
# that dial each other at once) left the peer not knowing we subscribe for as long as the link lasted: it sent
# us nothing, and our publishes to it failed for "no connected peer subscribes". One small RPC per peer.
SUBSCRIPTIONS_REFRESH_S = 10.0

# Async validator: (forwarder peer id, originator peer id, data) -> accept?
Validator = Callable[[str, str, bytes], Awaitable[bool]]


class ConnectError(MurmurError):
    """A dial failed or the multiaddr is malformed."""


def libp2p_key_pair(identity: Identity) -> Any:
    """The libp2p Ed25519 key pair of a Murmur identity (same seed, same peer ID)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(identity.seed)


_conn_keys = itertools.count(1)


class _Stream:
    """Adapts a libp2p net stream to `gossip.transport.Stream`: EOF reads b"", errors are StreamError.

    `conn_key` names the libp2p connection the stream runs on (unique per process), so a protocol
    that keeps per-peer state can tell a second stream on the same connection from a stream on a
    new connection (the peer restarted or redialled, and forgot everything).
    """

    def __init__(self, raw: Any, peer: str = "", budget: StreamBudget | None = None) -> None:
        self._raw = raw
        self.peer = peer
        self.budget = budget
        muxed = getattr(raw, "muxed_conn", None)
        key = getattr(muxed, "_murmur_conn_key", None)
        if key is None and muxed is not None:
            key = next(_conn_keys)
            try:
                muxed._murmur_conn_key = key
            except AttributeError:
                key = id(muxed)
        self.conn_key: int | None = key

    def frame_lease(self) -> Lease | None:
        """A reservation against the peer's buffer budget for what a frame reader holds (`gossip.framing`)."""
        return Lease(self.budget, self.peer, trio.current_time) if self.budget is not None else None

    async def read(self, n: int) -> bytes:
        from libp2p.network.stream.exceptions import StreamEOF
        from libp2p.network.stream.exceptions import StreamError as _LErr

        try:
            return await self._raw.read(n)
        except StreamEOF:
            return b""
        except (_LErr, OSError) as e:
            raise StreamError(f"stream read failed: {type(e).__name__}: {e}") from None
        except _net_errors() as e:  # muxer-level exceptions of py-libp2p
            if "EOF" in type(e).__name__:
                return b""
            raise StreamError(f"stream read failed: {type(e).__name__}: {e}") from None

    async def write(self, data: bytes | bytearray) -> None:
        try:
            await self._raw.write(data)
        except _net_errors() as e:
            raise StreamError(f"stream write failed: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        try:
            await self._raw.close()
        except _net_errors():  # closing a broken stream is not an error worth raising
            pass

    async def reset(self) -> None:
        try:
            await self._raw.reset()
        except _net_errors():
            pass


class _Inbox:
    """Our own bounded per-topic queue; overflow is counted, never silent."""

    def __init__(self, size: int) -> None:
        self.send, self.recv = trio.open_memory_channel[tuple[str, bytes]](size)
        self.dropped = 0

    async def receive(self) -> tuple[str, bytes]:
        return await self.recv.receive()


class Libp2pTransport:
    """A running py-libp2p host. Create with `open_transport(...)`; use only inside that context."""

    def __init__(
        self,
        identity: Identity,
        host: Any,
        pubsub: Any,
        router: Any,
        nursery: trio.Nursery,
        faults: StreamFaults | None = None,
        budget: StreamBudget | None = None,
    ) -> None:
        self.identity = identity
        self.faults = faults or StreamFaults()
        self.budget = budget or StreamBudget()
        self.peer_id: str = identity.peer_id
        self.host = host
        self.pubsub = pubsub
        self.router = router
        self._nursery = nursery
        self._inboxes: dict[str, list[_Inbox]] = {}
        self._subs: dict[str, Any] = {}
        self.counters: dict[str, int] = {
            "published": 0,
            "publish_errors": 0,
            "inbox_dropped": 0,
            "multi_topic": 0,
            "subscriptions_refresh_dropped": 0,
        }
        self.on_multi_topic: Callable[[str], None] | None = None  # originator of a message naming several topics

    # ------------------------------------------------------------ peers
    def listen_addrs(self) -> list[str]:
        """Full dialable multiaddrs (with /p2p/<id>)."""
        out = []
        for a in self.host.get_addrs():
            s = str(a)
            out.append(s if "/p2p/" in s else f"{s}/p2p/{self.peer_id}")
        return out

    def peers(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    async def connect(self, addr: str) -> str:
        from libp2p.peer.peerinfo import info_from_p2p_addr

        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except ValueError as e:  # multiaddr's parse errors and py-libp2p's InvalidAddrError are ValueErrors
            raise ConnectError(f"bad multiaddr {addr!r}: {e}") from None
        if info.peer_id.to_base58() == self.peer_id:
            raise ConnectError(f"{addr}: that is this node")
        try:
            await self.host.connect(info)
        except (
            Exception
        ) as e:  # py-libp2p's dial path also raises outside its hierarchy (a KeyError from the peerstore)
            raise ConnectError(f"cannot connect to {addr}: {type(e).__name__}: {e}") from None
        return info.peer_id.to_base58()

    async def disconnect(self, peer_id: str) -> None:
        from libp2p.peer.id import ID

        try:
            await self.host.disconnect(ID.from_base58(peer_id))
        except Exception as e:  # the fault closer runs this in the transport's nursery: nothing may end it
            log.debug("disconnect %s: %s", peer_id, e)

    def peer_addrs(self, peer_id: str) -> list[str]:
        from libp2p.peer.id import ID

        try:
            return [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer_id))]
        except (KeyError, ValueError):  # an unknown peer (PeerStoreError is a KeyError), a malformed id
            return []

    # ------------------------------------------------------------ gossip
    async def refresh_subscriptions(self) -> None:
        """Tell every pubsub peer our subscriptions again, every `SUBSCRIPTIONS_REFRESH_S`, for the host's life."""
        while True:
            await trio.sleep(SUBSCRIPTIONS_REFRESH_S)
            if not self.pubsub.topic_ids:
                continue
            hello = self.pubsub.get_hello_packet()
            for peer_id in tuple(self.pubsub.peers):
                queue = self.pubsub.peer_queues.get(peer_id)
                if queue is not None and not queue.push(hello):
                    self.counters["subscriptions_refresh_dropped"] += 1

    def topic_peers(self, topic: str) -> list[str]:
        """Connected peers that told us they subscribe to `topic`."""
        return [p.to_base58() for p in self.pubsub.peer_topics.get(topic, ())]

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > MAX_PUBLISH_BYTES:
            self.counters["publish_errors"] += 1
            raise PublishError(
                f"{len(data)}-byte message exceeds the {MAX_PUBLISH_BYTES}-byte gossip limit; "
                "bulk data moves over the broadcast's chunk streams"
            )
        targets = list(self.pubsub.peer_topics.get(topic, ()))
        if not targets:
            self.counters["publish_errors"] += 1
            raise PublishError(f"no connected peer subscribes to {topic}")
        await self._top_up_mesh(topic)
        mesh = self.router.mesh.get(topic)
        if mesh is not None:  # subscribed: py-libp2p sends only to the mesh
            targets = [p for p in targets if p in mesh]
            if not targets:
                self.counters["publish_errors"] += 1
                raise PublishError(f"no mesh peer for {topic} yet (subscribers are backing off)")
        full = []
        for p in targets:
            q = self.pubsub.peer_queues.get(p)
            if q is not None and len(q) >= q._queue.max_size:
                full.append(p.to_base58())
        if full and len(full) == len(targets):
            self.counters["publish_errors"] += 1
            raise PublishError(f"outbound queues full to every subscriber of {topic}: {full}")
        try:
            await self.pubsub.publish(topic, data)
        except (
            Exception
        ) as e:  # py-libp2p's publish path raises outside its hierarchy too; the caller gets PublishError
            self.counters["publish_errors"] += 1
            raise PublishError(f"publish to {topic} failed: {type(e).__name__}: {e}") from None
        self.counters["published"] += 1

    async def _top_up_mesh(self, topic: str) -> None:
        """GRAFT subscribed peers now when the mesh is below D_low, as the next heartbeat would.

        py-libp2p sends our own publishes only to mesh peers; a mesh that the heartbeat
        has not filled yet (a peer that just connected) would swallow the message silently.
        """
        mesh = self.router.mesh.get(topic)
        if mesh is None or len(mesh) >= GOSSIP_D_LOW:
            return
        for p in list(self.pubsub.peer_topics.get(topic, ())):
            if len(mesh) >= GOSSIP_D:
                break
            if p in mesh or not self.router._is_gossipsub_peer(p) or self.router._check_back_off(p, topic):
                continue
            mesh.add(p)
            try:
                self.router._notify_mesh_peer_added(p, topic)
                await self.router.emit_graft(topic, p)
            except _net_errors() as e:
                log.debug("graft %s on %s: %s", p, topic, e)

    async def subscribe(self, topic: str) -> MessageChannel:
        """A channel of (originator peer id, data) for `topic`; several callers may subscribe."""
        inbox = _Inbox(INBOX_SIZE)
        first = topic not in self._subs
        self._inboxes.setdefault(topic, []).append(inbox)
        if first:
            sub = await self.pubsub.subscribe(topic)
            self._subs[topic] = sub
            self._nursery.start_soon(self._drain, topic, sub)
        return inbox

    async def unsubscribe(self, topic: str) -> None:
        """Leave `topic`: its channels get nothing more; peers are told, and the mesh PRUNEd."""
        if self._subs.pop(topic, None) is None:
            return
        self._inboxes.pop(topic, None)
        try:
            await self.pubsub.unsubscribe(topic)
        except _net_errors() as e:  # a peer's stream went away while we told it
            log.debug("unsubscribe %s: %s", topic, e)

    async def _drain(self, topic: str, sub: Any) -> None:
        from libp2p.peer.id import ID

        async for msg in sub:
            origin = ID(msg.from_id).to_base58() if msg.from_id else ""
            for inbox in self._inboxes.get(topic, ()):
                try:
                    inbox.send.send_nowait((origin, bytes(msg.data)))
                except trio.WouldBlock:
                    inbox.dropped += 1
                    self.counters["inbox_dropped"] += 1
                    log.warning("inbox for %s full: message from %s dropped", topic, origin)

    def set_validator(self, topic: str, validator: Validator) -> None:
        """Run `validator` on every message of `topic` before it is delivered or forwarded.

        Our own publishes are accepted without calling it (py-libp2p would run it on them too).
        """
        from libp2p.peer.id import ID

        me = self.host.get_id()

        async def _v(forwarder: Any, msg: Any) -> bool:
            if forwarder == me:
                return True
            origin = ID(msg.from_id).to_base58() if msg.from_id else ""
            if len(msg.topicIDs) != 1:
                # One message on several topics would reach the subscribers of all of them: a batch
                # published to every rollout shard at once. Its originator signed the topic list.
                self.counters["multi_topic"] += 1
                if self.on_multi_topic is not None:
                    self.on_multi_topic(origin)
                return False
            try:
                return await validator(forwarder.to_base58(), origin, bytes(msg.data))
            except Exception:  # our validator's bug: the message is rejected, pubsub's service lives on
                log.exception("validator for %s raised; message rejected", topic)
                return False

        self.pubsub.set_topic_validator(topic, _v, True)

    def blacklist(self, peer_id: str) -> None:
        """Drop pubsub messages from `peer_id` from now on; the caller also disconnects it.

        Not `Pubsub.add_to_blacklist`: in 0.8.1 its teardown task races the dead-peer handler
        (`del self.peers[peer_id]` KeyError) and the exception kills the whole pubsub service.
        """
        from libp2p.peer.id import ID

        self.pubsub.blacklisted_peers.add(ID.from_base58(peer_id))

    def unblacklist(self, peer_id: str) -> None:
        from libp2p.peer.id import ID

        self.pubsub.blacklisted_peers.discard(ID.from_base58(peer_id))

    # ------------------------------------------------------------ bulk streams
    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        try:
            raw = await self.host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
        except _net_errors() + (ValueError,) as e:  # ValueError: a malformed peer id
            raise StreamError(f"cannot open {protocol} to {peer_id}: {type(e).__name__}: {e}") from None
        return _Stream(raw, peer_id, self.budget)

    def refuse_connections(self, refuse: Callable[[str], bool] | None) -> None:
        """Close every connection, in or out, with a peer for which `refuse(peer id)` holds (a graylisted key)."""
        self.host.get_network()._murmur_refuse = refuse

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        from libp2p.custom_types import TProtocol

        async def _h(raw: Any) -> None:
            remote = raw.muxed_conn.peer_id.to_base58()
            stream = _Stream(raw, remote, self.budget)
            try:
                await handler(stream, remote)
            except (DecodeError, FrameError) as e:  # the peer broke our protocol: its fault, scored
                await stream.reset()
                self.faults.record(remote, protocol, e, close=False)
            except (MurmurError, trio.TooSlowError) as e:  # refused, timed out, or the peer went away
                log.info("%s handler for %s: %s: %s", protocol, remote, type(e).__name__, e)
                await stream.reset()
            except Exception:  # a bug of ours that this peer's input reached: counted, not held against the peer
                log.exception("%s handler for %s crashed", protocol, remote)
                self.faults.count(protocol + " (handler bug)")
                await stream.reset()

        self.host.set_stream_handler(TProtocol(protocol), _h)


def _build(
    identity: Identity, websocket: bool, dial_timeout_s: float, faults: StreamFaults, budget: StreamBudget
) -> tuple[Any, Any, Any]:
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as x25519_pair
    from libp2p.custom_types import TProtocol
    from libp2p.network.config import ConnectionConfig
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    kp = libp2p_key_pair(identity)
    host = new_host(
        key_pair=kp,
        sec_opt={NOISE_ID: NoiseTransport(kp, noise_privkey=x25519_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_ID): Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=dial_timeout_s),
        enable_websocket=websocket,
    )
    router = GossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=GOSSIP_D,
        degree_low=GOSSIP_D_LOW,
        degree_high=GOSSIP_D_HIGH,
        heartbeat_interval=HEARTBEAT_S,
        heartbeat_initial_delay=0.1,
        adaptive_gossip_enabled=False,
        spam_protection_enabled=False,
        eclipse_protection_enabled=False,
        prune_back_off=10,
        # py-libp2p queues every message it sends for every connected peer not known to subscribe (up to
        # 100 a peer, 30 s) and flushes the queue when that peer subscribes: memory of 100 messages times
        # every peer, and each shard joined brought a burst of 30 s of its history. Gossip tolerates the
        # few messages lost while a new peer's subscriptions are learnt: announces repeat.
        max_pending_messages_per_peer=1,
        pending_messages_ttl=0.0,
    )
    pubsub = Pubsub(host, router, strict_signing=True)
    _guard_stream_handlers(host, faults)
    swarm = host.get_network()  # what gossip.hostlimits' hooks find
    swarm._murmur_budget, swarm._murmur_faults, swarm._murmur_refuse = budget, faults, None  # type: ignore[attr-defined]  # gossip.hostlimits' hooks read them off the swarm
    return host, pubsub, router


@asynccontextmanager
async def open_transport(
    identity: Identity,
    listen: list[str] | None = None,
    websocket: bool = False,
    dial_timeout_s: float = 5.0,
    limits: StreamLimits | None = None,
) -> AsyncIterator[Libp2pTransport]:
    """Start a host listening on `listen` (default an ephemeral 127.0.0.1 TCP port) and yield it."""
    from libp2p.tools.anyio_service import background_trio_service

    libp2p_fixes.install()
    addrs = [multiaddr.Multiaddr(a) for a in (listen or ["/ip4/127.0.0.1/tcp/0"])]
    faults = StreamFaults()
    # repeated held frames or overdrawn buffers: charged like any other stream fault, connection closed
    budget = StreamBudget(limits, on_charge=lambda peer, what: faults.record(peer, "stream budget", FrameError(what)))
    host, pubsub, router = _build(identity, websocket, dial_timeout_s, faults, budget)
    async with AsyncExitStack() as stack:
        # Order matters (py-libp2p 0.8.1): pubsub and router run before the network listens.
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await stack.enter_async_context(host.run(addrs))
        await pubsub.wait_until_ready()
        nursery = await stack.enter_async_context(trio.open_nursery())
        transport = Libp2pTransport(identity, host, pubsub, router, nursery, faults, budget)
        nursery.start_soon(faults.closer, transport.disconnect)
        nursery.start_soon(transport.refresh_subscriptions)
        try:
            yield transport
        finally:
            nursery.cancel_scope.cancel()
            # py-libp2p 0.8.1 leaves connections open on shutdown: peers would keep a dead
            # pubsub stream to us and never deliver to our restarted self. Close them.
            with trio.move_on_after(2, shield=True):  # type: ignore[call-arg]  # trio-typing's stubs predate trio's shield=
                # py-libp2p 0.8.1 closes its listeners in the swarm's shutdown path, but that path
                # runs cancelled and stops at its first await: the listening socket stayed open, and
                # peers that knew the address kept dialling a host whose swarm no longer ran. Close
                # them first, so no one redials in while the connections go.
                for listener in list(host.get_network().listeners.values()):
                    try:
                        await listener.close()
                    except Exception as e:  # shutdown: one failure must not keep the rest open
                        log.debug("closing listener: %s", e)
                for p in list(host.get_connected_peers()):
                    try:
                        await host.disconnect(p)
                    except Exception as e:  # shutdown: one failure must not keep the rest open
                        log.debug("closing connection to %s: %s", p, e)
