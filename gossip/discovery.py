"""Peer discovery: bootstrap multiaddrs, remembered peers, the Kademlia DHT; reconnect with backoff.

`Backoff` is the sans-IO part (exponential, jittered, reset on success);
`Discovery.run` is the trio loop that dials, records peers in the store
(`Store.see_peer`) and, when the DHT is on, feeds connected peers into the
routing table and dials what lookups find.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import trio

from murmur.gossip.host import ConnectError

log = logging.getLogger("murmur.gossip.discovery")


@dataclass
class _Slot:
    delay: float
    next_try: float = 0.0
    failures: int = 0


class Backoff:
    """When to redial each address: min_s after a failure, doubling to max_s, +-20% jitter."""

    def __init__(self, min_s: float = 0.5, max_s: float = 30.0, rng: random.Random | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.rng = rng or random.Random()
        self._slots: dict[str, _Slot] = {}

    def due(self, addr: str, now: float) -> bool:
        slot = self._slots.get(addr)
        return slot is None or now >= slot.next_try

    def failed(self, addr: str, now: float) -> float:
        slot = self._slots.setdefault(addr, _Slot(self.min_s))
        slot.failures += 1
        wait = slot.delay * self.rng.uniform(0.8, 1.2)
        slot.next_try = now + wait
        slot.delay = min(self.max_s, slot.delay * 2)
        return wait

    def succeeded(self, addr: str) -> None:
        self._slots.pop(addr, None)


def peer_of(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[1] if "/p2p/" in addr else ""


class Discovery:
    def __init__(
        self,
        transport: Any,
        bootstrap: list[str],
        store: Any | None = None,
        dht: bool = True,
        target_peers: int = 16,
        interval_s: float = 0.5,
        backoff: Backoff | None = None,
    ) -> None:
        self.transport = transport
        self.bootstrap = [a for a in bootstrap if a]
        self.store = store
        self.use_dht = dht
        self.target_peers = target_peers
        self.interval_s = interval_s
        self.backoff = backoff or Backoff()
        self.known: dict[str, list[str]] = {}  # peer id -> full multiaddrs to redial
        self.dht: Any = None
        self._recorded: set[str] = set()
        for a in self.bootstrap:
            self.known.setdefault(peer_of(a), []).append(a)

    def remember(self, peer_id: str, addrs: list[str]) -> None:
        full = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in addrs if "/ip4/0.0.0.0" not in a]
        if peer_id and peer_id != self.transport.peer_id and full:
            self.known[peer_id] = list(dict.fromkeys(self.known.get(peer_id, []) + full))[:8]

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.use_dht:
                await self._start_dht(nursery)
            task_status.started()
            while True:
                await self.tick(nursery)
                await trio.sleep(self.interval_s)

    async def tick(self, nursery: trio.Nursery) -> None:
        connected = set(self.transport.peers())
        for p in connected - self._recorded:
            addrs = self.transport.peer_addrs(p)
            self.remember(p, addrs)
            if self.store is not None:
                await trio.to_thread.run_sync(lambda p=p, a=addrs: self.store.see_peer(p, addrs=a, connected=True))
            if self.dht is not None:
                try:
                    from libp2p.peer.id import ID

                    await self.dht.add_peer(ID.from_base58(p), skip_server_mode_check=True)
                except Exception as e:
                    log.debug("dht add_peer %s: %s", p, e)
        self._recorded = connected
        if self.dht is not None:
            for info in list(self.dht.routing_table.get_peer_infos()):
                self.remember(info.peer_id.to_base58(), [str(a) for a in info.addrs])
        now = trio.current_time()
        want = [p for p in self.known if p not in connected and p != self.transport.peer_id]
        # bootstrap peers are always redialled; others only while we are below target
        for p in want:
            is_boot = any(peer_of(a) == p for a in self.bootstrap)
            if not is_boot and len(connected) >= self.target_peers:
                continue
            addr = self.known[p][0]
            if self.backoff.due(addr, now):
                self.backoff.failed(addr, now)  # pessimistic: reset on success
                nursery.start_soon(self._dial, addr)

    async def _dial(self, addr: str) -> None:
        try:
            with trio.fail_after(5):
                await self.transport.connect(addr)
        except (ConnectError, trio.TooSlowError) as e:
            log.debug("dial %s failed: %s", addr, e)
            return
        self.backoff.succeeded(addr)

    async def _start_dht(self, nursery: trio.Nursery) -> None:
        try:
            from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
            from libp2p.tools.anyio_service import background_trio_service

            self.dht = KadDHT(
                self.transport.host, DHTMode.SERVER, enable_random_walk=False, max_peers_per_subnet=1_000_000
            )
        except Exception as e:  # the DHT is an optimisation: bootstrap still works without it
            log.warning("DHT unavailable: %s", e)
            self.dht = None
            return

        async def _serve() -> None:
            async with background_trio_service(self.dht):
                delay = 1.0
                while True:
                    await trio.sleep(delay)
                    delay = min(30.0, delay * 2)
                    try:  # Kademlia self-lookup: asks known peers for the peers closest to us
                        with trio.move_on_after(10):
                            found = await self.dht.peer_routing.find_closest_peers_network(
                                self.dht.local_peer_id.to_bytes()
                            )
                        for pid in found or ():
                            addrs = [str(a) for a in self.transport.host.get_peerstore().addrs(pid)]
                            self.remember(pid.to_base58(), addrs)
                    except Exception as e:
                        log.debug("dht lookup: %s", e)

        nursery.start_soon(_serve)
