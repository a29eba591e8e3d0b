"""Simulation scenarios: one TOML file describes a swarm, its links, churn and adversaries.

The same file drives both the emulator (real node processes, wall-clock
seconds) and the virtual-time simulator (virtual seconds). Decoding is strict
(msgspec Structs with `forbid_unknown_fields`), and every error is one line
that names the file and the key: `file.toml: key 'group[1].count': ...`.
`docs/scenarios.md` documents every key; the Structs below are the source of
truth for defaults and bounds.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from murmur.gossip.errors import ConfigError
from murmur.gossip.tomlfile import convert_strict, parse_toml, read_toml, toml_value

BUILTINS = ("default", "churn", "adversarial", "heterogeneous", "wan", "large", "huge")
MAX_NODES = 100_000

Behaviour = Literal[
    "forged_reward", "invalid_signature", "replay", "stale_spam", "misscheduled", "corrupt_chunks", "free_ride"
]
BEHAVIOURS: tuple[str, ...] = get_args(Behaviour)

NonNeg = Annotated[float, Meta(ge=0.0)]
Pos = Annotated[float, Meta(gt=0.0)]


class NodeGroup(Struct, forbid_unknown_fields=True, kw_only=True):
    """`count` nodes that share hardware, links and a join/leave schedule."""

    name: Annotated[str, Meta(min_length=1, max_length=64)] = "node"
    count: Annotated[int, Meta(ge=1, le=MAX_NODES)] = 1
    # auto: no configured roles, as a volunteer's default node: it trains or generates by the swarm's need
    # (node.core.roles.PodRule), starting as a trainer
    role: Literal["trainer", "follower", "auto"] = "trainer"
    follow: Annotated[int, Meta(ge=0)] = 0  # followers: index of the trainer node whose lineage they track
    upload_bytes_per_s: Annotated[float, Meta(gt=0.0, le=1e12)] = 12_500_000.0  # 100 Mbit/s
    download_bytes_per_s: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0  # 0 = unlimited
    latency_ms: Annotated[float, Meta(ge=0.0, le=60_000.0)] = 20.0  # one way
    jitter_ms: Annotated[float, Meta(ge=0.0, le=60_000.0)] = 0.0
    loss: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    compute: Annotated[float, Meta(gt=0.0, le=1000.0)] = 1.0  # relative speed; 2.0 = twice as fast
    join_s: NonNeg = 0.0
    leave_s: Annotated[float, Meta(gt=0.0)] | None = None  # leaves for good at this time (None = stays)


class Churn(Struct, forbid_unknown_fields=True, kw_only=True):
    """Random departures: a Poisson process over the honest nodes, each away for `down_s`."""

    leaves_per_min: NonNeg = 0.0
    down_s: Pos = 30.0
    start_s: NonNeg = 0.0
    protect: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=10_000)] = []  # node indices never churned


class Event(Struct, forbid_unknown_fields=True, kw_only=True):
    at_s: NonNeg
    action: Literal["leave", "join", "restart"]
    node: Annotated[int, Meta(ge=0)]
    down_s: Pos = 5.0  # restart only: time away


class Adversary(Struct, forbid_unknown_fields=True, kw_only=True):
    """`count` extra nodes that misbehave. They get the links of group `group` (index)."""

    behaviour: Behaviour
    count: Annotated[int, Meta(ge=1, le=10_000)] = 1
    group: Annotated[int, Meta(ge=0)] = 0
    rate_per_s: Annotated[float, Meta(gt=0.0, le=10_000.0)] = 1.0  # bad messages per second per adversary
    start_s: NonNeg = 0.0


class Training(Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)] = "murmur-tiny"
    local_groups: Annotated[int, Meta(ge=0, le=1024)] = 4  # I
    external_groups: Annotated[int, Meta(ge=0, le=1024)] = 4  # J
    group_size: Annotated[int, Meta(ge=2, le=256)] = 8
    step_s: Pos = 2.0  # modelled seconds per step at compute 1.0 (virtual mode)
    max_staleness: Annotated[int, Meta(ge=0, le=1_000_000)] = 4
    max_steps: Annotated[int, Meta(ge=0)] = 0  # 0 = until duration_s
    # virtual mode: share of each group's prompts drawn from the shared prompt schedule (training/schedule.py)
    schedule_share: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class Gossip(Struct, forbid_unknown_fields=True, kw_only=True):
    degree: Annotated[int, Meta(ge=1, le=1024)] = 8  # rollout-gossip neighbours per node
    rate_limit_per_s: Pos = 20.0
    rate_burst: Annotated[int, Meta(ge=1)] = 40
    graylist_threshold: float = -50.0
    blacklist_s: Pos = 3600.0


class Sync(Struct, forbid_unknown_fields=True, kw_only=True):
    patch_bytes: Annotated[int, Meta(ge=1, le=2**40)] = 4 * 1024 * 1024
    chunk_bytes: Annotated[int, Meta(ge=1024, le=8 * 1024 * 1024)] = 256 * 1024
    publish_every: Annotated[int, Meta(ge=1)] = 1  # steps per published version
    broadcast_nodes: Annotated[int, Meta(ge=1, le=MAX_NODES)] = 64  # receivers in the measured broadcasts
    broadcasts: Annotated[int, Meta(ge=0, le=1000)] = 3  # measured broadcasts per run


class Learning(Struct, forbid_unknown_fields=True, kw_only=True):
    """Virtual mode's learning model (see docs/scenarios.md).

    Defaults: `python -m murmur.simulations.calibrate --matched` fitted to the compute-matched benchmark
    (`murmur bench swarm --matched`, 5 seeds each of N = 2, 4, 8 peers and one trainer with 1 and 3
    followers; the runs are in tests/data/matched_runs.json); skill is held-out accuracy and one
    update is 8 informative groups.
    """

    initial: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.386
    ceiling: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.84
    rate: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.002  # skill gain per 8 informative groups at skill 0
    external_weight: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.38  # value of another lineage's group vs a local one
    own_lineage_weight: Annotated[float, Meta(ge=0.0, le=10.0)] = 1.36  # value of a follower's group of its own lineage
    # share of a step that trains, when all its I local groups are informative; the rest generates them.
    # A step trains on u_local + u_ext groups and takes step_s / compute * (1 - train_share * (1 - u / I)).
    train_share: Annotated[float, Meta(ge=0.0, le=0.95)] = 0.681
    spread: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.02  # per-node spread of the initial skill


class Report(Struct, forbid_unknown_fields=True, kw_only=True):
    format: Literal["jsonl", "csv"] = "jsonl"
    sample_every_s: Pos = 5.0
    plots: bool = True


class Scenario(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)] = "scenario"
    description: str = ""
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    duration_s: Annotated[float, Meta(gt=0.0, le=10_000_000.0)] = 120.0
    swarm: Annotated[str, Meta(min_length=1, max_length=64)] = "murmur-sim"
    groups: list[NodeGroup] = msgspec.field(name="group", default_factory=lambda: [NodeGroup(count=4)])
    churn: Churn = msgspec.field(default_factory=Churn)
    events: list[Event] = msgspec.field(name="event", default_factory=list)
    adversaries: list[Adversary] = msgspec.field(name="adversary", default_factory=list)
    training: Training = msgspec.field(default_factory=Training)
    gossip: Gossip = msgspec.field(default_factory=Gossip)
    sync: Sync = msgspec.field(default_factory=Sync)
    learning: Learning = msgspec.field(default_factory=Learning)
    report: Report = msgspec.field(default_factory=Report)

    @property
    def honest_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def total_nodes(self) -> int:
        return self.honest_nodes + sum(a.count for a in self.adversaries)


class NodeSpec(Struct, frozen=True, kw_only=True):
    """One concrete node of a scenario, after expanding groups and adversaries."""

    index: int
    group: str
    role: str
    follow: int | None
    upload_bytes_per_s: float
    download_bytes_per_s: float
    latency_ms: float
    jitter_ms: float
    loss: float
    compute: float
    join_s: float
    leave_s: float | None
    behaviour: str | None = None  # adversaries only
    rate_per_s: float = 0.0
    start_s: float = 0.0


def expand(sc: Scenario) -> list[NodeSpec]:
    """Nodes in index order: honest groups first, then adversaries."""
    out: list[NodeSpec] = []
    for g in sc.groups:
        for _ in range(g.count):
            out.append(
                NodeSpec(
                    index=len(out),
                    group=g.name,
                    role=g.role,
                    follow=g.follow if g.role == "follower" else None,
                    upload_bytes_per_s=g.upload_bytes_per_s,
                    download_bytes_per_s=g.download_bytes_per_s,
                    latency_ms=g.latency_ms,
                    jitter_ms=g.jitter_ms,
                    loss=g.loss,
                    compute=g.compute,
                    join_s=g.join_s,
                    leave_s=g.leave_s,
                )
            )
    for a in sc.adversaries:
        g = sc.groups[a.group]
        for _ in range(a.count):
            out.append(
                NodeSpec(
                    index=len(out),
                    group=f"adversary:{a.behaviour}",
                    role="adversary",
                    follow=None,
                    upload_bytes_per_s=g.upload_bytes_per_s,
                    download_bytes_per_s=g.download_bytes_per_s,
                    latency_ms=g.latency_ms,
                    jitter_ms=g.jitter_ms,
                    loss=g.loss,
                    compute=g.compute,
                    join_s=max(g.join_s, a.start_s),
                    leave_s=g.leave_s,
                    behaviour=a.behaviour,
                    rate_per_s=a.rate_per_s,
                    start_s=a.start_s,
                )
            )
    return out


# ------------------------------------------------------------------ loading and checks


def _semantic_checks(sc: Scenario) -> list[tuple[str, str]]:
    """Cross-key rules msgspec cannot express: (key, problem)."""
    bad: list[tuple[str, str]] = []
    if not sc.groups:
        bad.append(("group", "a scenario needs at least one [[group]] of nodes"))
    if sc.total_nodes > MAX_NODES:
        bad.append(("group", f"{sc.total_nodes} nodes in all, over the limit of {MAX_NODES}"))
    honest = sc.honest_nodes
    trainers: set[int] = set()
    idx = 0
    for g in sc.groups:
        if g.role in ("trainer", "auto"):
            trainers.update(range(idx, idx + g.count))
        idx += g.count
    if not trainers:
        bad.append(("group", 'no group has role = "trainer" or "auto": nothing would train'))
    for i, g in enumerate(sc.groups):
        if g.leave_s is not None and g.leave_s <= g.join_s:
            bad.append((f"group[{i}].leave_s", f"leave_s ({g.leave_s}) must come after join_s ({g.join_s})"))
        if g.join_s >= sc.duration_s:
            bad.append((f"group[{i}].join_s", f"join_s ({g.join_s}) is not before duration_s ({sc.duration_s})"))
        if g.role == "follower" and g.follow not in trainers:
            bad.append(
                (
                    f"group[{i}].follow",
                    f"node {g.follow} is not a trainer (trainers: {_ranges(sorted(trainers)) or 'none'})",
                )
            )
        if g.download_bytes_per_s and g.download_bytes_per_s < 1024:
            bad.append((f"group[{i}].download_bytes_per_s", "below 1024 B/s: use 0 for unlimited"))
    for i, e in enumerate(sc.events):
        if e.node >= honest:
            bad.append((f"event[{i}].node", f"node {e.node} does not exist (honest nodes are 0..{honest - 1})"))
        if e.at_s >= sc.duration_s:
            bad.append((f"event[{i}].at_s", f"at_s ({e.at_s}) is not before duration_s ({sc.duration_s})"))
    for i, a in enumerate(sc.adversaries):
        if a.group >= len(sc.groups):
            bad.append((f"adversary[{i}].group", f"group {a.group} does not exist ({len(sc.groups)} groups)"))
        if a.start_s >= sc.duration_s:
            bad.append((f"adversary[{i}].start_s", f"start_s ({a.start_s}) is not before duration_s"))
    for j, p in enumerate(sc.churn.protect):
        if p >= honest:
            bad.append((f"churn.protect[{j}]", f"node {p} does not exist"))
    if sc.learning.initial > sc.learning.ceiling:
        bad.append(("learning.initial", f"initial ({sc.learning.initial}) above ceiling ({sc.learning.ceiling})"))
    if sc.sync.chunk_bytes > sc.sync.patch_bytes:
        bad.append(("sync.chunk_bytes", "larger than sync.patch_bytes"))
    if sc.sync.patch_bytes // sc.sync.chunk_bytes > 8192:
        bad.append(("sync.chunk_bytes", "patch would have more than 8192 chunks (the manifest limit)"))
    if sc.training.local_groups + sc.training.external_groups == 0:
        bad.append(("training.local_groups", "local_groups + external_groups is 0: no step would train"))
    return bad


def _ranges(xs: list[int]) -> str:
    if not xs:
        return ""
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}..{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def from_dict(raw: dict[str, Any], origin: str = "scenario") -> Scenario:
    """Strictly convert a parsed TOML table; ConfigError names `origin` and the key."""
    sc = convert_strict(raw, Scenario, origin)
    problems = _semantic_checks(sc)
    if problems:
        key, why = problems[0]
        raise ConfigError(f"{origin}: key '{key}': {why}")
    return sc


def loads(text: str, origin: str = "scenario") -> Scenario:
    return from_dict(parse_toml(text, origin), origin)


def load(path: str | Path) -> Scenario:
    return from_dict(read_toml(path, ConfigError, "scenario file"), str(path))


def builtin_text(name: str) -> str:
    if name not in BUILTINS:
        raise ConfigError(f"no built-in scenario {name!r} (choose from {', '.join(BUILTINS)})")
    return resources.files("murmur.simulations").joinpath("scenarios", f"{name}.toml").read_text("utf-8")


def builtin(name: str) -> Scenario:
    return loads(builtin_text(name), f"scenario:{name}")


def resolve(spec: str | Path) -> Scenario:
    """A built-in name or a path to a TOML file."""
    s = str(spec)
    if s in BUILTINS and not Path(s).exists():
        return builtin(s)
    return load(s)


def dumps(sc: Scenario) -> str:
    """The scenario as TOML (for the report folder), so a run can be repeated from its report."""
    return _to_toml(msgspec.to_builtins(sc))


def _to_toml(d: dict[str, Any]) -> str:
    lines: list[str] = []
    tables, arrays = {}, {}
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, dict):
            tables[k] = v
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            arrays[k] = v
        else:
            lines.append(f"{k} = {toml_value(v)}")
    for k, v in tables.items():
        lines += ["", f"[{k}]"] + [f"{kk} = {toml_value(vv)}" for kk, vv in v.items() if vv is not None]
    for k, items in arrays.items():
        for item in items:
            lines += ["", f"[[{k}]]"] + [f"{kk} = {toml_value(vv)}" for kk, vv in item.items() if vv is not None]
    return "\n".join(lines) + "\n"
