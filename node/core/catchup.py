"""Catch-up (sans-IO, part of `node.core.machine`): what the node holds and has on its way for the lineages it
fetches, which broadcast transfers it accepts, and one catch-up attempt of the served lineage at a time.

Steady-state versions arrive by the broadcast on their own; catch-up only acts when what is held plus what
is in flight cannot reach the head (joined late, restarted, missed a manifest). An attempt asks its sources
in turn (the publisher first, then peers serving the lineage; at most `CATALOG_SOURCES`), one catalog at a
time (`CatchUpPhase`); a catalog is planned with `sync.catchup.choose` (O(items)) over held items and
transfers in flight (cost 0) and the source's items, and the source is asked to offer the missing items
(it seeds them into the broadcast).
A source that fails (its catalog, or an offer) hands over to the next at once; when every source has
failed, the attempt waits out `CATCH_UP_PATIENCE_S` and starts over, as does an attempt that made no
progress in that time. A transfer accepted from the broadcast counts as on its way for
`IN_FLIGHT_PATIENCE_S` (at most `MAX_IN_FLIGHT` at once).

While the served lineage's head stays past what is held with no version applied (time its own worker is
down not counted), the node leaves it after `LEAVE_AFTER_S`, or after `TRIAL_S` when it never delivered a
version to this node; a configured lineage is never left. The machine says so (`CatchUpNeed.LEAVE`); the
leaving is the core's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from murmur.gossip import wire
from murmur.node.core.events import (
    Action,
    CatalogFailed,
    CatalogReceived,
    FetchCatalog,
    LoadStored,
    Log,
    OfferFailed,
    RequestOffer,
)
from murmur.node.core.lineages import LineageState
from murmur.sync.catchup import choose
from murmur.sync.errors import PatchError
from murmur.sync.items import KINDS, MAX_ITEMS, StoredItem, item_of, wanted

CATCH_UP_PATIENCE_S = 120.0  # a catch-up attempt with no progress after this is retried from scratch
IN_FLIGHT_PATIENCE_S = 30.0  # a transfer in flight longer than this no longer counts as on its way
RESYNC_AFTER_S = 10.0  # held versions that reach the head but do not apply for this long: re-read the store
CATALOG_SOURCES = 4
MAX_IN_FLIGHT = 256  # accepted transfers at once (each is a download the broadcast holds state for)
# A served lineage whose head stays past the held version this long with no version applied cannot be
# fetched from (a head moved by announces, manifests whose chunks no one serves): the follower leaves it.
LEAVE_AFTER_S = 180.0
# A lineage chosen but never delivered to this node (`LineageState.delivered`) is on trial: the worker is not
# switched to it until an item of it is stored, and it is left after one catch-up attempt's patience with no
# version applied, so a key that signs manifests it never serves costs a follower one catch-up, no generation.
TRIAL_S = CATCH_UP_PATIENCE_S

ItemKey = tuple[str, int, int]  # (kind, base, target) of a stored item


class CatchUpPhase(Enum):
    ASKING = "asking"  # a catalog request to `CatchUp.source` is out
    OFFERED = "offered"  # its catalog came: offers of the planned items are out to `source`
    EXHAUSTED = "exhausted"  # every source failed: wait out the patience, then start over


@dataclass(slots=True)
class CatchUp:
    """One catch-up attempt of the served lineage: sources asked in turn, at most one catalog at a time."""

    lineage: bytes
    sources: list[str]
    started: float
    phase: CatchUpPhase = CatchUpPhase.ASKING
    source: str = ""  # the peer asked (ASKING) or offering (OFFERED); unused once EXHAUSTED
    offered: int = 0

    def from_source(self, lineage: bytes, peer: str) -> bool:
        """Whether a reply about `lineage` from `peer` belongs to this attempt's current source."""
        return self.lineage == lineage and self.phase is not CatchUpPhase.EXHAUSTED and self.source == peer


