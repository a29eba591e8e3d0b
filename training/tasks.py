"""Deterministic task generators: (generator, config, seed) -> Task.

A task travels as a reference only (`gossip.wire.TaskRef`); every receiver
regenerates the question and the ground truth itself, so nothing here may
depend on anything but its arguments: each generator draws from a
`random.Random` seeded by a string made of the generator name and the seed
(string seeds hash with SHA-512, identical on every platform and run).

Every built-in generator also takes `split` ("all", "train" or "eval") and
`holdout` (K): a problem is on the eval side when a hash of its prompt is 0
mod K, and a generator with a split draws (deterministically, from the same
stream) until it meets a problem of its side. So the "train" and "eval" sides
of any built-in problem space are disjoint by construction, whatever the seeds.

Generators are a closed list. `rg:<dataset>` delegates to reasoning-gym,
whose datasets are deterministic functions of (config, seed, index); we build
a one-entry dataset per seed and cache the objects, because constructing one
is cheap (~80 us) but importing reasoning-gym is not (~1.3 s, done lazily).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec

from murmur.gossip.errors import TaskError

ConfigValue = int | float | str | bool


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One regenerated task: what a policy is asked and how its answer is scored."""

    prompt: str
    answer: str
    verifier: str  # exact | numeric | math_verify | rg_score | worked
    tolerance: float = 0.0
    generator: str = ""  # e.g. "arithmetic" or "rg:basic_arithmetic"
    config_json: str = "{}"  # canonical JSON of the generator config
    seed: int = 0
    metadata_json: str = "{}"  # reasoning-gym entry metadata, JSON (informational)


def canonical_config(config: Mapping[str, ConfigValue]) -> str:
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def _rng(name: str, seed: int) -> random.Random:
    return random.Random(f"murmur/{name}/{int(seed)}")


# ------------------------------------------------------------ config checking


class _Param(msgspec.Struct, frozen=True):
    typ: type
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None


def _resolve_config(gen: str, params: Mapping[str, _Param], config: Mapping[str, ConfigValue]) -> dict[str, Any]:
    """Defaults filled, types and ranges checked; unknown keys refused."""
    out: dict[str, Any] = {}
    for key in config:
        if key not in params:
            raise TaskError(f"generator {gen!r}: unknown config key {key!r} (known: {', '.join(sorted(params))})")
    for key, p in params.items():
        v = config.get(key, p.default)
        if p.typ is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise TaskError(f"generator {gen!r}: config {key!r} must be an integer, got {v!r}")
        if p.typ is str and not isinstance(v, str):
            raise TaskError(f"generator {gen!r}: config {key!r} must be a string, got {v!r}")
        if p.typ is bool and not isinstance(v, bool):
            raise TaskError(f"generator {gen!r}: config {key!r} must be true or false, got {v!r}")
        if p.lo is not None and v < p.lo or p.hi is not None and v > p.hi:
            raise TaskError(f"generator {gen!r}: config {key!r}={v!r} outside [{p.lo}, {p.hi}]")
        if p.choices is not None and v not in p.choices:
            raise TaskError(f"generator {gen!r}: config {key!r}={v!r} not one of {', '.join(p.choices)}")
        out[key] = v
    return out


# ------------------------------------------------------------ held-out split

SPLITS: Final = ("all", "train", "eval")
SPLIT_DRAWS: Final = 256  # draws per task before a split side is declared empty (0.8**256 ~ 1e-25)
_SPLIT_PARAMS: Final = {
    "split": _Param(str, "all", choices=SPLITS),
    "holdout": _Param(int, 5, 2, 1000),  # K: one problem in K is on the eval side
}


def eval_side(prompt: str, holdout: int) -> bool:
    """Whether a built-in problem belongs to the eval side of a split with this `holdout` (K)."""
    h = hashlib.blake2b(prompt.encode(), digest_size=8, person=b"murmur-holdout").digest()
    return int.from_bytes(h, "big") % holdout == 0


# ------------------------------------------------------------ built-in generators

_ARITH_PARAMS: Final = {
    "digits": _Param(int, 2, 1, 9),  # operand digit count (max); see min_digits
    "min_digits": _Param(int, 1, 1, 9),
    "ops": _Param(str, "+"),  # any of + - *
    "mod": _Param(int, 0, 0, 10**9),  # 0 = no modulus; else answer is (a op b) mod m
}


def _arithmetic(cfg: dict[str, Any], r: random.Random) -> tuple[str, str]:
    ops = cfg["ops"]
    if not ops or any(c not in "+-*" for c in ops):
        raise TaskError(f"generator 'arithmetic': config 'ops'={ops!r} must be a non-empty string of + - *")
    if cfg["min_digits"] > cfg["digits"]:
        raise TaskError("generator 'arithmetic': config 'min_digits' exceeds 'digits'")
    op = ops[r.randrange(len(ops))]

    def operand() -> int:
        d = r.randint(cfg["min_digits"], cfg["digits"])
        return r.randrange(0 if d == 1 else 10 ** (d - 1), 10**d)

    a, b = operand(), operand()
    val = a + b if op == "+" else a - b if op == "-" else a * b
    if cfg["mod"]:
        return f"({a}{op}{b})%{cfg['mod']}=", str(val % cfg["mod"])
    return f"{a}{op}{b}=", str(val)


