"""Fit virtual mode's learning model (`[learning]`) to a measured benchmark.

Two benchmarks: `murmur bench swarm --json` (cumulative sampled reward; `initial`, `rate`, `ceiling`
from its isolated curve, below) and `murmur bench swarm --matched --json` (held-out accuracy at equal
CPU, `fit_matched`: also `external_weight`, `own_lineage_weight` and `train_share`).

The model (simulations/vworker.py): skill p, reward of a step ≈ p, and
`p += rate (ceiling − p) u / 8` with u the informative groups among k local
groups of g completions; in expectation u = k (1 − p^g − (1 − p)^g). The fit
is a grid search minimising the squared error between the model's expected
block means and the measured ones (the benchmark's `block_means.isolated`,
or block means of `curves.isolated`), so a fit needs only numbers the
benchmark prints. `python -m murmur.simulations.calibrate BENCH.json` reads
`murmur bench swarm --json` output; docs/researcher.md records the fit.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def expected_curve(
    initial: float, rate: float, ceiling: float, steps: int, groups: int = 8, group_size: int = 8
) -> list[float]:
    p, out = initial, []
    for _ in range(steps):
        out.append(p)
        u = groups * (1 - p**group_size - (1 - p) ** group_size)
        p = min(ceiling, p + rate * (ceiling - p) * u / 8.0)
    return out


def block_means(curve: list[float], blocks: int = 5) -> list[float]:
    n = max(1, len(curve) // blocks)
    return [sum(curve[k : k + n]) / len(curve[k : k + n]) for k in range(0, n * blocks, n)]


def _err(p0: float, rate: float, ceil: float, target: list[float], steps: int, groups: int, size: int) -> float:
    got = block_means(expected_curve(p0, rate, ceil, steps, groups, size), len(target))
    return sum((a - b) ** 2 for a, b in zip(got, target))


def fit(target_blocks: list[float], steps: int, groups: int = 8, group_size: int = 8) -> dict[str, Any]:
    """Grid search, coarse then fine: initial 0.005–0.30, rate 0.002–0.4, ceiling 0.05–0.95."""

    def search(p0s: list[float], rates: list[float], ceils: list[float]) -> tuple[float, float, float, float]:
        return min(
            (_err(p0, r, c, target_blocks, steps, groups, group_size), p0, r, c)
            for p0 in p0s
            for r in rates
            for c in ceils
            if p0 <= c
        )

    _, p0, rate, ceil = search(
        [i * 0.02 for i in range(1, 16)], [i * 0.01 for i in range(1, 41)], [i * 0.04 for i in range(2, 24)]
    )
    err, p0, rate, ceil = search(
        [x for i in range(-4, 5) if (x := round(p0 + i * 0.005, 4)) > 0],
        [x for i in range(-6, 7) if (x := round(rate + i * 0.002, 4)) > 0],
        [x for i in range(-4, 5) if (x := round(ceil + i * 0.01, 4)) > 0],
    )
    model = expected_curve(p0, rate, ceil, steps, groups, group_size)
    return {
        "initial": p0,
        "rate": rate,
        "ceiling": ceil,
        "rmse": round((err / len(target_blocks)) ** 0.5, 4),
        "model_block_means": [round(x, 4) for x in block_means(model, len(target_blocks))],
        "target_block_means": target_blocks,
        "model_cumulative": round(sum(model), 3),
    }


def _matched_arms(bench: dict[str, Any]) -> dict[str, Any]:
    """One matched run's seed-mean curves and per-node updates, external share, steps and generation share."""
    per = bench["per_seed"]
    k = len(per[0]["curves"]["cpu_s"])

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def per_node(key: str, arm: str) -> float:
        return mean([mean(r[key][arm]) for r in per])

    ext = mean([mean(r["external_groups_per_node"]) for r in per])
    steps = [r.get("steps_per_node") for r in per]
    gen = [r.get("generation_share", {}).get("isolated") for r in per]
    return {
        "iso": [mean([r["curves"]["isolated"][j] for r in per]) for j in range(k)],
        "swarm": [mean([r["curves"]["swarm"][j] for r in per]) for j in range(k)],
        "marks": per[0]["curves"]["cpu_s"],
        "u_iso": per_node("updates_per_node", "isolated"),
        "u_swarm": per_node("updates_per_node", "swarm"),
        "ext_share": ext / (8.0 * per_node("updates_per_node", "swarm")),
        "steps_iso": mean([mean(s["isolated"]) for s in steps]) if all(steps) else None,
        "gen_iso": mean(gen) if all(g is not None for g in gen) else None,
        "local_groups": int(bench["trainer"]["local_groups"]),
        "followers": int(bench.get("followers", 0)),
        "nodes": int(bench["nodes"]),
        "speedup": float(bench["speedup"]),
        "adversary": bool(bench.get("with_adversary")),
    }


