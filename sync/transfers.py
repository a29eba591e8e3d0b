"""Sans-IO core of the multi-patch broadcast: every patch one node moves, and the rules above one patch.

`sync.swarm.SwarmSession` schedules the chunks of one patch. A node moves many
patches at once over one stream per peer; `BroadcastCore` holds them and
makes every decision that spans them:
- the transfer table: at most `max_transfers` patches; beyond that the oldest
  finished one goes, else the oldest unfinished one (counted), so patches whose
  chunks nobody serves cannot refuse every later patch;
- manifests asked of peers: a peer whose `Have`/`HaveChunk` names a patch id we
  have no manifest for is sent a `ManifestRequest`, and another advertiser is
  asked every `manifest_retry_s` until it arrives (at most
  `max_manifest_asks` unknown ids remembered); a `Manifest` is taken only if
  asked for and only if its content id is the patch id;
- the accept rule and the signature check come before a transfer exists;
- bans are node-wide: every session drops the peer, and the driver disconnects it;
- uploads: round-robin over the patches a peer has requests queued in, each
  chunk paid for in advance from the node's one token bucket
  (`network.upload_bytes_per_s`), so the limit holds across peers and patches.

It is a plain state machine with an injected clock (h11 style):
`sync.broadcast.BroadcastNode` owns the streams and the framing, feeds events
in and carries the returned actions out. Events are methods (`now` is the
caller's monotonic clock, `wall` its wall clock, for reports only):

    peer_connected(peer, now) / peer_gone(peer, now)   a chunk stream to it came up / the last one ended
    on_frame(peer, frame, now)                         a decoded frame arrived
    bad_frame(peer, reason)                            bytes broke the framing or the frame decoder
    offer(envelope, now, peer=None)                    a signed manifest was heard (gossip, API, a Manifest frame)
    follow(pid, held, now, wall) / abandon(pid)         the chunks kept on disk for an offered patch were read / were not
    publish(envelope, chunks, now, wall)               become the origin of a patch
    ban(peer, reason, now), tick(now)
    next_upload(peer, now) -> UploadSlot | None        the peer's writer is free: what to send next, and when
    take_upload(peer, slot, now) -> (Chunk | None, actions)   the slot's time came: the chunk to write

Actions: `Send`, `ServeReady` and `Penalise` (from `sync.swarm`), and `Load`,
`Stored`, `Complete`, `Added`, `Evicted`, `Disconnect`, `Wake` (below).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.wire import PATCH_MANIFEST, PatchManifest, content_id, open_envelope
from murmur.sync.chunks import DEFAULT_CHUNK_BYTES
from murmur.sync.swarm import (
    Ban,
    Chunk,
    Completed,
    Frame,
    Have,
    HaveChunk,
    Manifest,
    ManifestRequest,
    Penalise,
    Send,
    ServeReady,
    SwarmConfig,
    SwarmSession,
    Verified,
    session_from_manifest,
)
from murmur.sync.uplink import TokenBucket

MAX_TRANSFERS: Final = 64  # patches a node tracks at once
MAX_MANIFEST_ASKS: Final = 256  # unknown patch ids we ask peers about (and who advertised them)


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Load:
    """An accepted manifest: read the chunks kept on disk for it, then call `follow` (or `abandon`)."""

    pid: bytes
    manifest: PatchManifest


@dataclass(frozen=True, slots=True)
class Stored:
    """A chunk verified (it is served from memory from now on): keep it on disk for a restart."""

    pid: bytes
    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Complete:
    """Every chunk of the patch is held and verified."""

    pid: bytes


@dataclass(frozen=True, slots=True)
class Added:
    """A transfer joined the table (waiters for a transfer may look again)."""

    pid: bytes


@dataclass(frozen=True, slots=True)
class Evicted:
    """A transfer left the table to make room: release what the driver holds for it."""

    pid: bytes


@dataclass(frozen=True, slots=True)
class Disconnect:
    """`peer` is banned node-wide: close its streams and its connection."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class Wake:
    """`tick` has work again (it need not be called while `ticking` is false)."""


Action = Send | ServeReady | Penalise | Load | Stored | Complete | Added | Evicted | Disconnect | Wake


@dataclass(frozen=True, slots=True)
class UploadSlot:
    """A chunk upload paid for: `reserved` bytes of the patch `pid`, to be written at `at` or later."""

    pid: bytes
    reserved: int
    at: float


# ---------------------------------------------------------------- transfers


