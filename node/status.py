"""The node's state as one msgspec Struct: what the control socket serves and the dashboard,
metrics and demo read, so every view of a node shows the same numbers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from murmur.sync.ids import Relation

if TYPE_CHECKING:
    from murmur.node.config import Config

STATUS_LIMIT = 4 * 1024 * 1024  # bytes of one status reply on the control socket
TREND_POINTS = 60

# Every reason a node lets something go without it being a verdict on a peer (those are `rejected`).
# One registry: status, dashboard, metrics and docs/volunteer.md all list these names.
DROP_REASONS: dict[str, str] = {
    "worker_queue_full": "accepted rollout batches not handed to the worker: the link's queue was full",
    "worker_inbox_full": "rollout groups evicted (oldest first) from the worker's inbox before a step took them",
    "below_min_version": "external rollout groups past the staleness bound of the heads the trainer knows",
    "task_set_unused": "external rollouts of a task set this trainer does not hold",
    "task_set_refused": "task sets not added: unsigned by a trusted coordinator key, or invalid",
    "rollout_unpublishable": "own rollouts not signed: a behaviour log-prob outside the wire's range (receivers ban it)",
    "step_not_finite": "training steps not applied: the loss or the gradient was not finite (weights kept)",
    "publish_not_finite": "versions not published: new weights not finite (training resumed from the last version)",
    "patch_not_finite": "patches or anchors refused: they would make a weight non-finite (publisher charged)",
    "lineage_left": "served lineages left: no version applied for 180 s (their publisher not followed for 10 min)",
    "announce_unpublished": "node announces that could not be published (no peer on the topic)",
    "task_set_unpublished": "own task-set announces that could not be published (retried next round)",
    "group_not_selected": "informative groups not trained: outside a step's training.select_groups of largest "
    "reward variance (PODS down-sampling)",
    "foreign_share": "swarm groups of other lineages not trained: over a step's training.foreign_share_max",
    "no_gradient": "updates not applied: every row of the minibatch was another model's at weight 0",
}


class Drops:
    """Counters of what the node dropped, by a reason named in `DROP_REASONS` (an unknown name is a bug)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.worker: dict[str, int] = {}  # the worker's own totals, as last reported

    def add(self, reason: str, n: int = 1) -> None:
        if reason not in DROP_REASONS:
            raise KeyError(f"unregistered drop reason {reason!r}")
        self.counts[reason] = self.counts.get(reason, 0) + n

    def from_worker(self, totals: Mapping[str, int] | None) -> None:
        """The worker process reports running totals; the newest report wins (a restarted worker starts at 0)."""
        for reason, n in (totals or {}).items():
            if reason in DROP_REASONS and isinstance(n, int) and n >= 0:
                self.worker[reason] = n

    def view(self, worker_queue_full: int = 0, core: Mapping[str, int] | None = None) -> dict[str, int]:
        """All counters by reason; `core` adds the node core's own (it holds no `Drops`)."""
        out = dict(self.counts)
        for reason, n in [*self.worker.items(), *(core or {}).items()]:
            out[reason] = out.get(reason, 0) + n
        if worker_queue_full:
            out["worker_queue_full"] = out.get("worker_queue_full", 0) + worker_queue_full
        return {k: v for k, v in sorted(out.items()) if v}


class DiskView(Struct, kw_only=True):
    """One disk budget: what is used now and the configured limit (0: the limit is not in bytes, see `rule`)."""

    name: str  # ledger | peers | patches | partial | logs
    used_mb: float = 0.0
    limit_mb: float = 0.0
    rule: str = ""  # how it is enforced, e.g. "newest 200000 rows, 168 h"


def dir_mb(path: Path, prefix: str = "") -> float:
    """MiB under `path` (files whose names start with `prefix` when it is a file prefix in `path`)."""
    import os

    total = 0
    if prefix:
        for p in Path(path).glob(prefix + "*"):
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total / 2**20
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / 2**20


class DiskMeter:
    """Disk use per budget of one node home, re-measured at most every `every_s` (a walk is not free)."""

    def __init__(
        self, home: Path, cfg: Config, every_s: float = 30.0, peer_bytes: Callable[[], int] = lambda: 0
    ) -> None:
        self.home = Path(home)
        self.cfg = cfg
        self.peer_bytes = peer_bytes  # the peer table's share of state.db (the store's last count)
        self.every_s = every_s
        self._at = -1e18
        self._views: list[DiskView] = []

    def views(self, now: float) -> list[DiskView]:
        if now - self._at < self.every_s:
            return self._views
        self._at = now
        c = self.cfg
        d, s = c.disk, c.sync
        peers_mb = self.peer_bytes() / 2**20
        self._views = [
            DiskView(
                name="ledger",
                used_mb=round(max(0.0, dir_mb(self.home, "state.db") - peers_mb), 2),
                rule=f"newest {d.ledger_max_rows} rows (signed bytes on {d.ledger_payload_rows}), "
                f"{d.ledger_max_age_h:g} h",
            ),
            DiskView(
                name="peers",
                used_mb=round(peers_mb, 2),
                limit_mb=float(d.peers_max_mb),
                rule=f"{d.peers_max_rows} rows in state.db; announces of connected peers only",
            ),
            DiskView(
                name="patches",
                used_mb=round(dir_mb(self.home / "lineages"), 2),
                rule=f"{s.retain_versions} versions + {s.max_anchors} anchors per lineage",
            ),
            DiskView(
                name="partial",
                used_mb=round(dir_mb(self.home / "partial"), 2),
                rule="unfinished downloads, swept when done or abandoned",
            ),
            DiskView(
                name="logs",
                used_mb=round(dir_mb(self.home, "node.log"), 2),
                limit_mb=float(d.logs_max_mb),
                rule="node.log + 1 rotated copy",
            ),
        ]
        return self._views


