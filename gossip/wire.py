"""Wire formats: every message that crosses the network, as msgspec Structs in msgpack.

Every message travels inside a signed `Envelope`. The signature covers the
exact body bytes that are sent, prefixed with a signing domain that names the
kind, the format version and the swarm, so a body signed as one kind never
verifies as another, and a message signed in one swarm never verifies in
another. Every caller names its swarm: `seal` signs under the `swarm` it is
given and `decode_envelope`/`open_envelope` refuse any other swarm's envelope
with `WrongSwarm`; the argument has no default, so no path can sign or accept
for a swarm it did not choose, and one process can hold several swarms (a
simulator, a bench, a test). Every kind has a hard size limit, checked before anything is decoded,
and every variable-length field has a bound, so no input can make a decoder
allocate without limit. Decoding raises only `DecodeError` (or its subclass
`SignatureError`). `docs/protocol.md` documents every field and limit here.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Annotated, Any, Final, TypeVar

import msgspec
import numpy as np
from msgspec import Meta, Struct

from murmur.gossip.errors import DecodeError, SignatureError
from murmur.gossip.identity import Identity, verify

# v2: the envelope names its swarm (signed), NodeAnnounce states its publishing rate.
FORMAT_VERSION: Final = 2
DEFAULT_SWARM: Final = "murmur-default"  # node.config's default swarm name

# Global cap checked before any decode; per-kind caps below are tighter.
MAX_ENVELOPE_BYTES: Final = 900 * 1024

# Kinds
ROLLOUT_BATCH: Final = "rollout_batch"
TASK_SET: Final = "task_set"
PATCH_MANIFEST: Final = "patch_manifest"
NODE_ANNOUNCE: Final = "node_announce"

KIND_LIMITS: Final[dict[str, int]] = {
    ROLLOUT_BATCH: 512 * 1024,
    TASK_SET: 128 * 1024,
    PATCH_MANIFEST: 512 * 1024,
    NODE_ANNOUNCE: 16 * 1024,
}

# Field bounds
MAX_ROLLOUTS_PER_BATCH: Final = 64
MAX_COMPLETION_TOKENS: Final = 4096
MAX_TEXT_CHARS: Final = 32 * 1024
MAX_GENERATORS: Final = 64
MAX_CHUNKS: Final = 8192
MAX_CHUNK_BYTES: Final = 8 * 1024 * 1024
MAX_NAME: Final = 128
MAX_CONFIG_ENTRIES: Final = 32
# Behaviour log-probs: a sampled token has probability > 0, so an honest float32 log-prob lies in
# about [-104, 0] (exp underflows below). Both bounds leave a margin for engines not measured here
# (GPU kernels, bf16 compute); a claim at the upper margin moves a behaviour weight by e^0.001 at most.
LOGPROB_MIN: Final = -1000.0
LOGPROB_MAX: Final = 1e-3
# A sampling temperature is 0 (greedy) or at least this: receivers divide logits by it to spot-check.
MIN_TEMPERATURE: Final = 1e-2
MAX_TEMPERATURE: Final = 10.0

Hash32 = Annotated[bytes, Meta(min_length=32, max_length=32)]
PubKey = Annotated[bytes, Meta(min_length=32, max_length=32)]
Sig = Annotated[bytes, Meta(min_length=64, max_length=64)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
U32 = Annotated[int, Meta(ge=0, lt=2**32)]
U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
# msgspec's range checks refuse NaN and +-inf (every comparison with NaN is false), so every
# float field below carries one: no float from the network is non-finite.
Finite = Annotated[float, Meta(ge=-1e30, le=1e30)]
ConfigValue = int | Finite | str | bool


def now_ms() -> int:
    return int(time.time() * 1000)


class Envelope(Struct, array_like=True, forbid_unknown_fields=True):
    """Signed container: `sig` = ed25519(signer, domain(kind, v, swarm) || body)."""

    v: U32
    kind: Name
    swarm: Name
    body: Annotated[bytes, Meta(max_length=MAX_ENVELOPE_BYTES)]
    signer: PubKey
    sig: Sig


# ---------------------------------------------------------------- rollouts


class TaskRef(Struct, array_like=True, forbid_unknown_fields=True):
    """Which task: the receiver regenerates question and answer from this alone."""

    task_set: Hash32  # content id of the signed TaskSetManifest
    generator: Name  # GeneratorSpec.name inside that task set
    seed: U64


class SamplingParams(Struct, array_like=True, forbid_unknown_fields=True):
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_COMPLETION_TOKENS)] = 64


class Rollout(Struct, array_like=True, forbid_unknown_fields=True):
    """One completion of one task, with what a trainer needs to learn from it."""

    task: TaskRef
    lineage: Hash32  # the lineage whose policy produced it
    version: U64  # policy version at the first completion token
    completion_ids: Annotated[list[U32], Meta(max_length=MAX_COMPLETION_TOKENS)]
    text: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
    tokenizer_hash: Hash32
    # little-endian float32 behaviour log-prob per completion token
    logprobs: Annotated[bytes, Meta(max_length=4 * MAX_COMPLETION_TOKENS)]
    # (token index, version) segments: the policy version that produced each token
    # from that index on (partial rollouts continue under newer versions)
    token_versions: Annotated[list[tuple[U32, U64]], Meta(max_length=64)]
    sampling: SamplingParams
    reward: Finite  # claimed; every receiver recomputes it
    created_ms: U64
    # the round of the shared prompt schedule this rollout answers (training/schedule.py), 0 = not scheduled:
    # receivers refuse a claimed round outside their window, and a task that is not one of its round's prompts
    schedule_round: U32 = 0


class RolloutBatch(Struct, array_like=True, forbid_unknown_fields=True):
    v: U32
    swarm: Name
    producer: PubKey  # must equal the envelope signer
    seq: U64  # per producer, strictly increasing: part of the replay key
    created_ms: U64
    rollouts: Annotated[list[Rollout], Meta(min_length=1, max_length=MAX_ROLLOUTS_PER_BATCH)]


# ---------------------------------------------------------------- task sets


class GeneratorSpec(Struct, array_like=True, forbid_unknown_fields=True):
    """A deterministic task generator: a built-in name or `rg:<reasoning-gym dataset>`."""

    name: Name
    generator: Name
    config: Annotated[dict[Name, ConfigValue], Meta(max_length=MAX_CONFIG_ENTRIES)]
    seed_start: U64
    seed_end: U64  # exclusive
    verifier: Annotated[str, Meta(max_length=MAX_NAME)] = ""  # "" = the task set's verifier
    weight: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0


class TaskSetManifest(Struct, array_like=True, forbid_unknown_fields=True):
    v: U32
    name: Name
    version: U32
    coordinator: PubKey  # must equal the envelope signer
    created_ms: U64
    verifier: Name  # exact | numeric | math_verify | rg_score | worked
    tolerance: Annotated[float, Meta(ge=0.0, le=1e6)]
    generators: Annotated[list[GeneratorSpec], Meta(min_length=1, max_length=MAX_GENERATORS)]
    description: Annotated[str, Meta(max_length=4096)] = ""


# ---------------------------------------------------------------- patches


class ChunkRef(Struct, array_like=True, forbid_unknown_fields=True):
    hash: Hash32  # blake2b-256 of the chunk bytes
    size: Annotated[int, Meta(ge=1, le=MAX_CHUNK_BYTES)]


class PatchManifest(Struct, array_like=True, forbid_unknown_fields=True):
    """Signed by the lineage publisher; lists the chunks of one patch or anchor."""

    v: U32
    lineage: Hash32
    lineage_name: Name
    base_model_hash: Hash32
    publisher: PubKey  # must equal the envelope signer; lineage id derives from it
    base_version: U64  # == target_version for an anchor
    target_version: U64
    base_hash: Annotated[bytes, Meta(max_length=32)]  # b"" for an anchor
    target_hash: Annotated[bytes, Meta(min_length=16, max_length=32)]
    codec: Name  # "sparse-v1" (patch), "union-v1", "anchor-v1"
    total_bytes: Annotated[int, Meta(ge=0, le=MAX_CHUNKS * MAX_CHUNK_BYTES)]
    chunk_bytes: Annotated[int, Meta(ge=1, le=MAX_CHUNK_BYTES)]
    chunks: Annotated[list[ChunkRef], Meta(max_length=MAX_CHUNKS)]
    created_ms: U64


# ---------------------------------------------------------------- announces


class LineageDemand(Struct, array_like=True, forbid_unknown_fields=True):
    """What a trainer needs from followers of its lineage (capacity rule)."""

    lineage: Hash32
    name: Name
    head_version: U64
    rollouts_per_step: Annotated[int, Meta(ge=0, le=1_000_000)]
    step_time_s: Annotated[float, Meta(ge=0.0, le=1e6)]
    max_staleness: Annotated[int, Meta(ge=0, le=1_000_000)]
    # peer IDs told to stand by because demand is met (cost-aware activation)
    standby: Annotated[list[Annotated[str, Meta(max_length=MAX_NAME)]], Meta(max_length=256)] = []
    # rollouts/s the trainer counts from its active followers (each claim capped by its verified delivery):
    # what a follower weighs a lineage's supply by, never other followers' own claims
    supply_rollouts_per_s: Annotated[float, Meta(ge=0.0, le=1e9)] = 0.0


class NodeAnnounce(Struct, array_like=True, forbid_unknown_fields=True):
    v: U32
    peer_id: Annotated[str, Meta(max_length=MAX_NAME)]
    seq: U64
    created_ms: U64
    hardware: Name  # cpu | gpu-small | gpu-large
    gen_tokens_per_s: Annotated[float, Meta(ge=0.0, le=1e9)]
    rollout_latency_s: Annotated[float, Meta(ge=0.0, le=1e6)]
    upload_bytes_per_s: Annotated[float, Meta(ge=0.0, le=1e12)]
    memory_bytes: Annotated[int, Meta(ge=0, le=2**50)]
    roles: Annotated[list[Name], Meta(max_length=8)]
    lineages_followed: Annotated[list[Hash32], Meta(max_length=64)]
    serving: Annotated[bytes, Meta(max_length=32)] = b""  # lineage served as follower, b"" if none
    owned: Annotated[list[LineageDemand], Meta(max_length=16)] = []
    addrs: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=16)] = []
    # rollout batches per second it published over the last minute: receivers hold it to
    # (a multiple of) this rate and charge it only above (gossip.ratelimit); 0 = not stated
    publish_batches_per_s: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0


Body = RolloutBatch | TaskSetManifest | PatchManifest | NodeAnnounce
BODY_TYPES: Final[dict[str, type[Body]]] = {
    ROLLOUT_BATCH: RolloutBatch,
    TASK_SET: TaskSetManifest,
    PATCH_MANIFEST: PatchManifest,
    NODE_ANNOUNCE: NodeAnnounce,
}
# Bodies whose own public-key field must equal the envelope signer.
_SIGNER_FIELD: Final[dict[str, str]] = {
    ROLLOUT_BATCH: "producer",
    TASK_SET: "coordinator",
    PATCH_MANIFEST: "publisher",
}

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_body_decoders: dict[str, msgspec.msgpack.Decoder[Body]] = {
    k: msgspec.msgpack.Decoder(t) for k, t in BODY_TYPES.items()
}

T = TypeVar("T", bound=Struct)

# What msgspec may raise on hostile bytes: its own errors, invalid UTF-8 (UnicodeDecodeError
# is a ValueError), and numeric overflow. Decoders turn all of them into DecodeError.
_DECODE_FAILURES = (msgspec.MsgspecError, ValueError, OverflowError, RecursionError)


class WrongSwarm(DecodeError):
    """A well-formed envelope signed for another swarm than the receiver's."""


