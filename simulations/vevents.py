"""The virtual simulator's clock and event queue: typed event records, popped in time order.

A record names the node it happens at (`node`, an index into the simulation's nodes) and, where it must
not reach a later incarnation of that node (one that left and rejoined meanwhile), the incarnation it
was scheduled for (`inc`). Records are frozen msgspec Structs kept out of the cyclic collector: a big
run queues millions of them, and none refers back to anything that holds it.
"""

from __future__ import annotations

import heapq
from typing import Any

import msgspec

EPOCH = 1_700_000_000.0  # virtual t = 0 as unix time (pipeline freshness checks and created_ms use unix time)


class Event(msgspec.Struct, frozen=True, gc=False):
    """Something that happens at a virtual time (the subclasses say what)."""


class Join(Event, frozen=True):
    """A node (re)starts."""

    node: int


class Leave(Event, frozen=True):
    """A node's processes stop."""

    node: int


class Sample(Event, frozen=True):
    """The report samples the adversaries' scores."""


class Wake(Event, frozen=True):
    """A node's core is due a `Tick` (its `next_deadline()`)."""

    node: int
    inc: int


class StepDue(Event, frozen=True):
    """A node's modelled worker takes its next step."""

    node: int
    inc: int


class WorkerSends(Event, frozen=True):
    """A message of a node's modelled worker reaches its network process."""

    node: int
    msg: Any
    inc: int


class PeerLeft(Event, frozen=True):
    """A node notices that a connected peer's connection closed."""

    node: int
    peer: str
    inc: int


class AnnounceArrives(Event, frozen=True):
    """A signed announce from `src` reaches a node."""

    node: int
    src: int
    data: bytes
    inc: int


class ManifestArrives(Event, frozen=True):
    """A signed patch manifest from `src` reaches a node."""

    node: int
    src: int
    data: bytes
    inc: int


class PatchArrives(Event, frozen=True):
    """The modelled broadcast of an accepted manifest's bytes to a node completes."""

    node: int
    pid: bytes
    inc: int


class CatalogAsked(Event, frozen=True):
    """A catch-up catalog request from `asker` reaches peer `node`; `asker_inc` is the asker's incarnation."""

    node: int
    asker: int
    lineage: bytes
    asker_inc: int


class OfferAsked(Event, frozen=True):
    """A request from `asker` to seed one stored item into the broadcast reaches peer `node`."""

    node: int
    asker: int
    lineage: bytes
    item: tuple[str, int, int]
    asker_inc: int


class Reply(Event, frozen=True):
    """A peer's answer to a catch-up request reaches the asker's core: `event` is what the core is fed
    (`CatalogReceived`, `CatalogFailed`, `OfferFailed`)."""

    node: int
    event: Any
    inc: int


class BatchArrives(Event, frozen=True):
    """A copy of a rollout batch on shard topic `shard` reaches a node from mesh peer `fwd`; `origin`
    published it."""

    node: int
    fwd: int
    origin: int
    shard: int
    data: bytes
    inc: int


class AdversaryDue(Event, frozen=True):
    """An adversary sends its next hostile batch."""

    node: int
    inc: int


class EventQueue:
    """Events in time order, ties in the order they were pushed, and the virtual clock they move (`now`,
    set by whoever pops them)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, Event]] = []
        self.pushed = 0

    def push(self, t: float, ev: Event) -> None:
        self.pushed += 1
        heapq.heappush(self.heap, (t, self.pushed, ev))

    def unix(self) -> float:
        """The virtual clock as unix time: what the cores, pipelines and scores read."""
        return EPOCH + self.now

    def unix_ms(self) -> int:
        return int((EPOCH + self.now) * 1000)
