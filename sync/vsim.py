"""Discrete-event, virtual-time driver for `sync.swarm.SwarmSession`.

It runs the very core the live nodes run, with links emulated instead of
sockets, so thousands of nodes fit in minutes of CPU. The model:
- each node has one upload link (bytes leave one frame at a time at
  `up_bps`, round-robin over the peers with queued requests, exactly as the
  live node's shared token bucket orders them) and optionally a download link
  (`down_bps`, 0 = unlimited) that serialises arriving chunk bytes;
- a frame arrives `latency_s` after its last byte leaves; control frames
  (have-maps, requests, cancels; < 1 KiB) skip the bandwidth queues;
- `loss` is the probability that a chunk frame suffers a TCP-style
  retransmission and arrives `rto_s` late (streams are reliable, so loss is
  delay, not a lost frame);
- a killed node's neighbours learn it left one latency later and frames in
  flight to or from it vanish; a restarted node comes back with the chunks it
  had verified (they were persisted) and reconnects to its neighbours;
- chunk payloads are 32-byte tokens (the chunk hash) whose declared size is
  what the links are charged for, so no real hashing runs: the session's
  `check` compares the token with the manifest hash, and a corrupt node sends
  a wrong token, which the receiving session treats exactly like a bad hash.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from msgspec import Struct

from sync.swarm import (Ban, Chunk, Completed, Penalise, Send, ServeReady, SwarmConfig, SwarmSession,
                        Verified)

_BAD = b"\xff" * 32


class SimLink(Struct, kw_only=True, frozen=True):
    up_bps: float = 2 * 2**20
    down_bps: float = 0.0  # 0 = unlimited
    latency_s: float = 0.005  # one way
    loss: float = 0.0
    rto_s: float = 0.2


@dataclass
class _Node:
    id: int
    link: SimLink
    session: SwarmSession
    alive: bool = True
    inc: int = 0
    uploading: bool = False
    down_free: float = 0.0
    ready: deque[int] = field(default_factory=deque)
    ready_set: set[int] = field(default_factory=set)
    chunks: dict[int, bytes] = field(default_factory=dict)
    corrupt: bool = False
    completed_at: float | None = None
    bytes_out: int = 0
    penalties: dict[int, float] = field(default_factory=dict)
    banned: set[int] = field(default_factory=set)


def _check(expected: bytes, size: int, data: bytes) -> bool:
    return data == expected


class VirtualSwarm:
    """One origin (node 0) broadcasting one patch to `followers` nodes (1..N) in virtual time."""

    def __init__(
        self,
        followers: int,
        sizes: list[int],
        *,
        link: SimLink | None = None,
        links: dict[int, SimLink] | None = None,
        degree: int | None = None,
        config: SwarmConfig | None = None,
        seed: int = 0,
        tick_s: float = 0.25,
    ) -> None:
        self.n = followers
        self.sizes = sizes
        self.rng = random.Random(seed)
        self.cfg = config or SwarmConfig()
        self.tick_s = tick_s
        self.hashes = [self.rng.randbytes(32) for _ in sizes]
        self.pid = self.rng.randbytes(32)
        base = link or SimLink()
        links = links or {}
        self.adj = self._topology(followers + 1, degree)
        self.nodes = [
            _Node(i, links.get(i, base), self._session(i, have=range(len(sizes)) if i == 0 else ()))
            for i in range(followers + 1)
        ]
        self.nodes[0].chunks = dict(enumerate(self.hashes))
        self._heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0
        self._waiting = followers  # alive followers not yet complete: O(1) end test (an O(N) scan per event is quadratic)

    def _session(self, i: int, have: Any) -> SwarmSession:
        return SwarmSession(self.pid, self.hashes, self.sizes, have=have, origin=(i == 0), config=self.cfg,
                            now=self.now if hasattr(self, "now") else 0.0, seed=self.rng.randrange(2**32),
                            check=_check)

    def _topology(self, n: int, degree: int | None) -> list[set[int]]:
        adj: list[set[int]] = [set() for _ in range(n)]
        if degree is None or degree >= n - 1:
            for i in range(n):
                adj[i] = set(range(n)) - {i}
            return adj
        order = list(range(n))
        self.rng.shuffle(order)
        for a, b in zip(order, order[1:] + order[:1]):  # a ring keeps the graph connected
            adj[a].add(b)
            adj[b].add(a)
        for i in range(n):
            while len(adj[i]) < degree:
                j = self.rng.randrange(n)
                if j != i:
                    adj[i].add(j)
                    adj[j].add(i)
        return adj

    # ------------------------------------------------------------ scenario

    def kill(self, node: int, at: float) -> None:
        self._push(at, "kill", (node,))

    def restart(self, node: int, at: float, down_s: float = 0.5) -> None:
        self._push(at, "kill", (node,))
        self._push(at + down_s, "revive", (node,))

    def make_corrupt(self, node: int) -> None:
        self.nodes[node].corrupt = True

    # ------------------------------------------------------------ engine

    def _push(self, t: float, kind: str, args: tuple[Any, ...]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, args))

    def run(self, until_s: float = 600.0, max_events: int = 50_000_000) -> dict[str, Any]:
        wall = time.perf_counter()
        for i in range(len(self.nodes)):
            for j in self.adj[i]:
                if i < j:
                    self._push(self.nodes[i].link.latency_s, "connect", (i, j))
        for i in range(len(self.nodes)):
            self._push(self.tick_s * (1 + self.rng.random()), "tick", (i,))
        while self._heap and self.events < max_events:
            t, _, kind, args = heapq.heappop(self._heap)
            if t > until_s:
                break
            self.now = t
            self.events += 1
            getattr(self, "_ev_" + kind)(*args)
            if kind in ("deliver", "kill") and self._all_done():
                break
        return self.result(time.perf_counter() - wall)

    def _all_done(self) -> bool:
        return self._waiting == 0

    def _completed(self, nd: _Node) -> None:
        if nd.completed_at is None:
            nd.completed_at = self.now
            if nd.id != 0 and nd.alive:
                self._waiting -= 1

    def _ev_connect(self, i: int, j: int) -> None:
        a, b = self.nodes[i], self.nodes[j]
        if a.alive and b.alive:
            self._apply(a, a.session.peer_joined(j, self.now))
            self._apply(b, b.session.peer_joined(i, self.now))

    def _ev_tick(self, i: int) -> None:
        nd = self.nodes[i]
        if nd.alive:
            self._apply(nd, nd.session.tick(self.now))
        if not self._all_done():
            self._push(self.now + self.tick_s, "tick", (i,))

    def _ev_kill(self, i: int) -> None:
        nd = self.nodes[i]
        if not nd.alive:
            return
        nd.alive = False
        nd.inc += 1
        if i != 0 and nd.completed_at is None:
            self._waiting -= 1
        for j in self.adj[i]:
            self._push(self.now + nd.link.latency_s, "left", (j, i))

    def _ev_left(self, j: int, i: int) -> None:
        nd = self.nodes[j]
        if nd.alive:
            self._apply(nd, nd.session.peer_left(i, self.now))

    def _ev_revive(self, i: int) -> None:
        nd = self.nodes[i]
        if not nd.alive and i != 0 and nd.completed_at is None:
            self._waiting += 1
        nd.alive = True
        nd.inc += 1
        nd.uploading = False
        nd.ready.clear()
        nd.ready_set.clear()
        nd.session = self._session(i, have=list(nd.chunks))  # resume from the persisted have-set
        if nd.session.complete:
            self._completed(nd)
        for j in self.adj[i]:
            self._push(self.now + nd.link.latency_s, "connect", (i, j))

    def _ev_deliver(self, dst: int, src: int, frame: Any, dst_inc: int, src_inc: int) -> None:
        d, s = self.nodes[dst], self.nodes[src]
        if not d.alive or d.inc != dst_inc or s.inc != src_inc or src in d.banned:
            return
        self._apply(d, d.session.on_frame(src, frame, self.now))

    def _ev_upload_done(self, i: int, inc: int) -> None:
        nd = self.nodes[i]
        if nd.inc == inc and nd.alive:
            nd.uploading = False
            self._pump(nd)

    def _apply(self, nd: _Node, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                peer = self.nodes[a.peer]
                if peer.alive:
                    self._push(self.now + nd.link.latency_s, "deliver", (a.peer, nd.id, a.frame, peer.inc, nd.inc))
            elif isinstance(a, ServeReady):
                if a.peer not in nd.ready_set:
                    nd.ready.append(a.peer)
                    nd.ready_set.add(a.peer)
                self._pump(nd)
            elif isinstance(a, Verified):
                nd.chunks[a.index] = a.data
            elif isinstance(a, Completed):
                self._completed(nd)
            elif isinstance(a, Penalise):
                nd.penalties[a.peer] = nd.penalties.get(a.peer, 0.0) + a.amount
            elif isinstance(a, Ban):
                nd.banned.add(a.peer)

    def _pump(self, nd: _Node) -> None:
        """Start the next upload if the node's link is idle (round-robin over ready peers)."""
        if nd.uploading or not nd.alive:
            return
        while nd.ready:
            peer = nd.ready.popleft()
            nd.ready_set.discard(peer)
            idx, acts = nd.session.take_upload(peer, self.now)
            if nd.session.has_pending(peer):
                nd.ready.append(peer)
                nd.ready_set.add(peer)
            self._apply(nd, acts)
            if idx is None:
                continue
            dst = self.nodes[peer]
            size = self.sizes[idx]
            end = self.now + size / nd.link.up_bps
            nd.bytes_out += size
            nd.uploading = True
            self._push(end, "upload_done", (nd.id, nd.inc))
            if not dst.alive:
                return
            arrive = end + nd.link.latency_s
            if dst.link.down_bps > 0:
                dst.down_free = max(dst.down_free, self.now + nd.link.latency_s) + size / dst.link.down_bps
                arrive = max(arrive, dst.down_free)
            if nd.link.loss and self.rng.random() < nd.link.loss:
                arrive += nd.link.rto_s
            data = _BAD if nd.corrupt else nd.chunks[idx]
            self._push(arrive, "deliver", (peer, nd.id, Chunk(self.pid, idx, data), dst.inc, nd.inc))
            return

    # ------------------------------------------------------------ results

    def result(self, wall_s: float) -> dict[str, Any]:
        followers = self.nodes[1:]
        alive = [nd for nd in followers if nd.alive]
        times = sorted(nd.completed_at for nd in alive if nd.completed_at is not None)
        ok = all(nd.corrupt or (len(nd.chunks) == len(self.sizes)
                                and all(nd.chunks[i] == h for i, h in enumerate(self.hashes)))
                 for nd in alive)
        return {
            "completed": len(times),
            "alive": len(alive),
            "completion_s_p50": times[len(times) // 2] if times else math.inf,
            "completion_s_max": times[-1] if times and len(times) == len(alive) else math.inf,
            "origin_bytes_out": self.nodes[0].bytes_out,
            "all_hashes_match": ok and len(times) == len(alive),
            "events": self.events,
            "sim_wall_s": wall_s,
        }
