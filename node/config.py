"""Node configuration: TOML decoded strictly into msgspec Structs, plus environment overrides.

One source of truth: the Structs below carry every default and, in `Meta`
descriptions, the comment written into a new `config.toml`. An unknown key or
a wrong type is a one-line `ConfigError` naming the file and the key.
Environment variables `MURMUR_<SECTION>_<KEY>` override the file (values are
parsed as TOML literals, falling back to plain strings).
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from murmur.gossip import exchange, wire
from murmur.gossip.errors import ConfigError
from murmur.gossip.tomlfile import convert_strict, read_toml, toml_value
from murmur.training.downsample import MAX_SELECT_GROUPS
from murmur.training.selection import TaskSetChoice, needs_trust, normalise

CONFIG_FILE = "config.toml"
MAX_OVERSAMPLE = 8.0  # training.follower_oversample: past this a follower mostly makes groups no one takes


def _d(text: str) -> Meta:
    return Meta(description=text)


class NodeSection(Struct, forbid_unknown_fields=True, kw_only=True):
    swarm: Annotated[str, _d("swarm name: nodes only talk to nodes of the same swarm")] = "murmur-default"
    roles: Annotated[list[str], _d("roles to hold (trainer, follower, validator); empty = pick from hardware")] = []
    hardware: Annotated[str, _d("hardware class: auto, cpu, gpu-small, gpu-large")] = "auto"
    memory_budget_mb: Annotated[int, _d("upper bound for pools, queues and caches, in MiB")] = 4096
    role_dwell_s: Annotated[
        float,
        Meta(
            ge=0.0,
            le=86_400.0,
            description="with roles chosen by the node: least seconds between two "
            "switches between training and generating",
        ),
    ] = 300.0
    log_level: Annotated[str, _d("debug, info, warning or error")] = "info"


class NetworkSection(Struct, forbid_unknown_fields=True, kw_only=True):
    listen: Annotated[list[str], _d("libp2p listen multiaddrs")] = msgspec.field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/4001"]
    )
    bootstrap: Annotated[list[str], _d("bootstrap peers: full multiaddrs with /p2p/<peer id>")] = []
    dht: Annotated[bool, _d("use the Kademlia DHT for peer discovery")] = True
    upload_bytes_per_s: Annotated[int, _d("upload limit for bulk transfers, bytes/s; 0 = unlimited")] = 0
    relay_service: Annotated[bool, _d("offer circuit relay v2 to NATed peers (public nodes only)")] = False
    relay_max_reservations: Annotated[int, _d("relay: most reservations held at once")] = 16
    relay_max_circuit_bytes: Annotated[int, _d("relay: bytes per circuit before it is closed")] = 64 * 1024 * 1024
    relay_max_circuit_s: Annotated[int, _d("relay: seconds per circuit before it is closed")] = 600
    relays: Annotated[list[str], _d("relay peers to reserve a slot on when not publicly reachable")] = []
    webrtc: Annotated[
        bool,
        _d(
            "also listen on UDP /webrtc-direct (same port number as TCP) and dial it when TCP fails; "
            "needs aiortc (a default dependency of murmur-swarm: bash install.sh), ignored without it"
        ),
    ] = True


class GossipSection(Struct, forbid_unknown_fields=True, kw_only=True):
    rate_limit_per_s: Annotated[
        float,
        _d(
            "rollout batches per second accepted from a peer that announced no rate, "
            "and the floor of an announced peer's limit"
        ),
    ] = 20.0
    rate_burst: Annotated[int, _d("burst of rollout batches accepted from a peer that announced no rate")] = 40
    graylist_threshold: Annotated[float, _d("score below which a peer's messages are dropped unread")] = -50.0
    blacklist_s: Annotated[int, _d("seconds a peer proven to forge stays banned")] = 3600
    replay_cache: Annotated[int, _d("entries in the replay/duplicate cache")] = 100_000
    replay_ttl_s: Annotated[int, _d("seconds a message id is remembered")] = 900
    pool_max_rollouts: Annotated[
        int, _d("verified external rollouts a trainer keeps to sample from (bounded also by node.memory_budget_mb)")
    ] = 20_000
    validator_sample: Annotated[
        float,
        _d(
            "share of each producer's rollout batches a validator that does not "
            "train verifies (0-1); it drops the rest unverified"
        ),
    ] = exchange.SAMPLE_FRACTION
    validator_sample_floor_per_min: Annotated[
        float, _d("... and at least this many of each producer's batches a minute (all of them when it sends fewer)")
    ] = exchange.SAMPLE_FLOOR_PER_MIN


class SyncSection(Struct, forbid_unknown_fields=True, kw_only=True):
    publish_every: Annotated[int, _d("optimizer steps per published version")] = 1
    anchor_every: Annotated[int, _d("a full anchor every K versions")] = 16
    chunk_bytes: Annotated[int, _d("patch chunk size in bytes")] = 256 * 1024
    max_staleness: Annotated[int, _d("versions a rollout's policy may lag the head")] = 4
    retain_versions: Annotated[int, _d("patches kept on disk per lineage")] = 64
    max_anchors: Annotated[int, _d("full anchors kept on disk per lineage")] = 4
    stall_timeout_s: Annotated[float, _d("seconds without progress before switching peer")] = 5.0
    follow: Annotated[list[str], _d("lineage ids (hex) to follow; empty = choose by the capacity rule")] = []


class TrainingSection(Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, _d("murmur-tiny, or a local path to a Hugging Face causal LM")] = "murmur-tiny"
    engine: Annotated[str, _d("transformers or vllm")] = "transformers"
    task_sets: Annotated[
        list[str | TaskSetChoice],
        _d(
            'task sets to train on, mixed by weight: "builtin", "trusted" (every set from a trusted coordinator), '
            'a set name (its newest version) or a 64-hex set id; a string (weight 1) or { set = "...", weight = 2.0 }. '
            "A set not received yet is waited for"
        ),
    ] = msgspec.field(default_factory=lambda: ["builtin"])
    local_rollouts: Annotated[int, _d("I: own rollouts per step")] = 4
    external_rollouts: Annotated[int, _d("J: verified swarm rollouts per step")] = 4
    group_size: Annotated[int, _d("completions per prompt (GRPO group)")] = 8
    minibatch_groups: Annotated[
        int,
        _d(
            "informative groups per optimizer update, own and the swarm's: a step makes as many updates as they "
            "fill, so swarm rollouts add updates instead of displacing local ones (0: one update per step over "
            "all of them)"
        ),
    ] = 4
    select_groups: Annotated[
        int,
        _d(
            "PODS down-sampling: of a step's informative groups, own and the swarm's, train only this many, those "
            "whose rewards vary most (closest to half right); the rest are not trained (dropped: "
            "group_not_selected). 0: train them all"
        ),
    ] = 0
    pod_yield: Annotated[
        bool,
        _d(
            "a trainer whose followers deliver its lineage's informative groups generates fewer of its own (each "
            "delivered group stands for as many as it takes to make one informative group; at least "
            "local_rollouts / 8 are kept) and takes as many more external groups: its CPU goes to training"
        ),
    ] = True
    follower_oversample: Annotated[
        float,
        _d(
            "a follower generates up to this many times its trainer's need, since groups whose rewards are all "
            "equal stay local (1.0-8.0; 1.0: exactly the need)"
        ),
    ] = 1.0
    lr: Annotated[float, _d("learning rate; unset: 3e-4 for models up to 5M parameters (murmur-tiny), 1e-6 above")] = (
        3e-4
    )
    max_new_tokens: Annotated[int, _d("completion length limit")] = 16
    temperature: Annotated[
        float, _d("sampling temperature: 0 (greedy) or 0.01-10 (receivers refuse a rollout sampled outside that range)")
    ] = 1.0
    seed: Annotated[int, _d("random seed")] = 0
    schedule_share: Annotated[
        float,
        _d(
            "share (0-1) of each step's prompts drawn from the shared prompt schedule: every node training a task set "
            "derives the same prompts for each minute, so peers' answers to one prompt meet; 0 = every prompt drawn "
            "freely"
        ),
    ] = 0.0
    loss_norm: Annotated[
        str,
        _d(
            "GRPO loss normaliser: informative (token mean over informative groups' rows) "
            "or constant (Dr. GRPO / TRL dr_grpo: token sum over batch rows x "
            "max_new_tokens, zero-advantage rows counted)"
        ),
    ] = "informative"
    threads: Annotated[int, _d("torch threads for training and generation")] = 1
    device: Annotated[str, _d("auto, cpu or cuda")] = "auto"
    # other models' rollouts: HACPO's corrections (arXiv 2603.02604) and the choice of swarm data, each
    # switchable for the ablation; docs/training.md has the table
    foreign_pool: Annotated[
        bool,
        _d(
            "swarm rollouts of a task this step has an own group of (same task set, generator and seed) join that "
            "group: one baseline over all its answers (HACPO's pooled group)"
        ),
    ] = True
    foreign_baseline: Annotated[
        bool,
        _d(
            "HACPO's capability-weighted baseline over a group holding other models' rows (each source's rewards "
            "weighted by the learner's success rate over the source's, clipped 0.1-10); false: the plain mean"
        ),
    ] = True
    foreign_ratio_clip: Annotated[
        bool,
        _d(
            "HACPO's stepwise clipping: another model's sample trains only while its per-token ratio (the "
            "learner's log-probs against its own mean) lies in [1 - foreign_clip_delta + k x foreign_clip_step, "
            "1], k the update on the step's batch; outside it, weight 0 (a cut, never a floor)"
        ),
    ] = True
    foreign_clip_delta: Annotated[
        float,
        Meta(
            ge=0.0, le=1.0, description=("HACPO's delta: the band's lower bound at the first update is 1 - delta (0-1)")
        ),
    ] = 0.2
    foreign_clip_step: Annotated[
        float,
        Meta(
            ge=0.0,
            le=1.0,
            description=(
                "HACPO's Delta: the lower bound rises by this much with each further update on one step's batch (0-1)"
            ),
        ),
    ] = 0.025
    foreign_alpha: Annotated[
        float,
        Meta(
            ge=0.0,
            le=8.0,
            description=(
                "HACPO's exponential importance sampling: another model's sample is weighted by its per-token ratio "
                "to this power, truncated at 1 (0-8; 0 = off)"
            ),
        ),
    ] = 1.0
    foreign_capability: Annotated[
        bool,
        _d(
            "HACPO's capability coefficient: another model's sample is weighted by its source's success rate "
            "over the learner's, clipped to [0.1, foreign_capability_max]"
        ),
    ] = True
    foreign_capability_max: Annotated[
        float,
        Meta(
            ge=0.1,
            le=10.0,
            description=(
                "upper clip of the capability coefficient (0.1-10; HACPO's is 10). Above 1 a source that looks "
                "stronger multiplies its samples' weight, which is still capped at 1"
            ),
        ),
    ] = 1.0
    foreign_topr: Annotated[
        bool,
        _d(
            "TOPR's conservative negatives: another model's wrong answers are weighted by the learner's own "
            "likelihood ratio truncated at 1, outside HACPO's band and its power"
        ),
    ] = False
    foreign_rescue: Annotated[
        bool,
        _d(
            "rescue selection: take first the swarm's answers to tasks whose own group this step was all right or "
            "all wrong, then groups of medium difficulty"
        ),
    ] = True
    foreign_share_max: Annotated[
        float,
        Meta(
            ge=0.0,
            le=1.0,
            description=(
                "other models' rows at most this share of a step's rows, at least one group (0-1; 1 = no cap)"
            ),
        ),
    ] = 0.5
    foreign_wait: Annotated[
        int,
        Meta(
            ge=0,
            le=4,
            description=(
                "steps an own group of a shared-schedule prompt that no peer's answers joined waits for them "
                "before it trains alone (0-4; 0 = never waits)"
            ),
        ),
    ] = 1
    foreign_split: Annotated[
        bool,
        _d(
            "a shared-schedule prompt's own group is half a group, and peers' answers to it fill it to "
            "group_size (HACPO's half rollout cost)"
        ),
    ] = False
    foreign_prompt_ref: Annotated[
        bool,
        _d(
            "in a pooled group, another model's answers are weighed against the span of the learner's own "
            "completions of the same prompt, from the least to the most likely (false: against the running "
            "mean of all its own completions)"
        ),
    ] = True
    foreign_rows: Annotated[
        bool,
        _d(
            "train on other models' answers (false: they only set the baseline of the pooled group they join and "
            "cost no training pass; a swarm group of other models alone is not trained)"
        ),
    ] = True
    foreign_rows_rescue: Annotated[
        bool,
        _d(
            "train on other models' answers only in a pooled group they rescue (the learner's own answers to the "
            "prompt all right or all wrong); elsewhere they only set the pooled baseline and cost no training "
            "pass, and a swarm group of other models alone is not trained"
        ),
    ] = False


class DiskSection(Struct, forbid_unknown_fields=True, kw_only=True):
    ledger_max_rows: Annotated[int, _d("rollout ledger rows kept (oldest deleted first; totals are kept)")] = 200_000
    ledger_payload_rows: Annotated[int, _d("newest ledger rows that keep the rollout's signed bytes")] = 2_000
    ledger_max_age_h: Annotated[float, _d("ledger rows older than this many hours are deleted")] = 168.0
    logs_max_mb: Annotated[int, _d("node.log plus its one rotated copy, in MiB")] = 64
    peers_max_rows: Annotated[
        int,
        _d(
            "peer table rows kept in state.db (least recently seen strangers deleted "
            "first, then peers once connected or with accepted rollouts)"
        ),
    ] = 4096
    peers_max_mb: Annotated[float, _d("peer table bytes kept in state.db, in MiB (deleted in the same order)")] = 8.0

    def ledger_budget(self) -> Any:
        from murmur.node.store import LedgerBudget

        return LedgerBudget(
            max_rows=self.ledger_max_rows,
            payload_rows=self.ledger_payload_rows,
            max_age_s=self.ledger_max_age_h * 3600.0,
        )

    def peer_budget(self) -> Any:
        from murmur.node.store import PeerBudget

        return PeerBudget(max_rows=self.peers_max_rows, max_bytes=int(self.peers_max_mb * 2**20))


class TrustSection(Struct, forbid_unknown_fields=True, kw_only=True):
    coordinators: Annotated[list[str], _d("hex ed25519 public keys whose task sets this node accepts")] = []


class MetricsSection(Struct, forbid_unknown_fields=True, kw_only=True):
    port: Annotated[int, _d("Prometheus metrics port on 127.0.0.1; 0 = off")] = 0
    control_socket: Annotated[str, _d("control socket for `murmur node status`, relative to the home")] = "control.sock"


class Config(Struct, forbid_unknown_fields=True, kw_only=True):
    node: NodeSection = msgspec.field(default_factory=NodeSection)
    network: NetworkSection = msgspec.field(default_factory=NetworkSection)
    gossip: GossipSection = msgspec.field(default_factory=GossipSection)
    sync: SyncSection = msgspec.field(default_factory=SyncSection)
    training: TrainingSection = msgspec.field(default_factory=TrainingSection)
    disk: DiskSection = msgspec.field(default_factory=DiskSection)
    trust: TrustSection = msgspec.field(default_factory=TrustSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)


SECTIONS: dict[str, type[Struct]] = {
    "node": NodeSection,
    "network": NetworkSection,
    "gossip": GossipSection,
    "sync": SyncSection,
    "training": TrainingSection,
    "disk": DiskSection,
    "trust": TrustSection,
    "metrics": MetricsSection,
}


def default_home() -> Path:
    return Path(os.environ.get("MURMUR_HOME") or Path.home() / ".murmur")


def _convert(raw: dict[str, Any], origin: str) -> Config:
    return _check_values(convert_strict(raw, Config, origin), origin)


_CHOICES: dict[str, set[str]] = {
    "node.hardware": {"auto", "cpu", "gpu-small", "gpu-large"},
    "node.log_level": {"debug", "info", "warning", "error"},
    "training.engine": {"transformers", "vllm"},
    "training.device": {"auto", "cpu", "cuda"},
    "training.loss_norm": {"informative", "constant"},
}
_ROLES = {"trainer", "follower", "validator"}
_HEX32 = re.compile(r"^[0-9a-fA-F]{64}$")


def _check_values(cfg: Config, origin: str) -> Config:
    """Rules a type cannot express: closed choices, key formats, positive sizes."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{origin}: key '{key}': {why}")

    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise bad(key, f"{value!r} is not one of {', '.join(sorted(allowed))}")
    for role in cfg.node.roles:
        if role not in _ROLES:
            raise bad("node.roles", f"unknown role {role!r} (trainer, follower, validator)")
    for key in cfg.trust.coordinators:
        if not _HEX32.match(key):
            raise bad("trust.coordinators", f"{key!r} is not a 64-hex-digit ed25519 public key")
    for lineage in cfg.sync.follow:
        if not _HEX32.match(lineage):
            raise bad("sync.follow", f"{lineage!r} is not a 64-hex-digit lineage id")
    for key in ("network.listen", "network.bootstrap", "network.relays"):
        section, name = key.split(".")
        for addr in getattr(getattr(cfg, section), name):
            if not addr.startswith("/"):
                raise bad(key, f"{addr!r} is not a multiaddr (starts with /ip4/, /ip6/ or /dns/)")
    for key in (
        "sync.chunk_bytes",
        "sync.publish_every",
        "sync.anchor_every",
        "training.group_size",
        "node.memory_budget_mb",
        "disk.ledger_max_rows",
        "disk.ledger_max_age_h",
        "disk.logs_max_mb",
        "disk.peers_max_rows",
        "disk.peers_max_mb",
    ):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise bad(key, "must be positive")
    if cfg.disk.ledger_payload_rows < 0:
        raise bad("disk.ledger_payload_rows", "must not be negative")
    if not 0 <= cfg.training.minibatch_groups <= 1024:
        raise bad("training.minibatch_groups", "must be 0 (one update per step) to 1024")
    if not 0.0 <= cfg.training.schedule_share <= 1.0:
        raise bad("training.schedule_share", "must be 0 to 1")
    if not 0 <= cfg.training.select_groups <= MAX_SELECT_GROUPS:
        raise bad("training.select_groups", f"must be 0 (train every informative group) to {MAX_SELECT_GROUPS}")
    if not 1.0 <= cfg.training.follower_oversample <= MAX_OVERSAMPLE:
        raise bad("training.follower_oversample", f"must be 1.0 (the need) to {MAX_OVERSAMPLE:g}")
    if not 0.0 <= cfg.gossip.validator_sample <= 1.0:
        raise bad("gossip.validator_sample", "must be 0 to 1")
    if not 0.0 <= cfg.gossip.validator_sample_floor_per_min <= 600.0:
        raise bad("gossip.validator_sample_floor_per_min", "must be 0 to 600")
    if cfg.sync.max_staleness < 0:
        raise bad("sync.max_staleness", "must not be negative")
    t = cfg.training.temperature
    if not (t == 0.0 or wire.MIN_TEMPERATURE <= t <= wire.MAX_TEMPERATURE):
        # every receiver refuses such a rollout as bad_number: refuse the config, not each rollout silently
        raise bad(
            "training.temperature",
            f"{t!r} is neither 0 (greedy) nor in {wire.MIN_TEMPERATURE:g}-{wire.MAX_TEMPERATURE:g}",
        )
    choices = normalise(cfg.training.task_sets, f"{origin}: key 'training.task_sets'")
    untrusted = needs_trust(choices, "murmur-builtin")
    if untrusted and not cfg.trust.coordinators:
        raise bad(
            "training.task_sets",
            f"{untrusted[0]!r} can only come from a trusted coordinator and "
            '[trust] coordinators is empty (use "builtin" or add the coordinator\'s key)',
        )
    return cfg


