"""`murmur simulate`: run a scenario as real node processes, or in virtual time; write a report."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from murmur.gossip.errors import MurmurError
from murmur.node.cli.app import app, console, emit_json


@app.command("simulate")
def simulate(
    scenario_file: Annotated[Path | None, typer.Argument(help="scenario TOML file (docs/scenarios.md)")] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            "--scenario", "-s", help="built-in scenario: default, churn, adversarial, heterogeneous, wan, large, huge"
        ),
    ] = None,
    virtual: Annotated[
        bool, typer.Option("--virtual", help="virtual time: a node core per node; links, compute and learning modelled")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="report folder (default ./murmur-sim/<name>-<mode>-<time>)")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="override the scenario's seed")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="override duration_s (seconds)")] = None,
    rebuild: Annotated[
        Path | None, typer.Option("--rebuild", help="only regenerate the HTML/plots of a report folder")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="validate the scenario and print its nodes; run nothing")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the summary as one JSON line last")] = False,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="emulation: stop once every node has taken its first step "
            "(or one failed); scheduled joins, leaves and restarts come "
            "as soon as every running node has stepped: checks that a "
            "scenario runs",
        ),
    ] = False,
) -> None:
    """Run a scenario (real nodes, or --virtual) and write metrics + an HTML report with plots.

    Exits 1 when a node process of an emulation exited without the scenario stopping it (`nodes_failed`)."""
    import msgspec

    from murmur.simulations import scenario as sc_mod

    if rebuild is not None:
        from murmur.simulations.report import rebuild as do_rebuild

        page = do_rebuild(rebuild)
        console.print(f"report      {page}")
        return
    if scenario_file is not None and scenario is not None:
        raise MurmurError("give a scenario file or --scenario NAME, not both")
    sc = sc_mod.load(scenario_file) if scenario_file is not None else sc_mod.builtin(scenario or "default")
    if seed is not None or duration is not None:
        raw = msgspec.to_builtins(sc)
        if seed is not None:
            raw["seed"] = seed
        if duration is not None:
            raw["duration_s"] = duration
        sc = sc_mod.from_dict(raw, "command line")
    if check:
        nodes = sc_mod.expand(sc)
        console.print(f"scenario {sc.name!r}: {len(nodes)} nodes, {sc.duration_s:g} s, seed {sc.seed}")
        for n in nodes:
            console.print(
                f"  {n.index:4d} {n.group:24s} {n.role:9s} up {n.upload_bytes_per_s / 1e6:.2f} MB/s "
                f"down {n.download_bytes_per_s / 1e6:.2f} MB/s {n.latency_ms:g} ms loss {n.loss:g} "
                f"compute {n.compute:g}"
            )
        return
    mode = "virtual" if virtual else "emulate"
    folder = out or Path("murmur-sim") / f"{sc.name}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    if virtual:
        from murmur.simulations.virtual import VirtualSim

        sim = VirtualSim(sc, folder, progress=not json_out)  # held until the exit below, which frees nothing
        summary = sim.run()
    else:
        from murmur.simulations.emulate import run_emulation

        summary = run_emulation(sc, folder, progress=not json_out, smoke=smoke)
    if json_out:
        emit_json(summary)
    else:
        _print_summary(summary, folder)
    if virtual:
        _exit_keeping_the_heap()
    if summary.get("nodes_failed"):
        raise typer.Exit(1)


def _print_summary(summary: dict[str, Any], folder: Path) -> None:
    for key in (
        "mode",
        "nodes",
        "nodes_stepped",
        "virtual_s",
        "wall_s",
        "swarm_cumulative_reward",
        "isolated_cumulative_reward",
        "gain_swarm",
        "adversarial_accepted",
        "rejections",
    ):
        if key in summary:
            console.print(f"{key:28s}{summary[key]}")
    for f in summary.get("nodes_failed", []):
        console.print(
            f"node {f['node']} ({f['group']}) exited at {f['t']} s with code {f['exit_code']}: {f['last_log_line']}",
            markup=False,
            highlight=False,
        )
    console.print(f"report      {folder / 'index.html'}")


def _exit_keeping_the_heap() -> None:
    """A virtual run holds millions of small objects; freeing them one by one at interpreter exit takes a
    sizeable share of a big run's time, and the operating system reclaims the memory at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
