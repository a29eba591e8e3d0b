"""Hole punching (DCUtR): upgrade a relayed connection to a direct one by simultaneous TCP open.

Why: a relay is a shared, capped resource (bytes and seconds per circuit); two NATed volunteers
should talk directly when their NATs allow it. py-libp2p 0.8.1 ships DCUtR (`/libp2p/dcutr`): over
the relayed connection both sides exchange their predicted public addresses (observed WAN IP + their
TCP listen port; hole-punch dials leave from the listen port with SO_REUSEPORT), measure the RTT,
and dial each other at the same moment so each NAT sees an outbound SYN before the peer's SYN
arrives. It works through NATs that keep the source port (Linux MASQUERADE does, when the port is
free); it cannot work through port-randomising ("symmetric") NATs (`MASQUERADE --random-fully`),
where the relay stays the path. docs/reachability.md has the measurements.

py-libp2p's service also auto-drives: every 2 s it tries to upgrade any relayed connection it sees.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from murmur.gossip import libp2p_fixes
from murmur.gossip.errors import MurmurError

log = logging.getLogger("murmur.gossip.holepunch")

UPGRADE_TIMEOUT_S = 20.0


class HolePunchError(MurmurError):
    """A hole punch could not be attempted (no connection to the peer, bad peer id)."""


def connection_paths(transport: Any, peer_id: str) -> list[str]:
    """How we are connected to `peer_id` right now: a list of "direct", "relayed", "webrtc" (empty: not at all)."""
    from libp2p.peer.id import ID

    try:
        pid = ID.from_base58(peer_id)
    except Exception as e:
        raise HolePunchError(f"bad peer id {peer_id!r}: {e}") from None
    conns = (getattr(transport.host.get_network(), "connections", {}) or {}).get(pid) or []
    if not isinstance(conns, list):
        conns = [conns]
    out = []
    for conn in conns:
        try:
            addrs = [str(a) for a in (conn.get_transport_addresses() or [])]
        except Exception:
            addrs = []
        muxed = type(getattr(conn, "muxed_conn", None)).__name__
        if any("/p2p-circuit" in a for a in addrs):
            out.append("relayed")
        elif any("webrtc" in a for a in addrs) or "WebRTC" in muxed:  # inbound ones carry no addresses
            out.append("webrtc")
        else:
            out.append("direct")
    return out


def best_path(transport: Any, peer_id: str) -> str:
    """The best current path to `peer_id`: direct > webrtc > relayed > none."""
    paths = connection_paths(transport, peer_id)
    for p in ("direct", "webrtc", "relayed"):
        if p in paths:
            return p
    return "none"


@dataclass
class HolePuncher:
    transport: Any
    _dcutr: Any
    attempts: int = 0
    successes: int = 0
    last_error: str = ""

    async def upgrade(self, peer_id: str, timeout_s: float = UPGRADE_TIMEOUT_S) -> bool:
        """Try to replace the relayed connection to `peer_id` by a direct one. True if a direct one exists after."""
        from libp2p.peer.id import ID

        if best_path(self.transport, peer_id) == "direct":
            return True
        if best_path(self.transport, peer_id) == "none":
            raise HolePunchError(f"not connected to {peer_id}: connect through a relay first")
        self.attempts += 1
        ok = False
        with trio.move_on_after(timeout_s):
            try:
                ok = bool(await self._dcutr.initiate_hole_punch(ID.from_base58(peer_id)))
            except Exception as e:  # py-libp2p raises a variety of things on failed punches
                self.last_error = f"{type(e).__name__}: {e}"
        ok = ok and best_path(self.transport, peer_id) == "direct"
        if ok:
            self.successes += 1
        elif not self.last_error:
            self.last_error = "no direct connection after the hole punch (NAT maps ports unpredictably, or filters)"
        return ok

    async def wait_direct(self, peer_id: str, timeout_s: float) -> bool:
        """Wait (bounded) for a direct connection, e.g. one the peer's side punched."""
        with trio.move_on_after(timeout_s):
            while best_path(self.transport, peer_id) != "direct":
                await trio.sleep(0.1)
            self.successes += 1  # punched from the other side: still a hole-punched path for us
            return True
        self.last_error = f"no direct connection within {timeout_s:.0f} s"
        return False


@asynccontextmanager
async def attach_holepunch(transport: Any, auto: bool = True, dial_timeout_s: int = 5) -> AsyncIterator[HolePuncher]:
    """Run py-libp2p's DCUtR service on a running `Libp2pTransport` (it must also have the relay attached)."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
    from libp2p.tools.anyio_service import background_trio_service

    libp2p_fixes.install_dcutr()
    dcutr = DCUtRProtocol(transport.host, read_timeout=10, write_timeout=10, dial_timeout=dial_timeout_s)
    dcutr._murmur_manual = not auto  # type: ignore[attr-defined]  # read by libp2p_fixes' dcutr_manual_drive
    async with background_trio_service(dcutr):
        yield HolePuncher(transport, dcutr)