_DIGITS_OPS: Final = ("reverse", "sum", "max", "min", "first", "last", "count")
_DIGITS_PARAMS: Final = {
    "length": _Param(int, 4, 1, 32),
    "min_length": _Param(int, 1, 1, 32),
    "ops": _Param(str, "reverse,sum"),  # comma-separated subset of _DIGITS_OPS
}


def _digits(cfg: dict[str, Any], r: random.Random) -> tuple[str, str]:
    ops = [o.strip() for o in cfg["ops"].split(",") if o.strip()]
    if not ops or any(o not in _DIGITS_OPS for o in ops):
        raise TaskError(
            f"generator 'digits': config 'ops'={cfg['ops']!r}: use a comma list of {', '.join(_DIGITS_OPS)}"
        )
    if cfg["min_length"] > cfg["length"]:
        raise TaskError("generator 'digits': config 'min_length' exceeds 'length'")
    op = ops[r.randrange(len(ops))]
    n = r.randint(cfg["min_length"], cfg["length"])
    ds = "".join(str(r.randrange(10)) for _ in range(n))
    if op == "reverse":
        return f"rev {ds}=", ds[::-1]
    if op == "sum":
        return f"sum {ds}=", str(sum(map(int, ds)))
    if op == "max":
        return f"max {ds}=", max(ds)
    if op == "min":
        return f"min {ds}=", min(ds)
    if op == "first":
        return f"first {ds}=", ds[0]
    if op == "last":
        return f"last {ds}=", ds[-1]
    d = str(r.randrange(10))
    return f"count {d} {ds}=", str(ds.count(d))


_SORT_PARAMS: Final = {
    "length": _Param(int, 4, 1, 32),
    "min_length": _Param(int, 2, 1, 32),
    "max_value": _Param(int, 9, 1, 10**6),
    "descending": _Param(bool, False),
}


def _sorting(cfg: dict[str, Any], r: random.Random) -> tuple[str, str]:
    if cfg["min_length"] > cfg["length"]:
        raise TaskError("generator 'sorting': config 'min_length' exceeds 'length'")
    n = r.randint(cfg["min_length"], cfg["length"])
    xs = [r.randint(0, cfg["max_value"]) for _ in range(n)]
    word = "dsort" if cfg["descending"] else "sort"
    ys = sorted(xs, reverse=cfg["descending"])
    return f"{word} {','.join(map(str, xs))}=", ",".join(map(str, ys))


_WORKED_PARAMS: Final = {
    "length": _Param(int, 11, 2, 26),  # labelled digits in the chain (a, b, c, ...): length - 1 worked steps
    "min_length": _Param(int, 11, 2, 26),
    "mod": _Param(int, 10, 2, 1000),  # running sum mod m: every step's numbers stay below m
}
WORKED_MARKER: Final = "####"  # opens the part of a worked answer that carries its final result
WORKED_SEP: Final = ";"  # between a worked answer's steps (murmur-tiny's tokenizer has no newline)


def _worked(cfg: dict[str, Any], r: random.Random) -> tuple[str, str]:
    """A running sum mod m of a chain of labelled digits, worked one step at a time and closed by the
    marker: `chain a4b7c2=` -> `4+b7=1;1+c2=3;#### 3` (mod 10). Each step names the term it adds, so the
    work reads the prompt by label, not by position. The answer is the whole worked solution, which the
    `worked` verifier reads: only the result after the marker is graded, and work of another shape
    scores 0."""
    if cfg["min_length"] > cfg["length"]:
        raise TaskError("generator 'worked': config 'min_length' exceeds 'length'")
    n = r.randint(cfg["min_length"], cfg["length"])
    xs = [r.randrange(10) for _ in range(n)]
    labels = [chr(ord("a") + i) for i in range(n)]
    acc, lines = xs[0] % cfg["mod"], []
    for lab, x in zip(labels[1:], xs[1:]):
        nxt = (acc + x) % cfg["mod"]
        lines.append(f"{acc}+{lab}{x}={nxt}")
        acc = nxt
    return (
        f"chain {''.join(f'{lab}{x}' for lab, x in zip(labels, xs))}=",
        WORKED_SEP.join([*lines, f"{WORKED_MARKER} {acc}"]),
    )


class _Builtin(msgspec.Struct, frozen=True):
    params: dict[str, _Param]
    fn: Callable[[dict[str, Any], random.Random], tuple[str, str]]
    verifier: str  # natural default


BUILTIN_GENERATORS: Final[dict[str, _Builtin]] = {
    "arithmetic": _Builtin({**_ARITH_PARAMS, **_SPLIT_PARAMS}, _arithmetic, "numeric"),
    "digits": _Builtin({**_DIGITS_PARAMS, **_SPLIT_PARAMS}, _digits, "exact"),
    "sorting": _Builtin({**_SORT_PARAMS, **_SPLIT_PARAMS}, _sorting, "exact"),
    "worked": _Builtin({**_WORKED_PARAMS, **_SPLIT_PARAMS}, _worked, "worked"),
}