class BadNumber(DecodeError):
    """A signed body whose numbers are well-typed but out of their range (a non-finite or
    positive behaviour log-prob): a provable fault of its signer, named apart from garbage."""


def signing_domain(kind: str, version: int, swarm: str) -> bytes:
    # The swarm is length-prefixed so no (swarm, body) split can be re-read as another.
    sw = swarm.encode()
    return f"murmur/{kind}/v{version}\x00".encode() + struct.pack(">H", len(sw)) + sw


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def content_id(body: bytes) -> bytes:
    """Content address of a signed body (task set id, message id)."""
    return hashlib.blake2b(body, digest_size=32).digest()


def seal(identity: Identity, kind: str, body: Struct, *, swarm: str) -> bytes:
    """Encode `body`, sign it under the kind's domain in `swarm` and return the envelope bytes."""
    if not isinstance(swarm, str) or not 1 <= len(swarm) <= MAX_NAME:
        raise ValueError(f"swarm name must be 1..{MAX_NAME} characters")
    if kind not in BODY_TYPES:
        raise ValueError(f"unknown message kind {kind!r}")
    if not isinstance(body, BODY_TYPES[kind]):
        raise TypeError(f"{kind} body must be {BODY_TYPES[kind].__name__}")
    raw = encode(body)
    sig = identity.sign(signing_domain(kind, FORMAT_VERSION, swarm) + raw)
    data = encode(Envelope(FORMAT_VERSION, kind, swarm, raw, identity.public, sig))
    if len(data) > KIND_LIMITS[kind]:
        raise ValueError(f"{kind} message is {len(data)} bytes, over its limit of {KIND_LIMITS[kind]}")
    return data


