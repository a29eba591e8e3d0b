"""The event-loop stall meter: its sans-IO window, and a real blocked trio loop measured by the task."""

from __future__ import annotations

import time

import trio

from murmur.node.shell.stall import StallMeter, StallReporter, run


def test_meter_keeps_the_worst_since_start_and_over_the_recent_window() -> None:
    m = StallMeter(recent_s=5.0)
    m.record(0.0, 300.0)
    m.record(1.0, 20.0)
    m.record(2.0, -3.0)  # early wake-ups count as 0
    assert m.max_ms == 300.0 and m.recent_ms(2.0) == 300.0
    assert m.recent_ms(5.5) == 20.0  # the 300 ms sample left the window
    assert m.recent_ms(7.0) == 0.0
    assert m.max_ms == 300.0


def test_a_blocked_loop_is_measured() -> None:
    m = StallMeter()

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(run, m, 0.01)
            await trio.sleep(0.05)
            time.sleep(0.3)  # the attack's effect: synchronous work on the event loop
            with trio.fail_after(5):
                while m.max_ms < 250:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()

    trio.run(main)
    assert 250 <= m.max_ms < 5000


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)


def test_a_long_stall_is_reported_with_the_blocking_code() -> None:
    m = StallMeter()
    rep = StallReporter(after_s=0.1)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(run, m, 0.01, trio.current_time, rep)
            await trio.sleep(0.05)
            _hold_the_loop(0.5)
            with trio.fail_after(5):
                while m.max_ms < 250:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()

    trio.run(main)
    assert rep.reports == 1
    assert rep.last_stack.split(" < ")[0].endswith("_hold_the_loop")  # innermost first


def test_stall_reports_are_capped_per_minute() -> None:
    """A peer that can stall the loop again and again gets at most `per_min` stack dumps a minute in the
    log; the stalls past that are counted."""
    rep = StallReporter(after_s=0.02, per_min=6)
    rep.start()
    try:
        for i in range(8):
            rep.beat = time.monotonic()  # the loop woke, then blocks again: a new stall
            deadline = time.monotonic() + 30
            while rep.reports + rep.suppressed < i + 1:  # this thread is the blocked loop: wait for the watcher
                assert time.monotonic() < deadline, (i, rep.reports, rep.suppressed)
                time.sleep(0.005)
    finally:
        rep.stop()
    assert (rep.reports, rep.suppressed) == (6, 2)
