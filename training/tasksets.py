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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from murmur.gossip.errors import DecodeError, SignatureError, TaskError
from murmur.gossip.identity import Identity
from murmur.gossip.tomlfile import convert_strict, read_toml, validation_message
from murmur.gossip.wire import (
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
from murmur.training.tasks import RG_PREFIX, Task, builtin_config, check_generator, generate
from murmur.training.verifiers import check_verifier

BUILTIN_COORDINATOR: Final = Identity.from_seed(hashlib.blake2b(b"murmur/builtin-task-set/v1", digest_size=32).digest())

# The tiny model's curriculum: three families of digit-string rules that murmur-tiny learns on 2 CPU
# cores in minutes and that generalise by structure, so held-out problems are learnable (a sum's eval
# side would be arithmetic facts never seen). Each space is large (>= 11,100 problems) so that RL cannot
# pass by memorising training problems: it has to learn the rule. Each family's "-eval" generator is
# the held-out side of the same problem space (`split`, training/tasks.py): no eval problem can be
# drawn in training or in murmur-tiny's warm-up, which draws from the training generators only.
BUILTIN_NAME: Final = "murmur-builtin"
BUILTIN_VERSION: Final = 3
BUILTIN_TRAIN: Final = "lookup"  # the first family (tools that need one generator name use it)
BUILTIN_EVAL: Final = "lookup-eval"
EVAL_SUFFIX: Final = "-eval"
BUILTIN_FAMILIES: Final[tuple[tuple[str, str, dict[str, Any], str], ...]] = (
    ("lookup", "digits", {"length": 8, "min_length": 4, "ops": "first,last,max,min"}, "exact"),
    ("rev", "digits", {"length": 4, "min_length": 2, "ops": "reverse"}, "exact"),
    ("sort", "sorting", {"length": 4, "min_length": 2, "max_value": 9}, "exact"),
)


# The worked-answer regime: answers that need worked steps (>= 64 completion tokens of murmur-tiny's), as a
# real task's completions do, graded on the result after the marker (`worked` verifier). A set of its own,
# so that the short-answer curriculum and every model warmed up on it stay as they are.
ANSWERS: Final = ("short", "worked")  # the answer regimes: the built-in set's, and this set's
WORKED_NAME: Final = "murmur-worked"
WORKED_VERSION: Final = 1
WORKED_FAMILIES: Final[tuple[tuple[str, str, dict[str, Any], str], ...]] = (
    ("chain", "worked", {"length": 11, "min_length": 10, "mod": 10}, "worked"),
)


def _families_manifest(
    name: str,
    version: int,
    families: tuple[tuple[str, str, dict[str, Any], str], ...],
    verifier: str,
    description: str,
    coordinator: bytes | None,
) -> TaskSetManifest:
    pub = coordinator if coordinator is not None else BUILTIN_COORDINATOR.public
    gens = []
    for family, generator, cfg, fverifier in families:
        for split, gname in (("train", family), ("eval", family + EVAL_SUFFIX)):
            gens.append(
                GeneratorSpec(
                    name=gname,
                    generator=generator,
                    config={**cfg, "split": split},
                    seed_start=0,
                    seed_end=1_000_000,
                    verifier=fverifier,
                )
            )
    return TaskSetManifest(
        v=FORMAT_VERSION,
        name=name,
        version=version,
        coordinator=pub,
        created_ms=0,
        verifier=verifier,
        tolerance=0.0,
        generators=gens,
        description=description,
    )


def builtin_manifest(coordinator: bytes | None = None) -> TaskSetManifest:
    return _families_manifest(
        BUILTIN_NAME,
        BUILTIN_VERSION,
        BUILTIN_FAMILIES,
        "exact",
        "Built-in curriculum for murmur-tiny: digit look-ups (first, last, max, min of 4-8 "
        "digits), reversing 2-4 digits, sorting 2-4 digits; each '-eval' generator is the held-out "
        "side of its family's problem space.",
        coordinator,
    )


def worked_manifest(coordinator: bytes | None = None) -> TaskSetManifest:
    """The worked-answer set (unsigned; `sign_task_set` signs it for a coordinator, which peers must trust)."""
    return _families_manifest(
        WORKED_NAME,
        WORKED_VERSION,
        WORKED_FAMILIES,
        "worked",
        "Worked answers: the running sum mod 10 of 10-11 labelled digits, one step at a time, then "
        "'#### <result>' (69-76 characters); 'chain-eval' is the held-out side of its problem space.",
        coordinator,
    )


def answers_manifest(answers: str, coordinator: bytes | None = None) -> TaskSetManifest:
    """The built-in curriculum of an answer regime: "short" (the built-in set) or "worked"."""
    if answers not in ANSWERS:
        raise TaskError(f"answers must be one of {', '.join(ANSWERS)}, not {answers!r}")
    return builtin_manifest(coordinator) if answers == "short" else worked_manifest(coordinator)


def builtin_task_set(swarm: str, identity: Identity | None = None) -> bytes:
    """The built-in task set as an envelope signed for `swarm` (deterministic: created_ms = 0; its
    id, the hash of its body, is the same in every swarm)."""
    ident = identity or BUILTIN_COORDINATOR
    return seal(ident, TASK_SET, builtin_manifest(ident.public), swarm=swarm)


def task_set_id(envelope_bytes: bytes, *, swarm: str) -> bytes:
    env, _ = open_envelope(envelope_bytes, TASK_SET, swarm=swarm)
    return content_id(env.body)


def check_manifest(m: TaskSetManifest, origin: str = "task set") -> None:
    """Every generator/verifier known, every config accepted (one task generated each), and every
    eval generator held out from the set's training generators."""
    try:
        check_verifier(m.verifier)
        for g in m.generators:
            if g.verifier:
                check_verifier(g.verifier)
            check_generator(g.generator, g.config, g.seed_start)
        check_held_out(eval_generators(m), train_generators(m))
    except TaskError as e:
        raise TaskError(f"{origin}: {e}") from None


# ------------------------------------------------------------ held-out evaluation


def is_eval(g: GeneratorSpec) -> bool:
    """Generators named `<family>-eval` are held out: trainers never sample them."""
    return g.name.endswith(EVAL_SUFFIX)


def train_generators(m: TaskSetManifest) -> list[GeneratorSpec]:
    return [g for g in m.generators if not is_eval(g)]


def eval_generators(m: TaskSetManifest) -> list[GeneratorSpec]:
    return [g for g in m.generators if is_eval(g)]


def _span(cfg: dict[str, Any], lo: str, hi: str) -> tuple[int, int]:
    return int(cfg[lo]), int(cfg[hi])


def _disjoint_spans(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[1] < b[0] or b[1] < a[0]


def overlap(e: GeneratorSpec, t: GeneratorSpec) -> str | None:
    """Why eval generator `e` can produce a problem that training generator `t` can, or None when
    their problem spaces are disjoint by construction.

    Built-in generators: disjoint seeds are not enough (their spaces are small and seeds collide);
    disjoint means the eval and train sides of one split (same `holdout`), or different generators
    (their prompts differ in syntax), or operations, modulus, operand or list lengths never shared.
    reasoning-gym datasets: different datasets, or disjoint seed ranges of the same one (its datasets
    are large enough that such collisions are negligible; tests/test_tasks.py counts them)."""
    e_rg, t_rg = e.generator.startswith(RG_PREFIX), t.generator.startswith(RG_PREFIX)
    if e_rg or t_rg:
        if e.generator != t.generator:
            return None
        if e.seed_end <= t.seed_start or t.seed_end <= e.seed_start:
            return None
        return "the same reasoning-gym dataset with overlapping seed ranges"
    if e.generator != t.generator:
        return None
    ce, ct = builtin_config(e.generator, e.config), builtin_config(t.generator, t.config)
    if ce["split"] == "eval" and ct["split"] == "train" and ce["holdout"] == ct["holdout"]:
        return None
    if e.generator == "arithmetic":
        if (
            not set(ce["ops"]) & set(ct["ops"])
            or ce["mod"] != ct["mod"]
            or _disjoint_spans(_span(ce, "min_digits", "digits"), _span(ct, "min_digits", "digits"))
        ):
            return None
    elif e.generator == "digits":
        ops = [{o.strip() for o in c["ops"].split(",") if o.strip()} for c in (ce, ct)]
        if not ops[0] & ops[1] or _disjoint_spans(_span(ce, "min_length", "length"), _span(ct, "min_length", "length")):
            return None
    elif e.generator == "sorting":
        if ce["descending"] != ct["descending"] or _disjoint_spans(
            _span(ce, "min_length", "length"), _span(ct, "min_length", "length")
        ):
            return None
    elif e.generator == "worked":
        if ce["mod"] != ct["mod"] or _disjoint_spans(
            _span(ce, "min_length", "length"), _span(ct, "min_length", "length")
        ):
            return None
    return (
        "the same built-in problem space (disjoint seeds are not enough for built-in generators: "
        'give the pair split = "eval" / "train" with one holdout, or operations or operand '
        "ranges never trained on)"
    )


def check_held_out(evals: list[GeneratorSpec], trains: list[GeneratorSpec], where: str = "") -> None:
    """TaskError naming the first eval generator that overlaps a training (or warm-up) generator."""
    for e in evals:
        for t in trains:
            why = overlap(e, t)
            if why is not None:
                raise TaskError(f"eval generator {e.name!r} overlaps training generator {t.name!r}{where}: {why}")


def sign_task_set(identity: Identity, manifest: TaskSetManifest, *, swarm: str) -> bytes:
    """Sign `manifest` as `identity` for `swarm` (coordinator set to it; created_ms filled when 0)."""
    m = msgspec.structs.replace(manifest, coordinator=identity.public, created_ms=manifest.created_ms or now_ms())
    check_manifest(m, f"task set {m.name!r}")
    try:
        return seal(identity, TASK_SET, m, swarm=swarm)
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
    import re

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
            v=FORMAT_VERSION,
            name=t.name,
            version=t.version,
            coordinator=bytes(32),
            created_ms=t.created_ms,
            verifier=t.verifier,
            tolerance=t.tolerance,
            generators=[
                GeneratorSpec(
                    name=g.name,
                    generator=g.generator,
                    config=g.config,
                    seed_start=g.seed_start,
                    seed_end=g.seed_end,
                    verifier=g.verifier,
                    weight=g.weight,
                )
                for g in t.generators
            ],
            description=t.description,
        )
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
    """Task sets this node accepts, by id (signed for `swarm`); resolves task references into tasks."""

    def __init__(self, swarm: str) -> None:
        self.swarm = swarm
        self._sets: dict[bytes, TaskSetManifest] = {}
        self._envelopes: dict[bytes, bytes] = {}
        self._gens: dict[bytes, dict[str, GeneratorSpec]] = {}
        self._builtin_id = content_id(encode(builtin_manifest(BUILTIN_COORDINATOR.public)))  # the signed body

    @property
    def builtin_id(self) -> bytes:
        return self._builtin_id

    def add_builtin(self) -> TaskSetManifest:
        return self.add(builtin_task_set(self.swarm), set())

    def trusted_manifest(self, envelope_bytes: bytes, trusted: set[bytes]) -> tuple[bytes, TaskSetManifest]:
        """(id, manifest) of a signed task set from a trusted coordinator; SignatureError/DecodeError otherwise.
        Generates nothing: cheap enough to run before any limited check."""
        env, m = open_envelope(envelope_bytes, TASK_SET, swarm=self.swarm)
        tid = content_id(env.body)
        if env.signer == BUILTIN_COORDINATOR.public:
            if tid != self._builtin_id:
                raise SignatureError("task set signed with the public built-in key is not the built-in set")
        elif env.signer not in trusted:
            raise SignatureError(f"task set {m.name!r} is signed by untrusted coordinator {env.signer.hex()}")
        return tid, m

    def add(self, envelope_bytes: bytes, trusted: set[bytes], check: bool = True) -> TaskSetManifest:
        """Verify and register a signed task set; raise SignatureError/DecodeError/TaskError. `check=False`
        when the caller already ran `check_manifest` on it (under limits, in a verifier worker)."""
        tid, m = self.trusted_manifest(envelope_bytes, trusted)
        if tid in self._sets:
            return self._sets[tid]
        if check:
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
            raise TaskError(
                f"seed out of range: {ref.seed} not in [{g.seed_start}, {g.seed_end}) for generator {ref.generator!r}"
            )
        return self._sets[ref.task_set], g

    def resolve(self, ref: TaskRef, run: Callable[..., Any] | None = None) -> Task:
        """Regenerate the task a reference names; TaskError if it names nothing known.

        `run(fn, *args, **kwargs)` runs reasoning-gym generation where its cost is bounded (a verifier
        pool's `call`: the set's configuration came from the network); built-in generators are cheap
        and bounded by their own parameter ranges, and run here."""
        m, g = self.spec(ref)
        if run is not None and g.generator.startswith(RG_PREFIX):
            return run(
                generate, g.generator, g.config, ref.seed, verifier=g.verifier or m.verifier, tolerance=m.tolerance
            )
        return generate(g.generator, g.config, ref.seed, verifier=g.verifier or m.verifier, tolerance=m.tolerance)


__all__ = [
    "ANSWERS",
    "BUILTIN_COORDINATOR",
    "BUILTIN_EVAL",
    "WORKED_NAME",
    "answers_manifest",
    "worked_manifest",
    "BUILTIN_FAMILIES",
    "BUILTIN_NAME",
    "BUILTIN_TRAIN",
    "DecodeError",
    "EVAL_SUFFIX",
    "TaskRegistry",
    "check_held_out",
    "eval_generators",
    "is_eval",
    "overlap",
    "train_generators",
    "GeneratorToml",
    "TaskSetToml",
    "builtin_manifest",
    "builtin_task_set",
    "check_manifest",
    "load_task_set_toml",
    "manifest_from_toml",
    "sign_task_set",
    "task_set_id",
]
