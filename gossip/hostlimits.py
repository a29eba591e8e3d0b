"""py-libp2p 0.8.1 hooks that hold each peer to the stream budget of `gossip.limits`.

Installed by `gossip.libp2p_fixes.install()` with py-libp2p's other fixes; each hook
finds its host's state on the swarm (`_murmur_budget`, `_murmur_faults`, `_murmur_refuse`,
set by `gossip.host`), and does nothing on a swarm without it.

- Inbound stream caps: `SwarmConn._handle_muxed_stream` runs for every stream a peer opens,
  before py-libp2p's host-wide semaphore (which queues, so a full host stalled every new
  peer's streams behind one key's) and before multistream negotiation. A stream over the
  peer's or the node's cap is reset there.
- Yamux receive windows: py-libp2p logs a DATA frame beyond the stream's receive window and
  buffers it anyway, so a peer could push unbounded bytes into a stream nobody reads. Here
  that is what go-yamux makes it, a protocol error: the connection is closed and the sender
  charged (the window is our own accounting of credit we granted, so an honest sender never
  exceeds it).
- Pubsub RPC reads: py-libp2p reads an RPC's body (up to its 1 MiB limit) for as long as the
  sender takes. Here the body's bytes are reserved from the peer's budget as they arrive and
  the RPC must be complete within the frame deadline.
- Refused connections: a connection (inbound or outbound) with a peer the node refuses
  (graylisted or banned: `_murmur_refuse`) is closed as it is added, so reconnecting does not
  buy a graylisted key a fresh start; an inbound connection from a source range that already
  holds `StreamLimits.ip_connections` inbound connections (`gossip.iprange`) is closed too, so
  one machine's many keys cannot take every connection a node accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import trio

from gossip.iprange import full_range
from gossip.limits import FrameTimeout, Lease, StreamBudget, StreamLimits
from gossip.transport import FrameError

log = logging.getLogger("murmur.gossip.host")

RESET_TIMEOUT_S = 2.0


class WindowExceeded(trio.TooSlowError):
    """A peer sent beyond a yamux stream's receive window. A TooSlowError because that is what py-libp2p's
    muxer loop answers by closing the connection (the one exception it handles that way)."""


def _peer_of(conn: Any) -> str:
    try:
        return conn.peer_id.to_base58()
    except Exception:
        return "?"


def _install_inbound_stream_caps() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    if getattr(SwarmConn, "_murmur_caps", False):
        return
    handle = SwarmConn._handle_muxed_stream
    init = SwarmConn.__init__

    def __init__(self: Any, muxed_conn: Any, swarm: Any, *args: Any, **kw: Any) -> None:
        init(self, muxed_conn, swarm, *args, **kw)
        try:
            muxed_conn._murmur_swarm = swarm  # the yamux window hook finds the host's state through it
        except AttributeError:
            pass

    async def _handle_muxed_stream(self: Any, muxed_stream: Any) -> None:
        budget: StreamBudget | None = getattr(self.swarm, "_murmur_budget", None)
        if budget is None:
            await handle(self, muxed_stream)
            return
        peer = _peer_of(self.muxed_conn)
        if not budget.open_stream(peer):
            log.debug("inbound stream from %s refused: stream cap (%d open)", peer, budget.streams.get(peer, 0))
            with trio.move_on_after(RESET_TIMEOUT_S):
                try:
                    await muxed_stream.reset()
                except Exception:
                    pass
            return
        try:
            await handle(self, muxed_stream)
        finally:
            budget.close_stream(peer)

    SwarmConn.__init__ = __init__  # type: ignore[method-assign]  # this fix replaces py-libp2p's method
    SwarmConn._handle_muxed_stream = _handle_muxed_stream  # type: ignore[method-assign]  # this fix replaces py-libp2p's method
    SwarmConn._murmur_caps = True  # type: ignore[attr-defined]  # marks py-libp2p's class as patched


def _install_yamux_window_enforcement() -> None:
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    if getattr(YamuxStream, "_murmur_window", False):
        return

    def get(self: Any) -> int:
        return self.__dict__["_murmur_recv_window"]

    def set_(self: Any, value: int) -> None:
        if value < 0 and "_murmur_recv_window" in self.__dict__:
            self.__dict__["_murmur_recv_window"] = 0
            peer = _peer_of(self.conn)
            swarm = getattr(self.conn, "_murmur_swarm", None)
            faults = getattr(swarm, "_murmur_faults", None)
            err = FrameError(f"yamux stream {self.stream_id}: {-value} bytes beyond the receive window")
            if faults is not None:
                faults.record(peer, "/yamux/1.0.0", err)
            raise WindowExceeded(str(err))
        self.__dict__["_murmur_recv_window"] = value

    YamuxStream.recv_window = property(get, set_)  # type: ignore[assignment]  # a property in place of py-libp2p's plain attribute
    YamuxStream._murmur_window = True  # type: ignore[attr-defined]  # marks py-libp2p's class as patched


def _install_connection_refusal() -> None:
    from libp2p.network.exceptions import SwarmException
    from libp2p.network.swarm import Swarm

    if getattr(Swarm, "_murmur_refusal", False):
        return
    add = Swarm.add_conn

    async def add_conn(self: Any, muxed_conn: Any, *args: Any, **kw: Any) -> Any:
        refuse = getattr(self, "_murmur_refuse", None)
        if refuse is not None:
            peer = _peer_of(muxed_conn)
            if refuse(peer):
                faults = getattr(self, "_murmur_faults", None)
                if faults is not None:
                    faults.count("connection refused (graylisted)")
                with trio.move_on_after(RESET_TIMEOUT_S):
                    try:
                        await muxed_conn.close()
                    except Exception:
                        pass
                raise SwarmException(f"connection with {peer} refused: graylisted")
        budget: StreamBudget | None = getattr(self, "_murmur_budget", None)
        direction = kw.get("direction", args[0] if args else "unknown")
        if budget is not None:
            held = (c for conns in list(self.connections.values())
                    for c in (conns if isinstance(conns, list) else [conns]))
            full = range_full(budget.limits, str(direction), muxed_conn, held)
            if full is not None:
                lim = budget.limits
                ip = remote_ip(muxed_conn)
                budget.counters["connections_refused_ip"] += 1
                with trio.move_on_after(RESET_TIMEOUT_S):
                    try:
                        await muxed_conn.close()
                    except Exception:  # the connection is being refused: a failed close changes nothing
                        pass
                raise SwarmException(f"connection from {ip} refused: {full} holds {lim.ip_connections} connections")
        return await add(self, muxed_conn, *args, **kw)

    Swarm.add_conn = add_conn  # type: ignore[method-assign]  # this fix replaces py-libp2p's method
    Swarm._murmur_refusal = True  # type: ignore[attr-defined]  # marks py-libp2p's class as patched


def range_full(limits: StreamLimits, direction: str, conn: Any, held: Iterable[Any]) -> str | None:
    """The source range that already holds `limits.ip_connections` inbound connections, when `conn` (a new
    connection of `direction`) comes from it: then it is refused. None for an outbound connection (the node
    chose to dial it), and only inbound connections among those `held` count."""
    if direction != "inbound":
        return None
    ip = remote_ip(conn)
    if not ip:
        return None
    # a generator: `full_range` reads the held connections only for a counted range (not loopback)
    inbound = (remote_ip(c) for c in held if "INBOUND" in str(getattr(c, "direction", "")).upper())
    return full_range(ip, inbound, limits.ip_connections, limits.ip_unlimited)


def remote_ip(conn: Any) -> str:
    """The remote IP address of a direct connection (a py-libp2p muxed or swarm connection); "" for a
    relayed one (its address is the relay's) or when the transport does not say."""
    try:
        if "RELAYED" in str(conn.get_connection_type()):
            return ""
        addrs = [str(a) for a in (conn.get_transport_addresses() or [])]
    except Exception:  # a transport without these queries: not counted
        return ""
    for a in addrs:
        parts = a.split("/")
        if "/p2p-circuit" not in a and len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return ""


async def read_varint_frame(stream: Any, max_length: int, unbudgeted: Any) -> bytes:
    """py-libp2p's `read_varint_prefixed_bytes_limited`, with the body's bytes reserved from the peer's budget
    as they arrive and the whole RPC due within the frame deadline from its first byte."""
    from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
    from libp2p.utils.varint import decode_uvarint

    swarm = getattr(getattr(stream, "swarm_conn", None), "swarm", None)
    budget: StreamBudget | None = getattr(swarm, "_murmur_budget", None)
    if budget is None:
        return await unbudgeted(stream, max_length)
    first = await stream.read(1)
    if not first:
        raise IncompleteReadError("Stream ended while reading varint length prefix", expected_bytes=1,
                                  received_bytes=0)
    lease = Lease(budget, _peer_of(stream.muxed_conn), trio.current_time)
    try:
        with trio.move_on_after(lease.deadline_s):
            prefix = bytearray(first)
            while prefix[-1] & 0x80:
                if len(prefix) >= 10:
                    raise FrameError("varint length prefix over 64 bits")
                b = await stream.read(1)
                if not b:
                    raise IncompleteReadError("Stream ended while reading varint length prefix",
                                              expected_bytes=1, received_bytes=0)
                prefix += b
            n = decode_uvarint(bytes(prefix))
            if n > max_length:
                raise MessageTooLarge(f"Message length {n} exceeds maximum allowed {max_length}")
            body = bytearray()
            while len(body) < n:
                part = await stream.read(n - len(body))
                if not part:
                    raise IncompleteReadError(f"Incomplete message: expected {n}, got {len(body)}",
                                              expected_bytes=n, received_bytes=len(body))
                lease.grow(len(part))
                body += part
            return bytes(body)
        lease.timed_out()
        raise FrameTimeout(f"pubsub RPC from {lease.peer} incomplete after {lease.deadline_s:g} s")
    finally:
        lease.free()


def install() -> None:
    _install_inbound_stream_caps()
    _install_yamux_window_enforcement()
    _install_connection_refusal()