class Transfer:
    """One patch at this node: its signed manifest, its session, and the chunks held (served from memory)."""

    __slots__ = ("pid", "envelope", "manifest", "session", "chunks", "started")

    def __init__(
        self,
        pid: bytes,
        envelope: bytes,
        manifest: PatchManifest,
        session: SwarmSession,
        chunks: list[bytes | None],
        started: float,
    ) -> None:
        self.pid = pid
        self.envelope = envelope
        self.manifest = manifest
        self.session = session
        self.chunks = chunks
        self.started = started  # wall clock

    @property
    def completed_wall(self) -> float | None:
        """Wall-clock time of completion (the session's own clock measures the duration)."""
        s = self.session
        return None if s.completed_at is None else self.started + (s.completed_at - s.started)

    def payload(self) -> bytes:
        if not self.session.complete:
            raise MurmurError("patch not complete yet")
        return b"".join(self.chunks)  # type: ignore[arg-type]  # a complete session holds every chunk


class BroadcastCore:
    """Every patch this node sends or receives (see the module docstring)."""

    def __init__(
        self,
        config: SwarmConfig | None = None,
        *,
        swarm: str,
        upload_bytes_per_s: float = 0,
        upload_burst_bytes: float | None = None,
        accept: Callable[[PatchManifest], bool] | None = None,
        seed: int | None = None,
        manifest_retry_s: float = 2.0,
        max_transfers: int = MAX_TRANSFERS,
        max_manifest_asks: int = MAX_MANIFEST_ASKS,
        now: float = 0.0,
        check: Callable[[bytes, int, bytes], bool] | None = None,
    ) -> None:
        if max_transfers < 1 or max_manifest_asks < 1:
            raise ValueError("max_transfers and max_manifest_asks must be >= 1")
        self.cfg = config or SwarmConfig()
        self.swarm = swarm  # manifests signed for another swarm are refused
        # a burst of one chunk: a chunk is the unit written, so with less every first chunk after an
        # idle gap waits for its own tokens (most of a chunk's transfer time at volunteer rates)
        burst = (
            upload_burst_bytes
            if upload_burst_bytes is not None
            else max(DEFAULT_CHUNK_BYTES, 0.05 * upload_bytes_per_s)
        )
        self.bucket = TokenBucket(upload_bytes_per_s, burst, now=now)
        self.accept = accept or (lambda m: True)
        self.seed = seed
        self.manifest_retry_s = manifest_retry_s
        self.max_transfers = max_transfers
        self.max_manifest_asks = max_manifest_asks
        self.check = check  # a chunk's (expected hash, size, bytes) check; None: the session's own blake2b
        self._rng = random.Random(seed)
        # insertion order is age order: eviction takes the first finished, else the first
        self.transfers: dict[bytes, Transfer] = {}
        self.loading: dict[bytes, tuple[bytes, PatchManifest]] = {}  # offered, accepted, disk not read yet
        self.peers: dict[str, deque[bytes]] = {}  # connected peers -> their upload round-robin of patch ids
        self.banned: set[str] = set()
        # unknown patch ids seen in peers' have-maps: when we last asked for the manifest, who has it
        self._asked: dict[bytes, float] = {}
        self._advertisers: dict[bytes, set[str]] = {}
        self.frames_by_type: dict[str, int] = {}  # frames received, by type (diagnostics)
        self.counters = {"bad_frames": 0, "manifests_rejected": 0, "transfers_evicted": 0, "frames_unknown_patch": 0}

    # ------------------------------------------------------------ queries

    @property
    def ticking(self) -> bool:
        """Whether `tick` has work: a session that needs ticks, or a manifest still asked for."""
        return bool(self._advertisers) or any(tr.session.needs_tick for tr in self.transfers.values())

    def stats(self, pid: bytes) -> dict[str, Any]:
        tr = self.transfers[pid]
        s = tr.session
        return {
            "pid": pid.hex(),
            "chunks": s.n,
            "have": s.nhave,
            "complete": s.complete,
            "bytes_in": s.bytes_in,
            "bytes_out": s.bytes_out,
            "wasted_in": s.wasted_in,
            "started": tr.started,
            "completed": tr.completed_wall,
            "peers": s.peer_stats(),
        }

    # ------------------------------------------------------------ peers

    def peer_connected(self, peer: str, now: float) -> list[Action]:
        if peer in self.banned or peer in self.peers:
            return []
        self.peers[peer] = deque()
        out: list[Action] = []
        for tr in list(self.transfers.values()):
            out += self._expand(tr, tr.session.peer_joined(peer, now), now)
        return out

    def peer_gone(self, peer: str, now: float) -> list[Action]:
        if self.peers.pop(peer, None) is None:
            return []
        out: list[Action] = []
        for tr in list(self.transfers.values()):
            out += self._expand(tr, tr.session.peer_left(peer, now), now)
        return out

    def ban(self, peer: str, reason: str, now: float) -> list[Action]:
        """Node-wide: every session drops the peer, and the driver closes its connection."""
        if peer in self.banned:
            return []
        self.banned.add(peer)
        self.peers.pop(peer, None)
        out: list[Action] = []
        for tr in list(self.transfers.values()):
            acts: list[Any] = []
            tr.session.ban(peer, now, acts)
            out += self._expand(tr, acts, now)
        out.append(Disconnect(peer, reason))
        return out

    # ------------------------------------------------------------ frames

    def bad_frame(self, peer: str, reason: str) -> list[Action]:
        """Bytes from `peer` broke the framing or the frame decoder (the driver drops that stream)."""
        self.counters["bad_frames"] += 1
        return [Penalise(peer, reason, self.cfg.penalty_protocol)]

    def on_frame(self, peer: str, frame: Frame, now: float) -> list[Action]:
        if peer in self.banned:
            return []
        name = type(frame).__name__
        self.frames_by_type[name] = self.frames_by_type.get(name, 0) + 1
        if isinstance(frame, ManifestRequest):
            known = self.transfers.get(frame.pid)
            return [Send(peer, Manifest(frame.pid, known.envelope))] if known is not None else []
        if isinstance(frame, Manifest):
            if frame.pid in self.transfers or frame.pid not in self._asked:
                return []
            if content_id(frame.envelope) != frame.pid:
                return [Penalise(peer, "manifest does not match its patch id", self.cfg.penalty_protocol)]
            return self.offer(frame.envelope, now, peer=peer)
        tr = self.transfers.get(frame.pid)
        if tr is None:
            if isinstance(frame, (Have, HaveChunk)) and frame.pid not in self.loading:
                return self._advertised(peer, frame.pid, now)
            self.counters["frames_unknown_patch"] += 1  # a patch we dropped or never took: nothing to do
            return []
        return self._expand(tr, tr.session.on_frame(peer, frame, now), now)

    # ------------------------------------------------------------ manifests and the transfer table

    def offer(self, envelope: bytes, now: float, peer: str | None = None) -> list[Action]:
        """A signed manifest heard; its signature is checked before anything else happens.

        From `peer` (a `Manifest` frame), a bad one is that peer's fault (a penalty); from
        gossip or the API (`peer` None) it raises `DecodeError`. Accepted, it yields `Load`.
        """
        pid = content_id(envelope)
        if pid in self.transfers or pid in self.loading:
            return []
        try:
            _, manifest = open_envelope(envelope, expect=PATCH_MANIFEST, swarm=self.swarm)
        except DecodeError as e:
            self.counters["manifests_rejected"] += 1
            if peer is None:
                raise
            return [Penalise(peer, f"bad manifest: {e}", self.cfg.penalty_protocol)]
        if not self.accept(manifest):
            return []
        self.loading[pid] = (envelope, manifest)
        return [Load(pid, manifest)]

    def follow(self, pid: bytes, held: Mapping[int, bytes], now: float, wall: float) -> list[Action]:
        """Start receiving a patch after `Load`; `held` are the verified chunks kept on disk."""
        entry = self.loading.pop(pid, None)
        if entry is None:
            return []
        envelope, manifest = entry
        chunks: list[bytes | None] = [None] * len(manifest.chunks)
        for i, data in held.items():
            if 0 <= i < len(chunks):
                chunks[i] = data
        session = session_from_manifest(
            pid,
            manifest,
            have=[i for i, c in enumerate(chunks) if c is not None],
            config=self.cfg,
            now=now,
            seed=self.seed,
            check=self.check,
        )
        out = self._add(Transfer(pid, envelope, manifest, session, chunks, wall), now)
        if session.complete:
            out.append(Complete(pid))
        return out

    def abandon(self, pid: bytes) -> None:
        """The chunks on disk could not be read: forget the offer (a later one starts over)."""
        self.loading.pop(pid, None)

    def publish(self, envelope: bytes, chunks: list[bytes], now: float, wall: float) -> tuple[bytes, list[Action]]:
        """Become the origin of a signed patch whose chunk bytes are `chunks`; returns its patch id."""
        try:
            _, manifest = open_envelope(envelope, expect=PATCH_MANIFEST, swarm=self.swarm)
        except DecodeError:
            self.counters["manifests_rejected"] += 1
            raise
        if len(chunks) != len(manifest.chunks):
            raise MurmurError(f"{len(chunks)} chunks for a manifest listing {len(manifest.chunks)}")
        pid = content_id(envelope)
        session = session_from_manifest(
            pid,
            manifest,
            have=range(len(chunks)),
            origin=True,
            config=self.cfg,
            now=now,
            seed=self.seed,
            check=self.check,
        )
        self.transfers.pop(pid, None)  # we hold every chunk now: an earlier session of it starts over as origin
        self.loading.pop(pid, None)
        return pid, self._add(Transfer(pid, envelope, manifest, session, list(chunks), wall), now)

    def _add(self, tr: Transfer, now: float) -> list[Action]:
        out: list[Action] = []
        if len(self.transfers) >= self.max_transfers:
            # A transfer whose chunks nobody serves would otherwise hold its slot forever, and a full
            # table of them would refuse every later patch: the oldest unfinished one gives way.
            old = next((p for p, t in self.transfers.items() if t.session.complete), None)
            if old is None:
                old = next(iter(self.transfers))
                self.counters["transfers_evicted"] += 1
            del self.transfers[old]
            out.append(Evicted(old))
        self.transfers[tr.pid] = tr
        self._asked.pop(tr.pid, None)
        self._advertisers.pop(tr.pid, None)
        for peer in list(self.peers):
            out += self._expand(tr, tr.session.peer_joined(peer, now), now)
        out += [Added(tr.pid), Wake()]
        return out

    def _advertised(self, peer: str, pid: bytes, now: float) -> list[Action]:
        """`peer` holds a patch we have no manifest for: ask it, unless someone was asked just now."""
        out: list[Action] = []
        if pid not in self._advertisers:
            if len(self._advertisers) >= self.max_manifest_asks:
                old = next(iter(self._advertisers))
                del self._advertisers[old]
                self._asked.pop(old, None)
            self._advertisers[pid] = set()
            out.append(Wake())
        self._advertisers[pid].add(peer)
        if now - self._asked.get(pid, -1e9) >= self.manifest_retry_s:
            self._asked[pid] = now
            out.append(Send(peer, ManifestRequest(pid)))
        return out

    def _retry_manifests(self, now: float) -> list[Action]:
        """Ask another live advertiser: a request lost with a dying stream must not lose the patch for good."""
        out: list[Action] = []
        for pid, peers in list(self._advertisers.items()):
            if pid in self.transfers or pid in self.loading:
                continue
            if now - self._asked.get(pid, -1e9) < self.manifest_retry_s:
                continue
            live = [p for p in peers if p in self.peers]
            peers.intersection_update(live)
            if live:
                self._asked[pid] = now
                out.append(Send(self._rng.choice(sorted(live)), ManifestRequest(pid)))
        return out

    # ------------------------------------------------------------ clock

    def tick(self, now: float) -> list[Action]:
        """Stalls, back-offs and super-seeding of every session, and manifest retries."""
        out: list[Action] = []
        for tr in list(self.transfers.values()):
            if tr.session.needs_tick:  # up to max_transfers finished ones are kept: skip those
                out += self._expand(tr, tr.session.tick(now), now)
        if self._advertisers:
            out += self._retry_manifests(now)
        return out

    # ------------------------------------------------------------ uploads

    def next_upload(self, peer: str, now: float) -> UploadSlot | None:
        """Round-robin over the patches `peer` has requests queued in; the chunk is paid for now."""
        rr = self.peers.get(peer)
        if rr is None:
            return None
        for pid in self.transfers:
            if pid not in rr:
                rr.append(pid)
        for _ in range(len(rr)):
            pid = rr[0]
            rr.rotate(-1)
            tr = self.transfers.get(pid)
            if tr is None:
                rr.remove(pid)
                continue
            if tr.session.has_pending(peer):
                reserve = tr.manifest.chunk_bytes
                return UploadSlot(pid, reserve, now + self.bucket.reserve(reserve, now))
        return None

    def take_upload(self, peer: str, slot: UploadSlot, now: float) -> tuple[Chunk | None, list[Action]]:
        """The chunk to write for a slot whose time came; None (the payment refunded) if nothing is due now."""
        tr = self.transfers.get(slot.pid)
        if tr is None:
            self.bucket.refund(slot.reserved, now)
            return None, []
        idx, acts = tr.session.take_upload(peer, now)
        out = self._expand(tr, acts, now)
        data = tr.chunks[idx] if idx is not None else None
        if data is None:
            self.bucket.refund(slot.reserved, now)
            return None, out
        if len(data) < slot.reserved:
            self.bucket.refund(slot.reserved - len(data), now)
        return Chunk(tr.pid, idx, data), out  # type: ignore[arg-type]  # data is held only for a chosen index

    # ------------------------------------------------------------ session actions

    def _expand(self, tr: Transfer, actions: list[Any], now: float) -> list[Action]:
        """A session's actions as node actions: chunks kept, completion noted, bans made node-wide."""
        out: list[Action] = []
        for a in actions:
            if isinstance(a, (Send, ServeReady, Penalise)):
                out.append(a)
            elif isinstance(a, Verified):
                tr.chunks[a.index] = a.data
                out.append(Stored(tr.pid, a.index, a.data))
            elif isinstance(a, Completed):
                out.append(Complete(tr.pid))
            elif isinstance(a, Ban):
                out += self.ban(a.peer, a.reason, now)
        return out
