"""Staleness admission (sans-IO): who may generate for which version, which rollouts a trainer keeps.

A follower generates rollouts for a lineage only while its local version is
within `max_staleness` of the newest head it has seen (a verified manifest);
beyond that it pauses, catches up by the cheapest plan `sync.catchup.choose`
finds, and resumes. Each transition is an event the runtime logs and the
dashboard shows. A trainer keeps a rollout only if its policy version lags its
own head by at most `max_staleness` (and is not from the future). AReaL's
admission rule bounds how many rollouts may be in flight so that, even at
full speed, none lands staler than eta versions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sync.catchup import Plan, choose
from sync.patchstore import StoredItem

UNKNOWN = "unknown"  # no local version yet: nothing to generate with
FRESH = "fresh"  # within the bound: generating
STALE = "stale"  # beyond the bound: paused, catching up


@dataclass(frozen=True, slots=True)
class StalenessEvent:
    lineage: bytes
    state: str  # the new state
    previous: str
    local: int | None
    head: int | None
    at: float

    @property
    def message(self) -> str:
        name = self.lineage.hex()[:12]
        if self.state == STALE:
            return f"lineage {name}: {self.head - (self.local or 0) if self.head is not None else '?'} versions behind " \
                   f"(local {self.local}, head {self.head}); rollouts paused, catching up"
        if self.state == FRESH and self.previous == STALE:
            return f"lineage {name}: caught up to {self.local} (head {self.head}); rollouts resumed"
        return f"lineage {name}: {self.previous} -> {self.state} (local {self.local}, head {self.head})"


class _Track:
    __slots__ = ("local", "head", "state", "since")

    def __init__(self, now: float) -> None:
        self.local: int | None = None
        self.head: int | None = None
        self.state = UNKNOWN
        self.since = now


class StalenessGuard:
    """Per-node follower state for every lineage it tracks."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.k = max_staleness
        self._t: dict[bytes, _Track] = {}

    def _track(self, lineage: bytes, now: float) -> _Track:
        t = self._t.get(lineage)
        if t is None:
            t = self._t[lineage] = _Track(now)
        return t

    def observe_head(self, lineage: bytes, version: int, now: float) -> list[StalenessEvent]:
        """A verified manifest (or announce) says the lineage reached `version`."""
        t = self._track(lineage, now)
        if t.head is None or version > t.head:
            t.head = version
        return self._update(lineage, t, now)

    def applied(self, lineage: bytes, version: int, now: float) -> list[StalenessEvent]:
        """The node now holds `version` locally (patch applied, anchor loaded)."""
        t = self._track(lineage, now)
        t.local = version
        if t.head is None or version > t.head:
            t.head = version
        return self._update(lineage, t, now)

    def _update(self, lineage: bytes, t: _Track, now: float) -> list[StalenessEvent]:
        if t.local is None:
            new = UNKNOWN
        else:
            new = FRESH if (t.head or 0) - t.local <= self.k else STALE
        if new == t.state:
            return []
        ev = StalenessEvent(lineage, new, t.state, t.local, t.head, now)
        t.state, t.since = new, now
        return [ev]

    def may_generate(self, lineage: bytes) -> bool:
        t = self._t.get(lineage)
        return t is not None and t.state == FRESH

    def version_for_generation(self, lineage: bytes) -> int | None:
        """The version to generate with, or None while paused."""
        return self._t[lineage].local if self.may_generate(lineage) else None

    def lag(self, lineage: bytes) -> int | None:
        t = self._t.get(lineage)
        if t is None or t.local is None or t.head is None:
            return None
        return t.head - t.local

    def state(self, lineage: bytes) -> str:
        t = self._t.get(lineage)
        return t.state if t else UNKNOWN

    def snapshot(self) -> dict[str, dict[str, object]]:
        """For logs, `murmur node status` and the dashboard."""
        return {lin.hex(): {"state": t.state, "local": t.local, "head": t.head,
                            "lag": None if t.local is None or t.head is None else t.head - t.local,
                            "since": t.since, "max_staleness": self.k}
                for lin, t in self._t.items()}

    def plan_catch_up(self, lineage: bytes, items: Iterable[StoredItem]) -> Plan:
        """Cheapest way from the local version to the head, by `sync.catchup` (chain, union or anchor)."""
        t = self._t[lineage]
        if t.head is None:
            return Plan((), 0)
        return choose(t.local, t.head, items)


def rollout_staleness_error(version: int, head: int, max_staleness: int) -> str | None:
    """Why a trainer at `head` must drop a rollout generated at `version`; None when it may keep it."""
    if version > head:
        return f"rollout claims version {version}, ahead of the head {head}"
    if head - version > max_staleness:
        return f"rollout version {version} is {head - version} behind the head {head} (max {max_staleness})"
    return None


def admit_rollout(version: int, head: int, max_staleness: int) -> bool:
    return rollout_staleness_error(version, head, max_staleness) is None


def areal_may_submit(max_in_flight: int, running: int, eta: int, version: int, batch: int, accepted: int) -> bool:
    """AReaL: submit a new rollout only while min(C - running, (eta + v + 1)*B - (accepted + running)) > 0."""
    return min(max_in_flight - running, (eta + version + 1) * batch - (accepted + running)) > 0


class AReaLAdmission:
    """Counters for `areal_may_submit`: a generator asks before starting each rollout."""

    def __init__(self, eta: int, batch: int, max_in_flight: int) -> None:
        if eta < 0 or batch < 1 or max_in_flight < 1:
            raise ValueError("need eta >= 0, batch >= 1, max_in_flight >= 1")
        self.eta, self.batch, self.max_in_flight = eta, batch, max_in_flight
        self.version = 0
        self.running = 0
        self.accepted = 0

    def may_submit(self) -> bool:
        return areal_may_submit(self.max_in_flight, self.running, self.eta, self.version, self.batch, self.accepted)

    def try_submit(self) -> bool:
        if not self.may_submit():
            return False
        self.running += 1
        return True

    def finished(self, accepted: bool) -> None:
        if self.running <= 0:
            raise ValueError("finished() without a running rollout")
        self.running -= 1
        if accepted:
            self.accepted += 1

    def set_version(self, version: int) -> None:
        """The trainer published `version`: more rollouts may start."""
        if version < self.version:
            raise ValueError("versions only move forward")
        self.version = version
