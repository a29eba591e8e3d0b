"""The node's state as one msgspec Struct: what the control socket serves and the dashboard,
metrics and demo read, so every view of a node shows the same numbers."""

from __future__ import annotations

import msgspec
from msgspec import Struct

STATUS_LIMIT = 4 * 1024 * 1024  # bytes of one status reply on the control socket
TREND_POINTS = 60


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
    relation: str  # own | follow | seen
    publisher: str = ""  # peer id
    head: int = 0  # newest version announced
    held: int = 0  # version this node holds
    lag: int = 0
    need_rollouts_per_s: float = 0.0  # capacity rule, own lineages
    supply_rollouts_per_s: float = 0.0
    active: list[str] = []  # followers counted towards the demand
    standby: list[str] = []  # followers told to stand by
    rejected: dict[str, str] = {}  # follower -> why it does not count (e.g. staleness)
    admission: str = ""  # served lineage: unknown | fresh (generating) | stale (paused, catching up)
    admission_note: str = ""  # the last staleness transition, as logged


class ReachView(Struct, kw_only=True):
    """How this node is reachable (node.reach / node.doctor_reachability): the path, why, what helps."""

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
    hardware: str = ""
    listen: list[str] = []
    state: str = "starting"  # starting | running | stopping
    uptime_s: float = 0.0
    worker: str = "starting"  # worker process state: loading | training | generating | standby | catching-up | stopped
    worker_error: str = ""
    engine: str = ""  # transformers | vllm (sparse in place) | vllm (dense reload) | "vllm unavailable: <why>"
    peers: list[PeerView] = []
    lineages: list[LineageView] = []
    serving: str = ""  # lineage id hex this node generates rollouts for ("" when none)
    serving_reason: str = ""
    steps: int = 0
    versions_published: int = 0
    versions_applied: int = 0
    rollouts_produced: int = 0
    rollouts_published: int = 0
    rollouts_received: int = 0
    rollouts_accepted: int = 0
    rollouts_used: int = 0  # external rollouts fed to the trainer
    rejected: dict[str, int] = {}
    spot_checked: int = 0
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
    reach: ReachView = msgspec.field(default_factory=ReachView)


def encode_status(s: NodeStatus) -> bytes:
    return msgspec.json.encode(s)


def decode_status(data: bytes) -> NodeStatus:
    from gossip.errors import DecodeError

    if len(data) > STATUS_LIMIT:
        raise DecodeError(f"status reply is {len(data)} bytes, over {STATUS_LIMIT}")
    try:
        return msgspec.json.decode(data, type=NodeStatus)
    except (msgspec.MsgspecError, ValueError) as e:
        raise DecodeError(f"malformed status reply: {e}") from None
