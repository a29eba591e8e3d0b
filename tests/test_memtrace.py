"""The opt-in allocation tracer names the site that grew."""

from __future__ import annotations

import tracemalloc

from murmur.node.shell import memtrace

_held: list[bytes] = []


def _grow() -> None:
    for _ in range(200):
        _held.append(bytes(10_000))


def test_growth_is_named_by_site(monkeypatch) -> None:
    monkeypatch.setenv(memtrace.ENV, "5")
    assert memtrace.warmup_minutes() == 5.0
    monkeypatch.setenv(memtrace.ENV, "yes")
    assert memtrace.warmup_minutes() is None
    tracemalloc.start(memtrace.FRAMES)
    try:
        base = tracemalloc.take_snapshot()
        _grow()
        top = memtrace.top_growth(base, tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
        _held.clear()
    where, mib = top[0]
    assert "test_memtrace.py" in where.split(" < ")[0] and 1.5 < mib < 3.0
