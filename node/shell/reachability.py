"""NAT reachability for a running node: dial-back, relay reservation, relayed dials, hole punching.

Why one place: the node runtime, `murmur doctor` (through the status it serves) and the emulated-network
benchmark all need the same order of steps (docs/reachability.md, "Node runtime wiring"):

1. attach the circuit relay (accept relayed connections; relay for others with `network.relay_service`),
   DCUtR, and serve `/murmur/dialback/1`;
2. once directly connected peers exist (bootstrap), ask them to dial us back: public / private / unknown;
3. if not public: reserve on `network.relays` (or, when that list is empty, on the bootstrap peers, which
   refuse unless they relay) and announce the circuit addresses;
4. for peers learned from announces that we are not connected to, by `dial_plan`: a peer that
   announces relay circuits is private by its own verdict, so its direct addresses are LAN addresses:
   one quick TCP try (same LAN), then the circuit; WebRTC-direct (`network.webrtc`) is only for peers
   announcing no circuit (public, or not yet decided), after their TCP addresses. Bootstrap peers that
   Discovery could not reach over TCP are dialled at their /webrtc-direct addresses (a UDP-only network).
   Only one side dials a circuit first (py-libp2p's relay keys circuits by peer: crossed relayed dials
   broke stream opening): never a public node (the NATed side can dial it directly), else the smaller
   peer id; the other side dials `CROSS_GRACE_S` after its own verdict if still unconnected. The side
   that dialled the circuit then tries DCUtR upgrades (bounded).

The verdict is re-checked every `RECHECK_S`; sooner (`recheck_after`) while unknown or while a private
verdict is not yet confirmed. `ReachState.view()` is the
`ReachView` the node serves in its status; `node.cli.doctor_reachability` turns it into checks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from murmur.gossip.discovery import Backoff
from murmur.gossip.errors import MurmurError
from murmur.node.config import Config
from murmur.node.status import ReachView

log = logging.getLogger("murmur.node.reach")

RECHECK_S = 600.0
RETRY_S = 30.0  # while unknown, and while a private verdict is not yet confirmed
CONFIRM_PRIVATE = 3  # private verdicts in a row before the long recheck
DIAL_EVERY_S = 1.0
CROSS_GRACE_S = 45.0  # after our own verdict: the other side of a pair had time to dial first
MAX_DIALS_PER_ROUND = 4
WEBRTC_DIAL_S = 10.0  # ICE + DTLS + Noise over a data channel; ~0.1-0.3 s on loopback, one in six stalls
TCP_DIAL_S = 3.0  # a public peer's TCP address: Noise + yamux under load
LAN_DIAL_S = 1.0  # a private peer's own (LAN) address: answers in milliseconds on the same LAN, or never
BOOTSTRAP_GRACE_S = 5.0  # Discovery dials bootstrap peers over TCP first; WebRTC-direct only if that failed
WEBRTC_AFTER_S = 30.0  # an announced peer without circuits this long after we first saw it is not a NATed one
# The WebRTC-direct listener (aiortc's import, the transport, UDP sockets: CPU and GIL time on the event loop's
# thread) starts after the first connection has had this long to bring up gossip, ...
WEBRTC_SETTLE_S = 1.0
# ... or this long after the host is ready when no peer connects (a UDP-only network, where TCP dials fail
# after TCP_DIAL_S: WebRTC is then up before the next dial round needs it).
WEBRTC_NO_PEER_S = 2.0


DIRECT, RELAYED, HOLEPUNCHED, WEBRTC, OFFLINE = "direct", "relayed", "hole-punched", "webrtc", "offline"


def classify(s: ReachView) -> str:
    """The node's main path: direct if peers can dial it; else hole-punched/webrtc/relayed by what it uses."""
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


