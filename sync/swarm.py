"""Sans-IO chunk-swarming core: one `SwarmSession` per patch per node.

A patch is, here, an opaque byte string cut into chunks whose blake2b-256
hashes come from a signed `PatchManifest`. The session is a plain state
machine with an injected clock: the caller feeds it events (peer joined/left,
frame received, tick) and executes the actions it returns (send a frame,
store a verified chunk, report completion, penalise or ban a peer). The same
code runs under the libp2p driver (`sync.broadcast`, through the multi-patch
core `sync.transfers`) and the virtual-time simulator (`simulations.vsim`), so what
the simulator measures is what nodes run.

Scheduling, in brief (docs/broadcast.md has the full rules):
- receivers pull: each keeps a have-map per peer and requests the rarest
  chunk a peer holds, at most `max_inflight_per_peer` at a time per peer;
- uploads are pulled by the caller's link (`take_upload`) so the upload
  limiter, not the core, decides when bytes leave, and the core decides what;
- the origin super-seeds: it advertises to each peer only chunks nobody has
  been sent yet, so distinct chunks go to distinct peers and no chunk leaves
  the origin twice before every chunk has left it once;
- a chunk is advertised (HAVE) the moment its hash verifies (pipelining);
- a peer that makes no progress for `stall_timeout_s` loses its requests to
  other peers; a chunk that fails its hash bans its sender.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct

from murmur.gossip.errors import DecodeError
from murmur.gossip.scoring import Penalise  # the action this session returns (re-exported)
from murmur.gossip.wire import KIND_LIMITS, MAX_CHUNK_BYTES, MAX_CHUNKS, PATCH_MANIFEST, PatchManifest

# ---------------------------------------------------------------- frames

MAX_BITFIELD_BYTES: Final = (MAX_CHUNKS + 7) // 8
# msgpack framing around a chunk payload: tag, pid (34 B), index, bin header.
FRAME_OVERHEAD: Final = 64
MAX_FRAME_BYTES: Final = MAX_CHUNK_BYTES + FRAME_OVERHEAD
MAX_CONTROL_FRAME_BYTES: Final = MAX_BITFIELD_BYTES + FRAME_OVERHEAD

PatchId = Annotated[bytes, Meta(min_length=32, max_length=32)]
Index = Annotated[int, Meta(ge=0, lt=MAX_CHUNKS)]


class Have(Struct, tag=1, array_like=True, forbid_unknown_fields=True):
    """Full have-map: bit i (LSB-first within byte i//8) set = chunk i held and verified."""

    pid: PatchId
    bits: Annotated[bytes, Meta(max_length=MAX_BITFIELD_BYTES)]
    reply: bool = False  # the receiver should answer with its own Have


class HaveChunk(Struct, tag=2, array_like=True, forbid_unknown_fields=True):
    """One more chunk held: sent to every session peer that lacks it, as soon as it verifies."""

    pid: PatchId
    index: Index


class Request(Struct, tag=3, array_like=True, forbid_unknown_fields=True):
    pid: PatchId
    index: Index


class Cancel(Struct, tag=4, array_like=True, forbid_unknown_fields=True):
    """Withdraw a request (got the chunk elsewhere, or gave up on this peer)."""

    pid: PatchId
    index: Index


class Reject(Struct, tag=5, array_like=True, forbid_unknown_fields=True):
    """A request that will not be served: chunk not held, or the requester's queue is full."""

    pid: PatchId
    index: Index
    busy: bool = False  # True: held but the queue is full; ask again later or elsewhere


class Chunk(Struct, tag=6, array_like=True, forbid_unknown_fields=True):
    pid: PatchId
    index: Index
    data: Annotated[bytes, Meta(max_length=MAX_CHUNK_BYTES)]


class Leave(Struct, tag=7, array_like=True, forbid_unknown_fields=True):
    """The sender drops this session: forget its have-map, requests and queue."""

    pid: PatchId


class ManifestRequest(Struct, tag=8, array_like=True, forbid_unknown_fields=True):
    """Ask a peer that advertised an unknown patch id for its signed manifest (late joiners)."""

    pid: PatchId


class Manifest(Struct, tag=9, array_like=True, forbid_unknown_fields=True):
    """The signed PatchManifest envelope whose content id is `pid`; checked like a gossiped one."""

    pid: PatchId
    envelope: Annotated[bytes, Meta(max_length=KIND_LIMITS[PATCH_MANIFEST])]


Frame = Have | HaveChunk | Request | Cancel | Reject | Chunk | Leave | ManifestRequest | Manifest
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes, limit: int = MAX_FRAME_BYTES) -> Frame:
    """`gossip.wire.decode_struct` semantics (size cap first, DecodeError on garbage), cached decoder."""
    if len(data) > limit:
        raise DecodeError(f"swarm frame is {len(data)} bytes, over its limit of {limit}")
    try:
        return _frame_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"malformed swarm frame: {e}") from None


