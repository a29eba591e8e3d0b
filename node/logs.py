"""Logging for a running node: structured JSON lines (`--no-tui`) or a quiet log file under the TUI."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import Any, TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any `extra={"data": {...}}` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        data = getattr(record, "data", None)
        if isinstance(data, dict):
            out.update(data)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, sort_keys=False)


def setup(
    level: str = "info", stream: TextIO | None = None, logfile: Path | None = None, max_bytes: int = 64 * 2**20
) -> None:
    """JSON lines to `stream` (None: none) and to `logfile` (None: none); noisy libraries held at warning.

    The log file rotates at half of `max_bytes` with one older copy kept, so the two stay within it.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(LEVELS.get(level, logging.INFO))
    fmt = JsonFormatter()
    if stream is not None:
        h = logging.StreamHandler(stream)
        h.setFormatter(fmt)
        root.addHandler(h)
    if logfile is not None:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.handlers.RotatingFileHandler(logfile, maxBytes=max(1, max_bytes // 2), backupCount=1)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    for noisy in (
        "libp2p",
        "multiaddr",
        "async_service",
        "trio-websocket",
        "aioquic",
        "zeroconf",
        "urllib3",
        "transformers",
        "filelock",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING if level != "debug" else logging.INFO)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.ERROR)


def event(logger: logging.Logger, msg: str, **data: Any) -> None:
    logger.info(msg, extra={"data": data})


def stderr_stream() -> TextIO:
    return sys.stderr


def now() -> float:
    return time.time()
