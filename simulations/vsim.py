"""Discrete-event, virtual-time driver for the node's broadcast core, `sync.transfers.BroadcastCore`.

Every simulated node runs its own `BroadcastCore`, the object
`sync.broadcast.BroadcastNode` drives on a live node, fed the same events and
carrying out the same actions; only the links and the clock are emulated
(instead of streams and trio), so thousands of nodes fit in minutes of CPU.
So the transfer table, manifest requests, node-wide bans, the upload
round-robin across patches and peers, and the pacing of uploads by the
node's token bucket (`network.upload_bytes_per_s`, set to the node's link
rate) are the node's code, as are the per-patch `sync.swarm.SwarmSession`s
inside the core (rarest-first, super-seeding, pipelining, stalls).

The origin (node 0) publishes `patches` real signed patches
(`gossip.wire.PatchManifest`, random chunk bytes), `patch_interval_s` apart;
patches in flight at once share each node's links and upload bucket. The
driver does what the live shell does:
- a published manifest reaches every live node one latency (the origin's)
  after it is published, as the gossip on the announce topic would (one hop);
  with `gossip_manifests=False` nodes learn it only over the chunk streams
  (a peer's `Have` for an unknown patch id -> `ManifestRequest` -> `Manifest`);
- `Load` is answered at once with `follow(pid, held)`, `held` being the chunks
  this node persisted (`Stored`) for that patch;
- each peer has a writer: a `ServeReady` wakes it, it asks `next_upload`,
  waits until the slot's time, calls `take_upload` and hands the chunk to the
  link (the write returns at once, as a socket write into its buffer does),
  then asks again; `Disconnect` closes the connection (the peer's core sees
  `peer_gone` one latency later, and neither reconnects);
- `tick` runs every `tick_s` while the core says it is `ticking` (re-armed by
  `Wake`), as the live ticker does.

The links: each node has one upload link (bytes leave one frame at a time at
`up_bps`, in the order the writers hand them over) and optionally a download
link (`down_bps`, 0 = unlimited) that serialises arriving chunk bytes; a frame
arrives `latency_s` after its last byte leaves; control frames (have-maps,
requests, cancels, manifests) skip the bandwidth queues; `loss` is the
probability that a chunk frame suffers a TCP-style retransmission and arrives
`rto_s` late (streams are reliable, so loss is delay, not a lost frame). A
killed node's neighbours learn it left one latency later and frames in flight
to or from it vanish; a restarted node comes back with a fresh core, is
offered the manifests it had (as a restarted node hears them again), resumes
from the chunks it had persisted, and reconnects to its neighbours. Chunk
payloads are real bytes shared between nodes (no copies), so every receiver
checks each chunk against its manifest's blake2b hash as a live node does (the
hash of each distinct payload computed once per swarm); a corrupt node sends
32 wrong bytes in place of a chunk (the link is charged the chunk's size),
which every receiver's session rejects like any bad chunk.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from msgspec import Struct

from murmur.gossip.identity import Identity
from murmur.gossip.wire import DEFAULT_SWARM, FORMAT_VERSION, PATCH_MANIFEST, PatchManifest, content_id, seal
from murmur.sync.chunks import refs
from murmur.sync.swarm import Chunk, Penalise, Send, ServeReady, SwarmConfig, SwarmSession, chunk_hash
from murmur.sync.transfers import Action, BroadcastCore, Complete, Disconnect, Load, Stored, UploadSlot, Wake

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
    core: BroadcastCore
    alive: bool = True
    inc: int = 0
    up_free: float = 0.0  # when the upload link has sent what it was handed
    down_free: float = 0.0
    writing: set[int] = field(default_factory=set)  # peers whose writer holds a slot
    ticking: bool = False  # a tick is scheduled
    envelopes: dict[bytes, bytes] = field(default_factory=dict)  # manifests this node followed, by patch id
    store: dict[bytes, dict[int, bytes]] = field(default_factory=dict)  # persisted chunks, by patch id
    done: dict[bytes, float] = field(default_factory=dict)  # patch id -> when it completed here
    corrupt: bool = False
    completed_at: float | None = None  # every patch complete
    bytes_out: int = 0
    penalties: dict[int, float] = field(default_factory=dict)

    @property
    def banned(self) -> set[int]:
        return self.core.banned  # type: ignore[return-value]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys

    @property
    def first(self) -> bytes | None:
        return next(iter(self.envelopes), None)

    @property
    def chunks(self) -> dict[int, bytes]:
        """The persisted chunks of the first patch."""
        pid = self.first
        return self.store.get(pid, {}) if pid is not None else {}

    @property
    def session(self) -> SwarmSession:
        """The core's session of the first patch."""
        return self.core.transfers[self.first].session  # type: ignore[index]  # asked only once a patch was added


