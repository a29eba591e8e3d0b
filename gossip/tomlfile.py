"""Strict TOML files: read, convert into msgspec Structs, and write back.

Config files, task sets and scenarios all promise the same thing: a bad file
is one line naming the file and the key, never a traceback. This module is
the one place that turns tomllib and msgspec errors into that line.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from murmur.gossip.errors import ConfigError, MurmurError

T = TypeVar("T")

_AT = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def read_toml(path: str | Path, error: type[MurmurError] = ConfigError, what: str = "file") -> dict[str, Any]:
    """Parse a TOML file; every failure is `error` naming the file."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no such {what}") from None
    except UnicodeDecodeError:
        raise error(f"{p}: not valid TOML: not UTF-8 text") from None
    except OSError as e:
        raise error(f"{p}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p}: not valid TOML: {e}") from None


def parse_toml(text: str, origin: str, error: type[MurmurError] = ConfigError) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{origin}: not valid TOML: {e}") from None


def validation_message(
    e: msgspec.ValidationError, origin: str, path_of: Callable[[str], str] = lambda where: where
) -> str:
    """'<origin>: unknown key 'a.b'' / 'missing key' / 'key 'a.b': <why>' from a msgspec error."""
    text = str(e).replace("\n", " ")
    m = _AT.search(text)
    where = path_of(m.group(1) if m else "")
    for pattern, label in ((_UNKNOWN, "unknown key"), (_MISSING, "missing key")):
        hit = pattern.search(text)
        if hit:
            key = f"{where}.{hit.group(1)}" if where else hit.group(1)
            return f"{origin}: {label} '{key}'"
    return f"{origin}: key '{where or '?'}': {text.split(' - at ')[0]}"


def convert_strict(raw: Any, typ: type[T], origin: str, error: type[MurmurError] = ConfigError) -> T:
    if not isinstance(raw, dict):
        raise error(f"{origin}: top level must be a table")
    try:
        return msgspec.convert(raw, typ, strict=True)
    except msgspec.ValidationError as e:
        raise error(validation_message(e, origin)) from None


def toml_value(v: Any) -> str:
    """A TOML literal for a scalar or a list of scalars."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")
