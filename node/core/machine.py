"""The node's decisions as one sans-IO state machine: events in, actions out, time given by the driver.

API (the live runtime, the virtual-time simulator and the tests all drive it the same way):

    core = NodeCore(settings, identity, now)        # CoreSettings, gossip.identity.Identity, the start (seconds)
    actions = core.handle(event, now, wall_ms)      # one event at the driver's time -> a list of actions, in
                                                    # the order to carry out; `now`: monotonic seconds (timers,
                                                    # rates), `wall_ms`: unix ms (created_ms stamps)
    core.next_deadline()                            # when the core next needs a Tick (in the drivers' `now`)
    core.offer_manifest(manifest, now)              # handle(ManifestOffered(manifest)) as the broadcast's bool
    core.head_of(lineage)                           # the publisher-signed head, for the validation pipeline
    core.external_wanted(lineages)                  # whether an accepted rollout batch goes to the worker
    core.stats()                                    # a copy of the core's counters (the drivers never write them)

Events (`node.core.events`, re-exported here): `Tick` (timers: announce, catch-up, expiry), `AnnounceHeard` and
`ManifestHeard` (a gossip message whose envelope signature the pipeline already checked), `ManifestOffered`
(the broadcast asks whether to fetch a manifest: `Accept` or `Decline`),
`PeerGone`, `FromWorker` (a message from the worker process), `WorkerStarted`, `WorkerExited`,
`LineageKnown` (a lineage the store held at start), `StoredItems`, `TransferDone`, `PatchStored`,
`CatalogReceived`/`CatalogFailed` (catch-up replies), `OfferFailed`, `ListenAddrs`,
`RolloutsVerified` (a batch the pipeline accepted: what each follower delivered, `node.core.credit`, and what
the rollout exchange meters),
`RolloutsPublished` (a rollout Publish that went out), `SwarmHeard` (the announce topic's swarm-wide sums, from a
driver that does not feed every announce the topic carries). An event of another type is a driver bug:
`handle` ends in `assert_never`.

Actions: `Publish` (its `Topic`: announce or rollouts, with the rollout shard), `Subscribe` (rollout shards), `ToWorker`, `RestartWorker`, `RecordRollouts`,
`SeedVersion`, `StorePatch`, `DropItem`, `LoadStored`, `FetchCatalog`, `RequestOffer`, `Penalise`
(a positive amount: what the peer loses), `SeePeer` (persist a peer), `ResendTaskSets` (a new peer
appeared), `Log`.

State is proportional to what the node hears: a bounded peer table (`max_peers`, least recently
seen evicted) and a bounded lineage table (`max_lineages`, least recently active "seen" lineages
evicted; the own, the served and the worker's followed lineage stay).

`NodeCore` is the composition: it routes each event to the sub-machines that own its rules and keeps the
glue between them (announces and the capacity rule, the follower's lineage choice, the trial and
leaving, staleness admission and heads, the rollout exchange's plan, what the worker reports). The
sub-machines, each sans-IO with its own tests, are given the `now` of the event being handled (no clock is
read inside the core or a sub-machine, so one `handle` call sees one time), and follow one calling
convention: a method that may act appends its actions to the caller's `out: list[Action]`, and returns only
a query result (a bool, a row, a refusal, a need), never actions:
`node.core.peertable.PeerTable` (the peer table, expiry, a new peer's greeting), `node.core.lineages.LineageTable`
(lineage identity and heads), `node.core.catchup.CatchUpMachine` (items held and in flight, the broadcast
accept rule, catch-up attempts, when the served lineage is left), `node.core.supervision.WorkerSupervisor`
(worker state and restart backoff) and `node.core.sealing.RolloutSealer` (signed rollout batches). Rules from
elsewhere: the capacity rule in `node.roles`; staleness admission in `sync.staleness`; the patch accept
rule in `sync.items.wanted`; catch-up planning in `sync.catchup.choose`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, assert_never

from murmur.gossip import exchange, wire
from murmur.gossip.identity import Identity, peer_id_from_public
from murmur.node import pipe
from murmur.node.config import NetworkSection, NodeSection, SyncSection, TrainingSection
from murmur.node.core import roles
from murmur.node.core.catchup import LEAVE_AFTER_S, TRIAL_S, CatchUp, CatchUpMachine, CatchUpNeed
from murmur.node.core.credit import Deliveries
from murmur.node.core.events import (
    Accept,
    Action,
    AnnounceHeard,
    CatalogFailed,
    CatalogReceived,
    Decline,
    DropItem,
    Event,
    FromWorker,
    LineageKnown,
    ListenAddrs,
    LoadStored,
    Log,
    ManifestHeard,
    ManifestOffered,
    OfferFailed,
    PatchStored,
    PeerGone,
    Penalise,
    Publish,
    RolloutsPublished,
    RolloutsVerified,
    SeedVersion,
    StoredItems,
    StorePatch,
    Subscribe,
    SwarmHeard,
    Tick,
    Topic,
    ToWorker,
    TransferDone,
    WorkerExited,
    WorkerStarted,
)

# Actions the sub-machines emit, named as node.core.machine.X by the core's callers (the redundant alias marks a re-export).
from murmur.node.core.events import FetchCatalog as FetchCatalog
from murmur.node.core.events import RecordRollouts as RecordRollouts
from murmur.node.core.events import RequestOffer as RequestOffer
from murmur.node.core.events import ResendTaskSets as ResendTaskSets
from murmur.node.core.events import RestartWorker as RestartWorker
from murmur.node.core.events import SeePeer as SeePeer
from murmur.node.core.lineages import MIN_STEP_S, LineageState, LineageTable, Refusal
from murmur.node.core.peertable import PeerInfo, PeerTable
from murmur.node.core.rewards import RewardBook
from murmur.node.core.roles import ROLE_OBSERVE_S
from murmur.node.core.sealing import RolloutSealer
from murmur.node.core.supervision import WorkerSupervisor
from murmur.node.pipe import WorkerState
from murmur.sync.ids import Relation
from murmur.sync.items import diff_kind, item_of
from murmur.sync.staleness import StalenessEvent, StalenessGuard

ANNOUNCE_EVERY_S = 2.0
CATCH_UP_EVERY_S = 0.5
# A follower that stands by fetches no patches and so takes no new measure of their delivery time: the
# old measures expire, and it serves again to take new ones.
MEASURE_TTL_S = 300.0
CLAIM_PENALTY = 10.0  # a provably false signed claim about a lineage (node.core.lineages.Refusal)
FORGERY_PENALTY = 100.0  # ... that claims another key's lineage: graylisted at once, like a bad signature
SPOT_PENALTY = 25.0  # a failed log-prob spot check; two put a peer below the default graylist threshold
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
    # roles not configured and the hardware lets it train: train or follow by the swarm's need (roles.PodRule)
    choose_mode: bool = False
    role_observe_s: float = ROLE_OBSERVE_S
    role_dwell_s: float = NodeSection().role_dwell_s
    max_peers: int = 1024
    max_lineages: int = 256

    @classmethod
    def from_config(cls, cfg: Any, node_roles: list[str], hardware_class: str) -> CoreSettings:
        t = cfg.training
        return cls(
            swarm=cfg.node.swarm,
            roles=tuple(node_roles),
            hardware=hardware_class,
            choose_mode=roles.chooses_mode(cfg.node.roles, node_roles),
            role_dwell_s=cfg.node.role_dwell_s,
            max_staleness=cfg.sync.max_staleness,
            publish_every=max(1, cfg.sync.publish_every),
            external_rollouts=t.external_rollouts,
            group_size=t.group_size,
            max_new_tokens=t.max_new_tokens,
            upload_bytes_per_s=float(cfg.network.upload_bytes_per_s),
            memory_budget_mb=cfg.node.memory_budget_mb,
            follow=tuple(bytes.fromhex(x) for x in cfg.sync.follow),
        )


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
    def __init__(self, settings: CoreSettings, identity: Identity, now: float) -> None:
        self.s = settings
        self.ident = identity
        self.roles = list(settings.roles)
        # trains or follows by the swarm's need; its jitter (from the key) spreads the decisions of nodes
        # that started together
        self.pods = (
            roles.PodRule(
                "trainer" if "trainer" in self.roles else "follower",
                now,
                settings.role_observe_s,
                settings.role_dwell_s,
                identity.public[0] / 256,
            )
            if settings.choose_mode
            else None
        )
        # the sub-machines (each owns its rules and state; the core routes events to them)
        self.peer_table = PeerTable(settings.max_peers, identity.peer_id)
        self.table = LineageTable(settings.max_lineages)
        self.catchup = CatchUpMachine(now)
        self.supervisor = WorkerSupervisor(now)
        self.sealer = RolloutSealer(settings.swarm, identity)
        self.guard = StalenessGuard(settings.max_staleness)
        self.serving_reason = ""
        self.addrs: tuple[str, ...] = ()
        # the counters of the glue (the sub-machines count the rest: `stats`)
        self.counts: dict[str, int] = {
            "published": 0,
            "applied": 0,
            "spot_checked": 0,
            "spot_failed": 0,
            "used": 0,
            "rollouts_published": 0,
            "bytes_down": 0,
            "patches_not_finite": 0,
            "claims_capped": 0,
            "lineages_left": 0,
            "spot_eligible": 0,
            "role_switches": 0,
            "trials_refused": 0,
            "groups_trained": 0,
        }
        self.deliveries = Deliveries(max_peers=settings.max_peers)  # verified rollouts for our lineage, per producer
        self.tokenizer = b""  # our worker's tokenizer hash (its Ready): deliveries under another earn no credit
        self.supplied = Deliveries(max_peers=settings.max_peers)  # verified rollouts of any lineage, per producer
        # per lineage, the verified rewards of its informative groups: what orders the lineages it would follow
        self.verified_rewards = RewardBook(settings.max_lineages)
        self.steps = 0
        self.rewards: deque[float] = deque(maxlen=60)
        self.reward_first: list[float] = []
        self.step_times: deque[float] = deque(maxlen=8)
        # per step: (external groups trained, their lineages, optimizer updates); held-out (step, or the
        # version a follower held, accuracy)
        self.swarm_gave: deque[tuple[int, int, int]] = deque(maxlen=STEP_WINDOW)
        self.heldout: deque[tuple[int, float]] = deque(maxlen=60)
        # our own lineage's last held-out reading, and while a lineage we left it for is on trial, that reading
        self.own_quality: roles.Quality | None = None
        self.trial_of: roles.Quality | None = None
        self.version_times: deque[float] = deque(maxlen=8)
        self.fetch_s: deque[tuple[float, float]] = deque(maxlen=8)  # (when, seconds to deliver a patch)
        self.last_publish = 0.0
        self.gen_tps = 0.0
        self.latency = 0.0
        self.pace_rate = 0.0
        self.announce_seq = 0
        self._next_announce = 0.0
        self._next_catch_up = 0.0
        self.tokens_per_rollout = float(max(1, settings.max_new_tokens))
        self.follow_info: pipe.FollowInfo | None = None
        self.admitted: bool | None = None
        # the rollout exchange (gossip.exchange): which shards we join, fed from the peer table
        self.exchange = exchange.Exchange(identity.public)
        self.inbound = exchange.Meter()
        self.batch_rollouts = float(settings.group_size)  # mean rollouts per accepted batch (supply estimate)
        self.subscribed: tuple[int, tuple[int, ...]] = exchange.first_subscription()  # what the runtime joined first
        self.announced_rate = 0.0  # publish_batches_per_s of our last announce
        # a trainer publishes its own rollouts to the demand on its shard (gossip.exchange.publish_budget)
        self.outbox = exchange.Outbox(now) if "trainer" in settings.roles else None

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
        """When (in the drivers' `now`) the core next needs a `Tick`; a driver may tick earlier, never needs to."""
        return min(self._next_announce, self._next_catch_up)

    def stats(self) -> dict[str, int]:
        """The core's counters, its sub-machines' included, as a copy."""
        return {
            **self.counts,
            "worker_restarts": self.supervisor.restarts,
            "peers_evicted": self.peer_table.evicted,
            "rollouts_unpublishable": self.sealer.unpublishable,
            "rollouts_produced": self.sealer.produced,
            "rollouts_withheld": self.sealer.withheld,
            "rollouts_sealed": self.sealer.sealed,
            "rollouts_uninformative": self.sealer.uninformative,
            "groups_generated": self.sealer.groups_generated,
            "groups_sent": self.sealer.groups_sent,
        }

    @property
    def peers(self) -> dict[str, PeerInfo]:
        return self.peer_table.peers

    @property
    def worker_state(self) -> WorkerState:
        return self.supervisor.state

    @property
    def worker_error(self) -> str:
        return self.supervisor.error

    @property
    def engine(self) -> str:
        """What the worker runs (`pipe.Engine`): a MODE_*, or "<asked> unavailable: <why>"."""
        return self.supervisor.engine

    @property
    def catching(self) -> CatchUp | None:
        """The catch-up attempt under way, if any."""
        return self.catchup.attempt

    @property
    def in_flight(self) -> dict[tuple[bytes, str, int, int], float]:
        """Accepted transfers (lineage, kind, base, target) -> when accepted."""
        return self.catchup.in_flight

    def dissemination_s(self, now: float) -> float:
        return _median(s for t, s in self.fetch_s if now - t <= MEASURE_TTL_S)

    def offer_manifest(self, m: wire.PatchManifest, now: float) -> bool:
        """`handle(ManifestOffered(m), now, ...)` as the bool the broadcast's synchronous accept callback
        returns (its one action is the answer: nothing to carry out)."""
        return self._on_offered(m, now)

    def _on_offered(self, m: wire.PatchManifest, now: float) -> bool:
        """The follower's broadcast accept rule; an accepted manifest counts as in flight from now."""
        lid = bytes(m.lineage)
        # the committed lineage's patches still come while another is on trial: the worker keeps generating
        lin = self.table.rows.get(lid) if lid in (self.serving, self.committed) else None
        if lin is None or not lin.publisher or self.table.check_manifest(m) is not None:
            return False
        return self.catchup.accept(lin, m, now)

    # ------------------------------------------------------------ dispatch
    def handle(self, ev: Event, now: float, wall_ms: int) -> list[Action]:
        """One event at the driver's `now` (monotonic seconds: timers and rates) and `wall_ms` (unix
        milliseconds: the created_ms stamps receivers' freshness checks read): the actions to carry out, in order."""
        out: list[Action] = []
        if isinstance(ev, Tick):
            self._tick(now, wall_ms, out)
        elif isinstance(ev, AnnounceHeard):
            self._on_announce(ev, now, out)
        elif isinstance(ev, ManifestHeard):
            self._on_manifest(ev.body, now, out)
        elif isinstance(ev, FromWorker):
            self._on_worker(ev.msg, now, wall_ms, out)
        elif isinstance(ev, WorkerExited):
            self._on_worker_exit(ev.code, now, out)
        elif isinstance(ev, ListenAddrs):
            self.addrs = tuple(ev.addrs)[:16]
        elif isinstance(ev, PeerGone):
            self.peer_table.gone(ev.peer_id)
        elif isinstance(ev, WorkerStarted):
            self.supervisor.on_started(now)
        elif isinstance(ev, LineageKnown):
            self.table.load(ev.lineage, ev.name, ev.relation, ev.publisher, ev.base, ev.held, now)
        elif isinstance(ev, RolloutsPublished):
            self.counts["rollouts_published"] += max(0, int(ev.count))
        elif isinstance(ev, SwarmHeard):
            self.peer_table.on_swarm(ev, now)
        elif isinstance(ev, OfferFailed):
            self.catchup.on_offer_failed(ev, out)
        elif isinstance(ev, StoredItems):
            self.catchup.on_stored_items(ev.lineage, ev.items)
            if ev.items and ev.lineage == self.serving:
                self._commit(now, out)  # stored items were fetched and hash-checked: it delivered
        elif isinstance(ev, TransferDone):
            it = item_of(ev.manifest)
            if not self.catchup.holds(bytes(ev.manifest.lineage), (it.kind, it.base, it.target)):
                out.append(StorePatch(ev.pid))
        elif isinstance(ev, PatchStored):
            self._on_patch_stored(ev, now, out)
        elif isinstance(ev, CatalogReceived):
            self.catchup.on_catalog(ev, self.table.rows.get(ev.lineage), now, out)
        elif isinstance(ev, CatalogFailed):
            self.catchup.on_catalog_failed(ev, out)
        elif isinstance(ev, ManifestOffered):
            out.append(Accept() if self._on_offered(ev.manifest, now) else Decline())
        elif isinstance(ev, RolloutsVerified):
            self._meter_inbound(sum(n for _, n in ev.lineages), now)
            self.supplied.add(ev.producer, sum(n for _, n in ev.lineages), now)
            for lid, tok, n in ev.usable:
                if lid == self.own and tok == self.tokenizer:
                    self.deliveries.add(ev.producer, n, now)
            for lid, rs in ev.rewards:
                # a lineage's score is its publisher's own samples: anyone may sign rollouts labelled with any
                # lineage, and a stranger's bad ones would otherwise smear it
                lin = self.table.rows.get(lid)
                if lin is not None and lin.publisher and peer_id_from_public(lin.publisher) == ev.producer:
                    self.verified_rewards.add(lid, rs)
        else:
            assert_never(ev)
        return out

    # ------------------------------------------------------------ timers
    def _tick(self, now: float, wall_ms: int, out: list[Action]) -> None:
        if now >= self._next_announce:
            self._next_announce = now + ANNOUNCE_EVERY_S
            self._choose_mode(now, out)
            self._choose_serving(now, out)
            self._plan_exchange(now, out)
            out.append(Publish(Topic.ANNOUNCE, self._announce(now, wall_ms)))
            self.peer_table.expire(now)
            self.catchup.expire(now)
        if now >= self._next_catch_up:
            self._next_catch_up = now + CATCH_UP_EVERY_S
            self._catch_up(now, out)

    # ------------------------------------------------------------ gossip
    def _on_announce(self, ev: AnnounceHeard, now: float, out: list[Action]) -> None:
        greeting: list[Action] = []  # carried out once the announce's claims are handled
        if not self.peer_table.on_announce(ev, now, greeting):
            return
        for d in ev.body.owned:
            lin, why = self.table.on_demand(bytes(ev.signer), d, now)
            if why is not None:
                self._refused(ev.body.peer_id, "lineage claim refused", why, out)
            elif lin is not None:
                self._observe_head(lin, now, out)
        out.extend(greeting)

    def _on_manifest(self, m: wire.PatchManifest, now: float, out: list[Action]) -> None:
        lin, why = self.table.on_manifest(m, now)
        if why is not None:
            self._refused(peer_id_from_public(bytes(m.publisher)), "manifest refused", why, out)
        elif lin is not None:
            self._observe_head(lin, now, out)

    def _refused(self, signer: str, msg: str, why: Refusal, out: list[Action]) -> None:
        out.append(Log(msg, {"peer": signer, "why": why.reason[:200], "fault": why.fault}))
        if why.fault:
            out.append(
                Penalise(signer, f"lineage: {why.reason}"[:120], FORGERY_PENALTY if why.forged else CLAIM_PENALTY)
            )

    # ------------------------------------------------------------ staleness admission
    def _observe_head(self, lin: LineageState, now: float, out: list[Action]) -> None:
        if lin.lineage in (self.serving, self.committed):
            self._staleness(lin, self.guard.observe_head(lin.lineage, lin.head, now), out)
        self._tell_head(lin, out)

    def _tell_head(self, lin: LineageState, out: list[Action]) -> None:
        """A trainer's worker learns the head of every lineage that publishes (`LineageTable.head_to_tell`:
        announcing one is not enough, so rollouts under a lineage no one publishes are never trained on): its
        sampler ages every lineage's external groups out against them, not only its own (one message per head
        advance), and trains on no lineage whose head it was never told."""
        if "trainer" in self.roles:
            head = self.table.head_to_tell(lin)
            if head is not None:
                out.append(ToWorker(pipe.Head(lin.lineage.hex(), head)))

    def _staleness(self, lin: LineageState, events: list[StalenessEvent], out: list[Action]) -> None:
        for ev in events:
            out.append(Log("staleness", {"lineage": lin.lineage.hex()[:16], "state": ev.state, "message": ev.message}))
            self.table.admission_changed(lin, ev.state, ev.message)
        if events:
            self._send_admit(lin.lineage, out)

    def _send_admit(self, lid: bytes, out: list[Action]) -> None:
        """Tell the worker whether it may generate for the lineage it follows (the guard decides)."""
        if lid == self.committed:
            self.admitted = self.guard.may_generate(lid)
            out.append(ToWorker(pipe.Admit(lid.hex(), self.admitted)))

    # ------------------------------------------------------------ roles and the capacity rule
    def _demand(self, now: float) -> wire.LineageDemand | None:
        lin = self.table.rows.get(self.own) if self.own is not None else None
        if lin is None or "trainer" not in self.roles:  # a trainer turned follower no longer asks for its lineage
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
        for pid, p in self.peer_table.live(now):
            a = p.announce
            if "follower" not in a.roles:
                continue
            if bytes(a.serving) == self.own or pid in prev_standby:
                # a claimed throughput counts only as far as this follower's verified deliveries back it
                offers.append(
                    roles.Offer(
                        pid,
                        roles.offer_rate(a.gen_tokens_per_s, self.tokens_per_rollout),
                        a.rollout_latency_s,
                        backed=self.deliveries.credit(pid, now),
                    )
                )
        act = roles.activate(d, offers, self.dissemination_s(now))
        self.table.activated(lin, act)
        self.counts["claims_capped"] += len(act.capped)
        supply = act.supply if math.isfinite(act.supply) else 0.0
        return wire.LineageDemand(
            lineage=lin.lineage,
            name=lin.name,
            head_version=lin.head,
            rollouts_per_step=b,
            step_time_s=step_t,
            max_staleness=self.s.max_staleness,
            standby=act.standby[:256],
            supply_rollouts_per_s=min(max(0.0, supply), 1e9),
        )

    @property
    def role_reason(self) -> str:
        """Why this node trains or follows, when it chooses (else "")."""
        return self.pods.reason if self.pods is not None else ""

    def _choose_mode(self, now: float, out: list[Action]) -> None:
        """Pods by default (`roles.want_mode`, `roles.PodRule`): train our own lineage or generate for a published
        one short of rollouts. Only what publishers sign counts: their demand, bounded by the cadence of their
        signed versions, and the supply they count (followers' claims capped by verified delivery)."""
        if self.pods is None:
            return
        mode = self.pods.mode
        me = roles.Offer(self.ident.peer_id, roles.offer_rate(self.gen_tps, self.tokens_per_rollout), self.latency)
        options = []
        for lin, d in self.table.followable(now):
            if not lin.manifests and not lin.delivered:
                continue  # announced, never published: a head moved by announces proves no training
            mine = me.rollouts_per_s if mode == "follower" and lin.lineage == self.committed else 0.0
            options.append(
                roles.PodOption(
                    lin.lineage,
                    d,
                    max(0.0, lin.supply - mine),
                    me.peer_id in lin.standby,
                    self.verified_rewards.mean(lin.lineage),
                )
            )
        own = self.table.rows.get(self.own) if self.own is not None else None
        act = own.activation if own is not None and mode == "trainer" else None
        wanted = roles.want_mode(
            mode,
            options,
            me,
            (self.verified_rewards.mean(own.lineage), own.lineage) if own is not None else None,
            act.supply if act is not None and act.active else 0.0,
            self.dissemination_s(now),
            refused=self.pods.refused(now),
        )
        new = self.pods.step(now, wanted)
        if new is not None:
            # the lineage it takes is on trial until the weights it holds of it are measured (`_judge_trial`)
            self.trial_of = self.own_quality if new == "follower" else None
            self._switch_mode(now, new, out)

    def _judge_trial(self, quality: roles.Quality, now: float, out: list[Action]) -> None:
        """The first held-out reading of a lineage this node left its own for (`_choose_mode`): weights
        measurably worse than its own (`roles.not_worse`) send it back to its own lineage at once, and that
        lineage is no option for a dwell (`roles.PodRule.refuse`)."""
        if self.trial_of is None or self.pods is None or self.committed is None:
            return
        own, self.trial_of = self.trial_of, None
        if roles.not_worse(quality, own):
            return
        why = (
            f"lineage {self.committed.hex()[:8]} measured {quality.accuracy:.2f} < my own {own.accuracy:.2f}:"
            " back to my lineage"
        )
        self.counts["trials_refused"] += 1
        out.append(
            Log(
                "trial refused",
                {"lineage": self.committed.hex()[:16], "measured": quality.accuracy, "own": own.accuracy},
            )
        )
        new = self.pods.refuse(self.committed, now, why)
        if new is not None:
            self._switch_mode(now, new, out)

    def _switch_mode(self, now: float, new: str, out: list[Action]) -> None:
        """Restart the worker as a `new` (trainer or follower), keeping what the node holds."""
        assert self.pods is not None
        self.roles = roles.switch_roles(self.roles, new)
        # the new worker starts afresh: nothing followed, nothing told; the store keeps every lineage it held
        self.table.drop_choice()
        self.follow_info, self.admitted, self.pace_rate = None, None, 0.0
        self.serving_reason = ""
        self.catchup.reset()
        self.outbox = exchange.Outbox(now) if new == "trainer" else None
        self.counts["role_switches"] += 1
        out.append(Log("role", {"roles": list(self.roles), "reason": self.pods.reason}))
        self.supervisor.restart_for(now, out)
        out.append(RestartWorker(0.0, tuple(self.roles)))

    def _choose_serving(self, now: float, out: list[Action]) -> None:
        if "follower" not in self.roles:
            return
        me = roles.Offer(self.ident.peer_id, roles.offer_rate(self.gen_tps, self.tokens_per_rollout), self.latency)
        options = []
        refused = self.pods.refused(now) if self.pods is not None else set()
        for lin, d in self.table.followable(now, self.s.follow):
            if lin.lineage in refused:
                continue
            # the supply its trainer signs (claims capped by verified delivery), less our own share of it:
            # another follower's announced throughput is its own claim, which this node cannot observe
            mine = me.rollouts_per_s if lin.lineage == self.serving and me.peer_id not in lin.standby else 0.0
            options.append(roles.LineageOption(lin.lineage, d, max(0.0, lin.supply - mine), lin.standby))
        choice = roles.choose_lineage(
            me, options, self.dissemination_s(now), self.serving, configured=list(self.s.follow)
        )
        self.serving_reason = choice.reason
        self._pace(next((o.demand for o in options if o.lineage == choice.lineage), None), out)
        if choice.lineage == self.serving:
            return
        chosen = self.table.serve(choice.lineage)
        if chosen is not None:
            out.append(LoadStored(chosen.lineage))
        self.catchup.reset()
        out.append(
            Log("serving", {"lineage": choice.lineage.hex() if choice.lineage else None, "reason": choice.reason})
        )
        if chosen is None or chosen.delivered or chosen.lineage in self.s.follow:
            self._commit(now, out)
        else:
            out.append(Log("lineage on trial", {"lineage": chosen.lineage.hex()[:16], "trial_s": TRIAL_S}))
        if chosen is not None:
            self._observe_head(chosen, now, out)

    def _commit(self, now: float, out: list[Action]) -> None:
        """Switch the worker to the served lineage (or stand it by)."""
        if self.serving == self.committed:
            return
        lin = self.table.rows.get(self.serving) if self.serving is not None else None
        info = pipe.FollowInfo(lin.lineage.hex(), lin.name, lin.publisher.hex(), lin.base.hex()) if lin else None
        self.table.commit(lin.lineage if lin else None)
        self.follow_info = info
        out.append(ToWorker(pipe.Follow(info)))
        if lin is not None:
            out.append(Log("following", {"lineage": lin.lineage.hex()[:16], "delivered": lin.delivered}))
            self._observe_head(lin, now, out)
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

    def _announce(self, now: float, wall_ms: int) -> bytes:
        # above every seq this key signed before a restart, so receivers order our announces by seq alone
        self.announce_seq = max(self.announce_seq + 1, wall_ms)
        self.announced_rate = min(self.sealer.rate(now), 1e6)
        demand = self._demand(now)
        a = wire.NodeAnnounce(
            v=wire.FORMAT_VERSION,
            peer_id=self.ident.peer_id,
            seq=self.announce_seq,
            created_ms=wall_ms,
            hardware=self.s.hardware,
            gen_tokens_per_s=min(self.gen_tps, 1e9),
            rollout_latency_s=min(self.latency, 1e6),
            upload_bytes_per_s=min(self.s.upload_bytes_per_s, 1e12),
            memory_bytes=self.s.memory_budget_mb * 2**20,
            roles=self.roles,
            lineages_followed=[self.committed] if self.committed else [],
            serving=self.committed or b"",
            owned=[demand] if demand else [],
            addrs=list(self.addrs),
            publish_batches_per_s=self.announced_rate,
        )
        return wire.seal(self.ident, wire.NODE_ANNOUNCE, a, swarm=self.s.swarm)

    # ------------------------------------------------------------ catch-up
    def _catch_up(self, now: float, out: list[Action]) -> None:
        """Get from the held version of the served lineage to its head (`node.core.catchup`), asking the
        publisher, then the live peers serving the lineage, for their catalogs; or leave the lineage."""
        lid = self.serving
        lin = self.table.rows.get(lid) if lid is not None else None
        need = self.catchup.check(lin, now, self.supervisor.down, lin is not None and lin.lineage in self.s.follow, out)
        if lin is None or need is CatchUpNeed.NOTHING:
            return
        if need is CatchUpNeed.LEAVE:
            self._leave(lin, now, out)
            return
        publisher_peer = peer_id_from_public(lin.publisher)
        sources = [publisher_peer] + [
            pid
            for pid, p in self.peer_table.live(now)
            if bytes(p.announce.serving) == lin.lineage and pid != publisher_peer
        ]
        self.catchup.begin(lin.lineage, sources, now, out)

    def _leave(self, lin: LineageState, now: float, out: list[Action]) -> None:
        """The served lineage's versions could not be fetched: leave it and remember its publisher. Not
        charged: an unreachable publisher is not provably lying."""
        why = (
            f"held {lin.held} < head {lin.head} with no version applied for {LEAVE_AFTER_S:.0f} s"
            if lin.delivered
            else f"no version applied within {TRIAL_S:.0f} s of choosing it (head {lin.head})"
        )
        self.table.avoid(lin.publisher, why, now)
        self.counts["lineages_left"] += 1
        out.append(
            Log(
                "left lineage",
                {"lineage": lin.lineage.hex()[:16], "publisher": peer_id_from_public(lin.publisher), "why": why},
            )
        )
        self._choose_serving(now, out)

    # ------------------------------------------------------------ patches
    def _on_patch_stored(self, ev: PatchStored, now: float, out: list[Action]) -> None:
        m = ev.manifest
        lid = bytes(m.lineage)
        it = item_of(m)
        self.catchup.on_stored(lid, (it.kind, it.base, it.target))
        if lid == self.serving:
            self._commit(now, out)  # fetched, its chunks matched the signed manifest: the worker may switch to it
        self.counts["bytes_down"] += max(0, int(ev.bytes_in))
        self.fetch_s.append((now, max(0.0, _finite(ev.seconds))))
        out.append(
            Log(
                "patch received",
                {
                    "lineage": lid.hex()[:16],
                    "kind": it.kind,
                    "base": it.base,
                    "target": it.target,
                    "bytes": m.total_bytes,
                    "seconds": round(_finite(ev.seconds), 2),
                },
            )
        )
        out.append(ToWorker(pipe.Patch(lid.hex(), it.kind, it.base, it.target)))

    # ------------------------------------------------------------ worker
    def _on_worker_exit(self, code: int | None, now: float, out: list[Action]) -> None:
        if self.supervisor.on_exit(code, now, out):
            # what the exited worker was told went with it: the next one is told afresh
            self.admitted = None
            self.pace_rate = 0.0

    def _on_worker(self, m: pipe.FromWorker, now: float, wall_ms: int, out: list[Action]) -> None:
        if isinstance(m, pipe.State):
            self.supervisor.on_state(m.state, out)
        elif isinstance(m, pipe.Ready):
            self._on_ready(m, now, out)
        elif isinstance(m, pipe.Rollouts):
            outbox = self.outbox
            if outbox is not None and outbox.rate <= 0:  # a demand heard since the last plan is served at once
                outbox.set_rate(self._publish_budget(now, self.exchange.shards, max(1.0, self.batch_rollouts)), now)
            # the budget is for our own lineage's rollouts; a lineage we serve as a follower takes all we make
            allow = None if outbox is None else (lambda lid, n: lid != self.own or outbox.take(n, now))
            sealed = self.sealer.seal(m.items, now, wall_ms, self.exchange.publish_shard, out, allow)
            self.verified_rewards.add_groups(g for g in sealed if g.lineage == self.own)
        elif isinstance(m, pipe.Step):
            self.steps += 1
            self._reward(m.reward_mean)
            self.counts["used"] += m.used
            self.counts["groups_trained"] += m.trained_groups
            self.swarm_gave.append((m.external_groups, m.external_lineages, m.updates))
            if m.heldout is not None:
                self.heldout.append((m.step, m.heldout))
                self.own_quality = roles.Quality(m.heldout, m.heldout_tasks)
            self.step_times.append(max(0.0, _finite(m.step_s)))
            out.append(
                Log(
                    "step",
                    {
                        "step": m.step,
                        "version": m.version,
                        "reward_mean": m.reward_mean,
                        "loss": m.loss,
                        "n_external_groups": m.n_external_groups,
                        "step_s": m.step_s,
                    },
                )
            )
        elif isinstance(m, pipe.Gen):
            self._reward(m.reward_mean)
            if m.heldout is not None:  # a follower's, of the version it holds
                self.heldout.append((m.version, m.heldout))
                if self.trial_of is not None:
                    self._judge_trial(roles.Quality(m.heldout, m.heldout_tasks), now, out)
        elif isinstance(m, pipe.Published):
            if self.last_publish:
                self.version_times.append(now - self.last_publish)
            self.last_publish = now
            self.counts["published"] = m.version
            self.table.published(m.version)
            out.append(SeedVersion(m.envelope))
        elif isinstance(m, pipe.Applied):
            self._on_applied(m, now, out)
        elif isinstance(m, pipe.ApplyFailed):
            out.append(
                Log(
                    "patch apply failed",
                    {"lineage": m.lineage[:16], "base": m.base, "target": m.target, "error": m.error[:300]},
                )
            )
            lid = bytes.fromhex(m.lineage)
            lin = self.table.rows.get(lid)
            if m.fault == "non_finite_patch" and lin is not None and len(lin.publisher) == 32:
                self.counts["patches_not_finite"] += 1
                out.append(Penalise(peer_id_from_public(lin.publisher), m.fault, FORGERY_PENALTY))
            self.catchup.on_dropped(lid, (diff_kind(m.base, m.target), m.base, m.target))
            out.append(DropItem(lid, m.base, m.target))  # fetched again (from another peer)
        elif isinstance(m, pipe.Perf):
            a = 0.3
            tps, lat = max(0.0, _finite(m.gen_tokens_per_s)), max(0.0, _finite(m.rollout_latency_s))
            self.gen_tps = tps if not self.gen_tps else (1 - a) * self.gen_tps + a * tps
            self.latency = lat if not self.latency else (1 - a) * self.latency + a * lat
        elif isinstance(m, pipe.Engine):
            self.supervisor.on_engine(m, out)
        elif isinstance(m, pipe.SpotRound):
            self.counts["spot_eligible"] += max(0, m.eligible)
        elif isinstance(m, pipe.Spot):
            self.counts["spot_checked"] += 1
            peer = peer_id_from_public(bytes.fromhex(m.producer))
            if m.ok:
                self.deliveries.vouch(peer)
            else:
                self.deliveries.unvouch(peer)
                self.counts["spot_failed"] += 1
                out.append(Penalise(peer, "spot_check_failed", SPOT_PENALTY))
                out.append(Log("spot check failed", {"producer": peer, "diff": m.diff}))
        elif isinstance(m, pipe.Error):
            self.supervisor.on_error(m.message, out)
        elif isinstance(m, pipe.Log):
            out.append(Log("worker", {"message": m.message[:500]}))

    def _on_ready(self, m: pipe.Ready, now: float, out: list[Action]) -> None:
        base = bytes.fromhex(m.base)
        self.table.set_my_base(base, m.model_bytes)
        self.tokenizer = bytes.fromhex(m.tokenizer_hash)
        if m.lineage:
            lin = self.table.set_own(bytes.fromhex(m.lineage), m.name, self.ident.public, base, m.version, now)
            self.counts["published"] = lin.held
        out.append(
            Log(
                "worker ready",
                {
                    "base": m.base,
                    "model_bytes": m.model_bytes,
                    "version": m.version,
                    **({"lineage": m.lineage, "name": m.name} if m.lineage else {}),
                },
            )
        )
        self.supervisor.on_ready()
        self.table.worker_restarted()
        for lin in self.table.rows.values():
            self._tell_head(lin, out)
        if self.committed is not None and self.follow_info is not None:  # a restarted worker resumes where we are
            out.append(ToWorker(pipe.Follow(self.follow_info)))
            self._send_admit(self.committed, out)

    def _on_applied(self, m: pipe.Applied, now: float, out: list[Action]) -> None:
        lin, gained = self.table.version_applied(bytes.fromhex(m.lineage), m.version, m.need_anchor)
        if lin is None:
            return
        self.counts["applied"] += gained
        if not lin.need_anchor and lin.lineage in (self.serving, self.committed):
            self._staleness(lin, self.guard.applied(lin.lineage, lin.held, now), out)
        if lin.delivered and lin.lineage == self.serving:
            self._commit(now, out)

    def _reward(self, r: Any) -> None:
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            return
        self.rewards.append(float(r))
        if len(self.reward_first) < 5:
            self.reward_first.append(float(r))

    # ------------------------------------------------------------ the rollout exchange
    def _meter_inbound(self, rollouts: int, now: float) -> None:
        """A peer's batch of `rollouts` rollouts passed verification (what the exchange measures)."""
        n = max(0, int(rollouts))
        self.inbound.add(now, n)
        self.batch_rollouts = 0.95 * self.batch_rollouts + 0.05 * max(1, n)

    def external_demand(self) -> float:
        """Rollouts/s this node's trainer takes from others (J groups a step); 0 for a node that trains not."""
        if "trainer" not in self.roles:
            return 0.0
        step_t = _median(self.step_times) if self.step_times else DEFAULT_STEP_S
        return self.s.external_rollouts * self.s.group_size / max(step_t, MIN_STEP_S, 1e-3)

    def _plan_exchange(self, now: float, out: list[Action]) -> None:
        """Which rollout shards to join (gossip.exchange), from what the announces say, in batches/s."""
        swarm = self.peer_table.swarm(now)
        producers = int("trainer" in self.roles or "follower" in self.roles) + swarm.producers
        supply, own = swarm.supply, None
        mine = self.committed if self.committed is not None else self.own
        if swarm.counts_self and mine is not None:  # our own last announce: not offered to ourselves
            own = (mine, min(self.announced_rate, 1e3))
        per_batch = max(1.0, self.batch_rollouts)
        demand = self.external_demand()
        # home: our own lineage's shard when followers produce for it, the validated lineage's shard
        own_supply = (
            supply.of(self.own) - (own[1] if own is not None and own[0] == self.own else 0.0)
            if self.own is not None
            else 0.0
        )
        home = [self.own] if self.own is not None and own_supply > 1e-9 else []
        if "validator" in self.roles and self.committed is not None:
            home.append(self.committed)
        measured = self.inbound.rate(now) if demand > 0 else None
        plan = self.exchange.plan(
            now,
            producers,
            supply,
            demand / per_batch,
            home,
            measured / per_batch if measured is not None else None,
            own,
        )
        if self.outbox is not None:
            self.outbox.set_rate(self._publish_budget(now, plan.shards, per_batch), now)
        if (plan.shards, plan.subscribe) != self.subscribed:
            self.subscribed = (plan.shards, plan.subscribe)
            out.append(Subscribe(plan.shards, plan.subscribe))
            out.append(
                Log(
                    "exchange",
                    {
                        "shards": plan.shards,
                        "subscribe": list(plan.subscribe),
                        "home": list(plan.home),
                        "producers": producers,
                        "demand_rollouts_per_s": round(demand, 2),
                    },
                )
            )

    def _publish_budget(self, now: float, shards: int, per_batch: float) -> float:
        """Rollouts/s our trainer publishes to its lineage's shard (gossip.exchange.publish_budget), from what
        the announces and signed versions we heard say: each other trainer's demand as far as its versions
        back it (`LineageTable.effective_demand`; one not measured yet as `DEFAULT_STEP_S`, or the time
        since we first heard it if longer), at most `DEMAND_BOUND` times our own; what followers
        publish on the shard, as far as the rollouts we verified from each back its announced rate (a
        claim of supply that never comes cannot silence us); the trainers there; whether a validator
        takes it."""
        if self.own is None:
            return 0.0
        j = exchange.shard_of(self.own, shards)
        ref = self.external_demand() or roles.offer_rate(self.gen_tps, self.tokens_per_rollout)
        bound = exchange.DEMAND_BOUND * ref
        demands = []
        for lin in self.table.rows.values():
            if lin.relation == Relation.OWN or not lin.publisher:
                continue
            d = self.table.effective_demand(lin, now)
            if d is not None:
                # a trainer that has not measured a step yet plans with DEFAULT_STEP_S (as we do), for as long
                # as it has been announcing: a step never measured makes the claim fade
                step = d.step_time_s if d.step_time_s > 0 else max(DEFAULT_STEP_S, now - lin.since)
                demands.append(exchange.consumer_demand(d.rollouts_per_step, step, bound))
        followers, trainers, validated = 0.0, 1, False
        for pid, p in self.peer_table.live(now):
            a = p.announce
            if a.serving and exchange.shard_of(bytes(a.serving), shards) == j:
                validated = validated or "validator" in a.roles
                if "follower" in a.roles:  # as far as what we verified from it backs its claim
                    followers += min(min(a.publish_batches_per_s, 1e3) * per_batch, self.supplied.backed(pid, now))
            if (
                "trainer" in a.roles
                and a.owned
                and bytes(a.owned[0].lineage) != self.own
                and exchange.shard_of(bytes(a.owned[0].lineage), shards) == j
            ):
                trainers += 1
        return exchange.publish_budget(demands, followers, trainers, validated, self.s.group_size)

    def external_wanted(self, lineages: set[bytes]) -> bool:
        """Whether an accepted rollout batch goes to our worker (a trainer learns; a validator spot-checks)."""
        return "trainer" in self.roles or ("validator" in self.roles and self.committed in lineages)