class VirtualSwarm:
    """One origin (node 0) broadcasting `patches` patches of chunk sizes `sizes` to `followers` nodes (1..N)."""

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
        patches: int = 1,
        patch_interval_s: float = 0.0,
        gossip_manifests: bool = True,
        swarm: str = DEFAULT_SWARM,
    ) -> None:
        if patches < 1 or not sizes or min(sizes) < 1:
            raise ValueError("need at least one patch of at least one non-empty chunk")
        self.n = followers
        self.sizes = sizes
        self.rng = random.Random(seed)
        self.swarm = swarm  # the swarm the manifests are signed for and every core accepts
        self.cfg = config or SwarmConfig()
        self.tick_s = tick_s
        self.gossip_manifests = gossip_manifests
        self.identity = Identity.from_seed(self.rng.randbytes(32))
        self._hashes: dict[bytes, bytes] = {}  # chunk payload -> its blake2b (see `_check`)
        self.patches: list[tuple[bytes, bytes, list[bytes]]] = []  # (pid, envelope, chunks)
        for k in range(patches):
            self.patches.append(self._make_patch(k + 1))
        self.publish_at = [k * patch_interval_s for k in range(patches)]
        base = link or SimLink()
        links = links or {}
        self.adj = self._topology(followers + 1, degree)
        self.now = 0.0
        self.nodes = [_Node(i, links.get(i, base), self._core(links.get(i, base))) for i in range(followers + 1)]
        self._heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self._waiting = (
            followers  # alive followers not yet complete: O(1) end test (an O(N) scan per event is quadratic)
        )

    @property
    def pid(self) -> bytes:
        return self.patches[0][0]

    def _make_patch(self, version: int) -> tuple[bytes, bytes, list[bytes]]:
        chunks = [self.rng.randbytes(s) for s in self.sizes]
        me = self.identity.public
        m = PatchManifest(
            v=FORMAT_VERSION,
            lineage=hashlib.blake2b(b"vsim" + me, digest_size=32).digest(),
            lineage_name="vsim",
            base_model_hash=b"\0" * 32,
            publisher=me,
            base_version=version - 1,
            target_version=version,
            base_hash=b"\1" * 32,
            target_hash=self.rng.randbytes(32),
            codec="sparse-v1",
            total_bytes=sum(self.sizes),
            chunk_bytes=max(self.sizes),
            chunks=refs(chunks),
            created_ms=0,
        )
        env = seal(self.identity, PATCH_MANIFEST, m, swarm=self.swarm)
        return content_id(env), env, chunks

    def _core(self, link: SimLink) -> BroadcastCore:
        return BroadcastCore(
            self.cfg,
            swarm=self.swarm,
            upload_bytes_per_s=link.up_bps,
            seed=self.rng.randrange(2**32),
            now=self.now,
            check=self._check,
        )

    def _check(self, expected: bytes, size: int, data: bytes) -> bool:
        """A session's chunk check (`sync.swarm`'s: size, then blake2b against the manifest), with each distinct
        payload hashed once per swarm: payloads are shared bytes objects and the hash is a function of them."""
        if len(data) != size:
            return False
        h = self._hashes.get(data)
        if h is None:
            h = self._hashes[data] = chunk_hash(data)
        return h == expected

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
        for k, at in enumerate(self.publish_at):
            self._push(at, "publish", (k,))
        for i in range(len(self.nodes)):
            for j in self.adj[i]:
                if i < j:
                    self._push(self.nodes[i].link.latency_s, "connect", (i, j))
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
        return self._waiting == 0 and len(self.nodes[0].envelopes) == len(self.patches)

    def _completed(self, nd: _Node, pid: bytes) -> None:
        nd.done.setdefault(pid, self.now)
        if nd.completed_at is None and len(nd.done) == len(self.patches):
            nd.completed_at = self.now
            if nd.id != 0 and nd.alive:
                self._waiting -= 1

    def _ev_publish(self, k: int) -> None:
        nd = self.nodes[0]
        pid, env, chunks = self.patches[k]
        nd.envelopes[pid] = env
        nd.store[pid] = dict(enumerate(chunks))
        if not nd.alive:
            return
        _, acts = nd.core.publish(env, chunks, self.now, self.now)
        self._apply(nd, acts)
        self._completed(nd, pid)
        if self.gossip_manifests:
            for j in range(1, len(self.nodes)):
                self._push(self.now + nd.link.latency_s, "gossip", (j, k))

    def _ev_gossip(self, j: int, k: int) -> None:
        nd = self.nodes[j]
        if nd.alive:
            self._apply(nd, nd.core.offer(self.patches[k][1], self.now))

    def _ev_connect(self, i: int, j: int) -> None:
        a, b = self.nodes[i], self.nodes[j]
        if a.alive and b.alive and j not in a.core.banned and i not in b.core.banned:
            self._apply(a, a.core.peer_connected(j, self.now))  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
            self._apply(b, b.core.peer_connected(i, self.now))  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys

    def _ev_tick(self, i: int, inc: int) -> None:
        nd = self.nodes[i]
        if nd.inc != inc or not nd.alive:
            return
        self._apply(nd, nd.core.tick(self.now))
        if nd.core.ticking and not self._all_done():
            self._push(self.now + self.tick_s, "tick", (i, nd.inc))
        else:
            nd.ticking = False  # asleep until the core's next Wake

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
            self._apply(nd, nd.core.peer_gone(i, self.now))  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys

    def _ev_revive(self, i: int) -> None:
        nd = self.nodes[i]
        if not nd.alive and i != 0 and nd.completed_at is None:
            self._waiting += 1
        nd.alive = True
        nd.inc += 1
        nd.writing.clear()
        nd.ticking = False
        nd.up_free = nd.down_free = self.now
        nd.core = self._core(nd.link)  # a restarted process: nothing in memory survives
        for pid, env in nd.envelopes.items():
            if i == 0:
                self._apply(nd, nd.core.publish(env, self.patches[self._index(pid)][2], self.now, self.now)[1])
            else:
                self._apply(nd, nd.core.offer(env, self.now))  # -> Load -> follow from the persisted chunks
        for j in self.adj[i]:
            self._push(self.now + nd.link.latency_s, "connect", (i, j))

    def _index(self, pid: bytes) -> int:
        return next(k for k, p in enumerate(self.patches) if p[0] == pid)

    def _ev_deliver(self, dst: int, src: int, frame: Any, dst_inc: int, src_inc: int) -> None:
        d, s = self.nodes[dst], self.nodes[src]
        if not d.alive or d.inc != dst_inc or s.inc != src_inc or src in d.core.banned:
            return
        self._apply(d, d.core.on_frame(src, frame, self.now))  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys

    def _apply(self, nd: _Node, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                peer = self.nodes[a.peer]  # type: ignore[call-overload]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
                if peer.alive:
                    self._push(self.now + nd.link.latency_s, "deliver", (a.peer, nd.id, a.frame, peer.inc, nd.inc))
            elif isinstance(a, ServeReady):
                self._write(nd, a.peer)  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
            elif isinstance(a, Stored):
                nd.store.setdefault(a.pid, {})[a.index] = a.data
            elif isinstance(a, Complete):
                self._completed(nd, a.pid)
            elif isinstance(a, Penalise):
                nd.penalties[a.peer] = nd.penalties.get(a.peer, 0.0) + a.amount  # type: ignore[call-overload,index]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
            elif isinstance(a, Disconnect):
                for x, y in ((nd.id, a.peer), (a.peer, nd.id)):  # both ends see the connection go
                    self._push(self.now + nd.link.latency_s, "left", (x, y))
            elif isinstance(a, Load):
                nd.envelopes.setdefault(a.pid, self.patches[self._index(a.pid)][1])
                self._apply(nd, nd.core.follow(a.pid, nd.store.get(a.pid, {}), self.now, self.now))
            elif isinstance(a, Wake):
                if not nd.ticking:
                    nd.ticking = True
                    self._push(self.now + self.tick_s, "tick", (nd.id, nd.inc))
            # Added, Evicted: nothing waits on transfers here, and persisted chunks stay (as on disk)

    # ------------------------------------------------------------ uploads (the per-peer writers)

    def _write(self, nd: _Node, peer: int) -> None:
        """The peer's writer, woken: take the next slot the core schedules, unless it holds one."""
        if peer in nd.writing or not nd.alive:
            return
        slot = nd.core.next_upload(peer, self.now)  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
        if slot is None:
            return
        nd.writing.add(peer)
        self._push(slot.at, "slot", (nd.id, nd.inc, peer, slot))

    def _ev_slot(self, i: int, inc: int, peer: int, slot: UploadSlot) -> None:
        nd = self.nodes[i]
        if nd.inc != inc or not nd.alive:
            return
        nd.writing.discard(peer)
        chunk, acts = nd.core.take_upload(peer, slot, self.now)  # type: ignore[arg-type]  # the simulator's peers are node indices; the core keeps peer ids as opaque keys
        self._apply(nd, acts)
        if chunk is not None:
            self._send_chunk(nd, peer, chunk)
        self._write(nd, peer)

    def _send_chunk(self, nd: _Node, peer: int, chunk: Chunk) -> None:
        size = len(chunk.data)
        start = max(self.now, nd.up_free)
        end = start + size / nd.link.up_bps
        nd.up_free = end
        nd.bytes_out += size
        dst = self.nodes[peer]
        if not dst.alive:
            return
        arrive = end + nd.link.latency_s
        if dst.link.down_bps > 0:
            dst.down_free = max(dst.down_free, start + nd.link.latency_s) + size / dst.link.down_bps
            arrive = max(arrive, dst.down_free)
        if nd.link.loss and self.rng.random() < nd.link.loss:
            arrive += nd.link.rto_s
        if nd.corrupt:
            chunk = Chunk(chunk.pid, chunk.index, _BAD)
        self._push(arrive, "deliver", (peer, nd.id, chunk, dst.inc, nd.inc))

    # ------------------------------------------------------------ results

    def result(self, wall_s: float) -> dict[str, Any]:
        followers = self.nodes[1:]
        alive = [nd for nd in followers if nd.alive]
        times = sorted(nd.completed_at for nd in alive if nd.completed_at is not None)
        ok = all(nd.corrupt or self._holds_all(nd) for nd in alive)
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

    def _holds_all(self, nd: _Node) -> bool:
        """Every chunk of every patch, in the core's transfers, equal to what the origin published."""
        for pid, _env, chunks in self.patches:
            tr = nd.core.transfers.get(pid)
            if tr is None or not tr.session.complete or tr.chunks != chunks:
                return False
        return True