# ------------------------------------------------------------ reasoning-gym

RG_PREFIX: Final = "rg:"
_RG_CACHE_MAX: Final = 512
_rg_cache: OrderedDict[tuple[str, str, int], Any] = OrderedDict()


def _rg_module() -> Any:
    try:
        import reasoning_gym  # slow import, only when a task set uses it
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise TaskError(f"reasoning-gym is not installed: {e}") from None
    return reasoning_gym


def rg_dataset_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    _rg_module()
    return sorted(DATASETS)


def rg_dataset(name: str, config: Mapping[str, ConfigValue], seed: int) -> Any:
    """The one-entry dataset for `seed` (cached): entry 0 is the task."""
    key = (name, canonical_config(config), int(seed))
    ds = _rg_cache.get(key)
    if ds is not None:
        _rg_cache.move_to_end(key)
        return ds
    rg = _rg_module()
    if name not in rg_dataset_names():
        raise TaskError(f"unknown reasoning-gym dataset {name!r}")
    try:
        ds = rg.create_dataset(name, **dict(config), seed=int(seed), size=1)
    except TaskError:
        raise
    except Exception as e:  # reasoning-gym reports bad configs with assorted types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TaskError(f"reasoning-gym dataset {name!r}: bad config {canonical_config(config)}: {msg}") from None
    _rg_cache[key] = ds
    while len(_rg_cache) > _RG_CACHE_MAX:
        _rg_cache.popitem(last=False)
    return ds


def rg_entry(name: str, config: Mapping[str, ConfigValue], seed: int) -> dict[str, Any]:
    ds = rg_dataset(name, config, seed)
    try:
        return ds[0]
    except Exception as e:
        raise TaskError(f"reasoning-gym dataset {name!r} failed for seed {seed}: {e}") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return repr(o)


# ------------------------------------------------------------ entry points


def builtin_config(generator: str, config: Mapping[str, ConfigValue]) -> dict[str, Any]:
    """A built-in generator's config with defaults filled and every value checked."""
    b = BUILTIN_GENERATORS.get(generator)
    if b is None:
        raise TaskError(f"{generator!r} is not a built-in generator")
    return _resolve_config(generator, b.params, config)


def _builtin_problem(generator: str, b: _Builtin, cfg: dict[str, Any], seed: int) -> tuple[str, str]:
    r = _rng(generator, seed)
    split = cfg["split"]
    for _ in range(SPLIT_DRAWS):
        prompt, answer = b.fn(cfg, r)
        if split == "all" or eval_side(prompt, cfg["holdout"]) == (split == "eval"):
            return prompt, answer
    raise TaskError(
        f"generator {generator!r}: no {split!r} problem in {SPLIT_DRAWS} draws for seed {seed}; "
        f"the {split} side of this problem space is (nearly) empty: widen it or change 'holdout'"
    )


def known_generator(generator: str) -> bool:
    if generator in BUILTIN_GENERATORS:
        return True
    return generator.startswith(RG_PREFIX) and generator[len(RG_PREFIX) :] in rg_dataset_names()


def default_verifier(generator: str) -> str:
    if generator in BUILTIN_GENERATORS:
        return BUILTIN_GENERATORS[generator].verifier
    return "rg_score"


def check_generator(generator: str, config: Mapping[str, ConfigValue], seed: int = 0) -> None:
    """Raise TaskError unless `generator` exists and accepts `config` (one task is generated)."""
    generate(generator, config, seed)


def generate(
    generator: str,
    config: Mapping[str, ConfigValue],
    seed: int,
    verifier: str | None = None,
    tolerance: float = 0.0,
) -> Task:
    """The task for (generator, config, seed); a pure function of its arguments."""
    if not isinstance(seed, int) or seed < 0:
        raise TaskError(f"seed must be a non-negative integer, got {seed!r}")
    cfg_json = canonical_config(config)
    b = BUILTIN_GENERATORS.get(generator)
    if b is not None:
        prompt, answer = _builtin_problem(generator, b, _resolve_config(generator, b.params, config), seed)
        return Task(
            prompt=prompt,
            answer=answer,
            verifier=verifier or b.verifier,
            tolerance=tolerance,
            generator=generator,
            config_json=cfg_json,
            seed=seed,
        )
    if generator.startswith(RG_PREFIX):
        name = generator[len(RG_PREFIX) :]
        entry = rg_entry(name, config, seed)
        meta = json.dumps(entry.get("metadata", {}), sort_keys=True, default=_json_default)
        return Task(
            prompt=str(entry["question"]),
            answer=str(entry["answer"]),
            verifier=verifier or "rg_score",
            tolerance=tolerance,
            generator=generator,
            config_json=cfg_json,
            seed=seed,
            metadata_json=meta,
        )
    raise TaskError(f"unknown generator {generator!r} (built-in: {', '.join(BUILTIN_GENERATORS)}; or rg:<dataset>)")
