"""How long the node's event loop was blocked: a trio task that measures its own sleep overshoot.

Why in the node: py-libp2p's yamux resets a stream whose reader stalls for 5 s, and gossip latency is
the loop's latency, so a stall is the first symptom of an attack that makes the network process do
unbounded work. The meter sleeps `interval_s` and records how late it woke; the worst lateness since
start and over the last `recent_s` are served in the node's status (`loop_stall_max_ms`,
`loop_stall_recent_ms`), which `murmur bench attacks` reads. Lateness includes ordinary scheduling
delay on a loaded machine, so it is an upper bound on any single blocking call.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

INTERVAL_S = 0.05
RECENT_S = 5.0
REPORT_AFTER_S = 0.25  # a stall this long is logged with where the loop thread was
REPORTS_PER_MIN = 6
STACK_FRAMES = 10

log = logging.getLogger("murmur.stall")


class StallMeter:
    """Sans-IO record of wake-up lateness samples (ms) against an injected clock (seconds)."""

    def __init__(self, recent_s: float = RECENT_S) -> None:
        self.recent_s = recent_s
        self.max_ms = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (time, lateness ms), lateness decreasing

    def record(self, now: float, late_ms: float) -> None:
        late_ms = max(0.0, late_ms)
        self.max_ms = max(self.max_ms, late_ms)
        while self._recent and self._recent[-1][1] <= late_ms:  # a monotonic queue: O(1) amortised
            self._recent.pop()
        self._recent.append((now, late_ms))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.recent_s:
            self._recent.popleft()

    def recent_ms(self, now: float) -> float:
        self._expire(now)
        return self._recent[0][1] if self._recent else 0.0


class StallReporter:
    """A watcher thread that logs the loop thread's stack while the loop is blocked.

    Lateness says that the loop stalled; the stack says which code held it, which is what an operator
    (or a developer reproducing an attack) needs. The trio side only stores a timestamp per wake-up; the
    thread samples `sys._current_frames()` once per stall longer than `after_s`, at most
    `per_min` times a minute.
    """

    def __init__(self, after_s: float = REPORT_AFTER_S, per_min: int = REPORTS_PER_MIN) -> None:
        self.after_s = after_s
        self.per_min = per_min
        self.beat = time.monotonic()
        self.reports = 0
        self.suppressed = 0  # stalls past the per-minute report budget: counted, not logged
        self.last_stack = ""
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._times: deque[float] = deque()

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self.beat = time.monotonic()
        threading.Thread(target=self._watch, name="murmur-stall-reporter", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        reported = 0.0
        while not self._stop.wait(self.after_s / 4):
            beat, now = self.beat, time.monotonic()
            if now - beat < self.after_s or beat == reported:
                continue
            reported = beat
            while self._times and self._times[0] < now - 60.0:
                self._times.popleft()
            if len(self._times) >= self.per_min:
                self.suppressed += 1
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            self._times.append(now)
            self.reports += 1
            self.last_stack = " < ".join(
                f"{short_path(f.filename)}:{f.lineno} {f.name}"
                for f in reversed(traceback.extract_stack(frame)[-STACK_FRAMES:])
            )
            log.warning(
                "event loop blocked",
                extra={"data": {"blocked_ms": round((now - beat) * 1000.0), "where": self.last_stack}},
            )


class GcTimer:
    """The longest garbage-collector pause (ms) per generation, from `gc.callbacks`.

    A full collection walks every tracked object of the process, so its pause grows with the heap and
    is a stall of the loop like any other blocking call; timing it tells the two kinds of stall apart.
    """

    def __init__(self) -> None:
        self.max_ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = int(info.get("generation", 2))
        if 0 <= g <= 2:
            self.count[g] += 1
            self.max_ms[g] = max(self.max_ms[g], (time.perf_counter() - self._t0) * 1000.0)

    def install(self) -> None:
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)

    def uninstall(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)


def freeze_startup_heap() -> None:
    """Move everything allocated so far (modules, the tokenizer, the configuration) out of the collector's
    reach: it lives as long as the process, and a full collection would otherwise walk all of it, on the
    event loop, every time (the pause grows with the libraries a node imports, not with what it does)."""
    gc.collect()
    gc.freeze()


def short_path(path: str) -> str:
    """The last folder and file name of `path`, as stall and memory reports print a code site."""
    parts = path.split("/")
    return "/".join(parts[-2:])


async def run(
    meter: StallMeter,
    interval_s: float = INTERVAL_S,
    clock: Callable[[], float] = trio.current_time,
    reporter: StallReporter | None = None,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Measure until cancelled (and keep `reporter`, if any, watching the loop thread meanwhile)."""
    if reporter is not None:
        reporter.start()
    task_status.started()
    try:
        while True:
            before = clock()
            await trio.sleep(interval_s)
            now = clock()
            if reporter is not None:
                reporter.beat = time.monotonic()
            meter.record(now, (now - before - interval_s) * 1000.0)
    finally:
        if reporter is not None:
            reporter.stop()


async def watch_loop(meter: StallMeter, gc_timer: GcTimer) -> None:
    """The node's loop health until cancelled: full collections timed, the start-up heap frozen,
    lateness measured, long stalls reported with their stack, and allocations traced when asked
    (`node.shell.memtrace`)."""
    from murmur.node.shell import memtrace

    gc_timer.install()
    freeze_startup_heap()
    try:
        async with trio.open_nursery() as n:
            n.start_soon(run, meter, INTERVAL_S, trio.current_time, StallReporter())
            if (after_min := memtrace.warmup_minutes()) is not None:
                n.start_soon(memtrace.run, after_min * 60.0)
    finally:
        gc_timer.uninstall()