def matched_curve(
    p0: float,
    rate: float,
    ceiling: float,
    updates: float,
    marks: int,
    ext_share: float = 0.0,
    external_weight: float = 1.0,
) -> list[float]:
    """The model's skill at `marks` + 1 equal CPU marks over `updates` updates of 8 informative groups, a
    share `ext_share` of them external and worth `external_weight` each."""
    eff = rate * (1.0 - ext_share + external_weight * ext_share)
    return [ceiling - (ceiling - p0) * max(0.0, 1.0 - eff) ** (updates * j / marks) for j in range(marks + 1)]


def fit_matched(benches: list[dict[str, Any]]) -> dict[str, Any]:
    """`rate` and `ceiling` from the isolated arms' curves (each from its own start, in updates of 8
    informative groups), `external_weight` from the swarm-of-peers arms (other lineages' groups),
    `own_lineage_weight` from the trainer-with-followers arms (adversarial runs are predicted, not
    fitted), `train_share` from the isolated arms' generation share and informative fraction,
    `initial` the mean start; with each run's measured and modelled speedup."""
    from murmur.simulations import curves

    arms = [_matched_arms(b) for b in benches]

    def iso_err(rate: float, ceil: float) -> float:
        return sum(
            (m - y) ** 2
            for a in arms
            for m, y in zip(matched_curve(a["iso"][0], rate, ceil, a["u_iso"], len(a["marks"]) - 1), a["iso"])
        )

    rates = [0.0005 * i for i in range(1, 101)]
    ceils = [0.02 * i for i in range(5, 50)]
    _, rate, ceil = min((iso_err(r, c), r, c) for r in rates for c in ceils)
    peers = [a for a in arms if not a["followers"] and not a["adversary"]]
    followed = [a for a in arms if a["followers"]]

    def sw_err(w: float, which: list[dict[str, Any]]) -> float:
        return sum(
            (m - y) ** 2
            for a in which
            for m, y in zip(
                matched_curve(a["swarm"][0], rate, ceil, a["u_swarm"], len(a["marks"]) - 1, a["ext_share"], w),
                a["swarm"],
            )
        )

    def best(which: list[dict[str, Any]]) -> float:
        return min((sw_err(0.02 * i, which), 0.02 * i) for i in range(151))[1] if which else 1.0

    weight, own = best(peers), best(followed)
    shares = []
    for a in arms:  # T·I / G = (1 − g) / (g f), f the informative fraction of the generated groups
        if a["steps_iso"] and a["gen_iso"]:
            f = 8.0 * a["u_iso"] / (a["local_groups"] * a["steps_iso"])
            ratio = (1.0 - a["gen_iso"]) / (a["gen_iso"] * f)
            shares.append(ratio / (1.0 + ratio))
    runs = []
    for a in arms:
        k = len(a["marks"]) - 1
        iso = matched_curve(a["iso"][0], rate, ceil, a["u_iso"], k)
        sw = matched_curve(
            a["swarm"][0], rate, ceil, a["u_swarm"], k, a["ext_share"], own if a["followers"] else weight
        )
        runs.append(
            {
                "nodes": a["nodes"],
                "followers": a["followers"],
                "adversary": a["adversary"],
                "start": round(a["iso"][0], 4),
                "steps_iso": a["steps_iso"],
                "final_delta_measured": round(a["swarm"][-1] - a["iso"][-1], 4),
                "speedup_measured": a["speedup"],
                "speedup_model": round(curves.speedup(a["marks"], iso, sw)[0], 3),
                "ext_share": round(a["ext_share"], 3),
                "updates_iso_swarm": [round(a["u_iso"], 1), round(a["u_swarm"], 1)],
            }
        )
    return {
        "initial": round(sum(a["iso"][0] for a in arms) / len(arms), 3),
        "rate": rate,
        "ceiling": ceil,
        "external_weight": round(weight, 2),
        "own_lineage_weight": round(own, 2),
        "train_share": round(sum(shares) / len(shares), 3) if shares else None,
        "rmse_isolated": round((iso_err(rate, ceil) / sum(len(a["iso"]) for a in arms)) ** 0.5, 4),
        "rmse_swarm": round(
            ((sw_err(weight, peers) + sw_err(own, followed)) / max(1, sum(len(a["swarm"]) for a in peers + followed)))
            ** 0.5,
            4,
        ),
        "runs": runs,
    }


