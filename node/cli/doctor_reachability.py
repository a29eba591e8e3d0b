"""Doctor checks for reachability: which path this node uses (direct / hole-punched / relayed / webrtc),
why, and what the user can change (port forwarding, a relay list).

Why separate from node/cli/doctor.py: the checks are pure functions over a `ReachView` (node.status), the
same struct a running node serves in `murmur node status`, so they are testable without a network.
`doctor_check(ctx)` is what `murmur doctor` runs: it reads a running node's view over the control
socket, or else starts a short-lived host, dials the bootstrap peers, asks them for a dial-back and
tries a relay reservation, then reports.
"""

from __future__ import annotations

import time
from typing import Any

from murmur.node.cli.doctor import Check
from murmur.node.shell.reachability import DIRECT, HOLEPUNCHED, RELAYED, WEBRTC, classify, snapshot
from murmur.node.status import ReachView

ReachSnapshot = ReachView  # the snapshot type is the status struct: one shape for status and doctor


def _port(s: ReachView) -> str:
    for a in s.listen_addrs:
        parts = a.split("/")
        if len(parts) > 4 and parts[3] == "tcp" and parts[4] != "0":
            return parts[4]
    return "4001"


def _nat_kind(s: ReachView) -> str:
    if s.port_preserved is False:
        return "; the NAT changes source ports (symmetric-like): hole punching cannot predict the port"
    if s.port_preserved:
        return "; the NAT keeps source ports: hole punching can work"
    return ""


def check_path(s: ReachView) -> Check:
    path = classify(s)
    n_direct = sum(1 for p in s.peer_paths.values() if p == "direct")
    n_relayed = sum(1 for p in s.peer_paths.values() if p == "relayed")
    n_webrtc = sum(1 for p in s.peer_paths.values() if p == "webrtc")
    detail = f"path: {path}; peers: {n_direct} direct, {n_relayed} relayed" + (
        f", {n_webrtc} webrtc" if n_webrtc else ""
    )
    fwd = f"forward TCP port {_port(s)} on your router to this machine"
    if path == DIRECT and s.status == "public":
        return Check(name="reachability", ok=True, detail=f"{detail}; publicly reachable ({s.reason})")
    if path == DIRECT:
        return Check(
            name="reachability",
            ok=True,
            severity="warning",
            detail=f"{detail}; outbound only: peers cannot dial this node ({s.reason})",
            fix=f"{fwd}, or list relays in network.relays",
        )
    if path == HOLEPUNCHED:
        return Check(
            name="reachability",
            ok=True,
            detail=f"{detail}; behind NAT, hole punching succeeded {s.holepunch_successes}x{_nat_kind(s)}",
            fix=f"optional: {fwd} to be directly reachable without relays",
        )
    if path == RELAYED:
        why = s.holepunch_error or ("no NATed peer to punch to yet" if not s.holepunch_attempts else "failed")
        return Check(
            name="reachability",
            ok=True,
            severity="warning",
            detail=f"{detail}; behind NAT ({s.reason}); relayed through {len(s.reservations)} relay(s)"
            f"{_nat_kind(s)}; hole punching: {why}",
            fix=f"{fwd} for direct, faster transfers (relays cap bytes and seconds per circuit)",
        )
    if path == WEBRTC:
        # reached when TCP to the peer did not connect (a filter on the way) but UDP did
        return Check(
            name="reachability",
            ok=True,
            severity="warning",
            detail=f"{detail}; using WebRTC-direct (UDP): TCP to those peers did not connect ({s.reason})",
            fix="allow outbound TCP (WebRTC-direct is slower and cannot reach NATed peers), "
            f"or list relays in network.relays; {fwd} to be reachable",
        )
    return Check(
        name="reachability",
        ok=False,
        severity="warning",
        detail=f"no usable path: {s.reason}",
        fix=f"add a reachable relay to network.relays, or {fwd}",
    )


