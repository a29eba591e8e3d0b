"""Work bounds without clocks: count the Python lines a call runs, and stop it once past a limit.

A wall-clock bound on two shared, loaded cores fails at random and passes a slow regression on an
idle one; a line count is the same on every machine. Work proportional to a claimed number (a version
of 2**62, a count of 10**9) shows up as lines long before it could show up as seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class WorkExceeded(AssertionError):
    pass


def lines_run(fn: Callable[..., T], *args: Any, limit: int, **kwargs: Any) -> tuple[T, int]:
    """(fn(*args), Python lines it ran); raises WorkExceeded as soon as it runs more than `limit`."""
    n = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal n
        if event == "line":
            n += 1
            if n > limit:
                raise WorkExceeded(f"over {limit} Python lines")
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.settrace(old)
    return out, n