class CatchUpNeed(Enum):
    """What the core does after `CatchUpMachine.check`."""

    NOTHING = "nothing"  # caught up, everything needed on its way, or an attempt under way
    SOURCES = "sources"  # a new attempt: the core names its sources (`begin`)
    LEAVE = "leave"  # the lineage applied nothing for too long: the core leaves it


class CatchUpMachine:
    def __init__(self, now: float) -> None:
        self.stored: dict[bytes, set[ItemKey]] = {}  # served/own lineage -> items held (cache)
        self.in_flight: dict[tuple[bytes, str, int, int], float] = {}  # accepted transfers -> when
        self.attempt: CatchUp | None = None
        self.progress = (-1, 0.0)  # (held version of the served lineage, when it last changed)
        self.behind_since: float | None = None  # since when the served lineage's head is past what we hold
        self.last_check = now
        self.last_resync = -math.inf

    # ------------------------------------------------------------ held and on its way
    def holds(self, lid: bytes, key: ItemKey) -> bool:
        return key in self.stored.get(lid, set())

    def on_stored_items(self, lid: bytes, items: tuple[StoredItem, ...]) -> None:
        """What the store holds of `lid` (it replaces the cache)."""
        self.stored[lid] = {(i.kind, i.base, i.target) for i in items}

    def on_stored(self, lid: bytes, key: ItemKey) -> None:
        """A transfer completed and was stored: held, no longer on its way."""
        self.stored.setdefault(lid, set()).add(key)
        self.in_flight.pop((lid, *key), None)

    def on_dropped(self, lid: bytes, key: ItemKey) -> None:
        self.stored.get(lid, set()).discard(key)

    def accept(self, lin: LineageState, m: wire.PatchManifest, now: float) -> bool:
        """The broadcast accept rule for a manifest of `lin` (already checked): wanted, and room in flight;
        an accepted manifest counts as in flight from `now`."""
        if not wanted(m, lin.lineage, lin.publisher, lin.held, lin.need_anchor, self.stored.get(lin.lineage, set())):
            return False
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            return False
        it = item_of(m)
        self.in_flight[(lin.lineage, it.kind, it.base, it.target)] = now
        return True

    def expire(self, now: float) -> None:
        """Forget transfers long past their patience (their broadcast gave up on them)."""
        for key in [k for k, t in self.in_flight.items() if now - t > IN_FLIGHT_PATIENCE_S * 4]:
            del self.in_flight[key]

    def _free_items(self, lid: bytes, now: float) -> dict[ItemKey, StoredItem]:
        """Held items and accepted transfers still on their way: both cost nothing to plan with."""
        keys = set(self.stored.get(lid, set()))
        keys |= {
            (k, b, t) for (lin, k, b, t), at in self.in_flight.items() if lin == lid and now - at < IN_FLIGHT_PATIENCE_S
        }
        return {key: StoredItem(key[0], key[1], key[2], 0) for key in keys}

    # ------------------------------------------------------------ the attempt
    def reset(self) -> None:
        """The served lineage changed: no attempt, not behind."""
        self.attempt = None
        self.behind_since = None

    def check(
        self, lin: LineageState | None, now: float, worker_down: bool, configured: bool, out: list[Action]
    ) -> CatchUpNeed:
        """The catch-up timer for the served lineage `lin` (None: none served).

        `worker_down`: this node's worker cannot apply anything now (that time is not held against the
        publisher); `configured`: the lineage is configured, so never left.
        """
        gap, self.last_check = now - self.last_check, now
        if lin is None or (lin.head <= lin.held and not lin.need_anchor):
            self.reset()
            return CatchUpNeed.NOTHING
        if lin.held != self.progress[0]:
            self.progress = (lin.held, now)
            self.behind_since = now
        if self.behind_since is None:
            self.behind_since = now
        elif worker_down:
            self.behind_since += gap
        elif now - self.behind_since >= (LEAVE_AFTER_S if lin.delivered else TRIAL_S) and not configured:
            return CatchUpNeed.LEAVE
        try:
            choose(None if lin.need_anchor else lin.held, lin.head, self._free_items(lin.lineage, now).values())
            self.attempt = None
            # Everything needed is held or on its way. If the worker still does not move, what the store
            # holds differs from our cache (a payload lost after it was stored): re-read the store.
            if now - self.progress[1] >= RESYNC_AFTER_S and now - self.last_resync >= RESYNC_AFTER_S:
                self.last_resync = now
                out.append(LoadStored(lin.lineage))
            return CatchUpNeed.NOTHING
        except PatchError:
            pass
        if self.attempt is not None and now - self.attempt.started < CATCH_UP_PATIENCE_S:
            return CatchUpNeed.NOTHING
        return CatchUpNeed.SOURCES

    def begin(self, lid: bytes, sources: list[str], now: float, out: list[Action]) -> None:
        """A new attempt for `lid`, asking `sources` in turn (the first `CATALOG_SOURCES`)."""
        self.attempt = CatchUp(lid, sources[:CATALOG_SOURCES], now)
        self._ask_next(out)

    def _ask_next(self, out: list[Action]) -> None:
        c = self.attempt
        if c is None:
            return
        if not c.sources:
            c.phase = CatchUpPhase.EXHAUSTED
            return
        c.phase, c.source = CatchUpPhase.ASKING, c.sources.pop(0)
        out.append(FetchCatalog(c.source, c.lineage))

    def on_catalog_failed(self, ev: CatalogFailed, out: list[Action]) -> None:
        self._source_failed(ev, CatchUpPhase.ASKING, "catch-up source failed", out)

    def on_offer_failed(self, ev: OfferFailed, out: list[Action]) -> None:
        """An offered item did not come: the source cannot seed what it listed, so the next source is asked."""
        self._source_failed(ev, CatchUpPhase.OFFERED, "catch-up offer failed", out)

    def _source_failed(
        self, ev: CatalogFailed | OfferFailed, phase: CatchUpPhase, what: str, out: list[Action]
    ) -> None:
        """The current source failed in `phase`: logged, and the next source asked (stale reports ignored)."""
        c = self.attempt
        if c is None or c.phase is not phase or not c.from_source(ev.lineage, ev.peer):
            return
        out.append(Log(what, {"lineage": ev.lineage.hex()[:16], "peer": ev.peer, "error": ev.error[:200]}))
        self._ask_next(out)

    def on_catalog(self, ev: CatalogReceived, lin: LineageState | None, now: float, out: list[Action]) -> None:
        """The current source's catalog of `lin`: plan from what is held and on its way, offer the rest."""
        c = self.attempt
        if c is None or c.phase is not CatchUpPhase.ASKING or not c.from_source(ev.lineage, ev.peer) or lin is None:
            return
        free = self._free_items(ev.lineage, now)
        remote = [
            i
            for i in ev.items[:MAX_ITEMS]
            if i.kind in KINDS and (i.kind, i.base, i.target) not in free and i.target <= lin.head
        ]
        items = list(free.values()) + remote
        start = None if lin.need_anchor else lin.held
        head = min(lin.head, max((i.target for i in items), default=0))
        if start is not None and head <= start:
            self._ask_next(out)
            return
        try:
            try:
                plan = choose(start, head, items)
            except PatchError:  # the chain from what we hold was pruned there: an anchor will do
                plan = choose(None, head, items)
        except PatchError as e:
            out.append(Log("catch-up: no plan", {"lineage": ev.lineage.hex()[:16], "peer": ev.peer, "why": str(e)}))
            self._ask_next(out)
            return
        steps = [s for s in plan.steps if (s.kind, s.base, s.target) not in free]
        out.append(
            Log(
                "catching up",
                {
                    "lineage": ev.lineage.hex()[:16],
                    "plan": plan.kind,
                    "held": lin.held,
                    "head": head,
                    "fetch": len(steps),
                    "bytes": plan.total_bytes,
                    "source": ev.peer,
                },
            )
        )
        c.offered += len(steps)
        c.phase = CatchUpPhase.OFFERED
        for s in steps:
            out.append(RequestOffer(ev.peer, ev.lineage, s))
