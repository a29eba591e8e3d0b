"""How long the node's event loop was blocked: a trio task that measures its own sleep overshoot.

Why in the node: py-libp2p's yamux resets a stream whose reader stalls for 5 s, and gossip latency is
the loop's latency, so a stall is the first symptom of an attack that makes the network process do
unbounded work. The meter sleeps `interval_s` and records how late it woke; the worst lateness since
start and over the last `recent_s` are served in the node's status (`loop_stall_max_ms`,
`loop_stall_recent_ms`), which `murmur bench attacks` reads. Lateness includes ordinary scheduling
delay on a loaded machine, so it is an upper bound on any single blocking call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

INTERVAL_S = 0.05
RECENT_S = 5.0


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


async def run(meter: StallMeter, interval_s: float = INTERVAL_S, clock: Callable[[], float] = trio.current_time,
              *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Measure until cancelled."""
    task_status.started()
    while True:
        before = clock()
        await trio.sleep(interval_s)
        now = clock()
        meter.record(now, (now - before - interval_s) * 1000.0)
