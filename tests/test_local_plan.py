"""What a follower's worker applies from its own store (`sync.catchup.local_plan`), by plain calls."""

from __future__ import annotations

from murmur.sync.catchup import local_plan
from murmur.sync.patchstore import StoredItem


def chain(a: int, b: int) -> list[StoredItem]:
    return [StoredItem("patch", v, v + 1, 10) for v in range(a, b)]


def steps(plan) -> list[tuple[str, int, int]]:
    return [(s.kind, s.base, s.target) for s in plan.steps]


def test_a_gap_in_the_chain_is_bridged_by_a_stored_anchor_ahead() -> None:
    # held 20, patch 20->21 lost, 21..65 and the anchor at 24 stored: the worker must not wait for 20->21
    items = chain(21, 65) + [StoredItem("anchor", 24, 24, 1000)]
    plan = local_plan(20, items)
    assert plan is not None
    assert steps(plan) == [("anchor", 24, 24)] + [("patch", v, v + 1) for v in range(24, 65)]


def test_the_chain_from_the_held_version_is_used_when_it_is_whole() -> None:
    items = chain(20, 30) + [StoredItem("anchor", 24, 24, 1000)]
    assert steps(local_plan(20, items)) == [("patch", v, v + 1) for v in range(20, 30)]


def test_nothing_to_apply() -> None:
    assert local_plan(30, chain(20, 30)) is None  # nothing newer
    assert local_plan(20, chain(21, 30)) is None  # a gap and no anchor: the network fetches what is missing
    # an anchor behind the held version is no bridge (the follower refuses stale anchors)
    assert local_plan(20, chain(21, 30) + [StoredItem("anchor", 16, 16, 1000)]) is None
    assert local_plan(None, []) is None


def test_without_usable_state_only_an_anchor_starts() -> None:
    items = chain(0, 10) + [StoredItem("anchor", 8, 8, 1000)]
    assert steps(local_plan(None, items)) == [("anchor", 8, 8), ("patch", 8, 9), ("patch", 9, 10)]
