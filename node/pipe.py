"""The pipe between the network process and its worker: one msgspec Struct per message kind, msgpack bytes.

Both ends build a message with `encode(kind, body)`, which converts and
checks the body against its Struct before it is sent, and read it with
`decode(data)`, which checks it again on arrival: each message is decoded
once per process, payloads travel as bytes (signed envelopes, encoded
rollouts), and a malformed message is a `DecodeError`, never a KeyError deep
in a handler. Lineage ids and hashes are hex strings (the worker keys its
files by them).

network -> worker: Follow, Patch, Admit, Pace, Head, External, Stop
worker -> network: Ready, State, Rollouts, Step, Gen, Published, Applied, ApplyFailed, Perf, Spot, Error, Log
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, get_args

import msgspec
from msgspec import Meta, Struct

from murmur.gossip.errors import DecodeError

MAX_MESSAGE = 64 * 1024 * 1024  # a batch of encoded rollouts, or one signed envelope
MAX_VERSION = 2**63 - 1  # a policy version, as the wire bounds it (gossip.wire.U64)
MAX_HELDOUT_TASKS = 1_000_000  # tasks one held-out evaluation may report


class FollowInfo(Struct, forbid_unknown_fields=True):
    id: str
    name: str
    publisher: str
    base: str


class Follow(Struct, tag="follow", forbid_unknown_fields=True):
    info: FollowInfo | None = None  # None: stand by


class Patch(Struct, tag="patch", forbid_unknown_fields=True):
    lineage: str
    kind: str
    base: int
    target: int


class Admit(Struct, tag="admit", forbid_unknown_fields=True):
    lineage: str
    generate: bool


class Pace(Struct, tag="pace", forbid_unknown_fields=True):
    rollouts_per_s: float


class Head(Struct, tag="head", forbid_unknown_fields=True):
    """A lineage's publisher-signed head as the node core knows it: a trainer's sampler ages that
    lineage's external groups out against it (training/sampler.py)."""

    lineage: str
    version: Annotated[int, Meta(ge=0, le=MAX_VERSION)]


class External(Struct, tag="external", forbid_unknown_fields=True):
    data: bytes  # a verified RolloutBatch envelope


class Stop(Struct, tag="stop", forbid_unknown_fields=True):
    pass


class Ready(Struct, tag="ready", forbid_unknown_fields=True):
    base: str
    version: int
    tokenizer_hash: str = ""
    model_bytes: int = 0
    lineage: str = ""  # a trainer's own lineage
    name: str = ""


class WorkerState(StrEnum):
    """What the worker is doing. The worker reports the states from LOADING on; the network process's core
    sets STARTING (process spawned), READY (its Ready arrived) and RESTARTING (it exited, a restart is due)."""

    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    LOADING = "loading"
    WAITING_FOR_TASKS = "waiting-for-tasks"
    TRAINING = "training"
    GENERATING = "generating"
    STANDBY = "standby"
    CATCHING_UP = "catching-up"
    STOPPED = "stopped"


class State(Struct, tag="state", forbid_unknown_fields=True):
    state: WorkerState


class Rollouts(Struct, tag="rollouts", forbid_unknown_fields=True):
    items: list[bytes]  # encoded wire.Rollout, for the network process to sign and gossip


class Step(Struct, tag="step", forbid_unknown_fields=True):
    step: int
    version: int
    reward_mean: float | None
    loss: float | None
    n_external_groups: int
    step_s: float
    used: Annotated[int, Meta(ge=0)] = 0  # external rows that entered updates
    used_by_set: dict[str, Annotated[int, Meta(ge=0)]] = {}  # the same, per task set (hex id)
    published: int | None = None  # the version published after this step, if any
    rollouts_per_step: int = 0
    sampler: dict[str, int] = {}  # training.sampler.Sampler counters
    # what the swarm gave this step: external groups and rows (`used`) that entered updates, their lineages
    external_groups: Annotated[int, Meta(ge=0)] = 0
    external_lineages: Annotated[int, Meta(ge=0)] = 0
    updates: Annotated[int, Meta(ge=0)] = 0  # optimizer updates this step
    trained_groups: Annotated[int, Meta(ge=0)] = 0  # groups, own and external, that entered those updates
    heldout: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # held-out greedy accuracy, when measured
    heldout_tasks: Annotated[int, Meta(ge=0, le=MAX_HELDOUT_TASKS)] = 0  # ... over this many tasks
    dropped: dict[str, int] = {}  # running totals by node.status.DROP_REASONS


