"""Catch-up (`node.core.catchup`) on its own: sources asked in turn and rotated on failure, the patience, plans
around what is held and in flight, the broadcast accept rule and its bound, the store re-read, and when the
served lineage is to be left."""

from __future__ import annotations

from murmur.gossip.identity import Identity
from murmur.node.core.catchup import (
    CATALOG_SOURCES,
    CATCH_UP_PATIENCE_S,
    IN_FLIGHT_PATIENCE_S,
    LEAVE_AFTER_S,
    MAX_IN_FLIGHT,
    RESYNC_AFTER_S,
    TRIAL_S,
    CatchUpMachine,
    CatchUpNeed,
    CatchUpPhase,
)
from murmur.node.core.events import (
    CatalogFailed,
    CatalogReceived,
    FetchCatalog,
    LoadStored,
    Log,
    OfferFailed,
    RequestOffer,
)
from murmur.node.core.lineages import LineageState
from murmur.sync.ids import lineage_id
from murmur.sync.items import StoredItem
from tests.test_core import BASE, manifest

PUB = Identity.from_seed(b"\x09" * 32)
LID = lineage_id(PUB.public, BASE, "lin")
OTHER = b"\5" * 32


def row(held: int = 0, head: int = 6, delivered: bool = True, need_anchor: bool = False) -> LineageState:
    return LineageState(
        LID,
        "lin",
        "follow",
        publisher=PUB.public,
        base=BASE,
        head=head,
        held=held,
        signed_head=head,
        delivered=delivered,
        need_anchor=need_anchor,
    )


def of(out: list, cls: type) -> list:
    return [a for a in out if isinstance(a, cls)]


def test_sources_are_asked_one_at_a_time_and_each_failure_moves_to_the_next() -> None:
    m = CatchUpMachine(0.0)
    out: list = []
    m.begin(LID, ["a", "b", "c"], 0.0, out)
    assert out == [FetchCatalog("a", LID)] and m.attempt.phase is CatchUpPhase.ASKING
    # reports that are not about the current source, its lineage or its phase change nothing
    for stale in (CatalogFailed("b", LID, "x"), CatalogFailed("a", OTHER, "x")):
        assert_ignored(m, stale)
    out = []
    m.on_offer_failed(OfferFailed("a", LID, "x"), out)  # no offers are out yet
    assert out == []
    out = []
    m.on_catalog_failed(CatalogFailed("a", LID, "refused"), out)
    assert out == [
        Log("catch-up source failed", {"lineage": LID.hex()[:16], "peer": "a", "error": "refused"}),
        FetchCatalog("b", LID),
    ]
    out = []
    m.on_catalog(CatalogReceived("b", LID, (StoredItem("patch", 0, 1, 10),)), row(head=1), 1.0, out)
    assert of(out, RequestOffer) == [RequestOffer("b", LID, StoredItem("patch", 0, 1, 10))]
    assert m.attempt.phase is CatchUpPhase.OFFERED and m.attempt.source == "b" and m.attempt.offered == 1
    out = []
    m.on_catalog_failed(CatalogFailed("b", LID, "late"), out)  # b's catalog came: its failure is stale
    assert out == []
    m.on_offer_failed(OfferFailed("b", LID, "not held"), out)
    assert of(out, FetchCatalog) == [FetchCatalog("c", LID)] and out[0].msg == "catch-up offer failed"
    out = []
    m.on_catalog_failed(CatalogFailed("c", LID, "x"), out)
    assert of(out, FetchCatalog) == [] and m.attempt.phase is CatchUpPhase.EXHAUSTED
    out = []
    m.on_catalog_failed(CatalogFailed("c", LID, "again"), out)
    assert out == []


def assert_ignored(m: CatchUpMachine, ev: CatalogFailed) -> None:
    before = (m.attempt.phase, m.attempt.source, list(m.attempt.sources))
    out: list = []
    m.on_catalog_failed(ev, out)
    assert out == [] and (m.attempt.phase, m.attempt.source, list(m.attempt.sources)) == before


