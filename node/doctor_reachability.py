"""Doctor checks for reachability: which path this node uses (direct / relayed / hole-punched / webrtc),
why, and what the user can change.

Why separate from node/doctor.py: these checks need the live network pieces (relay, hole puncher,
reachability verdict). They are pure functions over a `ReachSnapshot` taken from a running node, so
they are testable without a network and the doctor can render them like its other checks.
`Check` here has the same shape the doctor uses (name, ok, detail, fix); if `node.doctor.Check`
exists, it is used instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

try:  # one Check type across the doctor, once node/doctor.py defines it
    from node.doctor import Check  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - before the doctor lands

    class Check(msgspec.Struct, kw_only=True):  # type: ignore[no-redef]
        name: str
        ok: bool
        detail: str
        fix: str = ""


DIRECT, RELAYED, HOLEPUNCHED, WEBRTC, OFFLINE = "direct", "relayed", "hole-punched", "webrtc", "offline"


@dataclass
class ReachSnapshot:
    """What the node knows about its reachability at one moment."""

    status: str  # public / private / unknown (gossip.reachability)
    reason: str
    observed_ips: list[str]
    listen_addrs: list[str]
    relay_service: bool
    relays_configured: list[str]
    reservations: list[str]  # our circuit addresses
    relay_errors: dict[str, str]
    peer_paths: dict[str, str] = field(default_factory=dict)  # peer -> direct/relayed/webrtc/none
    holepunch_attempts: int = 0
    holepunch_successes: int = 0
    holepunch_error: str = ""
    webrtc_reason: str = ""  # "" if available
    path: str = OFFLINE


def classify(s: ReachSnapshot) -> str:
    """The node's main path: direct if peers can dial it; else hole-punched/relayed/webrtc by what it uses."""
    if s.status == "public":
        return DIRECT
    paths = set(s.peer_paths.values())
    if s.holepunch_successes and "direct" in paths:
        return HOLEPUNCHED
    if "webrtc" in paths:
        return WEBRTC
    if "relayed" in paths or s.reservations:
        return RELAYED
    if "direct" in paths:
        return DIRECT  # outbound-only: we dial, nobody can dial us
    return OFFLINE


def snapshot(transport: Any, relay: Any = None, reach: Any = None, holepuncher: Any = None,
             peers: list[str] | None = None) -> ReachSnapshot:
    """Collect a snapshot from running pieces (any may be None)."""
    from gossip.holepunch import best_path
    from gossip.webrtc import webrtc_unavailable

    s = ReachSnapshot(
        status=getattr(reach, "status", "unknown"),
        reason=getattr(reach, "reason", "reachability not checked yet"),
        observed_ips=list(getattr(reach, "observed_ips", [])),
        listen_addrs=transport.listen_addrs(),
        relay_service=bool(getattr(relay, "service", False)),
        relays_configured=[r for r in getattr(relay, "reservations", {})] + list(getattr(relay, "errors", {})),
        reservations=relay.circuit_addrs() if relay is not None else [],
        relay_errors=dict(getattr(relay, "errors", {})),
        peer_paths={p: best_path(transport, p) for p in (peers if peers is not None else transport.peers())},
        holepunch_attempts=getattr(holepuncher, "attempts", 0),
        holepunch_successes=getattr(holepuncher, "successes", 0),
        holepunch_error=getattr(holepuncher, "last_error", ""),
        webrtc_reason=webrtc_unavailable() or "",
    )
    s.path = classify(s)
    return s


def _port(s: ReachSnapshot) -> str:
    for a in s.listen_addrs:
        parts = a.split("/")
        if len(parts) > 4 and parts[3] == "tcp":
            return parts[4]
    return "4001"


def check_path(s: ReachSnapshot) -> Check:
    path = classify(s)
    n_direct = sum(1 for p in s.peer_paths.values() if p == "direct")
    n_relayed = sum(1 for p in s.peer_paths.values() if p == "relayed")
    detail = f"path: {path}; peers: {n_direct} direct, {n_relayed} relayed"
    if path == DIRECT and s.status == "public":
        return Check(name="reachability", ok=True, detail=f"{detail}; publicly reachable ({s.reason})")
    if path == DIRECT:
        return Check(name="reachability", ok=True,
                     detail=f"{detail}; outbound only: peers cannot dial this node ({s.reason})",
                     fix=f"forward TCP port {_port(s)} on your router to this machine, or list relays in network.relays")
    if path == HOLEPUNCHED:
        return Check(name="reachability", ok=True,
                     detail=f"{detail}; behind NAT, hole punching succeeded {s.holepunch_successes}x",
                     fix=f"optional: forward TCP port {_port(s)} to be directly reachable")
    if path == RELAYED:
        why = s.holepunch_error or "no hole punch attempted"
        return Check(name="reachability", ok=True,
                     detail=f"{detail}; behind NAT ({s.reason}); relayed through {len(s.reservations)} relay(s); "
                            f"hole punching: {why}",
                     fix=f"forward TCP port {_port(s)} on your router to this machine for direct, faster transfers "
                         "(relays cap bytes and seconds per circuit)")
    if path == WEBRTC:
        return Check(name="reachability", ok=True, detail=f"{detail}; using WebRTC")
    return Check(name="reachability", ok=False,
                 detail=f"no usable path: {s.reason}",
                 fix="add a reachable relay to network.relays, or forward TCP port " + _port(s))


def check_relays(s: ReachSnapshot) -> Check:
    if s.status == "public":
        if s.relay_service:
            return Check(name="relay", ok=True, detail="publicly reachable and relaying for NATed peers")
        return Check(name="relay", ok=True, detail="publicly reachable; relay service off",
                     fix="set network.relay_service = true to help NATed volunteers")
    if s.reservations:
        bad = "; ".join(f"{k}: {v}" for k, v in s.relay_errors.items())
        return Check(name="relay", ok=True, detail=f"{len(s.reservations)} reservation(s)" + (f"; failed: {bad}" if bad else ""))
    if not s.relays_configured and not s.relay_errors:
        return Check(name="relay", ok=s.status != "private", detail="no relays configured",
                     fix="list public relay nodes (full multiaddrs with /p2p/<id>) in network.relays")
    bad = "; ".join(f"{k}: {v}" for k, v in s.relay_errors.items())
    return Check(name="relay", ok=False, detail=f"no relay reservation: {bad}",
                 fix="check the addresses in network.relays, or add another relay")


def check_webrtc(s: ReachSnapshot) -> Check:
    if s.webrtc_reason:
        return Check(name="webrtc", ok=True, detail=f"WebRTC fallback unavailable: {s.webrtc_reason}",
                     fix="pip install 'murmur[webrtc]' (aiortc) to enable the WebRTC fallback")
    return Check(name="webrtc", ok=True, detail="WebRTC fallback available (aiortc installed)")


def reachability_checks(s: ReachSnapshot) -> list[Check]:
    return [check_path(s), check_relays(s), check_webrtc(s)]
