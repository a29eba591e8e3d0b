"""Which task sets a node trains on: `[training] task_sets`, resolved against the sets it holds.

An entry is "builtin", "trusted" (every set from a trusted coordinator), a
task-set name (the newest version held: a coordinator's new version replaces
the old one at every node that follows the name; a name belongs to the coordinator
whose set of that name this node received first, so another trusted coordinator's
set of that name, whatever its version, is a different set, chosen by its id) or a 64-hex task-set id (that
exact set), either as a plain string (weight 1) or as a table
`{ set = "...", weight = 2.0 }`. Resolution is a pure function of the entries
and the sets held; an entry that matches nothing held yet is *waiting*, never
replaced by another set. The mixture's weights pick a set per prompt group;
within a set, its generators' own weights pick the generator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import msgspec

from murmur.gossip.errors import ConfigError
from murmur.gossip.wire import MAX_NAME, TaskSetManifest

BUILTIN: Final = "builtin"
TRUSTED: Final = "trusted"
MAX_CHOICES: Final = 64
MAX_WEIGHT: Final = 1e6
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class TaskSetChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    set: str  # builtin | trusted | a task-set name | a 64-hex task-set id
    weight: float = 1.0


class Resolution(msgspec.Struct, frozen=True):
    mixture: list[tuple[bytes, float]]  # (task-set id, weight), in entry order, ids unique
    waiting: list[str]  # entries that match no set held yet


def normalise(entries: Iterable[str | TaskSetChoice | dict], where: str = "training.task_sets") -> list[TaskSetChoice]:
    """Entries as choices, each checked: a one-line ConfigError naming the bad entry."""
    out = []
    for e in entries:
        if isinstance(e, dict):  # the plain-data form a worker spec carries
            try:
                e = msgspec.convert(e, TaskSetChoice)
            except msgspec.ValidationError as err:
                raise ConfigError(f"{where}: {err}") from None
        c = TaskSetChoice(set=e) if isinstance(e, str) else e
        name = c.set.strip()
        if not name or len(name) > MAX_NAME:
            raise ConfigError(f"{where}: {c.set!r} is not a task-set name, id, 'builtin' or 'trusted'")
        if not 0 < c.weight <= MAX_WEIGHT:
            raise ConfigError(f"{where}: weight {c.weight!r} of {name!r} must be in (0, {MAX_WEIGHT:g}]")
        out.append(TaskSetChoice(set=name.lower() if _HEX64.match(name) else name, weight=float(c.weight)))
    if not out:
        raise ConfigError(f'{where}: empty: name at least one task set ("builtin" is the built-in one)')
    if len(out) > MAX_CHOICES:
        raise ConfigError(f"{where}: more than {MAX_CHOICES} entries")
    return out


def needs_trust(choices: Iterable[TaskSetChoice], builtin_name: str) -> list[str]:
    """Entries that only a trusted coordinator can satisfy."""
    return [c.set for c in choices if c.set not in (BUILTIN, builtin_name)]


def resolve(
    choices: list[TaskSetChoice],
    held: Iterable[tuple[bytes, TaskSetManifest]],
    builtin_id: bytes,
    builtin_coordinator: bytes,
) -> Resolution:
    """The mixture of task-set ids the entries name among the `held` sets (all verified and trusted), which
    come in the order this node received them."""
    held = list(held)
    # the newest version per (coordinator, name); ties (two bodies, one version) go to the larger id
    newest: dict[tuple[bytes, str], tuple[int, bytes]] = {}
    owner: dict[str, bytes] = {}  # a name belongs to the coordinator whose set of that name came first
    for tid, m in held:
        key = (bytes(m.coordinator), m.name)
        owner.setdefault(m.name, key[0])
        if key not in newest or (m.version, tid) > newest[key]:
            newest[key] = (m.version, tid)
    ids = {tid for tid, _ in held}
    weights: dict[bytes, float] = {}
    waiting: list[str] = []

    def add(tid: bytes, w: float) -> None:
        weights[tid] = weights.get(tid, 0.0) + w

    for c in choices:
        if c.set == BUILTIN:
            add(builtin_id, c.weight)
        elif _HEX64.match(c.set):
            tid = bytes.fromhex(c.set)
            if tid in ids:
                add(tid, c.weight)
            else:
                waiting.append(c.set)
        elif c.set == TRUSTED:
            found = sorted(tid for (coord, _), (_, tid) in newest.items() if coord != builtin_coordinator)
            for tid in found:
                add(tid, c.weight)
            if not found:
                waiting.append(c.set)
        else:
            hit = newest.get((owner.get(c.set, b""), c.set))
            if hit:
                add(hit[1], c.weight)
            else:
                waiting.append(c.set)
    return Resolution(mixture=list(weights.items()), waiting=waiting)