def check_relays(s: ReachView) -> Check:
    if s.status == "public":
        if s.relay_service:
            return Check(
                name="relay",
                ok=True,
                detail=f"publicly reachable and relaying for NATed peers ({s.relaying} circuit(s) now)",
            )
        return Check(
            name="relay",
            ok=True,
            detail="publicly reachable; relay service off",
            fix="set network.relay_service = true to help NATed volunteers",
        )
    bad = "; ".join(f"{k}: {v}" for k, v in s.relay_errors.items())
    if s.reservations:
        return Check(
            name="relay", ok=True, detail=f"{len(s.reservations)} reservation(s)" + (f"; failed: {bad}" if bad else "")
        )
    if not s.relays_configured:
        return Check(
            name="relay",
            ok=s.status != "private",
            severity="warning",
            detail="no relays configured (and no bootstrap peer to try)",
            fix="list public relay nodes (full multiaddrs with /p2p/<id>) in network.relays",
        )
    return Check(
        name="relay",
        ok=s.status != "private",
        severity="warning",
        detail=f"no relay reservation: {bad or 'not attempted yet'}",
        fix="check the addresses in network.relays (the relay needs network.relay_service = true), "
        "or add another relay",
    )


def check_webrtc(s: ReachView) -> Check:
    if s.webrtc_reason:
        return Check(
            name="webrtc",
            ok=True,
            severity="warning",
            detail=f"WebRTC fallback unavailable: {s.webrtc_reason}",
            fix="aiortc is a default dependency of murmur-swarm: rerun `bash install.sh` (or .venv/bin/pip install -e .)",
        )
    return Check(name="webrtc", ok=True, detail="WebRTC fallback available (aiortc installed)")


def reachability_checks(s: ReachView) -> list[Check]:
    return [check_path(s), check_relays(s), check_webrtc(s)]


# ---------------------------------------------------------------- `murmur doctor`
def doctor_check(ctx: Any) -> list[Check]:
    """The doctor's reachability checks (ctx: node.cli.doctor.Context); bounded by ~4x the dial timeout + 20 s.

    A running node on this home knows best: its live view is reported. Otherwise, with bootstrap peers,
    a short-lived host asks them to dial back; without any, the doctor's local heuristic is used.
    """
    from murmur.node.cli.doctor import check_reachability as local_guess
    from murmur.node.shell import control

    try:
        st = control.status(ctx.home, ctx.cfg.metrics.control_socket, min(2.0, ctx.timeout_s))
        checks = reachability_checks(st.reach)
        checks[0].detail = f"running node: {checks[0].detail}"
        return checks
    except Exception:  # no node running here (ControlError) or an old one: probe ourselves
        pass
    boot = [a for a in ctx.bootstrap if "/p2p/" in a]
    if not boot:
        return local_guess(ctx)
    import trio

    view = trio.run(probe, ctx.cfg, boot, ctx.timeout_s)
    return reachability_checks(view)


def _free(addr: str) -> bool:
    import socket

    parts = addr.split("/")
    if len(parts) < 5 or parts[1] != "ip4" or parts[3] != "tcp":
        return False
    s = socket.socket()
    try:
        s.bind((parts[2], int(parts[4])))
        return True
    except (OSError, ValueError):
        return False
    finally:
        s.close()


async def probe(cfg: Any, bootstrap: list[str], timeout_s: float = 5.0) -> ReachView:
    """One-shot: a throwaway-key host on the configured listen port (so port forwarding is what gets
    tested), connected to `bootstrap`, dial-back checked; if not public, a relay reservation is tried
    on network.relays (or the bootstrap peers). The host is closed on return."""
    import os

    import trio

    from murmur.gossip.dialback import DialbackServer, check_reachability
    from murmur.gossip.host import open_transport
    from murmur.gossip.identity import Identity
    from murmur.gossip.relay import attach_relay

    listen = [a for a in cfg.network.listen if _free(a)] or ["/ip4/0.0.0.0/tcp/0"]
    t0 = time.monotonic()
    reach = None
    async with (
        open_transport(Identity.from_seed(os.urandom(32)), listen, dial_timeout_s=timeout_s) as t,
        attach_relay(t, cfg.network) as relay,
    ):
        DialbackServer(t)

        async def dial(a: str) -> None:
            with trio.move_on_after(timeout_s + 1):
                try:
                    await t.connect(a)
                except Exception:
                    pass  # check_bootstrap reports unreachable bootstrap peers

        async with trio.open_nursery() as n:
            for a in bootstrap[:8]:
                n.start_soon(dial, a)
        if t.peers():
            reach = await check_reachability(t, t.peers(), timeout_s=timeout_s * 3 + 5)
            if reach.status != "public":
                await relay.reserve_all(list(cfg.network.relays or bootstrap), timeout_s=timeout_s * 2)
        view = snapshot(t, relay, reach)
        if reach is None:
            view.reason = f"no bootstrap peer answered within {time.monotonic() - t0:.0f} s"
    return view