def decode_envelope(data: bytes, expect: str | None = None, *, swarm: str) -> Envelope:
    """Size limit, structure and swarm (`WrongSwarm` unless signed for `swarm`); the cheap
    first stages of validation."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError("message is not bytes")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise DecodeError(f"message is {len(data)} bytes, over the {MAX_ENVELOPE_BYTES}-byte limit")
    try:
        env = _envelope_decoder.decode(data)
    except _DECODE_FAILURES as e:
        raise DecodeError(f"malformed envelope: {e}") from None
    if env.v != FORMAT_VERSION:
        raise DecodeError(f"unsupported envelope format version {env.v}")
    if env.kind not in BODY_TYPES:
        raise DecodeError(f"unknown message kind {env.kind!r}")
    if expect is not None and env.kind != expect:
        raise DecodeError(f"expected a {expect} message, got {env.kind}")
    if len(data) > KIND_LIMITS[env.kind]:
        raise DecodeError(f"{env.kind} message is {len(data)} bytes, over its limit of {KIND_LIMITS[env.kind]}")
    if env.swarm != swarm:
        raise WrongSwarm(f"{env.kind} signed for swarm {env.swarm[:64]!r}, not {swarm[:64]!r}")
    return env


def verify_envelope(env: Envelope) -> None:
    if not verify(env.signer, env.sig, signing_domain(env.kind, env.v, env.swarm) + env.body):
        raise SignatureError(f"{env.kind} signature does not verify for its signer")


def decode_body(env: Envelope) -> Body:
    """Decode the body of an (already verified) envelope into its Struct."""
    try:
        body = _body_decoders[env.kind].decode(env.body)
    except _DECODE_FAILURES as e:
        raise DecodeError(f"malformed {env.kind} body: {e}") from None
    if body.v != FORMAT_VERSION:
        raise DecodeError(f"unsupported {env.kind} format version {body.v}")
    field = _SIGNER_FIELD.get(env.kind)
    if field is not None and getattr(body, field) != env.signer:
        raise SignatureError(f"{env.kind} {field} key differs from the envelope signer")
    _check_semantics(env.kind, body)
    return body


def _check_semantics(kind: str, body: Struct) -> None:
    """Cross-field rules msgspec constraints cannot express."""
    if isinstance(body, RolloutBatch):
        for i, r in enumerate(body.rollouts):
            if len(r.logprobs) != 4 * len(r.completion_ids):
                raise DecodeError(f"rollout {i}: {len(r.logprobs)} logprob bytes for {len(r.completion_ids)} tokens")
            bad = rollout_number_fault(r)
            if bad:
                raise BadNumber(f"rollout {i}: {bad}")
            prev = -1
            for idx, ver in r.token_versions:
                if idx <= prev or idx > len(r.completion_ids) or ver < r.version:
                    raise DecodeError(f"rollout {i}: token_versions out of order or range")
                prev = idx
    elif isinstance(body, TaskSetManifest):
        names = [g.name for g in body.generators]
        if len(set(names)) != len(names):
            raise DecodeError("task set has duplicate generator names")
        for g in body.generators:
            if g.seed_end <= g.seed_start:
                raise DecodeError(f"generator {g.name}: empty seed range")
    elif isinstance(body, PatchManifest):
        if body.target_version < body.base_version:
            raise DecodeError("patch target version precedes its base")
        if sum(c.size for c in body.chunks) != body.total_bytes:
            raise DecodeError("patch chunk sizes do not add up to total_bytes")
        if any(c.size > body.chunk_bytes for c in body.chunks):
            raise DecodeError("patch chunk larger than chunk_bytes")


def rollout_number_fault(r: Rollout) -> str:
    """Why a rollout's numbers are out of range beyond what its field types check ("" when none is):
    what a receiver refuses as `BadNumber`, and what a producer checks before it signs."""
    t = r.sampling.temperature
    if 0.0 < t < MIN_TEMPERATURE:
        return f"temperature {t!r} is neither 0 (greedy) nor at least {MIN_TEMPERATURE:g}"
    return logprob_fault(r.logprobs)


_LOGPROB_MAX_F32: Final = struct.unpack("<f", struct.pack("<f", LOGPROB_MAX))[0]  # the bound numpy compares with
_FEW_LOGPROBS: Final = 256  # up to this many, unpacking into Python floats is faster than numpy's per-call setup


def logprob_fault(data: bytes) -> str:
    """Why little-endian float32 behaviour log-probs are out of range ("" when all are in
    [LOGPROB_MIN, LOGPROB_MAX]); NaN fails both comparisons, so it is never in range."""
    n = len(data) // 4
    if n <= _FEW_LOGPROBS:  # the same float32 comparisons: both bounds rounded to float32 as numpy rounds them
        vals = struct.unpack(f"<{n}f", data[: 4 * n])
        total = sum(vals)  # NaN when any is NaN (or both infinities are there): then the loop names it
        if total == total and (not vals or (min(vals) >= LOGPROB_MIN and max(vals) <= _LOGPROB_MAX_F32)):
            return ""
        for j, x in enumerate(vals):
            if not LOGPROB_MIN <= x <= _LOGPROB_MAX_F32:
                return f"log-prob {x!r} at token {j} is outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}]"
        return ""
    a = np.frombuffer(data, dtype="<f4", count=n)
    ok = (a >= LOGPROB_MIN) & (a <= LOGPROB_MAX)
    if bool(ok.all()):
        return ""
    j = int(np.argmin(ok))
    return f"log-prob {float(a[j])!r} at token {j} is outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}]"


def open_envelope(data: bytes, expect: str | None = None, *, swarm: str) -> tuple[Envelope, Any]:
    """Full check: limits, structure, swarm, signature, body. Returns (envelope, body)."""
    env = decode_envelope(data, expect, swarm=swarm)
    verify_envelope(env)
    return env, decode_body(env)


def decode_struct(data: bytes, typ: type[T], limit: int) -> T:
    """Decode an unsigned local structure (stream frames, control messages) with a size cap."""
    if len(data) > limit:
        raise DecodeError(f"{typ.__name__} is {len(data)} bytes, over its limit of {limit}")
    try:
        return msgspec.msgpack.decode(data, type=typ)
    except _DECODE_FAILURES as e:
        raise DecodeError(f"malformed {typ.__name__}: {e}") from None