def snapshot(
    transport: Any,
    relay: Any = None,
    reach: Any = None,
    holepuncher: Any = None,
    peers: list[str] | None = None,
    punched_passively: int = 0,
) -> ReachView:
    """Collect a view from running pieces (any may be None)."""
    from murmur.gossip.holepunch import best_path
    from murmur.gossip.webrtc import webrtc_unavailable

    reservations = relay.circuit_addrs() if relay is not None else []
    s = ReachView(
        status=getattr(reach, "status", "unknown"),
        reason=getattr(reach, "reason", "reachability not checked yet"),
        observed_ips=list(getattr(reach, "observed_ips", [])),
        port_preserved=getattr(reach, "port_preserved", None),
        listen_addrs=transport.listen_addrs(),
        relay_service=bool(getattr(relay, "service", False)),
        relaying=relay.active_circuits() if relay is not None else 0,
        relays_configured=list(getattr(relay, "configured", [])),
        reservations=reservations,
        relay_errors=dict(getattr(relay, "errors", {})),
        peer_paths={p: best_path(transport, p) for p in (peers if peers is not None else transport.peers())},
        holepunch_attempts=getattr(holepuncher, "attempts", 0),
        holepunch_successes=getattr(holepuncher, "successes", 0) + punched_passively,
        holepunch_error=getattr(holepuncher, "last_error", ""),
        webrtc_reason=webrtc_unavailable() or "",
    )
    s.path = classify(s)
    return s


@dataclass(frozen=True)
class Dial:
    """One step of a dial plan: how (tcp / webrtc / circuit), where, and for how long at most."""

    kind: str
    addr: str
    timeout_s: float


def dial_plan(peer: str, addrs: list[str], webrtc: bool) -> list[Dial]:
    """The order in which to try a peer's announced addresses; pure, so the rule is testable.

    Why: a peer that announces relay circuits has found out it is not publicly reachable (it reserves
    only then), so its direct addresses are private LAN addresses. Between two NATed homes they never
    answer, and WebRTC-direct (which needs the listener reachable on UDP) cannot work either; seconds
    spent there delayed the circuit and the hole punch behind it. Such a peer gets one short TCP try
    (peers on the same LAN answer at once) and then its circuits. A peer without circuits (public, or
    undecided) gets its TCP addresses, then - when our own WebRTC-direct is up - its /webrtc-direct ones.
    """
    from murmur.gossip.relay import is_circuit
    from murmur.gossip.webrtc import is_webrtc_addr

    def full(a: str) -> str:
        return a if "/p2p/" in a else f"{a}/p2p/{peer}"

    circuits = [a for a in addrs if is_circuit(a)]
    rtc = [full(a) for a in addrs if is_webrtc_addr(a) and not is_circuit(a)]
    tcp = [
        full(a)
        for a in addrs
        if not is_circuit(a) and not is_webrtc_addr(a) and "/ip4/0.0.0.0/" not in a and "/ip6/::/" not in a
    ]
    if circuits:
        return [Dial("tcp", a, LAN_DIAL_S) for a in tcp[:1]] + [Dial("circuit", a, 10.0) for a in circuits[:2]]
    return [Dial("tcp", a, TCP_DIAL_S) for a in tcp[:2]] + (
        [Dial("webrtc", a, WEBRTC_DIAL_S) for a in rtc[:2]] if webrtc else []
    )


MAX_UPGRADE_TRIES = 2
TARGET_PEERS = 16


def recheck_after(status: str, streak: int) -> float:
    """Seconds until the next dial-back check, after `streak` checks in a row gave `status`.

    Why a private verdict needs confirming: a dial-back that times out looks the same whether a NAT
    dropped it or a loaded peer (or we) answered late, and a public node that believed it was private
    would announce relay circuits and stay off the direct path until the long recheck. A public
    verdict is proof (a peer completed Noise with us as ourselves) and needs none.
    """
    if status == "public" or (status == "private" and streak >= CONFIRM_PRIVATE):
        return RECHECK_S
    return RETRY_S


def process_start() -> float:
    """Wall-clock time this process started (so startup costs, imports included, are measured honestly).

    From the kernel's start time (clock ticks since boot) against CLOCK_BOOTTIME, both on the same clock.
    Not psutil's `create_time()`: it adds the ticks to /proc/stat's `btime`, which is whole seconds,
    so it makes every process older than it is by the boot time's lost fraction (up to a second).
    """
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime; comm may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: no /proc, no CLOCK_BOOTTIME
        return time.time()