def test_an_attempt_asks_at_most_the_first_sources() -> None:
    m = CatchUpMachine(0.0)
    sources = [f"p{i}" for i in range(CATALOG_SOURCES + 3)]
    asked: list = []
    m.begin(LID, sources, 0.0, asked)
    for _ in range(len(sources)):
        m.on_catalog_failed(CatalogFailed(m.attempt.source, LID, "x"), asked)
    assert [a.peer for a in of(asked, FetchCatalog)] == sources[:CATALOG_SOURCES]


def test_a_behind_lineage_needs_sources_until_an_attempt_runs_and_again_after_its_patience() -> None:
    m = CatchUpMachine(0.0)
    lin = row(held=0, head=6)
    assert m.check(lin, 0.0, False, False, []) is CatchUpNeed.SOURCES
    m.begin(LID, ["a"], 0.0, [])
    assert m.check(lin, CATCH_UP_PATIENCE_S - 0.5, False, False, []) is CatchUpNeed.NOTHING
    assert m.attempt is not None
    assert m.check(lin, CATCH_UP_PATIENCE_S, False, False, []) is CatchUpNeed.SOURCES
    # caught up: the attempt is over
    assert m.check(row(held=6, head=6), CATCH_UP_PATIENCE_S + 1, False, False, []) is CatchUpNeed.NOTHING
    assert m.attempt is None and m.behind_since is None
    # held items do not count as caught up when an anchor is needed
    assert m.check(row(held=6, head=6, need_anchor=True), 200.0, False, False, []) is CatchUpNeed.SOURCES


def test_what_is_held_or_in_flight_needs_no_catch_up_until_the_transfer_outlives_its_patience() -> None:
    m = CatchUpMachine(0.0)
    m.on_stored_items(LID, (StoredItem("patch", 0, 1, 10), StoredItem("patch", 1, 2, 10)))
    assert m.accept(row(held=0, head=3), manifest(PUB, "lin", 2, 3), 0.0)
    lin = row(held=0, head=3)
    assert m.check(lin, 1.0, False, False, []) is CatchUpNeed.NOTHING and m.attempt is None
    assert m.check(lin, IN_FLIGHT_PATIENCE_S, False, False, []) is CatchUpNeed.SOURCES  # no longer on its way
    m.on_stored(LID, ("patch", 2, 3))
    assert m.in_flight == {} and m.check(lin, IN_FLIGHT_PATIENCE_S + 1, False, False, []) is CatchUpNeed.NOTHING
    m.on_dropped(LID, ("patch", 1, 2))  # the worker could not apply it: no longer held
    assert m.check(lin, IN_FLIGHT_PATIENCE_S + 2, False, False, []) is CatchUpNeed.SOURCES


def test_held_versions_that_do_not_apply_make_it_re_read_the_store_once_per_period() -> None:
    m = CatchUpMachine(0.0)
    m.on_stored_items(LID, (StoredItem("patch", 0, 1, 10), StoredItem("patch", 1, 2, 10)))
    lin = row(held=0, head=2)
    reads = []
    for t in (0.0, RESYNC_AFTER_S - 0.5, RESYNC_AFTER_S, RESYNC_AFTER_S + 5, 2 * RESYNC_AFTER_S):
        out: list = []
        assert m.check(lin, t, False, False, out) is CatchUpNeed.NOTHING
        reads += [t] * len(of(out, LoadStored))
        assert of(out, LoadStored) in ([], [LoadStored(LID)])
    assert reads == [RESYNC_AFTER_S, 2 * RESYNC_AFTER_S]


def test_a_delivered_lineage_is_left_after_its_patience_and_one_on_trial_sooner() -> None:
    for delivered, patience in ((True, LEAVE_AFTER_S), (False, TRIAL_S)):
        m = CatchUpMachine(0.0)
        lin = row(held=1, head=6, delivered=delivered)
        m.check(lin, 0.0, False, False, [])
        assert m.check(lin, patience - 0.5, False, False, []) is not CatchUpNeed.LEAVE
        assert m.check(lin, patience, False, False, []) is CatchUpNeed.LEAVE
        assert m.check(lin, patience + 1000, False, True, []) is not CatchUpNeed.LEAVE  # configured: never left
    assert TRIAL_S < LEAVE_AFTER_S


