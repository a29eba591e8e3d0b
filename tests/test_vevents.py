"""The virtual simulator's event queue (`simulations/vevents.py`): time order, ties in push order, and
records a big run can hold by the million."""

from __future__ import annotations

import gc
import heapq

import msgspec
import pytest

from murmur.simulations.vevents import EPOCH, BatchArrives, EventQueue, Join, Leave, Reply, Sample


def test_events_pop_in_time_order_ties_in_the_order_pushed() -> None:
    q = EventQueue()
    q.push(2.0, Leave(1))
    q.push(1.0, Join(1))
    q.push(2.0, Join(2))
    q.push(1.0, Sample())
    got = [heapq.heappop(q.heap)[::2] for _ in range(4)]
    assert got == [(1.0, Join(1)), (1.0, Sample()), (2.0, Leave(1)), (2.0, Join(2))]
    q.now = 2.5
    assert q.unix() == EPOCH + 2.5 and q.unix_ms() == int((EPOCH + 2.5) * 1000)


def test_records_are_frozen_and_left_to_reference_counting() -> None:
    ev = BatchArrives(3, 1, 0, 2, b"batch", 7)
    with pytest.raises(AttributeError):
        ev.node = 4  # type: ignore[misc]
    assert not gc.is_tracked(ev) and not gc.is_tracked(Reply(0, object(), 1))
    assert msgspec.structs.asdict(ev) == {"node": 3, "fwd": 1, "origin": 0, "shard": 2, "data": b"batch", "inc": 7}
