"""The compute-matched benchmark's page: `murmur bench swarm --matched --out DIR` writes the run's JSON
(`result.json`), its curves (`accuracy.png`, `generation_share.png`) and `index.html`, which shows them
with the run's configuration, its speedup and interval, and who trained on what."""

from __future__ import annotations

import html
import json
import random
from pathlib import Path
from typing import Any

from murmur.simulations.bench.matched import bootstrap_ci
from murmur.simulations.report import pyplot, save_figure

BAND_RESAMPLES = 2000


def arm_label(result: dict[str, Any]) -> str:
    """The second arm in words: what the isolated nodes were compared with."""
    if result.get("default_roles"):
        return f"{result['nodes']} nodes with their own roles"
    if result.get("followers"):
        return f"a trainer with {result['followers']} follower(s)"
    if result.get("with_adversary"):
        return f"{result['nodes'] - 1} honest peers and one adversary"
    return f"a swarm of {result['nodes']} peers"


def accuracy_bands(result: dict[str, Any], arm: str, seed: int = 0) -> dict[str, list[float]]:
    """Per checkpoint, over the seeds: the mean held-out accuracy of `arm` ("isolated" or "swarm") and a
    bootstrap 95 % interval of that mean (seeds resampled)."""
    per = result["per_seed"]
    xs = per[0]["curves"]["cpu_s"]
    rng = random.Random(seed)
    mean, lo, hi = [], [], []
    for k in range(len(xs)):
        ys = [float(r["curves"][arm][k]) for r in per]
        mean.append(sum(ys) / len(ys))
        a, b = bootstrap_ci(ys, rng, BAND_RESAMPLES)
        lo.append(a)
        hi.append(b)
    return {"cpu_s": [float(x) for x in xs], "mean": mean, "lo": lo, "hi": hi}


def _plot_accuracy(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    top = 0.1
    for arm, label, colour in (("isolated", "alone", "tab:red"), ("swarm", arm_label(result), "tab:blue")):
        b = accuracy_bands(result, arm)
        ax.plot(b["cpu_s"], b["mean"], lw=2, color=colour, label=f"{label} (mean of {len(result['per_seed'])} seeds)")
        ax.fill_between(b["cpu_s"], b["lo"], b["hi"], color=colour, alpha=0.2, lw=0)
        top = max(top, *b["hi"])
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("CPU-seconds per node (measured)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"Held-out accuracy at equal CPU, {result['answers']} answers (band: 95 % interval of the mean)")
    ax.legend(loc="lower right")
    save_figure(fig, path)


def _plot_generation_share(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = ("isolated", "swarm")
    per = result["per_seed"]
    for i, arm in enumerate(arms):
        ys = [float(r["generation_share"][arm]) for r in per]
        ax.scatter([i] * len(ys), ys, color="tab:gray", s=18, zorder=3)
        ax.bar(i, sum(ys) / len(ys), color=("tab:red", "tab:blue")[i], alpha=0.6)
    ax.set_xticks(range(len(arms)), ["alone", arm_label(result)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("sampling CPU / step CPU")
    ax.set_title("Generation share of the trainers' steps (dots: seeds)")
    save_figure(fig, path)


def _row(cells: list[Any], head: bool = False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"


def write_page(result: dict[str, Any], out: Path) -> Path:
    """Write `result.json`, the two figures and `index.html` into `out`; returns the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    _plot_accuracy(result, out / "accuracy.png")
    _plot_generation_share(result, out / "generation_share.png")
    lo, hi = result["speedup_ci"]
    seeds = [
        _row(
            [
                "seed",
                "speedup",
                "reached",
                "alone final",
                "swarm final",
                "updates/node alone → swarm",
                "external groups/node",
                "used / verified",
                "swarm groups generated / sent / trained",
            ],
            head=True,
        )
    ]
    for r in result["per_seed"]:
        g = r.get("groups", {}).get("swarm")  # a result written before groups were counted has none
        seeds.append(
            _row(
                [
                    r["seed"],
                    r["speedup"],
                    r["reached"],
                    r["iso_final"],
                    r["swarm_final"],
                    f"{r['updates_per_node']['isolated']} → {r['updates_per_node']['swarm']}",
                    r["external_groups_per_node"],
                    r["used_over_verified"],
                    "—" if g is None else f"{g['generated']} / {g['sent']} / {g['trained']}",
                ]
            )
        )
    if result.get("default_roles"):
        seeds.append(_row(["seed", "final roles", "pods (trainer: followers)", "switches per node"], head=True))
        for r in result["per_seed"]:
            ro = r["roles"]
            seeds.append(
                _row(
                    [
                        r["seed"],
                        " ".join(ro["final"]),
                        "; ".join(f"{t}: {len(f)}" for t, f in ro["pods"].items()),
                        ro["switches"],
                    ]
                )
            )
    adv = result.get("adversary")
    adversary = (
        ""
        if not adv
        else ("<h2>The adversary</h2><p>" + html.escape(", ".join(f"{k}: {v}" for k, v in adv.items())) + "</p>")
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>murmur bench swarm --matched</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .6em;text-align:right}}
table{{border-collapse:collapse}}tr:nth-child(even){{background:#f4f4f4}}</style></head><body>
<h1>Does joining pay? Alone vs {html.escape(arm_label(result))}</h1>
<p>Measured: every node's thread CPU (generation, training, verification of what it is sent), nodes stepped
least-CPU-first to {result["cpu_s_per_node"]} CPU-s each; held-out greedy accuracy on {result["eval_tasks"]}
problems at {result["checkpoints"]} equal CPU marks; {len(result["per_seed"])} paired seeds
({html.escape(", ".join(str(s) for s in result["seeds"]))}); answers: {html.escape(result["answers"])};
the swarm arm's PODS down-sampling (select_groups): {result.get("select_groups", 0) or "off"}.</p>
<p><b>Speedup to the alone arm's final accuracy: {result["speedup"]}</b> (95 % interval {lo} … {hi};
reached in {result["reached"]} of {len(result["per_seed"])} seeds; a seed that never reached it counts as
its upper bound). Final accuracy, swarm minus alone: {result["final_acc_delta"]}.</p>
<img src="accuracy.png" alt="held-out accuracy against CPU per arm">
<img src="generation_share.png" alt="generation share per arm">
<h2>Who trained on what, per seed</h2>
<table>{"".join(seeds)}</table>
{adversary}
<p>The numbers behind this page: <a href="result.json">result.json</a>.</p>
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path
