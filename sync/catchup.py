"""Choosing the cheapest way, in bytes, from the version a node holds to the head.

Every stored item is an edge between versions: a patch v->v+1, a union
a->b, or an anchor (from anywhere, including from nothing) to v. The
cheapest plan is a shortest path over these forward edges, so chain, union,
anchor + chain and mixes (anchor, then a union) all fall out of one dynamic
program. It is a pure function of the sizes; the caller decides whether to
build a union first (see `LineagePublisher.catch_up`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from murmur.sync.errors import PatchError
from murmur.sync.items import StoredItem


@dataclass(frozen=True)
class Plan:
    steps: tuple[StoredItem, ...]  # in the order to apply
    total_bytes: int

    @property
    def kind(self) -> str:
        """ "none", "chain", "union", "anchor" (anchor alone) or "anchor+chain" etc."""
        if not self.steps:
            return "none"
        kinds: list[str] = []
        for s in self.steps:
            k = {"patch": "chain"}.get(s.kind, s.kind)
            if not kinds or kinds[-1] != k:
                kinds.append(k)
        return "+".join(kinds)


def choose(have: int | None, head: int, items: Iterable[StoredItem]) -> Plan:
    """The byte-cheapest sequence of items taking a node from `have` (None: no state) to `head`.

    Ties go to fewer steps. Raises PatchError when no sequence reaches the head.
    """
    if have is not None and have > head:
        raise PatchError(f"held version {have} is ahead of the head {head}")
    if have == head:
        return Plan((), 0)
    edges: dict[int, list[StoredItem]] = {}
    anchors: list[StoredItem] = []
    for it in items:
        if it.kind == "anchor":
            if it.target <= head:
                anchors.append(it)
        elif it.base < it.target <= head:
            edges.setdefault(it.target, []).append(it)
    inf = (float("inf"), 0)
    best: dict[int, tuple[float, int]] = {}
    back: dict[int, StoredItem | None] = {}
    if have is not None:
        best[have] = (0, 0)
        back[have] = None
    for a in anchors:
        cost = (a.bytes, 1)
        if cost < best.get(a.target, inf):
            best[a.target] = cost
            back[a.target] = a
    # Edges only go forward, so visiting their targets in increasing order settles every version
    # before it is used as a base: O(items log items), whatever the version numbers are.
    for v in sorted(edges):
        for e in edges[v]:
            if e.base in best:
                c = (best[e.base][0] + e.bytes, best[e.base][1] + 1)
                if c < best.get(v, inf):
                    best[v] = c
                    back[v] = e
    if head not in best:
        raise PatchError(f"no stored patches or anchors reach version {head} from {have}")
    steps: list[StoredItem] = []
    v = head
    while True:  # each step moves strictly down, to a version with a recorded predecessor or to the start
        step = back.get(v)
        if step is None:
            break
        steps.append(step)
        if step.kind == "anchor":
            break
        v = step.base
    steps.reverse()
    return Plan(tuple(steps), int(best[head][0]))


def local_plan(have: int | None, items: Iterable[StoredItem]) -> Plan | None:
    """What a node applies from its own store: the cheapest route from `have` (None: no usable state) to the
    newest stored version, else, when the chain from `have` has a gap, a route that starts at a stored anchor
    ahead of `have` (patches behind an anchor are useless once the chain broke). None when nothing applies.
    """
    items = list(items)
    head = max((i.target for i in items), default=-1)
    if have is not None and head <= have:
        return None
    try:
        return choose(have, head, items)
    except PatchError:
        if have is None:
            return None
    ahead = [i for i in items if i.kind != "anchor" or i.target > have]
    try:
        return choose(None, head, ahead)
    except PatchError:
        return None