def test_a_version_applied_or_time_the_worker_was_down_restarts_the_count() -> None:
    m = CatchUpMachine(0.0)
    m.check(row(held=1), 0.0, False, False, [])
    m.check(row(held=2), LEAVE_AFTER_S - 1, False, False, [])  # progress
    assert m.check(row(held=2), LEAVE_AFTER_S + 10, False, False, []) is not CatchUpNeed.LEAVE
    assert m.check(row(held=2), 2 * LEAVE_AFTER_S - 1, False, False, []) is CatchUpNeed.LEAVE
    m = CatchUpMachine(0.0)
    m.check(row(held=1), 0.0, False, False, [])
    m.check(row(held=1), 100.0, True, False, [])  # the 100 s before this were the worker's, not the publisher's
    assert m.check(row(held=1), 100.0 + LEAVE_AFTER_S - 1, False, False, []) is not CatchUpNeed.LEAVE
    assert m.check(row(held=1), 100.0 + LEAVE_AFTER_S, False, False, []) is CatchUpNeed.LEAVE


def test_a_catalog_is_planned_around_what_is_held_and_in_flight() -> None:
    m = CatchUpMachine(0.0)
    m.on_stored_items(LID, (StoredItem("patch", 0, 1, 10),))
    m.accept(row(held=0, head=4), manifest(PUB, "lin", 1, 2), 0.0)
    m.begin(LID, ["a", "b"], 0.0, [])
    items = tuple(StoredItem("patch", v, v + 1, 10) for v in range(5))  # 0..5, one past the head
    out: list = []
    m.on_catalog(CatalogReceived("a", LID, items), row(held=0, head=4), 1.0, out)
    assert [o.item for o in of(out, RequestOffer)] == [StoredItem("patch", 2, 3, 10), StoredItem("patch", 3, 4, 10)]
    assert {o.peer for o in of(out, RequestOffer)} == {"a"} and of(out, Log)[0].msg == "catching up"


def test_a_catalog_that_brings_nothing_new_moves_to_the_next_source() -> None:
    m = CatchUpMachine(0.0)
    m.begin(LID, ["a", "b"], 0.0, [])
    out: list = []
    m.on_catalog(CatalogReceived("a", LID, (StoredItem("patch", 0, 1, 10),)), row(held=3, head=6), 1.0, out)
    assert out == [FetchCatalog("b", LID)]
    out = []
    m.on_catalog(CatalogReceived("b", LID, (StoredItem("patch", 4, 5, 10),)), row(held=3, head=6), 1.0, out)
    assert of(out, Log)[0].msg == "catch-up: no plan" and of(out, RequestOffer) == []
    assert m.attempt.phase is CatchUpPhase.EXHAUSTED


def test_the_accept_rule_takes_what_is_wanted_up_to_the_bound_in_flight() -> None:
    m = CatchUpMachine(0.0)
    lin = row(held=3, head=10)
    assert not m.accept(lin, manifest(PUB, "lin", 2, 3), 0.0)  # not ahead of what is held
    m.on_stored_items(LID, (StoredItem("patch", 3, 4, 10),))
    assert not m.accept(lin, manifest(PUB, "lin", 3, 4), 0.0)  # held already
    assert m.accept(lin, manifest(PUB, "lin", 4, 5), 7.0)
    assert m.in_flight == {(LID, "patch", 4, 5): 7.0}
    for v in range(5, 5 + MAX_IN_FLIGHT - 1):
        assert m.accept(lin, manifest(PUB, "lin", v, v + 1), 7.0)
    assert len(m.in_flight) == MAX_IN_FLIGHT
    assert not m.accept(lin, manifest(PUB, "lin", 900, 901), 7.0)
    m.expire(7.0 + IN_FLIGHT_PATIENCE_S * 4)
    assert len(m.in_flight) == MAX_IN_FLIGHT  # kept until past four patiences
    m.expire(7.5 + IN_FLIGHT_PATIENCE_S * 4)
    assert m.in_flight == {} and m.accept(lin, manifest(PUB, "lin", 900, 901), 200.0)