class Gen(Struct, tag="gen", forbid_unknown_fields=True):
    reward_mean: float | None
    version: int
    tokens: int = 0
    latency_s: float = 0.0
    # held-out greedy accuracy of the weights it holds (`version`), when measured (node.worker.main.follower_eval_due)
    heldout: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    heldout_tasks: Annotated[int, Meta(ge=0, le=MAX_HELDOUT_TASKS)] = 0  # ... over this many tasks


class Published(Struct, tag="published", forbid_unknown_fields=True):
    version: int
    envelope: bytes
    total_bytes: int = msgspec.field(default=0, name="bytes")


class Applied(Struct, tag="applied", forbid_unknown_fields=True):
    lineage: str
    version: int
    need_anchor: bool = False


class ApplyFailed(Struct, tag="apply_failed", forbid_unknown_fields=True):
    lineage: str
    base: int
    target: int
    error: str = ""
    fault: str = ""  # "non_finite_patch": the publisher's signed content is at fault (it is charged)


class Perf(Struct, tag="perf", forbid_unknown_fields=True):
    gen_tokens_per_s: float
    rollout_latency_s: float


class Spot(Struct, tag="spot", forbid_unknown_fields=True):
    ok: bool
    producer: str
    diff: float
    lineage: str = ""
    version: int = 0


class SpotRound(Struct, tag="spot_round", forbid_unknown_fields=True):
    eligible: int  # received rollouts the worker could check this round (it held their weights)


class Error(Struct, tag="error", forbid_unknown_fields=True):
    message: str


class Log(Struct, tag="log", forbid_unknown_fields=True):
    message: str


class Engine(Struct, tag="engine", forbid_unknown_fields=True):
    requested: str  # [training] engine: transformers | vllm
    mode: str = ""  # training.engine MODE_*: what the worker opened ("" when it could not)
    error: str = ""  # why not


ToWorker = Follow | Patch | Admit | Pace | Head | External | Stop
FromWorker = (
    Ready
    | State
    | Rollouts
    | Step
    | Gen
    | Published
    | Applied
    | ApplyFailed
    | Perf
    | Spot
    | SpotRound
    | Engine
    | Error
    | Log
)
Message = ToWorker | FromWorker

KINDS: dict[str, type[Struct]] = {t.__struct_config__.tag: t for t in get_args(Message)}
# kinds whose body is one value rather than a mapping
_SCALAR = {
    "follow": "info",
    "external": "data",
    "state": "state",
    "rollouts": "items",
    "error": "message",
    "log": "message",
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def make(kind: str, body: Any = None) -> Struct:
    """The Struct for `(kind, body)`, body a mapping of its fields (or the one value of a scalar kind)."""
    t = KINDS.get(kind)
    if t is None:
        raise DecodeError(f"unknown pipe message kind {kind!r}")
    if kind in _SCALAR:
        body = {_SCALAR[kind]: body}
    try:
        return msgspec.convert(body or {}, type=t)
    except (msgspec.ValidationError, TypeError) as e:
        raise DecodeError(f"pipe message {kind}: {e}") from None


def encode(kind: str, body: Any = None) -> bytes:
    return _encoder.encode(make(kind, body))


def encode_struct(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE:
        raise DecodeError(f"pipe message of {len(data)} bytes, over {MAX_MESSAGE}")
    try:
        return _decoder.decode(data)
    except (msgspec.MsgspecError, ValueError) as e:
        raise DecodeError(f"malformed pipe message: {e}") from None
