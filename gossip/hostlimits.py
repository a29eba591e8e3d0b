"""What holds each peer to the stream budget of `gossip.limits` inside py-libp2p 0.8.1.

Plain functions: `gossip.libp2p_fixes` installs the py-libp2p methods that call them (its fixes
`stream_caps`, `yamux_window_limit`, `connection_refusal` and `pubsub_oversize_charge`), and
nothing here patches py-libp2p. Each finds its host's state on the swarm (`_murmur_budget`,
`_murmur_faults`, `_murmur_refuse`, set by `gossip.host`), and does nothing on a swarm without it.

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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from murmur.gossip.iprange import full_range
from murmur.gossip.limits import FrameTimeout, Lease, StreamBudget, StreamLimits
from murmur.gossip.transport import FrameError

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


async def admit_inbound_stream(conn: Any, muxed_stream: Any, handle: Callable[[Any, Any], Awaitable[None]]) -> None:
    """`SwarmConn._handle_muxed_stream` under the stream budget: a stream over the peer's or the node's cap
    is reset; one within both goes to `handle` (py-libp2p's own method) and gives its place back however
    that ends. A swarm without a budget is handled as py-libp2p does."""
    budget: StreamBudget | None = getattr(conn.swarm, "_murmur_budget", None)
    if budget is None:
        await handle(conn, muxed_stream)
        return
    peer = _peer_of(conn.muxed_conn)
    if not budget.open_stream(peer):
        log.debug("inbound stream from %s refused: stream cap (%d open)", peer, budget.streams.get(peer, 0))
        with trio.move_on_after(RESET_TIMEOUT_S):
            try:
                await muxed_stream.reset()
            except Exception:  # the stream is being refused: a failed reset changes nothing
                pass
        return
    try:
        await handle(conn, muxed_stream)
    finally:
        budget.close_stream(peer)


def window_exceeded(stream: Any, overrun: int) -> WindowExceeded:
    """The error for a yamux `stream` whose sender went `overrun` bytes beyond its receive window, recorded
    against the peer in its swarm's `_murmur_faults` (py-libp2p's `SwarmConn` sets `muxed_conn.swarm`)."""
    swarm = getattr(stream.conn, "swarm", None)
    faults = getattr(swarm, "_murmur_faults", None)
    err = FrameError(f"yamux stream {stream.stream_id}: {overrun} bytes beyond the receive window")
    if faults is not None:
        faults.record(_peer_of(stream.conn), "/yamux/1.0.0", err)
    return WindowExceeded(str(err))


async def refuse_connection(swarm: Any, muxed_conn: Any, direction: str) -> None:
    """Close `muxed_conn` and raise SwarmException when `swarm` refuses it: its peer is graylisted or banned
    (`_murmur_refuse`), or it is inbound from a source range that already holds `StreamLimits.ip_connections`
    inbound connections. Returns for a connection py-libp2p may add."""
    from libp2p.network.exceptions import SwarmException

    refuse = getattr(swarm, "_murmur_refuse", None)
    if refuse is not None:
        peer = _peer_of(muxed_conn)
        if refuse(peer):
            faults = getattr(swarm, "_murmur_faults", None)
            if faults is not None:
                faults.count("connection refused (graylisted)")
            await _close(muxed_conn)
            raise SwarmException(f"connection with {peer} refused: graylisted")
    budget: StreamBudget | None = getattr(swarm, "_murmur_budget", None)
    if budget is None:
        return
    held = (c for conns in list(swarm.connections.values()) for c in (conns if isinstance(conns, list) else [conns]))
    full = range_full(budget.limits, direction, muxed_conn, held)
    if full is not None:
        budget.counters["connections_refused_ip"] += 1
        await _close(muxed_conn)
        raise SwarmException(
            f"connection from {remote_ip(muxed_conn)} refused: {full} holds {budget.limits.ip_connections} connections"
        )


async def _close(muxed_conn: Any) -> None:
    with trio.move_on_after(RESET_TIMEOUT_S):
        try:
            await muxed_conn.close()
        except Exception:  # the connection is being refused: a failed close changes nothing
            pass


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
    # A copy of py-libp2p's function, not a wrapper: its reads happen inside it, so wrapping would need a
    # stand-in stream that leases each read and arms the deadline on the first byte, and an over-long
    # prefix would leave it as py-libp2p's ParseError rather than our FrameError, which the guard charges.
    from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
    from libp2p.utils.varint import decode_uvarint

    swarm = getattr(getattr(stream, "swarm_conn", None), "swarm", None)
    budget: StreamBudget | None = getattr(swarm, "_murmur_budget", None)
    if budget is None:
        return await unbudgeted(stream, max_length)
    first = await stream.read(1)
    if not first:
        raise IncompleteReadError("Stream ended while reading varint length prefix", expected_bytes=1, received_bytes=0)
    lease = Lease(budget, _peer_of(stream.muxed_conn), trio.current_time)
    try:
        with trio.move_on_after(lease.deadline_s):
            prefix = bytearray(first)
            while prefix[-1] & 0x80:
                if len(prefix) >= 10:
                    raise FrameError("varint length prefix over 64 bits")
                b = await stream.read(1)
                if not b:
                    raise IncompleteReadError(
                        "Stream ended while reading varint length prefix", expected_bytes=1, received_bytes=0
                    )
                prefix += b
            n = decode_uvarint(bytes(prefix))
            if n > max_length:
                raise MessageTooLarge(f"Message length {n} exceeds maximum allowed {max_length}")
            body = bytearray()
            while len(body) < n:
                part = await stream.read(n - len(body))
                if not part:
                    raise IncompleteReadError(
                        f"Incomplete message: expected {n}, got {len(body)}", expected_bytes=n, received_bytes=len(body)
                    )
                lease.grow(len(part))
                body += part
            return bytes(body)
        lease.timed_out()
        raise FrameTimeout(f"pubsub RPC from {lease.peer} incomplete after {lease.deadline_s:g} s")
    finally:
        lease.free()
