"""Staleness admission (sans-IO): whether a follower may generate for the lineage it serves.

A follower generates rollouts for a lineage only while its local version is
within `max_staleness` of the newest publisher-signed head it knows; beyond
that it pauses, catches up (`node.core.machine`, by the cheapest plan
`sync.catchup.choose` finds), and resumes. Each transition is an event the
node core logs and the dashboard shows. (Receivers drop rollouts beyond the
bound in the verification pipeline, `gossip/validation.py`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Admission(StrEnum):
    """A followed lineage's staleness state (the values are what logs and status show)."""

    UNKNOWN = "unknown"  # no local version yet: nothing to generate with
    FRESH = "fresh"  # within the bound: generating
    STALE = "stale"  # beyond the bound: paused, catching up


@dataclass(frozen=True, slots=True)
class StalenessEvent:
    lineage: bytes
    state: Admission  # the new state
    previous: Admission
    local: int | None
    head: int | None
    at: float

    @property
    def message(self) -> str:
        name = self.lineage.hex()[:12]
        if self.state == Admission.STALE:
            return (
                f"lineage {name}: {self.head - (self.local or 0) if self.head is not None else '?'} versions behind "
                f"(local {self.local}, head {self.head}); rollouts paused, catching up"
            )
        if self.state == Admission.FRESH and self.previous == Admission.STALE:
            return f"lineage {name}: caught up to {self.local} (head {self.head}); rollouts resumed"
        return f"lineage {name}: {self.previous} -> {self.state} (local {self.local}, head {self.head})"


class _Track:
    __slots__ = ("local", "head", "state")

    def __init__(self) -> None:
        self.local: int | None = None
        self.head: int | None = None
        self.state = Admission.UNKNOWN


class StalenessGuard:
    """Per-node follower state for every lineage it tracks."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.k = max_staleness
        self._t: dict[bytes, _Track] = {}

    def _track(self, lineage: bytes) -> _Track:
        t = self._t.get(lineage)
        if t is None:
            t = self._t[lineage] = _Track()
        return t

    def observe_head(self, lineage: bytes, version: int, now: float) -> list[StalenessEvent]:
        """A verified manifest (or announce) says the lineage reached `version`."""
        t = self._track(lineage)
        if t.head is None or version > t.head:
            t.head = version
        return self._update(lineage, t, now)

    def applied(self, lineage: bytes, version: int, now: float) -> list[StalenessEvent]:
        """The node now holds `version` locally (patch applied, anchor loaded)."""
        t = self._track(lineage)
        t.local = version
        if t.head is None or version > t.head:
            t.head = version
        return self._update(lineage, t, now)

    def _update(self, lineage: bytes, t: _Track, now: float) -> list[StalenessEvent]:
        if t.local is None:
            new = Admission.UNKNOWN
        else:
            new = Admission.FRESH if (t.head or 0) - t.local <= self.k else Admission.STALE
        if new == t.state:
            return []
        ev = StalenessEvent(lineage, new, t.state, t.local, t.head, now)
        t.state = new
        return [ev]

    def may_generate(self, lineage: bytes) -> bool:
        t = self._t.get(lineage)
        return t is not None and t.state == Admission.FRESH