class PeerView(Struct, kw_only=True):
    peer_id: str
    roles: list[str] = []
    hardware: str = ""
    gen_tokens_per_s: float = 0.0
    rollout_latency_s: float = 0.0
    serving: str = ""  # lineage id hex the peer serves as follower
    last_seen_s: float = 0.0  # seconds since its last announce


class LineageView(Struct, kw_only=True):
    lineage: str  # id hex
    name: str
    relation: Relation
    publisher: str = ""  # peer id
    head: int = 0  # newest version announced
    held: int = 0  # version this node holds
    lag: int = 0
    need_rollouts_per_s: float = 0.0  # capacity rule, own lineages
    supply_rollouts_per_s: float = 0.0
    active: list[str] = []  # followers counted towards the demand
    standby: list[str] = []  # followers told to stand by
    rejected: dict[str, str] = {}  # follower -> why it does not count (e.g. staleness)
    admission: str = ""  # a served lineage's `sync.staleness.Admission` (fresh: generating, stale: paused); "" if none
    admission_note: str = ""  # the last staleness transition, as logged
    on_trial: bool = False  # chosen, none of its versions delivered yet: the worker still serves `following`


class ExchangeView(Struct, kw_only=True):
    """The rollout exchange (gossip.exchange): shards joined, and rollouts received, verified, used and
    dropped (totals, and per second over the last 30 s), distinct producers verified in the last 10 min."""

    shards: int = 1  # the shard count this node believes
    subscribed: list[int] = []
    produced_rollouts: int = 0  # made by our worker since the node started
    published_rollouts: int = 0  # ... sent to a shard (a trainer: within its publish budget)
    uninformative_rollouts: int = 0  # ... kept local: groups no receiver can learn from (rewards all equal, lone)
    withheld_rollouts: int = 0  # ... a trainer kept local: no one asked for them
    unsent_rollouts: int = 0  # ... signed to publish that did not go out (no subscriber of the shard connected)
    groups_generated: int = 0  # groups (one task's completions) made by our worker since the node started
    groups_sent: int = 0  # ... of them signed to publish: informative, within a trainer's publish budget
    groups_trained: int = 0  # groups, own and the swarm's, that entered this node's optimizer updates
    publish_budget_per_s: float | None = None  # a trainer's publish budget, rollouts/s (None: not a trainer)
    unsampled_batches: int = 0  # a validator's: outside its sample, dropped unverified (not received work)
    sample_fraction: float | None = None  # a validator that does not train: its stated sample (None: verifies all)
    sample_floor_per_min: float | None = None  # ... and its floor per producer
    sample_rate: float | None = None  # ... the share of batches it checked so far
    received_batches: int = 0
    received_rollouts: int = 0  # rollouts of received batches that decoded
    verified_batches: int = 0
    verified_rollouts: int = 0
    used_rollouts: int = 0  # external rollouts the trainer trained on
    dropped: dict[str, int] = {}  # reason -> batches dropped before or in verification
    rates: dict[str, float] = {}  # <counter>_per_s
    used_over_verified: float = 0.0
    distinct_producers: int = 0
    task_sets: dict[str, dict[str, int]] = {}  # task set hex -> verified_rollouts, used_rollouts (coordinators)
    # task set hex -> lineage hex -> distinct producers whose verified rollouts of it were on that set (10 min)
    lineages_by_task_set: dict[str, dict[str, int]] = {}


class ReachView(Struct, kw_only=True):
    """How this node is reachable (node.shell.reachability / node.cli.doctor_reachability): the path, why, what helps."""

    path: str = "offline"  # direct | hole-punched | relayed | webrtc | offline
    status: str = "unknown"  # public | private | unknown (peers' dial-back verdict)
    reason: str = "reachability not checked yet"
    observed_ips: list[str] = []  # how peers see us
    port_preserved: bool | None = None  # NAT kept our source port (hole punching can work); None: unknown
    listen_addrs: list[str] = []
    announce_addrs: list[str] = []  # what we tell peers (reachable direct addrs, then relay circuits)
    relay_service: bool = False  # we relay for others
    relaying: int = 0  # circuits we relay right now
    relays_configured: list[str] = []
    reservations: list[str] = []  # our circuit addresses
    relay_errors: dict[str, str] = {}
    peer_paths: dict[str, str] = {}  # peer id -> direct | relayed | webrtc | none
    holepunch_attempts: int = 0
    holepunch_successes: int = 0
    holepunch_error: str = ""
    webrtc_reason: str = ""  # "" when the WebRTC extra is available
    host_ready_s: float | None = None  # process start -> host listening
    first_peer_s: float | None = None  # process start -> first connection


