"""The node's decisions as one sans-IO state machine: events in, actions out, an injected clock.

API (the live runtime, the virtual-time simulator and the tests all drive it the same way):

    core = NodeCore(settings, identity, clock, wall_ms)  # CoreSettings, gossip.identity.Identity,
                                                          # () -> float seconds (timers), () -> int unix ms
                                                          # (created_ms stamps; default the wall clock)
    actions = core.handle(event)                    # one event -> a list of actions, in the order to carry out
    core.next_deadline()                            # when the core next needs a Tick (its own clock's seconds)
    core.offer_manifest(manifest)                   # handle(ManifestOffered(manifest)) as the broadcast's bool
    core.head_of(lineage)                           # the publisher-signed head, for the validation pipeline
    core.stats()                                    # a copy of the core's counters (the drivers never write them)

Events (`node.events`, re-exported here): `Tick` (timers: announce, catch-up, expiry), `AnnounceHeard` and
`ManifestHeard` (a gossip message whose envelope signature the pipeline already checked), `ManifestOffered`
(the broadcast asks whether to fetch a manifest: `Accept` or `Decline`),
`PeerGone`, `FromWorker` (a message from the worker process), `WorkerStarted`, `WorkerExited`,
`LineageKnown` (a lineage the store held at start), `StoredItems`, `TransferDone`, `PatchStored`,
`CatalogReceived`/`CatalogFailed` (catch-up replies), `OfferFailed`, `ListenAddrs`,
`RolloutsVerified` (a batch the pipeline accepted: what each follower delivered, `node.credit`, and what
the rollout exchange meters),
`RolloutsPublished` (a rollout Publish that went out). An event of another type is a driver bug:
`handle` ends in `assert_never`.

Actions: `Publish` (topic announce|rollouts, with the rollout shard), `Subscribe` (rollout shards), `ToWorker`, `RestartWorker`, `RecordRollouts`,
`SeedVersion`, `StorePatch`, `DropItem`, `LoadStored`, `FetchCatalog`, `RequestOffer`, `Penalise`
(a positive amount: what the peer loses), `SeePeer` (persist a peer), `ResendTaskSets` (a new peer
appeared), `Log`.

State is proportional to what the node hears: a bounded peer table (`max_peers`, least recently
seen evicted) and a bounded lineage table (`max_lineages`, least recently active "seen" lineages
evicted; the own, the served and the worker's followed lineage stay). The lineage rules (identity, heads) live in
`node.lineages`; the capacity rule in `node.roles`; staleness admission in `sync.staleness`; the
patch accept rule in `sync.items.wanted`; catch-up planning in `sync.catchup.choose`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, assert_never

from gossip import exchange, wire
from gossip.errors import DecodeError, PatchError
from gossip.identity import Identity, peer_id_from_public
from gossip.ratelimit import RateMeter
from node import pipe, roles
from node.config import NetworkSection, NodeSection, SyncSection, TrainingSection
from node.credit import Deliveries
from node.events import (Tick, ListenAddrs, AnnounceHeard, ManifestHeard, PeerGone, FromWorker, WorkerExited,
                         WorkerStarted, LineageKnown, StoredItems, TransferDone, PatchStored, CatalogReceived,
                         CatalogFailed, OfferFailed, RolloutsVerified, RolloutsPublished,
                         ManifestOffered, Publish, ToWorker, ResendTaskSets, Accept, Decline,
                         RestartWorker, RecordRollouts, SeedVersion, StorePatch, DropItem, LoadStored, FetchCatalog,
                         RequestOffer, Penalise, SeePeer, Log, Subscribe, Event, Action)  # noqa: F401 - part of the core's API
from node.pipe import WorkerState
from node.lineages import MIN_STEP_S, LineageState, LineageTable, Refusal
from sync.catchup import choose
from sync.items import KINDS, MAX_ITEMS, StoredItem, diff_kind, item_of, wanted
from sync.staleness import StalenessGuard

ANNOUNCE_EVERY_S = 2.0
PEER_EXPIRY_S = 30.0  # a peer silent this long no longer counts for roles and demand
PEER_FORGET_S = 120.0  # ... and this long is dropped from the table
CATCH_UP_EVERY_S = 0.5
# A follower that stands by fetches no patches and so takes no new measure of their delivery time: the
# old measures expire, and it serves again to take new ones.
MEASURE_TTL_S = 300.0
CATCH_UP_PATIENCE_S = 120.0  # a catch-up attempt with no progress after this is retried from scratch
IN_FLIGHT_PATIENCE_S = 30.0  # a transfer in flight longer than this no longer counts as on its way
RESYNC_AFTER_S = 10.0  # held versions that reach the head but do not apply for this long: re-read the store
BATCH_MAX_ROLLOUTS = wire.MAX_ROLLOUTS_PER_BATCH
CLAIM_PENALTY = 10.0  # a provably false signed claim about a lineage (node.lineages.Refusal)
FORGERY_PENALTY = 100.0  # ... that claims another key's lineage: graylisted at once, like a bad signature
SPOT_PENALTY = 25.0  # a failed log-prob spot check; two put a peer below the default graylist threshold
CATALOG_SOURCES = 4
MAX_IN_FLIGHT = 256  # accepted transfers at once (each is a download the broadcast holds state for)
# A served lineage whose head stays past the held version this long with no version applied cannot be
# fetched from (a head moved by announces, manifests whose chunks no one serves): the follower leaves it.
LEAVE_AFTER_S = 180.0
# A lineage chosen but never delivered to this node (`LineageState.delivered`) is on trial: the worker is not
# switched to it until an item of it is stored, and it is left after one catch-up attempt's patience with no
# version applied, so a key that signs manifests it never serves costs a follower one catch-up, no generation.
TRIAL_S = CATCH_UP_PATIENCE_S
# ... counted only while this node's own worker is up: a worker that is starting cannot apply anything
WORKER_DOWN = frozenset({WorkerState.STARTING, WorkerState.RESTARTING, WorkerState.LOADING,
                         WorkerState.WAITING_FOR_TASKS, WorkerState.STOPPED})
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 30.0, 60.0)
WORKER_STABLE_S = 120.0  # a worker that ran this long resets the restart backoff
DEFAULT_STEP_S = 5.0  # a trainer that has not measured a step yet plans its exchange demand with this
STEP_WINDOW = 20  # trainer steps the status's per-step swarm figures average over


@dataclass(frozen=True)
class CoreSettings:
    """Everything the core needs from the configuration (no file, no I/O)."""

    # Defaults are the node configuration's, so a core built without a file (the simulator, a bench, a
    # test) runs the numbers a default node runs.
    swarm: str
    roles: tuple[str, ...]
    hardware: str = "cpu"
    max_staleness: int = SyncSection().max_staleness
    publish_every: int = SyncSection().publish_every
    external_rollouts: int = TrainingSection().external_rollouts
    group_size: int = TrainingSection().group_size
    max_new_tokens: int = TrainingSection().max_new_tokens
    upload_bytes_per_s: float = float(NetworkSection().upload_bytes_per_s)
    memory_budget_mb: int = NodeSection().memory_budget_mb
    follow: tuple[bytes, ...] = ()  # configured lineages (empty: choose by demand)
    max_peers: int = 1024
    max_lineages: int = 256

    @classmethod
    def from_config(cls, cfg: Any, node_roles: list[str], hardware_class: str) -> CoreSettings:
        t = cfg.training
        return cls(swarm=cfg.node.swarm, roles=tuple(node_roles), hardware=hardware_class,
                   max_staleness=cfg.sync.max_staleness, publish_every=max(1, cfg.sync.publish_every),
                   external_rollouts=t.external_rollouts, group_size=t.group_size, max_new_tokens=t.max_new_tokens,
                   upload_bytes_per_s=float(cfg.network.upload_bytes_per_s),
                   memory_budget_mb=cfg.node.memory_budget_mb,
                   follow=tuple(bytes.fromhex(x) for x in cfg.sync.follow))


# ---------------------------------------------------------------- state


@dataclass(slots=True)
class PeerInfo:
    announce: wire.NodeAnnounce
    public: bytes
    seen: float


class CatchUpPhase(Enum):
    ASKING = "asking"  # a catalog request to `CatchUp.source` is out
    OFFERED = "offered"  # its catalog came: offers of the planned items are out to `source`
    EXHAUSTED = "exhausted"  # every source failed: wait out the patience, then start over


@dataclass(slots=True)
class CatchUp:
    """One catch-up attempt of the served lineage: sources asked in turn, at most one catalog at a time."""

    lineage: bytes
    sources: list[str]
    started: float
    phase: CatchUpPhase = CatchUpPhase.ASKING
    source: str = ""  # the peer asked (ASKING) or offering (OFFERED); unused once EXHAUSTED
    offered: int = 0

    def from_source(self, lineage: bytes, peer: str) -> bool:
        """Whether a reply about `lineage` from `peer` belongs to this attempt's current source."""
        return self.lineage == lineage and self.phase is not CatchUpPhase.EXHAUSTED and self.source == peer