@dataclass
class ReachState:
    """Reachability of one running node. Fields are filled as the steps above complete."""

    transport: Any
    cfg: Config
    bootstrap: list[str]
    known: Callable[[], dict[str, list[str]]]  # peer id -> addresses it announced
    relay: Any = None
    holepuncher: Any = None
    reach: Any = None  # gossip.dialback.Reachability, once checked
    checked: trio.Event = field(default_factory=trio.Event)  # set after the first verdict
    started_unix: float = field(default_factory=process_start)
    host_ready_s: float | None = None
    first_peer_s: float | None = None
    first_peer: trio.Event = field(default_factory=trio.Event)  # set at the first connection
    circuit_dialled: set[str] = field(default_factory=set)  # peers we reached through a relay
    relayed_seen: set[str] = field(default_factory=set)  # peers we were ever relayed to
    upgrade_tries: dict[str, int] = field(default_factory=dict)
    backoff: Backoff = field(default_factory=lambda: Backoff(min_s=2.0, max_s=10.0))
    checked_at: float | None = None  # trio time of the first verdict
    streak: int = 0  # checks in a row that gave the current verdict
    auto_upgrade: bool = True  # try DCUtR after dialling a circuit (the benchmark times the relay first)
    first_seen: dict[str, float] = field(default_factory=dict)
    webrtc_addrs: list[str] = field(default_factory=list)  # our /webrtc-direct listen addresses, once up
    webrtc_error: str = ""  # why WebRTC-direct is off ("" while it is up or starting)
    webrtc_dialled: set[str] = field(default_factory=set)  # peers we reached over WebRTC-direct

    # ------------------------------------------------------------ views
    def public(self) -> bool:
        return getattr(self.reach, "status", "") == "public"

    def announce_addrs(self) -> list[str]:
        """What peers should dial: verified public addresses, then relay circuits, then listen addresses
        (reachable on the same LAN). Wildcard addresses are left out."""
        t = self.transport
        direct = [f"{a}/p2p/{t.peer_id}" for a in getattr(self.reach, "reachable_addrs", [])]
        circuits = self.relay.circuit_addrs() if self.relay is not None else []
        listen = [a for a in t.listen_addrs() if "/ip4/0.0.0.0/" not in a and "/ip6/::/" not in a]
        return list(dict.fromkeys(direct + circuits + listen))[:16]

    def punched(self) -> int:
        """Peers once relayed that are now directly connected: hole punches, whichever side drove them."""
        from murmur.gossip.holepunch import best_path

        return sum(1 for p in self.relayed_seen if best_path(self.transport, p) == "direct")

    def view(self) -> ReachView:
        hp = self.holepuncher
        own = getattr(hp, "successes", 0)
        v = snapshot(self.transport, self.relay, self.reach, hp, punched_passively=max(0, self.punched() - own))
        v.announce_addrs = self.announce_addrs()
        v.host_ready_s = self.host_ready_s
        v.first_peer_s = self.first_peer_s
        if self.relay is not None and not v.relays_configured:
            v.relays_configured = self._relay_candidates()
        if self.webrtc_error:
            v.webrtc_reason = self.webrtc_error
        if self.reach is None and "webrtc" in v.peer_paths.values() and "direct" not in v.peer_paths.values():
            v.reason = "not checked: peers reached over WebRTC-direct only (the dial-back needs a TCP peer)"
        return v

    def _relay_candidates(self) -> list[str]:
        return list(self.cfg.network.relays or [a for a in self.bootstrap if "/p2p/" in a])

    # ------------------------------------------------------------ steps
    def _direct_peers(self) -> list[str]:
        from murmur.gossip.holepunch import best_path

        return [p for p in self.transport.peers() if best_path(self.transport, p) == "direct"]

    async def check_once(self) -> None:
        from murmur.gossip.dialback import check_reachability

        peers = self._direct_peers()
        if not peers:
            return
        before = getattr(self.reach, "status", None)
        self.reach = await check_reachability(self.transport, peers)
        self.streak = self.streak + 1 if self.reach.status == before else 1
        log.info("reachability: %s (%s)", self.reach.status, self.reach.reason)
        if not self.public():
            want = [a for a in self._relay_candidates() if a not in self.relay.reservations]
            if want:
                got = await self.relay.reserve_all(want)
                log.info("relay reservations: %s; errors: %s", [r.circuit_addr for r in got], self.relay.errors)
        if self.checked_at is None:
            self.checked_at = trio.current_time()
        self.checked.set()

    async def check_loop(self) -> None:
        while True:
            # wait for a directly connected peer to ask (a node without bootstrap peers waits to be dialled);
            # the transport offers no connect event, so this polls, cheaply
            while not self._direct_peers():
                await trio.sleep(0.2)
            try:
                await self.check_once()
            except MurmurError as e:
                log.info("reachability check: %s", e)
            await trio.sleep(recheck_after(getattr(self.reach, "status", "unknown"), self.streak))

    def _should_dial_circuit(self, peer: str, now: float) -> bool:
        """One side per pair dials through the relay: a public node waits to be dialled directly; of two
        NATed nodes the smaller peer id dials. Either dials anyway once the other has not for a while."""
        since = max(self.first_seen.get(peer, now), self.checked_at if self.checked_at is not None else now)
        if now - since >= CROSS_GRACE_S:
            return True
        return not self.public() and self.transport.peer_id < peer

    async def start_webrtc(self) -> None:
        """Listen on UDP /webrtc-direct next to the TCP listen addresses (config `network.webrtc`, aiortc).

        In the background, and not while the first connection brings up gossip: the attach takes CPU and
        the event loop's thread (aiortc's import holds the GIL even on a worker thread) exactly when the
        first connection's handshakes, subscriptions and first message need them, so the first message
        would wait on a fallback path. WebRTC-direct is a fallback for peers that
        TCP cannot reach, so it starts `WEBRTC_SETTLE_S` after the first connection, or `WEBRTC_NO_PEER_S`
        after the host is ready if none comes (then TCP is what fails, and the fallback is needed)."""
        from murmur.gossip.webrtc import WebRTCUnavailable, attach_webrtc, webrtc_listen_for

        if not self.cfg.network.webrtc:
            self.webrtc_error = "disabled in config (network.webrtc = false)"
            return
        with trio.move_on_after(WEBRTC_NO_PEER_S) as waiting:
            await self.first_peer.wait()
        if not waiting.cancelled_caught:
            await trio.sleep(WEBRTC_SETTLE_S)
        try:
            self.webrtc_addrs = await attach_webrtc(self.transport, webrtc_listen_for(self.transport.listen_addrs()))
            log.info("listening on WebRTC-direct: %s", self.webrtc_addrs)
        except WebRTCUnavailable as e:
            self.webrtc_error = str(e)
            log.info("WebRTC-direct off: %s", e)

    async def _connect(self, peer: str, addrs: list[str]) -> None:
        """Walk `dial_plan`; a circuit only on the side that should dial it (`_should_dial_circuit`)."""
        now = trio.current_time()
        # A NATed peer announces its LAN addresses until its own verdict and reservation (seconds) add
        # circuits: WebRTC towards it is futile, and a failed attempt leaves its private /webrtc-direct
        # address in the peerstore, where later dials (relayed ones included) tried it again (seen with
        # two NATed homes: circuits timed out while ICE checks to the other home's LAN address ran).
        # So WebRTC-direct goes to bootstrap peers, and to announced peers still circuit-less after
        # WEBRTC_AFTER_S.
        from murmur.gossip.discovery import peer_of

        settled = now - self.first_seen.get(peer, now) >= WEBRTC_AFTER_S
        configured = any(peer_of(a) == peer for a in self.bootstrap)
        for d in dial_plan(peer, addrs, webrtc=bool(self.webrtc_addrs) and (settled or configured)):
            if peer in self.transport.peers():
                return
            if d.kind == "circuit":
                if not self._should_dial_circuit(peer, now):
                    return
                try:
                    await self.relay.dial(d.addr, timeout_s=d.timeout_s)
                    self.circuit_dialled.add(peer)
                    self.backoff.succeeded(peer)
                    log.info("connected to %s through a relay", peer)
                    return
                except MurmurError as e:
                    log.info("%s", e)
                continue
            try:
                with trio.move_on_after(d.timeout_s):
                    await self.transport.connect(d.addr)
                    if d.kind == "webrtc":
                        self.webrtc_dialled.add(peer)
                        log.info("connected to %s over WebRTC-direct", peer)
                    self.backoff.succeeded(peer)
                    return
            except MurmurError as e:
                if d.kind == "webrtc":
                    log.info("WebRTC-direct to %s: %s", peer, e)

    def _targets(self, now: float) -> dict[str, list[str]]:
        """Announced peers, plus bootstrap peers still unreached `BOOTSTRAP_GRACE_S` after we first
        wanted them, at their /webrtc-direct addresses only (Discovery owns their TCP dials)."""
        from murmur.gossip.discovery import peer_of
        from murmur.gossip.webrtc import is_webrtc_addr

        out = {p: list(a) for p, a in self.known().items()}
        boot: dict[str, list[str]] = {}
        for a in self.bootstrap:
            p = peer_of(a)
            if p and p not in out and is_webrtc_addr(a):
                boot.setdefault(p, []).append(a)
        for p, addrs in boot.items():
            if now - self.first_seen.setdefault(p, now) >= BOOTSTRAP_GRACE_S:
                out[p] = addrs
        return out

    async def upgrade(self, peer: str) -> None:
        from murmur.gossip.holepunch import HolePunchError

        self.upgrade_tries[peer] = self.upgrade_tries.get(peer, 0) + 1
        try:
            ok = await self.holepuncher.upgrade(peer, timeout_s=20.0)
            log.info("hole punch to %s: %s %s", peer, "direct" if ok else "failed", self.holepuncher.last_error)
        except HolePunchError as e:
            log.info("hole punch to %s: %s", peer, e)

    async def dial_loop(self) -> None:
        from murmur.gossip.holepunch import best_path

        async with trio.open_nursery() as n:
            busy: set[str] = set()

            async def one(peer: str, fn: Any, *args: Any) -> None:
                try:
                    await fn(*args)
                finally:
                    busy.discard(peer)

            while True:
                now = trio.current_time()
                connected = set(self.transport.peers())
                for p in connected:
                    if best_path(self.transport, p) == "relayed":
                        self.relayed_seen.add(p)
                        if (
                            self.auto_upgrade
                            and p in self.circuit_dialled
                            and p not in busy
                            and self.upgrade_tries.get(p, 0) < MAX_UPGRADE_TRIES
                        ):
                            busy.add(p)
                            n.start_soon(one, p, self.upgrade, p)
                started = 0
                for peer, addrs in list(self._targets(now).items()):
                    if peer == self.transport.peer_id or peer in connected or peer in busy:
                        continue
                    self.first_seen.setdefault(peer, now)
                    if len(connected) >= TARGET_PEERS or started >= MAX_DIALS_PER_ROUND:
                        break
                    if not self.backoff.due(peer, now):
                        continue
                    self.backoff.failed(peer, now)  # pessimistic: reset on success
                    busy.add(peer)
                    started += 1
                    n.start_soon(one, peer, self._connect, peer, list(addrs))
                await trio.sleep(DIAL_EVERY_S)


