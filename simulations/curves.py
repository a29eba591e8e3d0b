"""Time to target on learning curves: the one rule the compute-matched benchmark and the virtual
simulator both use to turn two curves (alone, in the swarm) into a speedup."""

from __future__ import annotations


def first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    """The x at which the curve (xs, ys), xs[0] the start, first reaches `target` after it began: at
    the first point after the start when it is reached there (the resolution is one point), else
    linearly between the points around it; None when it never is."""
    for k in range(1, len(xs)):
        if ys[k] >= target:
            if k == 1 or ys[k] <= ys[k - 1]:
                return xs[k]
            return xs[k - 1] + (xs[k] - xs[k - 1]) * (target - ys[k - 1]) / (ys[k] - ys[k - 1])
    return None


def auc(xs: list[float], ys: list[float]) -> float:
    """The mean of the curve over its span (trapezoids)."""
    return sum((xs[k] - xs[k - 1]) * (ys[k] + ys[k - 1]) / 2 for k in range(1, len(xs))) / max(xs[-1] - xs[0], 1e-9)


def speedup(xs: list[float], alone: list[float], swarm: list[float]) -> tuple[float, bool, float, float | None]:
    """(speedup, reached, alone_x, swarm_x): `alone_x` is where the alone curve first reaches its own last
    value, `swarm_x` where the swarm curve first reaches that value; speedup = alone_x / swarm_x, or,
    when the swarm never reaches it, alone_x / xs[-1] with `reached` false (an upper bound)."""
    target = alone[-1]
    alone_x = first_reach(xs, alone, target)
    alone_x = xs[-1] if alone_x is None else alone_x  # only a flat or falling last step misses it
    swarm_x = first_reach(xs, swarm, target)
    if swarm_x is None:
        return alone_x / xs[-1], False, alone_x, None
    return alone_x / swarm_x, True, alone_x, swarm_x