def _median(xs: Any) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


def _finite(x: Any, default: float = 0.0) -> float:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


class NodeCore:
    def __init__(self, settings: CoreSettings, identity: Identity, clock: Callable[[], float],
                 wall_ms: Callable[[], int] = wire.now_ms, *,
                 producers_count: Callable[[float], int] | None = None,
                 supply_view: Callable[[], exchange.Supply] | None = None) -> None:
        self.s = settings
        self.ident = identity
        self.clock = clock  # any monotonic seconds: timers and rates
        self.wall_ms = wall_ms  # unix milliseconds: what receivers' freshness checks compare created_ms with
        self.roles = list(settings.roles)
        self.peers: dict[str, PeerInfo] = {}
        self.table = LineageTable(settings.max_lineages, clock)
        self.guard = StalenessGuard(settings.max_staleness)
        self.serving_reason = ""
        self.addrs: tuple[str, ...] = ()
        self.stored: dict[bytes, set[tuple[str, int, int]]] = {}  # served/own lineage -> items held (cache)
        self.in_flight: dict[tuple[bytes, str, int, int], float] = {}  # accepted transfers -> when
        self.catching: CatchUp | None = None
        self.counters: dict[str, int] = {"published": 0, "applied": 0, "spot_checked": 0, "spot_failed": 0,
                                         "used": 0, "rollouts_published": 0, "bytes_down": 0,
                                         "worker_restarts": 0, "peers_evicted": 0, "rollouts_unpublishable": 0,
                                         "patches_not_finite": 0, "claims_capped": 0, "lineages_left": 0,
                                         "spot_eligible": 0}
        self.deliveries = Deliveries(max_peers=settings.max_peers)  # verified rollouts for our lineage, per producer
        self.worker_state = WorkerState.STARTING
        self.worker_error = ""
        self.engine = ""  # what the worker runs (pipe.Engine): a MODE_*, or "<asked> unavailable: <why>"
        self.worker_started = clock()
        self.restarts_in_row = 0
        self.steps = 0
        self.rewards: deque[float] = deque(maxlen=60)
        self.reward_first: list[float] = []
        self.step_times: deque[float] = deque(maxlen=8)
        # per step: (external groups trained, their lineages, optimizer updates); held-out (step, accuracy)
        self.swarm_gave: deque[tuple[int, int, int]] = deque(maxlen=STEP_WINDOW)
        self.heldout: deque[tuple[int, float]] = deque(maxlen=60)
        self.version_times: deque[float] = deque(maxlen=8)
        self.fetch_s: deque[tuple[float, float]] = deque(maxlen=8)  # (when, seconds to deliver a patch)
        self.last_publish = 0.0
        self.gen_tps = 0.0
        self.latency = 0.0
        self.pace_rate = 0.0
        self.announce_seq = 0
        self.rollout_seq = 0
        self.publish_meter = RateMeter()  # rollout batches/s we publish, stated in our announce
        self._next_announce = 0.0
        self._next_catch_up = 0.0
        self.progress = (-1, 0.0)  # (held version of the served lineage, when it last changed)
        self.behind_since: float | None = None  # since when the served lineage's head is past what we hold
        self.last_check = clock()
        self.last_resync = -math.inf
        self.tokens_per_rollout = float(max(1, settings.max_new_tokens))
        self.follow_info: pipe.FollowInfo | None = None
        self.admitted: bool | None = None
        # the rollout exchange (gossip.exchange): which shards we join, fed from the peer table
        self.exchange = exchange.Exchange(identity.public)
        self.inbound = exchange.Meter()
        self.batch_rollouts = float(settings.group_size)  # mean rollouts per accepted batch (supply estimate)
        self.subscribed: tuple[int, tuple[int, ...]] = (1, (0,))  # what the runtime joined first
        self.producers_heard = exchange.DistinctCount(window_s=PEER_EXPIRY_S)  # not bounded by max_peers
        # How many producers the announce topic told us of. The virtual simulator, whose announces go one
        # hop, injects the count the live announce topic would have given (a view read, never written).
        self._producers_count = producers_count or self.producers_heard.count
        # ... and, likewise, what producers announce per lineage (batches/s); None: read our peer table
        self._supply_view = supply_view
        self.announced_rate = 0.0  # publish_batches_per_s of our last announce

    # ------------------------------------------------------------ queries
    @property
    def own(self) -> bytes | None:
        return self.table.own

    @property
    def serving(self) -> bytes | None:
        """The lineage chosen: caught up, its patches accepted."""
        return self.table.serving

    @property
    def committed(self) -> bytes | None:
        """The lineage the worker follows (`serving`, once it delivered)."""
        return self.table.committed

    @property
    def on_trial(self) -> bytes | None:
        """The lineage chosen but not yet followed: none of its versions delivered, the worker still serves
        `committed` until one is stored, and it is left after `TRIAL_S` without one."""
        return self.serving if self.serving is not None and self.serving != self.committed else None

    @property
    def lineages(self) -> dict[bytes, LineageState]:
        return self.table.rows

    def head_of(self, lineage: bytes) -> int | None:
        lin = self.table.rows.get(bytes(lineage))
        return lin.head if lin is not None and lin.publisher else None

    def next_deadline(self) -> float:
        """When (on the core's clock) the core next needs a `Tick`; a driver may tick earlier, never needs to."""
        return min(self._next_announce, self._next_catch_up)

    def stats(self) -> dict[str, int]:
        """The core's counters, as a copy."""
        return dict(self.counters)

    def dissemination_s(self) -> float:
        now = self.clock()
        return _median(s for t, s in self.fetch_s if now - t <= MEASURE_TTL_S)

    def offer_manifest(self, m: wire.PatchManifest) -> bool:
        """`handle(ManifestOffered(m))` as the bool the broadcast's synchronous accept callback returns."""
        return any(type(a) is Accept for a in self.handle(ManifestOffered(m)))

    def _on_offered(self, m: wire.PatchManifest) -> bool:
        """The follower's broadcast accept rule; an accepted manifest counts as in flight from now."""
        lid = bytes(m.lineage)
        # the committed lineage's patches still come while another is on trial: the worker keeps generating
        lin = self.table.rows.get(lid) if lid in (self.serving, self.committed) else None
        if lin is None or not lin.publisher or self.table.check_manifest(m) is not None:
            return False
        if not wanted(m, lin.lineage, lin.publisher, lin.held, lin.need_anchor, self.stored.get(lin.lineage, set())):
            return False
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            return False
        it = item_of(m)
        self.in_flight[(lin.lineage, it.kind, it.base, it.target)] = self.clock()
        return True

    # ------------------------------------------------------------ dispatch
    def handle(self, ev: Event) -> list[Action]:
        out: list[Action] = []
        if isinstance(ev, Tick):
            self._tick(out)
        elif isinstance(ev, AnnounceHeard):
            self._on_announce(ev, out)
        elif isinstance(ev, ManifestHeard):
            self._on_manifest(ev.body, out)
        elif isinstance(ev, FromWorker):
            self._on_worker(ev.msg, out)
        elif isinstance(ev, WorkerExited):
            self._on_worker_exit(ev.code, out)
        elif isinstance(ev, ListenAddrs):
            self.addrs = tuple(ev.addrs)[:16]
        elif isinstance(ev, PeerGone):
            self.peers.pop(ev.peer_id, None)
        elif isinstance(ev, WorkerStarted):
            self.worker_started = self.clock()
            self.worker_state = WorkerState.STARTING
        elif isinstance(ev, LineageKnown):
            self.table.load(ev.lineage, ev.name, ev.relation, ev.publisher, ev.base, ev.held)
        elif isinstance(ev, RolloutsPublished):
            self.counters["rollouts_published"] += max(0, int(ev.count))
        elif isinstance(ev, OfferFailed):
            self._on_offer_failed(ev, out)
        elif isinstance(ev, StoredItems):
            self.stored[ev.lineage] = {(i.kind, i.base, i.target) for i in ev.items}
            if ev.items and ev.lineage == self.serving:
                self._commit(out)  # stored items were fetched and hash-checked: it delivered
        elif isinstance(ev, TransferDone):
            it = item_of(ev.manifest)
            if (it.kind, it.base, it.target) not in self.stored.get(bytes(ev.manifest.lineage), set()):
                out.append(StorePatch(ev.pid))
        elif isinstance(ev, PatchStored):
            self._on_patch_stored(ev, out)
        elif isinstance(ev, CatalogReceived):
            self._on_catalog(ev, out)
        elif isinstance(ev, CatalogFailed):
            self._on_catalog_failed(ev, out)
        elif isinstance(ev, ManifestOffered):
            out.append(Accept() if self._on_offered(ev.manifest) else Decline())
        elif isinstance(ev, RolloutsVerified):
            self._meter_inbound(sum(n for _, n in ev.lineages))
            for lid, n in ev.lineages:
                if lid == self.own:
                    self.deliveries.add(ev.producer, n, self.clock())
        else:
            assert_never(ev)
        return out

    # ------------------------------------------------------------ timers
    def _tick(self, out: list[Action]) -> None:
        now = self.clock()
        if now >= self._next_announce:
            self._next_announce = now + ANNOUNCE_EVERY_S
            self._choose_serving(out)
            self._plan_exchange(now, out)
            out.append(Publish("announce", self._announce()))
            self._expire_peers(now)
        if now >= self._next_catch_up:
            self._next_catch_up = now + CATCH_UP_EVERY_S
            self._catch_up(now, out)

    def _expire_peers(self, now: float) -> None:
        for pid in [p for p, info in self.peers.items() if now - info.seen > PEER_FORGET_S]:
            del self.peers[pid]
        for key in [k for k, t in self.in_flight.items() if now - t > IN_FLIGHT_PATIENCE_S * 4]:
            del self.in_flight[key]

    # ------------------------------------------------------------ gossip
    def _on_announce(self, ev: AnnounceHeard, out: list[Action]) -> None:
        body = ev.body
        if peer_id_from_public(ev.signer) != body.peer_id or body.peer_id == self.ident.peer_id:
            return
        now = self.clock()
        prev = self.peers.get(body.peer_id)
        if prev is not None and prev.announce.seq >= body.seq:
            return
        if prev is None and len(self.peers) >= self.s.max_peers:
            seen = [info.seen for info in self.peers.values()]  # the first least recently seen, in C
            oldest = next(itertools.islice(self.peers, seen.index(min(seen)), None))
            del self.peers[oldest]
            self.counters["peers_evicted"] += 1
        self.peers[body.peer_id] = PeerInfo(body, bytes(ev.signer), now)
        if body.publish_batches_per_s > 0:
            self.producers_heard.add(body.peer_id, now)
        for d in body.owned:
            lin, why = self.table.on_demand(bytes(ev.signer), d)
            if why is not None:
                self._refused(body.peer_id, "lineage claim refused", why, out)
            elif lin is not None:
                self._observe_head(lin, out)
        if prev is None:
            out.append(ResendTaskSets())
            out.append(Log("peer announced", {"peer": body.peer_id, "roles": list(body.roles)}))
            out.append(SeePeer(body.peer_id, bytes(ev.signer), tuple(body.addrs), ev.data))

    def _on_manifest(self, m: wire.PatchManifest, out: list[Action]) -> None:
        lin, why = self.table.on_manifest(m)
        if why is not None:
            self._refused(peer_id_from_public(bytes(m.publisher)), "manifest refused", why, out)
        elif lin is not None:
            self._observe_head(lin, out)

    def _refused(self, signer: str, msg: str, why: Refusal, out: list[Action]) -> None:
        out.append(Log(msg, {"peer": signer, "why": why.reason[:200], "fault": why.fault}))
        if why.fault:
            out.append(Penalise(signer, f"lineage: {why.reason}"[:120], FORGERY_PENALTY if why.forged else CLAIM_PENALTY))

    # ------------------------------------------------------------ staleness admission
    def _observe_head(self, lin: LineageState, out: list[Action]) -> None:
        if lin.lineage in (self.serving, self.committed):
            self._staleness(lin, self.guard.observe_head(lin.lineage, lin.head, self.clock()), out)
        self._tell_head(lin, out)

    def _tell_head(self, lin: LineageState, out: list[Action]) -> None:
        """A trainer's worker learns every publisher-proven head we know: its sampler ages every lineage's
        external groups out against them, not only its own (one message per head advance)."""
        if "trainer" in self.roles and lin.publisher and lin.head > lin.worker_head:
            lin.worker_head = lin.head
            out.append(ToWorker(pipe.Head(lin.lineage.hex(), lin.head)))

    def _staleness(self, lin: LineageState, events: list[Any], out: list[Action]) -> None:
        for ev in events:
            out.append(Log("staleness", {"lineage": lin.lineage.hex()[:16], "state": ev.state,
                                         "message": ev.message}))
            lin.admission, lin.admission_note = ev.state, ev.message
        if events:
            self._send_admit(lin.lineage, out)

    def _send_admit(self, lid: bytes, out: list[Action]) -> None:
        """Tell the worker whether it may generate for the lineage it follows (the guard decides)."""
        if lid == self.committed:
            self.admitted = self.guard.may_generate(lid)
            out.append(ToWorker(pipe.Admit(lid.hex(), self.admitted)))

    # ------------------------------------------------------------ roles and the capacity rule
    def _demand(self) -> wire.LineageDemand | None:
        lin = self.table.rows.get(self.own) if self.own is not None else None
        if lin is None:
            return None
        # The capacity rule counts in published versions (the staleness bound is in versions): one
        # version spans `publish_every` optimizer steps, and needs that many steps' external rollouts.
        k = self.s.publish_every
        step_t = _median(self.version_times) if self.version_times else k * _median(self.step_times)
        step_t = min(max(step_t, MIN_STEP_S if step_t > 0 else 0.0), 1e6)
        b = k * self.s.external_rollouts * self.s.group_size
        d = roles.Demand(rollouts_per_step=b, step_time_s=step_t, max_staleness=self.s.max_staleness)
        offers = []
        prev_standby = set(lin.activation.standby) if lin.activation else set()
        now = self.clock()
        for pid, p in self.peers.items():
            a = p.announce
            if now - p.seen > PEER_EXPIRY_S or "follower" not in a.roles:
                continue
            if bytes(a.serving) == self.own or pid in prev_standby:
                # a claimed throughput counts only as far as this follower's verified deliveries back it
                offers.append(roles.Offer(pid, roles.offer_rate(a.gen_tokens_per_s, self.tokens_per_rollout),
                                          a.rollout_latency_s, backed=self.deliveries.credit(pid, now)))
        lin.activation = roles.activate(d, offers, self.dissemination_s())
        self.counters["claims_capped"] += len(lin.activation.capped)
        return wire.LineageDemand(lineage=lin.lineage, name=lin.name, head_version=lin.head, rollouts_per_step=b,
                                  step_time_s=step_t, max_staleness=self.s.max_staleness,
                                  standby=lin.activation.standby[:256])

    def _choose_serving(self, out: list[Action]) -> None:
        if "follower" not in self.roles:
            return
        now = self.clock()
        supply: dict[bytes, float] = {}
        for q in self.peers.values():
            if now - q.seen <= PEER_EXPIRY_S and q.announce.serving:
                lid = bytes(q.announce.serving)
                supply[lid] = supply.get(lid, 0.0) + roles.offer_rate(q.announce.gen_tokens_per_s,
                                                                      self.tokens_per_rollout)
        options = []
        for lin, d in self.table.followable(now, self.s.follow):
            options.append(roles.LineageOption(lin.lineage, d, supply.get(lin.lineage, 0.0), lin.standby))
        me = roles.Offer(self.ident.peer_id, roles.offer_rate(self.gen_tps, self.tokens_per_rollout), self.latency)
        choice = roles.choose_lineage(me, options, self.dissemination_s(), self.serving, configured=list(self.s.follow))
        self.serving_reason = choice.reason
        self._pace(next((o.demand for o in options if o.lineage == choice.lineage), None), out)
        if choice.lineage == self.serving:
            return
        lin = self.table.rows[choice.lineage] if choice.lineage is not None else None
        if lin is not None:
            lin.relation = "follow"
            out.append(LoadStored(lin.lineage))
        self.table.serving = choice.lineage
        self.catching = None
        self.behind_since = None
        out.append(Log("serving", {"lineage": choice.lineage.hex() if choice.lineage else None,
                                   "reason": choice.reason}))
        if lin is None or lin.delivered or lin.lineage in self.s.follow:
            self._commit(out)
        else:
            out.append(Log("lineage on trial", {"lineage": lin.lineage.hex()[:16], "trial_s": TRIAL_S}))
        if lin is not None:
            self._observe_head(lin, out)

    def _commit(self, out: list[Action]) -> None:
        """Switch the worker to the served lineage (or stand it by)."""
        if self.serving == self.committed:
            return
        lin = self.table.rows.get(self.serving) if self.serving is not None else None
        info = pipe.FollowInfo(lin.lineage.hex(), lin.name, lin.publisher.hex(), lin.base.hex()) if lin else None
        self.table.committed = lin.lineage if lin else None
        self.follow_info = info
        out.append(ToWorker(pipe.Follow(info)))
        if lin is not None:
            out.append(Log("following", {"lineage": lin.lineage.hex()[:16], "delivered": lin.delivered}))
            self._observe_head(lin, out)
            self._send_admit(lin.lineage, out)

    def _pace(self, demand: roles.Demand | None, out: list[Action]) -> None:
        """Cap the follower's generation at its trainer's need, so surplus rollouts do not take CPU from trainers.

        The cap is the whole need `(1+m)·B/T_L` (not the unmet part: announced
        throughputs are capacities, not current rates); 0 means no cap (the
        trainer has not measured a step yet).
        """
        rate = roles.required_rate(demand) if demand is not None else 0.0
        if abs(rate - self.pace_rate) > 0.1 * max(rate, self.pace_rate, 1e-9):
            self.pace_rate = rate
            out.append(ToWorker(pipe.Pace(rate)))

    def _announce(self) -> bytes:
        # above every seq this key signed before a restart, so receivers order our announces by seq alone
        self.announce_seq = max(self.announce_seq + 1, self.wall_ms())
        self.announced_rate = min(self.publish_meter.rate(self.clock()), 1e6)
        demand = self._demand()
        a = wire.NodeAnnounce(
            v=wire.FORMAT_VERSION, peer_id=self.ident.peer_id, seq=self.announce_seq, created_ms=self.wall_ms(),
            hardware=self.s.hardware, gen_tokens_per_s=min(self.gen_tps, 1e9),
            rollout_latency_s=min(self.latency, 1e6), upload_bytes_per_s=min(self.s.upload_bytes_per_s, 1e12),
            memory_bytes=self.s.memory_budget_mb * 2**20, roles=self.roles,
            lineages_followed=[self.committed] if self.committed else [], serving=self.committed or b"",
            owned=[demand] if demand else [], addrs=list(self.addrs),
            publish_batches_per_s=self.announced_rate)
        return wire.seal(self.ident, wire.NODE_ANNOUNCE, a, swarm=self.s.swarm)

    # ------------------------------------------------------------ catch-up
    def _free_items(self, lid: bytes, now: float) -> dict[tuple[str, int, int], StoredItem]:
        """Held items and accepted transfers still on their way: both cost nothing to plan with."""
        keys = set(self.stored.get(lid, set()))
        keys |= {(k, b, t) for (lin, k, b, t), at in self.in_flight.items()
                 if lin == lid and now - at < IN_FLIGHT_PATIENCE_S}
        return {key: StoredItem(key[0], key[1], key[2], 0) for key in keys}

    def _catch_up(self, now: float, out: list[Action]) -> None:
        """Get from the held version to the head without downloading anything held or already in flight.

        Steady-state versions arrive by the broadcast on their own; this only
        acts when what is held plus what is in flight cannot reach the head
        (joined late, restarted, missed a manifest): it asks the publisher
        (then peers serving the lineage) for its catalog, plans the cheapest
        route with `sync.catchup.choose` (cost O(items)), and has the peer
        seed the missing items into the broadcast.
        """
        lid = self.serving
        lin = self.table.rows.get(lid) if lid is not None else None
        gap, self.last_check = now - self.last_check, now
        if lin is None or (lin.head <= lin.held and not lin.need_anchor):
            self.catching = None
            self.behind_since = None
            return
        if lin.held != self.progress[0]:
            self.progress = (lin.held, now)
            self.behind_since = now
        if self.behind_since is None:
            self.behind_since = now
        elif self.worker_state in WORKER_DOWN:
            self.behind_since += gap  # our own worker cannot apply anything: not the publisher's doing
        elif now - self.behind_since >= (LEAVE_AFTER_S if lin.delivered else TRIAL_S) \
                and lin.lineage not in self.s.follow:
            self._leave(lin, now, out)
            return
        try:
            choose(None if lin.need_anchor else lin.held, lin.head, self._free_items(lid, now).values())
            self.catching = None
            # Everything needed is held or on its way. If the worker still does not move, what the store
            # holds differs from our cache (a payload lost after it was stored): re-read the store.
            if now - self.progress[1] >= RESYNC_AFTER_S and now - self.last_resync >= RESYNC_AFTER_S:
                self.last_resync = now
                out.append(LoadStored(lid))
            return
        except PatchError:
            pass
        if self.catching is not None and now - self.catching.started < CATCH_UP_PATIENCE_S:
            return
        publisher_peer = peer_id_from_public(lin.publisher)
        sources = [publisher_peer] + [pid for pid, p in self.peers.items()
                                      if bytes(p.announce.serving) == lid and pid != publisher_peer
                                      and now - p.seen <= PEER_EXPIRY_S]
        self.catching = CatchUp(lid, sources[:CATALOG_SOURCES], now)
        self._ask_next(out)

    def _leave(self, lin: LineageState, now: float, out: list[Action]) -> None:
        """The served lineage's versions could not be fetched: leave it and remember its publisher. Not
        charged: an unreachable publisher is not provably lying."""
        why = (f"held {lin.held} < head {lin.head} with no version applied for {LEAVE_AFTER_S:.0f} s" if lin.delivered
               else f"no version applied within {TRIAL_S:.0f} s of choosing it (head {lin.head})")
        self.table.avoid(lin.publisher, why, now)
        self.counters["lineages_left"] += 1
        out.append(Log("left lineage", {"lineage": lin.lineage.hex()[:16], "publisher":
                                        peer_id_from_public(lin.publisher), "why": why}))
        self._choose_serving(out)

    def _ask_next(self, out: list[Action]) -> None:
        c = self.catching
        if c is None:
            return
        if not c.sources:
            c.phase = CatchUpPhase.EXHAUSTED
            return
        c.phase, c.source = CatchUpPhase.ASKING, c.sources.pop(0)
        out.append(FetchCatalog(c.source, c.lineage))

    def _on_catalog_failed(self, ev: CatalogFailed, out: list[Action]) -> None:
        self._source_failed(ev, CatchUpPhase.ASKING, "catch-up source failed", out)

    def _on_offer_failed(self, ev: OfferFailed, out: list[Action]) -> None:
        """An offered item did not come: the source cannot seed what it listed, so the next source is asked."""
        self._source_failed(ev, CatchUpPhase.OFFERED, "catch-up offer failed", out)

    def _source_failed(self, ev: CatalogFailed | OfferFailed, phase: CatchUpPhase, what: str,
                       out: list[Action]) -> None:
        """The current source failed in `phase`: logged, and the next source asked (stale reports ignored)."""
        c = self.catching
        if c is None or c.phase is not phase or not c.from_source(ev.lineage, ev.peer):
            return
        out.append(Log(what, {"lineage": ev.lineage.hex()[:16], "peer": ev.peer, "error": ev.error[:200]}))
        self._ask_next(out)

    def _on_catalog(self, ev: CatalogReceived, out: list[Action]) -> None:
        c = self.catching
        lin = self.table.rows.get(ev.lineage)
        if c is None or c.phase is not CatchUpPhase.ASKING or not c.from_source(ev.lineage, ev.peer) or lin is None:
            return
        now = self.clock()
        free = self._free_items(ev.lineage, now)
        remote = [i for i in ev.items[:MAX_ITEMS]
                  if i.kind in KINDS and (i.kind, i.base, i.target) not in free and i.target <= lin.head]
        items = list(free.values()) + remote
        start = None if lin.need_anchor else lin.held
        head = min(lin.head, max((i.target for i in items), default=0))
        if start is not None and head <= start:
            self._ask_next(out)
            return
        try:
            try:
                plan = choose(start, head, items)
            except PatchError:  # the chain from what we hold was pruned there: an anchor will do
                plan = choose(None, head, items)
        except PatchError as e:
            out.append(Log("catch-up: no plan", {"lineage": ev.lineage.hex()[:16], "peer": ev.peer, "why": str(e)}))
            self._ask_next(out)
            return
        steps = [s for s in plan.steps if (s.kind, s.base, s.target) not in free]
        out.append(Log("catching up", {"lineage": ev.lineage.hex()[:16], "plan": plan.kind, "held": lin.held,
                                       "head": head, "fetch": len(steps), "bytes": plan.total_bytes,
                                       "source": ev.peer}))
        c.offered += len(steps)
        c.phase = CatchUpPhase.OFFERED
        for s in steps:
            out.append(RequestOffer(ev.peer, ev.lineage, s))

    # ------------------------------------------------------------ patches
    def _on_patch_stored(self, ev: PatchStored, out: list[Action]) -> None:
        m = ev.manifest
        lid = bytes(m.lineage)
        it = item_of(m)
        self.stored.setdefault(lid, set()).add((it.kind, it.base, it.target))
        self.in_flight.pop((lid, it.kind, it.base, it.target), None)
        if lid == self.serving:
            self._commit(out)  # fetched, its chunks matched the signed manifest: the worker may switch to it
        self.counters["bytes_down"] += max(0, int(ev.bytes_in))
        self.fetch_s.append((self.clock(), max(0.0, _finite(ev.seconds))))
        out.append(Log("patch received", {"lineage": lid.hex()[:16], "kind": it.kind, "base": it.base,
                                          "target": it.target, "bytes": m.total_bytes,
                                          "seconds": round(_finite(ev.seconds), 2)}))
        out.append(ToWorker(pipe.Patch(lid.hex(), it.kind, it.base, it.target)))

    # ------------------------------------------------------------ worker
    def _on_worker_exit(self, code: int | None, out: list[Action]) -> None:
        now = self.clock()
        if self.worker_state is WorkerState.RESTARTING:
            return
        if now - self.worker_started >= WORKER_STABLE_S:
            self.restarts_in_row = 0
        delay = RESTART_BACKOFF_S[min(self.restarts_in_row, len(RESTART_BACKOFF_S) - 1)]
        self.restarts_in_row += 1
        self.counters["worker_restarts"] += 1
        if code not in (0, None) and not self.worker_error:
            self.worker_error = f"worker exited with code {code}"
        self.worker_state = WorkerState.RESTARTING
        self.admitted = None
        self.pace_rate = 0.0
        out.append(Log("worker exited", {"code": code, "error": self.worker_error[:300], "restart_in_s": delay,
                                         "restarts": self.counters["worker_restarts"]}))
        out.append(RestartWorker(delay))

    def _on_worker(self, m: pipe.FromWorker, out: list[Action]) -> None:  # noqa: C901 - one branch per kind
        if isinstance(m, pipe.State):
            self.worker_state = m.state
            out.append(Log("worker state", {"state": self.worker_state.value}))
        elif isinstance(m, pipe.Ready):
            self._on_ready(m, out)
        elif isinstance(m, pipe.Rollouts):
            self._seal_rollouts(m.items, out)
        elif isinstance(m, pipe.Step):
            self.steps += 1
            self._reward(m.reward_mean)
            self.counters["used"] += m.used
            self.swarm_gave.append((m.external_groups, m.external_lineages, m.updates))
            if m.heldout is not None:
                self.heldout.append((m.step, m.heldout))
            self.step_times.append(max(0.0, _finite(m.step_s)))
            out.append(Log("step", {"step": m.step, "version": m.version, "reward_mean": m.reward_mean,
                                    "loss": m.loss, "n_external_groups": m.n_external_groups, "step_s": m.step_s}))
        elif isinstance(m, pipe.Gen):
            self._reward(m.reward_mean)
        elif isinstance(m, pipe.Published):
            now = self.clock()
            if self.last_publish:
                self.version_times.append(now - self.last_publish)
            self.last_publish = now
            self.counters["published"] = m.version
            lin = self.table.rows.get(self.own) if self.own is not None else None
            if lin is not None:
                lin.head = lin.held = lin.signed_head = m.version
            out.append(SeedVersion(m.envelope))
        elif isinstance(m, pipe.Applied):
            self._on_applied(m, out)
        elif isinstance(m, pipe.ApplyFailed):
            out.append(Log("patch apply failed", {"lineage": m.lineage[:16], "base": m.base, "target": m.target,
                                                  "error": m.error[:300]}))
            lid = bytes.fromhex(m.lineage)
            lin = self.table.rows.get(lid)
            if m.fault == "non_finite_patch" and lin is not None and len(lin.publisher) == 32:
                self.counters["patches_not_finite"] += 1
                out.append(Penalise(peer_id_from_public(lin.publisher), m.fault, FORGERY_PENALTY))
            self.stored.get(lid, set()).discard((diff_kind(m.base, m.target), m.base, m.target))
            out.append(DropItem(lid, m.base, m.target))  # fetched again (from another peer)
        elif isinstance(m, pipe.Perf):
            a = 0.3
            tps, lat = max(0.0, _finite(m.gen_tokens_per_s)), max(0.0, _finite(m.rollout_latency_s))
            self.gen_tps = tps if not self.gen_tps else (1 - a) * self.gen_tps + a * tps
            self.latency = lat if not self.latency else (1 - a) * self.latency + a * lat
        elif isinstance(m, pipe.Engine):
            self.engine = m.mode or f"{m.requested} unavailable: {m.error}"
            out.append(Log("worker engine", {"engine": self.engine}))
        elif isinstance(m, pipe.SpotRound):
            self.counters["spot_eligible"] += max(0, m.eligible)
        elif isinstance(m, pipe.Spot):
            self.counters["spot_checked"] += 1
            if not m.ok:
                self.counters["spot_failed"] += 1
                peer = peer_id_from_public(bytes.fromhex(m.producer))
                out.append(Penalise(peer, "spot_check_failed", SPOT_PENALTY))
                out.append(Log("spot check failed", {"producer": peer, "diff": m.diff}))
        elif isinstance(m, pipe.Error):
            self.worker_error = m.message[:4000]
            out.append(Log("worker failed", {"error": self.worker_error[:300]}))
        elif isinstance(m, pipe.Log):
            out.append(Log("worker", {"message": m.message[:500]}))

    def _on_ready(self, m: pipe.Ready, out: list[Action]) -> None:
        base = bytes.fromhex(m.base)
        self.table.set_my_base(base, m.model_bytes)
        if m.lineage:
            lin = self.table.set_own(bytes.fromhex(m.lineage), m.name, self.ident.public, base, m.version)
            self.counters["published"] = lin.held
        out.append(Log("worker ready", {"base": m.base, "model_bytes": m.model_bytes, "version": m.version,
                                        **({"lineage": m.lineage, "name": m.name} if m.lineage else {})}))
        self.worker_state = WorkerState.READY
        for lin in self.table.rows.values():  # a restarted worker's sampler starts with no heads
            lin.worker_head = -1
            self._tell_head(lin, out)
        if self.committed is not None and self.follow_info is not None:  # a restarted worker resumes where we are
            out.append(ToWorker(pipe.Follow(self.follow_info)))
            self._send_admit(self.committed, out)

    def _on_applied(self, m: pipe.Applied, out: list[Action]) -> None:
        lin = self.table.rows.get(bytes.fromhex(m.lineage))
        if lin is None:
            return
        if m.version > lin.held:
            self.counters["applied"] += m.version - lin.held
            lin.delivered = True
        lin.held = m.version
        lin.need_anchor = m.need_anchor
        lin.head = max(lin.head, lin.held)
        if lin.relation == "seen":
            lin.relation = "follow"
        if not lin.need_anchor and lin.lineage in (self.serving, self.committed):
            self._staleness(lin, self.guard.applied(lin.lineage, lin.held, self.clock()), out)
        if lin.delivered and lin.lineage == self.serving:
            self._commit(out)

    def _reward(self, r: Any) -> None:
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            return
        self.rewards.append(float(r))
        if len(self.reward_first) < 5:
            self.reward_first.append(float(r))

    # ------------------------------------------------------------ rollouts
    def _seal_rollouts(self, encoded: list[bytes], out: list[Action]) -> None:
        """Our worker's rollouts: batches of at most 64, each signed once, recorded, then published."""
        from gossip.validation import rollout_id

        rollouts = []
        for b in encoded:
            try:
                r = wire.decode_struct(b, wire.Rollout, wire.KIND_LIMITS[wire.ROLLOUT_BATCH])
            except DecodeError as e:
                out.append(Log("worker rollout undecodable", {"error": str(e)[:200]}))
                continue
            # what receivers refuse as a forgery is never signed (an engine's missing log-prob is NaN)
            bad = (wire.rollout_number_fault(r) if len(r.logprobs) == 4 * len(r.completion_ids)
                   else "log-prob bytes do not match the tokens")
            if bad:
                self.counters["rollouts_unpublishable"] += 1
                out.append(Log("worker rollout not published", {"error": bad[:200]}))
                continue
            rollouts.append(r)
        by_lineage: dict[bytes, list[wire.Rollout]] = {}
        for r in rollouts:  # a batch goes to its lineage's shard, so it holds one lineage
            by_lineage.setdefault(bytes(r.lineage), []).append(r)
        parts = [(lid, rs[i:i + BATCH_MAX_ROLLOUTS]) for lid, rs in by_lineage.items()
                 for i in range(0, len(rs), BATCH_MAX_ROLLOUTS)]
        for lid, part in parts:
            # wall-clock microseconds: still increasing after a restart or a reboot (a reused seq is a replay)
            self.rollout_seq = max(self.rollout_seq + 1, int(self.wall_ms()) * 1000)
            batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=self.s.swarm, producer=self.ident.public,
                                      seq=self.rollout_seq, created_ms=self.wall_ms(), rollouts=part)
            data = wire.seal(self.ident, wire.ROLLOUT_BATCH, batch, swarm=self.s.swarm)
            out.append(RecordRollouts(tuple(
                dict(rollout_id=rollout_id(r), direction="produced", status="produced", producer=self.ident.public,
                     lineage=bytes(r.lineage), version=r.version, task_set=bytes(r.task.task_set),
                     generator=r.task.generator, task_seed=r.task.seed, reward=r.reward,
                     tokens=len(r.completion_ids), payload=data if j == 0 else None)
                for j, r in enumerate(part))))
            self.publish_meter.tick(self.clock())
            out.append(Publish("rollouts", data, len(part), self.exchange.publish_shard(lid)))

    # ------------------------------------------------------------ the rollout exchange
    def _meter_inbound(self, rollouts: int) -> None:
        """A peer's batch of `rollouts` rollouts passed verification (what the exchange measures)."""
        n = max(0, int(rollouts))
        self.inbound.add(self.clock(), n)
        self.batch_rollouts = 0.95 * self.batch_rollouts + 0.05 * max(1, n)

    def external_demand(self) -> float:
        """Rollouts/s this node's trainer takes from others (J groups a step); 0 for a node that trains not."""
        if "trainer" not in self.roles:
            return 0.0
        step_t = _median(self.step_times) if self.step_times else DEFAULT_STEP_S
        return self.s.external_rollouts * self.s.group_size / max(step_t, MIN_STEP_S, 1e-3)

    def _plan_exchange(self, now: float, out: list[Action]) -> None:
        """Which rollout shards to join (gossip.exchange), from what the announces say, in batches/s."""
        producers = int("trainer" in self.roles or "follower" in self.roles) + self._producers_count(now)
        own = None
        if self._supply_view is not None:
            supply = self._supply_view()
            mine = self.committed if self.committed is not None else self.own
            if mine is not None:  # the view counts our own last announce too: not offered to ourselves
                own = (mine, min(self.announced_rate, 1e3))
        else:
            supply = exchange.Supply()
            for p in self.peers.values():
                a = p.announce
                if now - p.seen > PEER_EXPIRY_S or not a.publish_batches_per_s > 0:
                    continue
                lid = bytes(a.serving) or (bytes(a.owned[0].lineage) if a.owned else b"")
                if lid:
                    supply.add(lid, min(a.publish_batches_per_s, 1e3))
        per_batch = max(1.0, self.batch_rollouts)
        demand = self.external_demand()
        # home: our own lineage's shard when followers produce for it, the validated lineage's shard
        own_supply = supply.of(self.own) - (own[1] if own is not None and own[0] == self.own else 0.0) \
            if self.own is not None else 0.0
        home = [self.own] if self.own is not None and own_supply > 1e-9 else []
        if "validator" in self.roles and self.committed is not None:
            home.append(self.committed)
        measured = self.inbound.rate(now) if demand > 0 else None
        plan = self.exchange.plan(now, producers, supply, demand / per_batch, home,
                                  measured / per_batch if measured is not None else None, own)
        if (plan.shards, plan.subscribe) != self.subscribed:
            self.subscribed = (plan.shards, plan.subscribe)
            out.append(Subscribe(plan.shards, plan.subscribe))
            out.append(Log("exchange", {"shards": plan.shards, "subscribe": list(plan.subscribe),
                                        "home": list(plan.home), "producers": producers,
                                        "demand_rollouts_per_s": round(demand, 2)}))

    def external_wanted(self, lineages: set[bytes]) -> bool:
        """Whether an accepted rollout batch goes to our worker (a trainer learns; a validator spot-checks)."""
        return "trainer" in self.roles or ("validator" in self.roles and self.committed in lineages)
