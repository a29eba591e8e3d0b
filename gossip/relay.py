"""Circuit relay v2 for Murmur: a relay service on public nodes, reservations and relayed dials for NATed ones.

Why: a volunteer behind a home NAT cannot accept connections, so two NATed nodes could never talk.
A public node with `network.relay_service = true` forwards bytes between them (bounded by
`relay_max_reservations`, `relay_max_circuit_bytes`, `relay_max_circuit_s`); a NATed node reserves a
slot on each of `network.relays` and is then reachable at `<relay addr>/p2p-circuit/p2p/<its id>`.

This uses py-libp2p 0.8.1's own circuit v2 implementation (`/libp2p/circuit/relay/0.2.0/hop|stop`),
measured to work here (docs/reachability.md). It attaches to a host created by `gossip.host.open_transport`
without changing that module: the host's swarm skips `/p2p-circuit` addresses in `connect()`, so relayed
dials go through `CircuitV2Transport.dial`, whose upgraded connection the swarm then owns like any other
(gossip and streams work over it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import multiaddr
import trio

from murmur.gossip.errors import MurmurError

log = logging.getLogger("murmur.gossip.relay")

CIRCUIT = "/p2p-circuit"
RESERVE_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 10.0
# Concurrent circuits one reservation may carry (py-libp2p's default; not in the config file).
MAX_CIRCUITS_PER_PEER = 8


class RelaySettings(Protocol):
    """The relay keys of a node's `[network]` config section (the node's config struct satisfies it)."""

    relay_service: bool
    relay_max_reservations: int
    relay_max_circuit_bytes: int
    relay_max_circuit_s: int


class RelayError(MurmurError):
    """A reservation or a relayed dial failed, or a relay address is malformed."""


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """The address at which `peer_id` is reachable through the relay at `relay_addr` (with /p2p/<relay>)."""
    if "/p2p/" not in relay_addr or is_circuit(relay_addr):
        raise RelayError(f"relay address must be a direct multiaddr ending in /p2p/<relay id>: {relay_addr!r}")
    return f"{relay_addr}{CIRCUIT}/p2p/{peer_id}"


def split_circuit(addr: str) -> tuple[str, str]:
    """(relay address with /p2p/<relay>, destination peer id) of a circuit address."""
    if not is_circuit(addr):
        raise RelayError(f"not a circuit address: {addr!r}")
    relay, _, rest = addr.partition(CIRCUIT)
    dest = rest.removeprefix("/p2p/").split("/")[0]
    if "/p2p/" not in relay or not dest:
        raise RelayError(f"circuit address needs /p2p/<relay>/p2p-circuit/p2p/<peer>: {addr!r}")
    return relay, dest


@dataclass
class RelayLimitsView:
    """The limits a relay service enforces, as read from the config (reported by the doctor)."""

    max_reservations: int
    max_circuit_bytes: int
    max_circuit_s: int


@dataclass
class Reservation:
    relay_addr: str
    relay_peer: str
    circuit_addr: str  # where others can dial us through this relay
    expires_unix: float


@dataclass
class Relay:
    """Relay state attached to one host. Create with `attach_relay`."""

    transport: Any  # gossip.host.Libp2pTransport
    service: bool
    limits: RelayLimitsView
    _protocol: Any = None
    _client: Any = None
    _nursery: trio.Nursery | None = None
    reservations: dict[str, Reservation] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # relay addr -> last error
    configured: list[str] = field(default_factory=list)  # relays we tried to reserve on

    def circuit_addrs(self) -> list[str]:
        """Our addresses through every live reservation."""
        now = time.time()
        return [r.circuit_addr for r in self.reservations.values() if r.expires_unix > now]

    def active_circuits(self) -> int:
        """Circuits this node relays right now (relay service only)."""
        return len(getattr(self._protocol, "_active_relays", {}) or {})

    async def reserve(self, relay_addr: str, timeout_s: float = RESERVE_TIMEOUT_S) -> Reservation:
        """Connect to the relay at `relay_addr` and reserve a slot; py-libp2p refreshes it before expiry."""
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID

        if is_circuit(relay_addr):
            raise RelayError(f"cannot reserve on a relayed address: {relay_addr}")
        try:
            with trio.fail_after(timeout_s):
                relay_peer = await self.transport.connect(relay_addr)
                stream = await self.transport.host.new_stream(ID.from_base58(relay_peer), [PROTOCOL_ID])
                assert self._nursery is not None
                ok = await self._client.reserve(stream, ID.from_base58(relay_peer), self._nursery)
                try:
                    await stream.close()
                except Exception:
                    pass
        except trio.TooSlowError:
            self.errors[relay_addr] = f"reservation timed out after {timeout_s:.0f} s"
            raise RelayError(f"reservation on {relay_addr} timed out after {timeout_s:.0f} s") from None
        except MurmurError as e:
            self.errors[relay_addr] = str(e)
            raise RelayError(f"cannot reach relay {relay_addr}: {e}") from None
        except Exception as e:
            self.errors[relay_addr] = f"{type(e).__name__}: {e}"
            raise RelayError(f"reservation on {relay_addr} failed: {type(e).__name__}: {e}") from None
        if not ok:
            self.errors[relay_addr] = "relay refused the reservation (not a relay, or full)"
            raise RelayError(f"{relay_addr} refused the reservation (not a relay, or its slots are full)")
        expires = float(self._client._reservations.get(ID.from_base58(relay_peer), 0) or time.time() + 3600)
        res = Reservation(relay_addr, relay_peer, circuit_addr(relay_addr, self.transport.peer_id), expires)
        self.reservations[relay_addr] = res
        self.errors.pop(relay_addr, None)
        return res

    async def reserve_all(self, relay_addrs: list[str], timeout_s: float = RESERVE_TIMEOUT_S) -> list[Reservation]:
        """Reserve on every relay in the list, concurrently; failures are recorded in `errors`."""
        out: list[Reservation] = []
        self.configured = list(dict.fromkeys(self.configured + relay_addrs[:16]))[:16]

        async def one(a: str) -> None:
            try:
                out.append(await self.reserve(a, timeout_s))
            except RelayError as e:
                log.info("%s", e)

        async with trio.open_nursery() as n:
            for a in relay_addrs[:16]:
                n.start_soon(one, a)
        return out

    async def dial(self, addr: str, timeout_s: float = DIAL_TIMEOUT_S) -> str:
        """Open a relayed connection to the peer at circuit address `addr`; returns its peer id."""
        relay_addr, dest = split_circuit(addr)
        if dest == self.transport.peer_id:
            raise RelayError(f"{addr}: that is this node")
        try:
            with trio.fail_after(timeout_s):
                # The relay must be connected first (the circuit runs over that connection).
                await self.transport.connect(relay_addr)
                await self._client.dial(multiaddr.Multiaddr(addr))
        except trio.TooSlowError:
            raise RelayError(f"relayed dial to {addr} timed out after {timeout_s:.0f} s") from None
        except MurmurError as e:
            raise RelayError(f"relayed dial to {addr}: cannot reach the relay: {e}") from None
        except Exception as e:
            raise RelayError(f"relayed dial to {addr} failed: {type(e).__name__}: {e}") from None
        return dest


def limits_from(network: RelaySettings) -> RelayLimitsView:
    return RelayLimitsView(network.relay_max_reservations, network.relay_max_circuit_bytes, network.relay_max_circuit_s)


@asynccontextmanager
async def attach_relay(transport: Any, network: RelaySettings) -> AsyncIterator[Relay]:
    """Add circuit relay v2 to a running `Libp2pTransport`.

    Always: accept relayed connections (STOP) and dial through relays. With `network.relay_service`:
    also relay for others (HOP) within the configured limits. Reservations on `network.relays` are
    NOT made here (the caller decides after the reachability check): call `relay.reserve_all(...)`.
    """
    from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport
    from libp2p.tools.anyio_service import background_trio_service

    view = limits_from(network)
    if view.max_reservations < 0 or view.max_circuit_bytes < 0 or view.max_circuit_s < 0:
        raise RelayError("relay limits must be >= 0")
    limits = RelayLimits(
        duration=view.max_circuit_s,
        data=view.max_circuit_bytes,
        max_circuit_conns=MAX_CIRCUITS_PER_PEER,
        max_reservations=view.max_reservations,
    )
    protocol = CircuitV2Protocol(transport.host, limits=limits, allow_hop=network.relay_service)
    # STOP only for the dialing side: with CLIENT, py-libp2p would make a reservation on every dial.
    client = CircuitV2Transport(transport.host, protocol, RelayConfig(roles=RelayRole.STOP, limits=limits))
    relay = Relay(transport, network.relay_service, view, protocol, client)
    async with background_trio_service(protocol), trio.open_nursery() as nursery:
        relay._nursery = nursery
        try:
            yield relay
        finally:
            nursery.cancel_scope.cancel()
