"""The network process's shutdown watchdog: a SIGTERM exits the process in time even when shutdown hangs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A process whose shutdown hangs: SIGTERM reaches its handler, the loop never gets to stop.
HUNG = """
import sys, threading, time, trio
from murmur.node.shell import lifecycle

async def main():
    lifecycle.install_signals(threading.Event(), lambda signum: None, 0.5)
    print("ready", flush=True)
    while True:
        time.sleep(3600)  # the event loop is held: only the watchdog thread can end this process

trio.run(main)
"""


def test_sigterm_exits_a_hung_process_through_the_watchdog() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", HUNG], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 0
    assert "shutdown watchdog: exiting" in p.stderr.read()
