"""Process lifecycle of the network process: signals arm an exit watchdog at once, then stop the loop."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import trio


def arm_watchdog(deadline_s: float) -> None:
    """Whatever hangs during shutdown (a libp2p close, a stuck thread), the process exits 0 in time."""

    def fire() -> None:
        logging.getLogger("murmur.node").warning("shutdown watchdog: exiting")
        logging.shutdown()
        os._exit(0)

    t = threading.Timer(deadline_s, fire)
    t.daemon = True
    t.start()


def install_signals(armed: threading.Event, on_signal: Callable[[int], None], deadline_s: float) -> dict[int, Any]:
    """SIGINT/SIGTERM: arm the exit watchdog at once (in the handler itself), then call `on_signal` on the loop.

    A plain handler rather than trio's signal receiver, so the exit clock starts when the signal
    arrives, not when a busy event loop gets round to it; installed before anything slow starts.
    Returns the previous handlers, to restore.
    """
    token = trio.lowlevel.current_trio_token()

    def handler(signum: int, frame: Any) -> None:
        if not armed.is_set():
            armed.set()
            arm_watchdog(deadline_s)
        try:
            token.run_sync_soon(on_signal, signum)
        except trio.RunFinishedError:
            pass

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