def virtual_speedup(fitted: dict[str, Any], run: dict[str, Any], seeds: int = 5) -> dict[str, Any]:
    """The virtual simulator on one matched run's setup (its N trainers, or one trainer and its K
    followers; I = 16 and J = 16 (16·K) groups of 8; as many steps as its isolated nodes made) with the
    fitted `[learning]`: its `alone` speedup and final skill difference, mean over `seeds` seeds."""
    from murmur.simulations import scenario as S
    from murmur.simulations.virtual import run_virtual

    groups = (
        f'[[group]]\ncount = 1\n[[group]]\ncount = {run["followers"]}\nrole = "follower"\nfollow = 0\n'
        if run["followers"]
        else f"[[group]]\ncount = {run['nodes']}\n"
    )
    j = 16 * max(1, run["followers"])
    learning = "".join(
        f"{k} = {fitted[k]}\n"
        for k in ("rate", "ceiling", "external_weight", "own_lineage_weight", "train_share")
        if fitted.get(k) is not None
    )
    out = []
    for seed in range(seeds):
        text = (
            f"seed = {seed}\nduration_s = {max(2.0, round(run['steps_iso']))}\n{groups}"
            f"[training]\nlocal_groups = 16\nexternal_groups = {j}\nstep_s = 1.0\n"
            f"[sync]\nbroadcasts = 0\n[report]\nplots = false\n"
            f"[learning]\ninitial = {round(run['start'], 4)}\nspread = 0.0\n{learning}"
        )
        out.append(run_virtual(S.loads(text, "matched.toml"))["alone"])
    return {
        "speedup_virtual": round(sum(a["speedup"] for a in out) / seeds, 3),
        "final_delta_virtual": round(sum(a["final_skill_delta"] for a in out) / seeds, 4),
    }


PROJECT_SHARES = (0.5, 0.75, 0.9)
PROJECT_SETUPS = (
    {"nodes": 1, "followers": 1},
    {"nodes": 1, "followers": 3},
    {"nodes": 1, "followers": 7},
    {"nodes": 2, "followers": 0},
    {"nodes": 8, "followers": 0},
)


def project(
    fitted: dict[str, Any],
    steps: float,
    start: float,
    shares: tuple[float, ...] = PROJECT_SHARES,
    seeds: int = 5,
    setups: tuple[dict[str, int], ...] = PROJECT_SETUPS,
) -> list[dict[str, Any]]:
    """Modelled, not measured: the virtual simulator's compute-matched speedup of each setup in
    `PROJECT_SETUPS` where generation is a share g of a step, with everything else as fitted. A step's
    training share is what generation leaves (`train_share` = 1 - g); `pod_ceiling` = 1 / (1 - g) is
    the most a pod can save (it saves at most the generation)."""
    rows = []
    for g in shares:
        at_g = {**fitted, "train_share": round(1.0 - g, 4)}
        for setup in setups:
            run = {**setup, "steps_iso": steps, "start": start}
            rows.append(
                {
                    "generation_share": g,
                    **setup,
                    "pod_ceiling": round(1.0 / (1.0 - g), 2),
                    **virtual_speedup(at_g, run, seeds),
                    "modelled": True,
                }
            )
    return rows


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--project":
        # --project RUN.json ...: fit as --matched does, then project each setup to other generation shares
        fitted = fit_matched([json.loads(open(f).read().strip().splitlines()[-1]) for f in argv[1:]])
        runs = [r for r in fitted["runs"] if r["steps_iso"] and not r["adversary"]]
        steps = sum(r["steps_iso"] for r in runs) / max(1, len(runs))
        start = sum(r["start"] for r in runs) / max(1, len(runs))
        print(json.dumps({"steps": round(steps, 1), "start": round(start, 4), "rows": project(fitted, steps, start)}))
        return
    if argv and argv[0] == "--matched":
        fitted = fit_matched([json.loads(open(f).read().strip().splitlines()[-1]) for f in argv[1:]])
        for run in fitted["runs"]:
            if run["steps_iso"] and not run["adversary"]:
                run.update(virtual_speedup(fitted, run))
        print(json.dumps(fitted))
        return
    bench = json.loads(open(argv[0]).read().strip().splitlines()[-1])
    curve = bench.get("curves", {}).get("isolated")
    blocks = block_means(curve) if curve else bench["block_means"]["isolated"]
    print(json.dumps(fit(blocks, bench.get("rounds", 200))))


if __name__ == "__main__":
    main(sys.argv[1:])
