"""Fit virtual mode's learning model (`[learning]` initial, rate, ceiling) to a measured isolated curve.

The model (simulations/virtual.py): skill p, reward of a step ≈ p, and
`p += rate (ceiling − p) u / 8` with u the informative groups among k local
groups of g completions; in expectation u = k (1 − p^g − (1 − p)^g). The fit
is a grid search minimising the squared error between the model's expected
block means and the measured ones (the benchmark's `block_means.isolated`,
or block means of `curves.isolated`), so a fit needs only numbers the
benchmark prints. `python -m simulations.calibrate BENCH.json` reads
`murmur bench swarm --json` output; docs/researcher.md records the fit.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def expected_curve(initial: float, rate: float, ceiling: float, steps: int, groups: int = 8,
                   group_size: int = 8) -> list[float]:
    p, out = initial, []
    for _ in range(steps):
        out.append(p)
        u = groups * (1 - p ** group_size - (1 - p) ** group_size)
        p = min(ceiling, p + rate * (ceiling - p) * u / 8.0)
    return out


def block_means(curve: list[float], blocks: int = 5) -> list[float]:
    n = max(1, len(curve) // blocks)
    return [sum(curve[k:k + n]) / len(curve[k:k + n]) for k in range(0, n * blocks, n)]


def _err(p0: float, rate: float, ceil: float, target: list[float], steps: int, groups: int, size: int) -> float:
    got = block_means(expected_curve(p0, rate, ceil, steps, groups, size), len(target))
    return sum((a - b) ** 2 for a, b in zip(got, target))


def fit(target_blocks: list[float], steps: int, groups: int = 8, group_size: int = 8) -> dict[str, Any]:
    """Grid search, coarse then fine: initial 0.005–0.30, rate 0.002–0.4, ceiling 0.05–0.95."""
    def search(p0s: list[float], rates: list[float], ceils: list[float]) -> tuple[float, float, float, float]:
        return min((_err(p0, r, c, target_blocks, steps, groups, group_size), p0, r, c)
                   for p0 in p0s for r in rates for c in ceils if p0 <= c)

    _, p0, rate, ceil = search([i * 0.02 for i in range(1, 16)], [i * 0.01 for i in range(1, 41)],
                               [i * 0.04 for i in range(2, 24)])
    err, p0, rate, ceil = search([x for i in range(-4, 5) if (x := round(p0 + i * 0.005, 4)) > 0],
                                 [x for i in range(-6, 7) if (x := round(rate + i * 0.002, 4)) > 0],
                                 [x for i in range(-4, 5) if (x := round(ceil + i * 0.01, 4)) > 0])
    model = expected_curve(p0, rate, ceil, steps, groups, group_size)
    return {"initial": p0, "rate": rate, "ceiling": ceil,
            "rmse": round((err / len(target_blocks)) ** 0.5, 4),
            "model_block_means": [round(x, 4) for x in block_means(model, len(target_blocks))],
            "target_block_means": target_blocks, "model_cumulative": round(sum(model), 3)}


def main(argv: list[str]) -> None:
    bench = json.loads(open(argv[0]).read().strip().splitlines()[-1])
    curve = bench.get("curves", {}).get("isolated")
    blocks = block_means(curve) if curve else bench["block_means"]["isolated"]
    print(json.dumps(fit(blocks, bench.get("rounds", 200))))


if __name__ == "__main__":
    main(sys.argv[1:])