def _parse_env_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_raw(path: Path | None) -> dict[str, Any]:
    if path is None or not Path(path).exists():
        return {}
    return read_toml(path)


def env_overrides(environ: dict[str, str] | None = None) -> dict[tuple[str, str], tuple[str, Any]]:
    """{(section, key): (variable name, value)} for every MURMUR_<SECTION>_<KEY> that names a field."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[tuple[str, str], tuple[str, Any]] = {}
    for var, text in environ.items():
        if not var.startswith("MURMUR_") or var == "MURMUR_HOME":
            continue
        rest = var[len("MURMUR_") :].lower()
        section, _, key = rest.partition("_")
        if section in SECTIONS and key:
            if key not in SECTIONS[section].__struct_fields__:
                raise ConfigError(f"environment: {var} names no config key '{section}.{key}'")
            out[(section, key)] = (var, _parse_env_value(text))
    return out


def load_config(path: Path | None = None, environ: dict[str, str] | None = None) -> Config:
    return load_config_with_sources(path, environ)[0]


def load_config_with_sources(
    path: Path | None = None, environ: dict[str, str] | None = None
) -> tuple[Config, dict[str, str]]:
    """The effective config and, for every `section.key`, where its value came from."""
    raw = load_raw(path)
    origin = str(path) if path else "config"
    _convert(raw, origin)  # errors in the file are reported against the file
    sources: dict[str, str] = {}
    for section, typ in SECTIONS.items():
        for key in typ.__struct_fields__:
            in_file = isinstance(raw.get(section), dict) and key in raw[section]
            sources[f"{section}.{key}"] = origin if in_file else "default"
    for (section, key), (var, value) in env_overrides(environ).items():
        raw.setdefault(section, {})[key] = value
        sources[f"{section}.{key}"] = f"env {var}"
    return _convert(raw, "environment"), sources


# Keys whose default depends on something else (the model's size): a new config.toml shows them commented out,
# so the node chooses unless the volunteer does.
UNSET_IN_NEW_FILE = {"training.lr"}


def render_default_config() -> str:
    """A commented config.toml; every key shown with its default and meaning."""
    config = Config()
    lines = [
        "# Murmur node configuration. Every key is optional; shown with its default "
        "(a key shown commented out is chosen by the node unless you set it).",
        "# Override any key with MURMUR_<SECTION>_<KEY>, e.g. MURMUR_NETWORK_UPLOAD_BYTES_PER_S=2097152.",
        "",
    ]
    for section, typ in SECTIONS.items():
        lines.append(f"[{section}]")
        values = getattr(config, section)
        hints = typing.get_type_hints(typ, include_extras=True)
        for key in typ.__struct_fields__:
            meta = getattr(hints[key], "__metadata__", ())
            desc = next((m.description for m in meta if isinstance(m, Meta) and m.description), "")
            if desc:
                lines.append(f"# {desc}")
            unset = "# " if f"{section}.{key}" in UNSET_IN_NEW_FILE else ""
            lines.append(f"{unset}{key} = {toml_value(getattr(values, key))}")
        lines.append("")
    return "\n".join(lines)


def flatten(config: Config) -> dict[str, Any]:
    return {
        f"{s}.{k}": msgspec.to_builtins(getattr(getattr(config, s), k))
        for s, t in SECTIONS.items()
        for k in t.__struct_fields__
    }