async def _serve(state: ReachState, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from murmur.gossip.dialback import DialbackServer
    from murmur.gossip.holepunch import attach_holepunch
    from murmur.gossip.relay import attach_relay

    t = state.transport
    async with attach_relay(t, state.cfg.network) as relay, attach_holepunch(t, auto=False) as hp:
        DialbackServer(t)
        state.relay, state.holepuncher = relay, hp
        state.host_ready_s = round(time.time() - state.started_unix, 3)
        task_status.started()
        async with trio.open_nursery() as n:
            n.start_soon(state.check_loop)
            n.start_soon(state.dial_loop)
            n.start_soon(state.start_webrtc)
            with trio.move_on_after(120):
                while not t.peers():
                    await trio.sleep(0.05)
                state.first_peer_s = round(time.time() - state.started_unix, 3)
                state.first_peer.set()


async def start_reachability(
    transport: Any,
    cfg: Config,
    nursery: trio.Nursery,
    bootstrap: list[str] | None = None,
    known: Callable[[], dict[str, list[str]]] | None = None,
) -> ReachState:
    """Attach relay, hole punching and dial-back to a running transport; run the checks in `nursery`.

    `known` returns the addresses peers announced (peer id -> multiaddrs, circuits included); the node
    passes its NodeAnnounce table. Returns at once (the services are attached); the verdict follows.
    """
    state = ReachState(transport, cfg, list(bootstrap or []), known or (dict))
    await nursery.start(_serve, state)
    return state