def bits_from_indices(indices: Iterable[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def indices_from_bits(bits: bytes, n: int) -> list[int]:
    """Decode a have-map; DecodeError when its length or padding bits do not fit n chunks."""
    if len(bits) != (n + 7) // 8:
        raise DecodeError(f"have-map of {len(bits)} bytes for {n} chunks")
    out = [i for i in range(n) if bits[i >> 3] >> (i & 7) & 1]
    if n % 8 and bits and bits[-1] >> (n % 8):
        raise DecodeError("have-map sets bits past the last chunk")
    return out


def chunk_hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Send:
    peer: str
    frame: Frame


@dataclass(frozen=True, slots=True)
class ServeReady:
    """`peer` has queued requests: the caller's upload link should call `take_upload(peer)`."""

    peer: str


@dataclass(frozen=True, slots=True)
class Verified:
    """A chunk passed its hash: persist it (it is served onward from now on)."""

    index: int
    data: bytes
    peer: str


@dataclass(frozen=True, slots=True)
class Completed:
    pid: bytes


@dataclass(frozen=True, slots=True)
class Ban:
    peer: str
    reason: str


Action = Send | ServeReady | Verified | Completed | Penalise | Ban


class SwarmConfig(Struct, kw_only=True, frozen=True):
    """Tunables of the scheduler; defaults suit 256 KiB chunks on 1-100 MB/s links."""

    # Defaults from virtual-time sweeps (docs/broadcast.md): few requests out, short queues at the
    # uploader, so a request waits at a busy peer for at most ~one chunk time and otherwise moves on.
    max_inflight_per_peer: int = 1  # requests outstanding at one peer
    max_inflight_total: int = 3  # requests outstanding at all peers together
    max_queue_per_peer: int = 2  # a peer's requests queued here; more get Reject(busy)
    max_queue_total: int = 1  # requests queued here from all peers; more get Reject(busy)
    stall_timeout_s: float = 5.0  # no chunk from a peer for this long while we wait on it: switch
    avoid_s: float = 10.0  # a stalled peer is skipped for this long
    busy_backoff_s: float = 0.1  # after Reject(busy), wait this long before asking that peer again (~1 chunk time)
    ban_after_corrupt: int = 1  # corrupt chunks that get a peer banned
    seed_window: int = 1  # origin super-seeding: un-sent chunks advertised to each peer at a time
    endgame: bool = True  # near the end, also request in-flight chunks from a second peer
    penalty_corrupt: float = 100.0  # score points lost (gossip.scoring.Penalise)
    penalty_stall: float = 2.0
    penalty_protocol: float = 10.0


# ---------------------------------------------------------------- session


class _Peer:
    __slots__ = (
        "id",
        "has",
        "nhas",
        "inflight",
        "serve",
        "queued",
        "last_rx",
        "stalls",
        "corrupt",
        "avoid_until",
        "bytes_in",
        "bytes_out",
        "assigned",
        "known",
        "cancelled",
    )

    def __init__(self, pid: str, n: int, now: float) -> None:
        self.id = pid
        self.has = bytearray(n)
        self.nhas = 0
        self.inflight: dict[int, float] = {}  # my requests to this peer: index -> time sent
        self.serve: deque[int] = deque()  # this peer's requests to me, in arrival order
        self.queued: set[int] = set()
        self.last_rx = now
        self.stalls = 0
        self.corrupt = 0
        self.avoid_until = 0.0
        self.bytes_in = 0
        self.bytes_out = 0
        self.assigned: dict[int, float] = {}  # origin: un-sent chunks advertised to this peer -> when
        self.known = False  # its have-map arrived
        self.cancelled: set[int] = set()  # requests withdrawn after a stall: their chunks may still arrive


def _default_check(expected: bytes, size: int, data: bytes) -> bool:
    return len(data) == size and chunk_hash(data) == expected


class SwarmSession:
    """One node's part in the broadcast of one patch (see the module docstring)."""

    def __init__(
        self,
        pid: bytes,
        hashes: list[bytes],
        sizes: list[int],
        *,
        have: Iterable[int] = (),
        origin: bool = False,
        config: SwarmConfig | None = None,
        now: float = 0.0,
        seed: int | None = None,
        check: Callable[[bytes, int, bytes], bool] | None = None,
    ) -> None:
        if len(hashes) != len(sizes) or len(hashes) > MAX_CHUNKS:
            raise ValueError("hashes and sizes must have the same length, at most MAX_CHUNKS")
        self.pid = pid
        self.n = len(hashes)
        self.hashes = hashes
        self.sizes = sizes
        self.cfg = config or SwarmConfig()
        self._check = check or _default_check
        self._rng = random.Random(seed)
        order = list(range(self.n))
        self._rng.shuffle(order)
        self._tiebreak = [0] * self.n  # per-node random order among equally rare chunks
        for rank, i in enumerate(order):
            self._tiebreak[i] = rank
        self.have = bytearray(self.n)
        self.nhave = 0
        for i in set(have):
            if 0 <= i < self.n:
                self.have[i] = 1
                self.nhave += 1
        if origin and self.nhave != self.n:
            raise ValueError("the origin must hold every chunk")
        self.origin = origin
        self.started = now
        self.completed_at: float | None = now if self.nhave == self.n else None
        self.avail = [0] * self.n
        self.peers: dict[str, _Peer] = {}
        self.banned: set[str] = set()
        self.requested: dict[int, set[str]] = {}  # index -> peers it is requested from
        self.bytes_in = 0
        self.bytes_out = 0
        self.wasted_in = 0  # duplicate or corrupt chunk bytes received
        self.queued_total = 0  # requests queued here, all peers
        # origin super-seeding: chunks not yet sent to anyone, and who holds an advertisement
        self._super = origin and self.n > 0
        self._unsent: set[int] = set(range(self.n)) if self._super else set()
        self._assigned_to: dict[int, str] = {}

    # ------------------------------------------------------------ queries

    @property
    def complete(self) -> bool:
        return self.nhave == self.n

    @property
    def needs_tick(self) -> bool:
        """False once there is nothing left for `tick` to do: complete, and not super-seeding any more."""
        return not self.complete or self._super

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if not self.have[i]]

    def has_pending(self, peer: str) -> bool:
        p = self.peers.get(peer)
        return bool(p and p.serve)

    def peer_stats(self) -> dict[str, dict[str, float]]:
        return {
            p.id: {
                "bytes_in": p.bytes_in,
                "bytes_out": p.bytes_out,
                "has": p.nhas,
                "inflight": len(p.inflight),
                "queued": len(p.serve),
                "stalls": p.stalls,
            }
            for p in self.peers.values()
        }

    def my_bits(self) -> bytes:
        return bits_from_indices((i for i in range(self.n) if self.have[i]), self.n)

    # ------------------------------------------------------------ membership

    def peer_joined(self, peer: str, now: float) -> list[Action]:
        if peer in self.banned or peer in self.peers:
            return []
        self.peers[peer] = _Peer(peer, self.n, now)
        return [Send(peer, Have(self.pid, self._advertised_bits(peer), reply=True))]

    def peer_left(self, peer: str, now: float) -> list[Action]:
        p = self.peers.pop(peer, None)
        if p is None:
            return []
        self._forget(p)
        out: list[Action] = []
        if self._super:
            self._reassign(now, out)
        self._fill(now, out)
        return out

    def _forget(self, p: _Peer) -> None:
        self.queued_total -= len(p.queued)
        p.queued.clear()
        p.serve.clear()
        for i in range(self.n):
            if p.has[i]:
                self.avail[i] -= 1
        for i in p.inflight:
            s = self.requested.get(i)
            if s is not None:
                s.discard(p.id)
                if not s:
                    del self.requested[i]
        for i in p.assigned:
            if self._assigned_to.get(i) == p.id:
                del self._assigned_to[i]

    def _advertised_bits(self, peer: str) -> bytes:
        if self._super:
            return bytes((self.n + 7) // 8)  # assignments follow as HaveChunk once we know its have-map
        return self.my_bits()

    # ------------------------------------------------------------ frames in

    def on_frame(self, peer: str, frame: Frame, now: float) -> list[Action]:
        if peer in self.banned:
            return []
        out: list[Action] = []
        p = self.peers.get(peer)
        if p is None:
            if isinstance(frame, Leave):
                return []
            out += self.peer_joined(peer, now)
            p = self.peers[peer]
        if isinstance(frame, Chunk):
            self._on_chunk(p, frame, now, out)
        elif isinstance(frame, Request):
            self._on_request(p, frame.index, out)
        elif isinstance(frame, HaveChunk):
            self._on_have_chunk(p, frame.index, now, out)
        elif isinstance(frame, Have):
            self._on_have(p, frame, now, out)
        elif isinstance(frame, Cancel):
            if frame.index in p.queued:
                p.queued.discard(frame.index)
                self.queued_total -= 1
                try:
                    p.serve.remove(frame.index)
                except ValueError:
                    pass
        elif isinstance(frame, Reject):
            self._on_reject(p, frame, now, out)
        elif isinstance(frame, Leave):
            out += self.peer_left(peer, now)
        return out

    def _bad_index(self, p: _Peer, index: int, out: list[Action]) -> bool:
        if index < self.n:
            return False
        out.append(Penalise(p.id, f"chunk index {index} out of range (patch has {self.n})", self.cfg.penalty_protocol))
        return True

    def _on_have(self, p: _Peer, frame: Have, now: float, out: list[Action]) -> None:
        try:
            idx = indices_from_bits(frame.bits, self.n)
        except DecodeError as e:
            out.append(Penalise(p.id, str(e), self.cfg.penalty_protocol))
            return
        for i in range(self.n):
            if p.has[i]:
                self.avail[i] -= 1
        p.has = bytearray(self.n)
        for i in idx:
            p.has[i] = 1
            self.avail[i] += 1
        p.nhas = len(idx)
        p.known = True
        if frame.reply:
            out.append(Send(p.id, Have(self.pid, self._advertised_bits(p.id), reply=False)))
        if self._super:
            self._assign(p, now, out)
        self._fill(now, out)

    def _on_have_chunk(self, p: _Peer, index: int, now: float, out: list[Action]) -> None:
        if self._bad_index(p, index, out) or p.has[index]:
            return
        p.has[index] = 1
        p.nhas += 1
        self.avail[index] += 1
        if self._super and index in p.assigned:
            del p.assigned[index]
        if not self.have[index]:
            self._fill(now, out)

    def _on_request(self, p: _Peer, index: int, out: list[Action]) -> None:
        if self._bad_index(p, index, out):
            return
        if not self.have[index]:
            out.append(Send(p.id, Reject(self.pid, index)))
            return
        if index in p.queued:
            return
        if self._super and (index not in self._unsent or self._assigned_to.get(index, p.id) != p.id):
            # super-seeding: what already left once, or was offered to someone else, comes from peers
            out.append(Send(p.id, Reject(self.pid, index)))
            return
        if len(p.serve) >= self.cfg.max_queue_per_peer or self.queued_total >= self.cfg.max_queue_total:
            out.append(Send(p.id, Reject(self.pid, index, busy=True)))
            return
        p.serve.append(index)
        p.queued.add(index)
        self.queued_total += 1
        if len(p.serve) == 1:
            out.append(ServeReady(p.id))

    def _on_reject(self, p: _Peer, frame: Reject, now: float, out: list[Action]) -> None:
        i = frame.index
        if self._bad_index(p, i, out) or i not in p.inflight:
            return
        self._drop_request(p, i)
        if frame.busy:
            p.avoid_until = max(p.avoid_until, now + self.cfg.busy_backoff_s)
        elif p.has[i]:
            p.has[i] = 0
            p.nhas -= 1
            self.avail[i] -= 1
        self._fill(now, out)

    def _drop_request(self, p: _Peer, i: int) -> None:
        p.inflight.pop(i, None)
        s = self.requested.get(i)
        if s is not None:
            s.discard(p.id)
            if not s:
                del self.requested[i]

    def _on_chunk(self, p: _Peer, frame: Chunk, now: float, out: list[Action]) -> None:
        i = frame.index
        if self._bad_index(p, i, out):
            return
        size = len(frame.data)
        p.bytes_in += size
        self.bytes_in += size
        if i not in p.inflight:
            if i in p.cancelled and not self.have[i]:
                # A slow peer's answer crossed our cancel on the wire: late, not malicious, and still
                # good data if its hash checks out.
                p.cancelled.discard(i)
            else:
                self.wasted_in += size
                if not self.have[i]:
                    out.append(Penalise(p.id, f"unrequested chunk {i}", self.cfg.penalty_protocol))
                return
        p.cancelled.discard(i)
        p.last_rx = now
        self._drop_request(p, i)
        if self.have[i]:
            self.wasted_in += size  # endgame duplicate
            self._fill(now, out)
            return
        if not self._check(self.hashes[i], self.sizes[i], frame.data):
            self.wasted_in += size
            p.corrupt += 1
            out.append(Penalise(p.id, f"chunk {i} failed its hash", self.cfg.penalty_corrupt))
            if p.corrupt >= self.cfg.ban_after_corrupt:
                out.append(Ban(p.id, f"sent {p.corrupt} corrupt chunk(s)"))
                self.ban(p.id, now, out)
            self._fill(now, out)
            return
        self.have[i] = 1
        self.nhave += 1
        out.append(Verified(i, frame.data, p.id))
        for pid in list(self.requested.pop(i, ())):  # endgame: withdraw the duplicate request
            q = self.peers.get(pid)
            if q is not None:
                q.inflight.pop(i, None)
                out.append(Send(pid, Cancel(self.pid, i)))
        msg = HaveChunk(self.pid, i)
        for q in self.peers.values():
            if not q.has[i]:
                out.append(Send(q.id, msg))
        if self.nhave == self.n:
            self.completed_at = now
            out.append(Completed(self.pid))
            for q in self.peers.values():  # nothing more to fetch: withdraw leftovers
                for j in list(q.inflight):
                    out.append(Send(q.id, Cancel(self.pid, j)))
                q.inflight.clear()
            self.requested.clear()
        else:
            self._fill(now, out)

    def ban(self, peer: str, now: float, out: list[Action] | None = None) -> None:
        """Stop talking to `peer` in this session (also called by the driver on a node-wide ban)."""
        self.banned.add(peer)
        p = self.peers.pop(peer, None)
        if p is not None:
            self._forget(p)
            if out is not None:
                if self._super:
                    self._reassign(now, out)
                self._fill(now, out)

    # ------------------------------------------------------------ uploads

    def take_upload(self, peer: str, now: float) -> tuple[int | None, list[Action]]:
        """Next chunk to send to `peer`, called when the upload link is free; None if nothing queued."""
        p = self.peers.get(peer)
        out: list[Action] = []
        if p is None:
            return None, out
        while p.serve:
            i = p.serve.popleft()
            p.queued.discard(i)
            self.queued_total -= 1
            if not self.have[i]:
                continue
            p.bytes_out += self.sizes[i]
            self.bytes_out += self.sizes[i]
            if self._super:
                p.assigned.pop(i, None)
                if self._assigned_to.get(i) == peer:
                    del self._assigned_to[i]
                self._unsent.discard(i)
                if not self._unsent:
                    self._end_super(out)
                else:
                    self._assign(p, now, out)
            return i, out
        return None, out

    # ------------------------------------------------------------ origin super-seeding

    def _assign(self, p: _Peer, now: float, out: list[Action]) -> None:
        """Advertise to `p` un-sent chunks it lacks and nobody else was offered, up to the window."""
        if not p.known:
            return
        while len(p.assigned) < self.cfg.seed_window:
            best = None
            for i in self._unsent:
                if i in self._assigned_to or p.has[i]:
                    continue
                if best is None or self._tiebreak[i] < self._tiebreak[best]:
                    best = i
            if best is None:
                return
            p.assigned[best] = now
            self._assigned_to[best] = p.id
            out.append(Send(p.id, HaveChunk(self.pid, best)))

    def _reassign(self, now: float, out: list[Action]) -> None:
        for q in sorted(self.peers.values(), key=lambda q: len(q.assigned)):
            self._assign(q, now, out)

    def _end_super(self, out: list[Action]) -> None:
        """Every chunk has left once: from now on the origin is an ordinary seeder."""
        self._super = False
        self._assigned_to.clear()
        bits = self.my_bits()
        for q in self.peers.values():
            q.assigned.clear()
            out.append(Send(q.id, Have(self.pid, bits, reply=False)))

    # ------------------------------------------------------------ requests

    def _fill(self, now: float, out: list[Action]) -> None:
        if self.nhave == self.n:
            return
        cfg = self.cfg
        budget = cfg.max_inflight_total - sum(len(p.inflight) for p in self.peers.values())
        if budget <= 0:
            return
        peers = [
            p
            for p in self.peers.values()
            if p.nhas and p.avoid_until <= now and len(p.inflight) < cfg.max_inflight_per_peer
        ]
        if not peers:
            return
        # least loaded first, then fastest measured; random among equals so load spreads
        peers.sort(key=lambda p: (len(p.inflight), self._rng.random()))
        missing = [i for i in range(self.n) if not self.have[i]]
        for endgame in (False, True):
            if endgame and not (cfg.endgame and len(self.requested) == len(missing)):
                break
            progress = True
            while progress and budget > 0:
                progress = False
                for p in peers:
                    if len(p.inflight) >= cfg.max_inflight_per_peer or budget <= 0:
                        continue
                    i = self._pick(p, missing, endgame)
                    if i is None:
                        continue
                    p.inflight[i] = now
                    self.requested.setdefault(i, set()).add(p.id)
                    out.append(Send(p.id, Request(self.pid, i)))
                    budget -= 1
                    progress = True

    def _pick(self, p: _Peer, missing: list[int], endgame: bool) -> int | None:
        best = None
        bkey = None
        has = p.has
        avail = self.avail
        tb = self._tiebreak
        req = self.requested
        for i in missing:
            if not has[i]:
                continue
            r = req.get(i)
            if r:
                if not endgame or len(r) > 1 or p.id in r:
                    continue
            key = (avail[i], tb[i])
            if bkey is None or key < bkey:
                best, bkey = i, key
        return best

    # ------------------------------------------------------------ clock

    def tick(self, now: float) -> list[Action]:
        """Stall detection and retries; call every fraction of `stall_timeout_s`."""
        out: list[Action] = []
        cfg = self.cfg
        for p in list(self.peers.values()):
            if p.inflight:
                waited = now - max(p.last_rx, min(p.inflight.values()))
                if waited > cfg.stall_timeout_s:
                    p.stalls += 1
                    p.avoid_until = now + cfg.avoid_s
                    for i in list(p.inflight):
                        self._drop_request(p, i)
                        p.cancelled.add(i)
                        out.append(Send(p.id, Cancel(self.pid, i)))
                    out.append(Penalise(p.id, f"no progress for {waited:.1f} s", cfg.penalty_stall))
            if self._super:
                for i, t in list(p.assigned.items()):
                    if now - t > cfg.stall_timeout_s and i not in p.queued:
                        # it never asked for its assignment: offer the chunk to someone else
                        del p.assigned[i]
                        if self._assigned_to.get(i) == p.id:
                            del self._assigned_to[i]
        if self._super:
            self._reassign(now, out)
        self._fill(now, out)
        return out


def session_from_manifest(pid: bytes, manifest: PatchManifest, **kw: Any) -> SwarmSession:
    return SwarmSession(pid, [c.hash for c in manifest.chunks], [c.size for c in manifest.chunks], **kw)
