"""Where a node's network process grows: `MURMUR_TRACEMALLOC=<minutes>` traces its allocations.

Off by default (tracing slows every allocation). When set, the node starts `tracemalloc` at start-up,
takes a baseline snapshot after the given number of minutes (the caches' warm-up), and from then on
logs, every `INTERVAL_S`, the allocation sites that grew most since the baseline (`memory growth`
log lines: file:line and MiB). A volunteer whose node grows over hours can send these lines; they
name the table or cache to bound.
"""

from __future__ import annotations

import logging
import os
import tracemalloc

import trio

from murmur.node.shell.stall import short_path

ENV = "MURMUR_TRACEMALLOC"
INTERVAL_S = 300.0
TOP = 8
FRAMES = 4

log = logging.getLogger("murmur.memory")


def warmup_minutes() -> float | None:
    """The baseline delay asked for in the environment, or None when tracing is off."""
    raw = os.environ.get(ENV, "")
    try:
        minutes = float(raw)
    except ValueError:
        return None
    return minutes if minutes >= 0 else None


def top_growth(base: tracemalloc.Snapshot, now: tracemalloc.Snapshot, top: int = TOP) -> list[tuple[str, float]]:
    """The `top` allocation sites (innermost frames, joined) that grew most from `base` to `now`, in MiB."""
    stats = now.compare_to(base, "traceback")
    out = []
    for st in stats[:top]:
        where = " < ".join(
            f"{short_path(f.filename)}:{f.lineno}" for f in reversed(list(st.traceback)[-FRAMES:])
        )  # innermost first
        out.append((where, round(st.size_diff / 2**20, 2)))
    return out


async def run(warmup_s: float, interval_s: float = INTERVAL_S) -> None:
    """Trace until cancelled (started only when `warmup_minutes()` is not None)."""
    tracemalloc.start(FRAMES)
    await trio.sleep(warmup_s)
    base = tracemalloc.take_snapshot()
    while True:
        await trio.sleep(interval_s)
        now = tracemalloc.take_snapshot()
        current, _ = tracemalloc.get_traced_memory()
        log.warning(
            "memory growth", extra={"data": {"traced_mb": round(current / 2**20, 1), "top": top_growth(base, now)}}
        )