class NodeStatus(Struct, kw_only=True):
    peer_id: str = ""
    swarm: str = ""
    roles: list[str] = []
    # why it holds them: "configured", the hardware's reason, or (roles chosen by the swarm's need) why it
    # trains or generates now
    roles_reason: str = ""
    roles_chosen: bool = False  # it trains or generates by the swarm's need (no configured roles)
    role_switches: int = 0  # switches between training and generating in this run
    trials_refused: int = 0  # ... of them, returns to its own lineage from one whose weights measured worse
    hardware: str = ""
    listen: list[str] = []
    state: str = "starting"  # starting | running | stopping
    uptime_s: float = 0.0
    worker: str = "starting"  # worker process state: loading | training | generating | standby | catching-up | stopped
    worker_error: str = ""
    engine: str = ""  # transformers | vllm (sparse in place) | vllm (dense reload) | "vllm unavailable: <why>"
    worker_restarts: int = 0  # times the worker process was restarted after it died
    worker_pid: int = 0
    peers: list[PeerView] = []
    lineages: list[LineageView] = []
    serving: str = ""  # lineage id hex this node generates rollouts for ("" when none)
    serving_reason: str = ""
    following: str = ""  # lineage id hex the worker generates for: `serving` once it delivered a version
    steps: int = 0
    versions_published: int = 0
    versions_applied: int = 0
    rollouts_produced: int = (
        0  # signed and recorded (the ledger: across restarts); all made: exchange.produced_rollouts
    )
    rollouts_published: int = 0
    rollouts_received: int = 0
    rollouts_accepted: int = 0
    rollouts_used: int = 0  # external rollouts that entered the trainer's updates
    used_over_verified: float | None = None  # rollouts_used / rollouts_accepted (None: none accepted yet)
    external_groups_per_step: float = 0.0  # external groups trained per step, over the last 20 steps
    external_lineages_per_step: float = 0.0  # distinct lineages they came from, per step, same window
    updates_per_step: float = 0.0  # optimizer updates per step, same window
    # held-out greedy accuracy of the weights the node holds, oldest first: a trainer's every 25 steps, a
    # follower's when the version it holds changed (within a tenth of its generation time)
    heldout_trend: list[float] = []
    heldout_start: float | None = None
    heldout_now: float | None = None
    rejected: dict[str, int] = {}
    spot_eligible: int = 0  # received rollouts the worker could spot-check (it held their exact weights)
    spot_checked: int = 0  # of them, re-scored (training.spotcheck: SPOT_RATE, at most SPOT_PER_ROUND a round)
    spot_failed: int = 0
    reward_trend: list[float] = []
    reward_start: float | None = None
    reward_now: float | None = None
    gen_tokens_per_s: float = 0.0
    rollout_latency_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    memory_rss_mb: float = 0.0
    memory_budget_mb: int = 0
    metrics_port: int = 0
    dropped: dict[str, int] = {}  # reason (DROP_REASONS) -> count since start
    disk: list[DiskView] = []
    # robustness (node.shell.stall, gossip.host.StreamFaults, gossip.scoring): see docs/security.md
    loop_stall_max_ms: float = 0.0  # worst event-loop lateness since start
    loop_stall_recent_ms: float = 0.0  # worst over the last 5 s
    gc_pause_max_ms: float = 0.0  # longest full (generation 2) garbage collection since start
    stream_faults: dict[str, int] = {}  # protocol -> streams that broke it (peer scored, stream closed)
    # gossip.limits: streams refused over a cap, frames reset (buffer full, deadline), peers charged; and
    # the inbound streams and frame bytes held now
    stream_limits: dict[str, int] = {}
    peer_scores: dict[str, float] = {}  # peer id -> current gossip score, for peers with a record
    peer_charged: dict[str, float] = {}  # peer id -> all penalties charged to it so far (no decay), same peers
    peer_faults: dict[str, dict[str, int]] = {}  # charged peer id -> reason -> times (scoring.MAX_REASONS each)
    reach: ReachView = msgspec.field(default_factory=ReachView)
    exchange: ExchangeView = msgspec.field(default_factory=ExchangeView)


def encode_status(s: NodeStatus) -> bytes:
    return msgspec.json.encode(s)


def decode_status(data: bytes) -> NodeStatus:
    from murmur.gossip.errors import DecodeError

    if len(data) > STATUS_LIMIT:
        raise DecodeError(f"status reply is {len(data)} bytes, over {STATUS_LIMIT}")
    try:
        return msgspec.json.decode(data, type=NodeStatus)
    except (msgspec.MsgspecError, ValueError) as e:
        raise DecodeError(f"malformed status reply: {e}") from None
