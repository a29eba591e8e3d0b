"""The node's lineage table (node/lineages.py), sans-IO: which signed claims move a row, which are refused,
and what a follower may believe of a publisher's demand. (sync/lineage.py's publisher and follower are
tests/test_lineage.py's.)"""

from __future__ import annotations

from node.lineages import DEMAND_FRESH_S, SIZE_FACTOR, LineageTable
from sync.ids import lineage_id
from tests.test_core import BASE, demand, key, manifest


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def table(model_bytes: int = 1 << 20) -> tuple[LineageTable, Clock]:
    clock = Clock()
    t = LineageTable(64, clock)
    t.set_my_base(BASE, model_bytes)
    return t, clock


def test_only_a_stored_own_lineage_becomes_this_nodes_own() -> None:
    t, _ = table()
    rows = {rel: key(i) for i, rel in enumerate(("follow", "seen", "own"), start=1)}
    for rel, ident in rows.items():
        t.load(lineage_id(ident.public, BASE, rel), rel, rel, ident.public, BASE, 5)
        assert t.own == (lineage_id(ident.public, BASE, "own") if rel == "own" else None), rel
    assert {r.relation for r in t.rows.values()} == {"follow", "seen", "own"}


def test_a_manifest_is_refused_only_past_three_times_the_base_model_and_a_mebibyte() -> None:
    size = 1 << 20
    t, _ = table(size)
    pub = key(9)
    limit = int(SIZE_FACTOR * size) + (1 << 20)
    assert t.check_manifest(manifest(pub, "lin", 1, 2, total=limit)) is None
    why = t.check_manifest(manifest(pub, "lin", 1, 2, total=limit + 1))
    assert why is not None and why.fault and "out of proportion" in why.reason


def test_a_demand_is_acted_on_for_thirty_seconds() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=0.0))
    assert why is None and lin is not None
    clock.t += DEMAND_FRESH_S
    assert t.effective_demand(lin, clock()) is not None
    clock.t += 0.5
    assert t.effective_demand(lin, clock()) is None


def test_the_observed_step_time_counts_only_versions_that_moved_the_head() -> None:
    """After a restart a row holds version 10 (not yet heard live): an older signed version heard first
    sets nothing apart from liveness, so the step time measured later spans real advances only."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.load(lid, "lin", "seen", pub.public, BASE, 10)
    lin, why = t.on_manifest(manifest(pub, "lin", 4, 5))
    assert why is None and lin is not None and lin.head == 10 and lin.live
    clock.t += 100.0
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 11, step_time_s=1.0))
    assert why is None and [v for _, v in lin.advances] == [11]
    d = t.effective_demand(lin, clock())
    assert d is not None and d.step_time_s == 1.0  # the claim stands: one advance, heard just now


def test_own_lineage_listed_first_does_not_hide_the_followable_ones() -> None:
    t, clock = table()
    me, pub = key(1), key(9)
    t.set_own(lineage_id(me.public, BASE, "mine"), "mine", me.public, BASE, 3)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3))
    assert [lin.lineage for lin, _ in t.followable(clock())] == [lid]


def test_the_step_time_is_no_shorter_than_the_publisher_demonstrably_takes() -> None:
    """A publisher claiming 1 s per version while its signed versions arrive 10 s apart is believed at 10 s."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=1.0))
    clock.t += 10.0
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 4, step_time_s=1.0))
    assert why is None and lin is not None
    d = t.effective_demand(lin, clock())
    assert d is not None and d.step_time_s == 10.0
    clock.t += 30.0  # and no shorter than the time since its last version
    assert t.effective_demand(lin, clock()).step_time_s == 30.0
