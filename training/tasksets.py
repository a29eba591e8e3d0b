"""Signed task sets: load from TOML, sign, verify, and resolve task references.

A task set is a `gossip.wire.TaskSetManifest` signed by a coordinator; its id
is the content id (blake2b-256) of the signed body, so a reference to it pins
the exact generators, configs, seed ranges and verifiers. The registry accepts
a set only when the signature verifies, the coordinator is trusted, and every
generator and verifier is in the closed built-in lists (checked by generating
one task per generator), so `resolve` can never meet an unknown name later.

The built-in set is signed by a fixed, publicly derivable key
(`BUILTIN_COORDINATOR`), so every node computes the same set and the same id
and can swap rollouts on it without configuring trust. Because that private
key is public, the registry trusts it for exactly one body: the built-in one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Final

import msgspec

from gossip.wire import (
    FORMAT_VERSION,
    TASK_SET,
    GeneratorSpec,
    TaskRef,
    TaskSetManifest,
    content_id,
    encode,
    now_ms,
    open_envelope,
    seal,
)
from gossip.errors import DecodeError, SignatureError, TaskError
from gossip.identity import Identity
from gossip.tomlfile import convert_strict, read_toml, validation_message
from training.tasks import Task, check_generator, generate
from training.verifiers import check_verifier

BUILTIN_COORDINATOR: Final = Identity.from_seed(hashlib.blake2b(b"murmur/builtin-task-set/v1", digest_size=32).digest())

# The tiny model's curriculum: single-digit sums with "<a>+<b>=" prompts. Seeds
# below EVAL_SEED_START are for training; the eval generator holds the rest out.
BUILTIN_NAME: Final = "murmur-builtin"
BUILTIN_TRAIN: Final = "add"
BUILTIN_EVAL: Final = "add-eval"


def builtin_manifest(coordinator: bytes | None = None) -> TaskSetManifest:
    pub = coordinator if coordinator is not None else BUILTIN_COORDINATOR.public
    cfg: dict[str, Any] = {"digits": 1, "ops": "+"}
    return TaskSetManifest(
        v=FORMAT_VERSION,
        name=BUILTIN_NAME,
        version=1,
        coordinator=pub,
        created_ms=0,
        verifier="numeric",
        tolerance=0.0,
        generators=[
            GeneratorSpec(name=BUILTIN_TRAIN, generator="arithmetic", config=cfg, seed_start=0, seed_end=1_000_000),
            GeneratorSpec(name=BUILTIN_EVAL, generator="arithmetic", config=cfg, seed_start=1_000_000,
                          seed_end=1_010_000),
        ],
        description="Built-in curriculum for murmur-tiny: one-digit addition; 'add-eval' is held out by seed.",
    )


def builtin_task_set(identity: Identity | None = None) -> bytes:
    """The built-in task set as a signed envelope (deterministic: created_ms = 0)."""
    ident = identity or BUILTIN_COORDINATOR
    return seal(ident, TASK_SET, builtin_manifest(ident.public))


def task_set_id(envelope_bytes: bytes) -> bytes:
    env, _ = open_envelope(envelope_bytes, TASK_SET)
    return content_id(env.body)


def check_manifest(m: TaskSetManifest, origin: str = "task set") -> None:
    """Every generator/verifier known and every config accepted (one task generated each)."""
    try:
        check_verifier(m.verifier)
        for g in m.generators:
            if g.verifier:
                check_verifier(g.verifier)
            check_generator(g.generator, g.config, g.seed_start)
    except TaskError as e:
        raise TaskError(f"{origin}: {e}") from None


def sign_task_set(identity: Identity, manifest: TaskSetManifest) -> bytes:
    """Sign `manifest` as `identity` (coordinator set to it; created_ms filled when 0)."""
    m = msgspec.structs.replace(manifest, coordinator=identity.public,
                                created_ms=manifest.created_ms or now_ms())
    check_manifest(m, f"task set {m.name!r}")
    try:
        return seal(identity, TASK_SET, m)
    except ValueError as e:
        raise TaskError(f"task set {m.name!r}: {e}") from None


# ------------------------------------------------------------ TOML


class GeneratorToml(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    generator: str
    config: dict[str, int | float | str | bool] = {}
    seed_start: int = 0
    seed_end: int
    verifier: str = ""
    weight: float = 1.0


class TaskSetToml(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    version: int = 1
    verifier: str
    tolerance: float = 0.0
    description: str = ""
    created_ms: int = 0
    generators: list[GeneratorToml]


def _wire_path(where: str) -> str:
    """Turn an array-like wire path such as `[7][0][5]` into `generators[0].seed_end`."""
    import re  # noqa: PLC0415

    idx = [int(x) for x in re.findall(r"\[(\d+)\]", where)]
    if not idx:
        return where
    top = TaskSetManifest.__struct_fields__
    out = top[idx[0]] if idx[0] < len(top) else where
    if out == "generators" and len(idx) >= 2:
        out += f"[{idx[1]}]"
        if len(idx) >= 3 and idx[2] < len(GeneratorSpec.__struct_fields__):
            out += "." + GeneratorSpec.__struct_fields__[idx[2]]
    return out


def load_task_set_toml(path: str | Path) -> TaskSetManifest:
    """Strictly parse a task-set TOML file into an (unsigned) manifest; errors name file and key."""
    path = Path(path)
    raw = read_toml(path, TaskError, "task-set file")
    return manifest_from_toml(convert_strict(raw, TaskSetToml, str(path), TaskError), str(path))


def manifest_from_toml(t: TaskSetToml, origin: str) -> TaskSetManifest:
    """An unsigned manifest from its TOML form, with every protocol bound and generator checked."""
    try:
        m = TaskSetManifest(
            v=FORMAT_VERSION, name=t.name, version=t.version, coordinator=bytes(32), created_ms=t.created_ms,
            verifier=t.verifier, tolerance=t.tolerance,
            generators=[GeneratorSpec(name=g.name, generator=g.generator, config=g.config, seed_start=g.seed_start,
                                      seed_end=g.seed_end, verifier=g.verifier, weight=g.weight)
                        for g in t.generators],
            description=t.description)
        # round-trip through the wire decoder: applies every field bound of the protocol
        m = msgspec.msgpack.decode(encode(m), type=TaskSetManifest)
    except msgspec.ValidationError as e:
        raise TaskError(validation_message(e, origin, _wire_path)) from None
    names = [g.name for g in m.generators]
    if len(set(names)) != len(names):
        raise TaskError(f"{origin}: duplicate generator names")
    for i, g in enumerate(m.generators):
        if g.seed_end <= g.seed_start:
            raise TaskError(f"{origin}: key 'generators[{i}].seed_end': must exceed seed_start")
    check_manifest(m, origin)
    return m


# ------------------------------------------------------------ registry


class TaskRegistry:
    """Task sets this node accepts, by id; resolves task references into tasks."""

    def __init__(self) -> None:
        self._sets: dict[bytes, TaskSetManifest] = {}
        self._envelopes: dict[bytes, bytes] = {}
        self._gens: dict[bytes, dict[str, GeneratorSpec]] = {}
        self._builtin_id = content_id(open_envelope(builtin_task_set(), TASK_SET)[0].body)

    @property
    def builtin_id(self) -> bytes:
        return self._builtin_id

    def add_builtin(self) -> TaskSetManifest:
        return self.add(builtin_task_set(), set())

    def add(self, envelope_bytes: bytes, trusted: set[bytes]) -> TaskSetManifest:
        """Verify and register a signed task set; raise SignatureError/DecodeError/TaskError."""
        env, m = open_envelope(envelope_bytes, TASK_SET)
        tid = content_id(env.body)
        if tid in self._sets:
            return self._sets[tid]
        if env.signer == BUILTIN_COORDINATOR.public:
            if tid != self._builtin_id:
                raise SignatureError("task set signed with the public built-in key is not the built-in set")
        elif env.signer not in trusted:
            raise SignatureError(f"task set {m.name!r} is signed by untrusted coordinator {env.signer.hex()}")
        check_manifest(m, f"task set {m.name!r}")
        self._sets[tid] = m
        self._envelopes[tid] = bytes(envelope_bytes)
        self._gens[tid] = {g.name: g for g in m.generators}
        return m

    def get(self, task_set_id: bytes) -> TaskSetManifest:
        m = self._sets.get(task_set_id)
        if m is None:
            raise TaskError(f"unknown task set {task_set_id.hex()}")
        return m

    def envelope(self, task_set_id: bytes) -> bytes:
        self.get(task_set_id)
        return self._envelopes[task_set_id]

    def list(self) -> list[tuple[bytes, TaskSetManifest]]:
        return list(self._sets.items())

    def __contains__(self, task_set_id: object) -> bool:
        return task_set_id in self._sets

    def spec(self, ref: TaskRef) -> tuple[TaskSetManifest, GeneratorSpec]:
        gens = self._gens.get(ref.task_set)
        if gens is None:
            raise TaskError(f"unknown task set {bytes(ref.task_set).hex()}")
        g = gens.get(ref.generator)
        if g is None:
            raise TaskError(f"unknown generator {ref.generator!r} in task set {bytes(ref.task_set).hex()[:16]}")
        if not g.seed_start <= ref.seed < g.seed_end:
            raise TaskError(f"seed out of range: {ref.seed} not in [{g.seed_start}, {g.seed_end}) "
                            f"for generator {ref.generator!r}")
        return self._sets[ref.task_set], g

    def resolve(self, ref: TaskRef) -> Task:
        """Regenerate the task a reference names; TaskError if it names nothing known."""
        m, g = self.spec(ref)
        return generate(g.generator, g.config, ref.seed, verifier=g.verifier or m.verifier, tolerance=m.tolerance)


__all__ = [
    "BUILTIN_COORDINATOR", "BUILTIN_EVAL", "BUILTIN_NAME", "BUILTIN_TRAIN", "DecodeError", "TaskRegistry",
    "GeneratorToml", "TaskSetToml", "builtin_manifest", "builtin_task_set", "check_manifest", "load_task_set_toml",
    "manifest_from_toml", "sign_task_set", "task_set_id",
]
