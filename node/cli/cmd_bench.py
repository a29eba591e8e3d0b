"""`murmur bench ...`: every benchmark lives in `simulations/bench/`; this only wires and prints.

Progress goes to stderr; the last line of stdout is always one JSON object.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from murmur.node.cli.app import bench_app, emit_json

JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object as the last line (always on)")]
SeedOpt = Annotated[int, typer.Option("--seed", help="random seed")]


def _run(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(fn(**kwargs))


@bench_app.command("codec")
def bench_codec(
    json_out: JsonOpt = True,
    params: Annotated[int, typer.Option(help="model size to build, parameters")] = 100_000_000,
    steps: Annotated[int, typer.Option(help="optimizer steps, one version each")] = 50,
    seed: SeedOpt = 0,
) -> None:
    """Sparse patch codec on a ~100M-parameter model trained for real (bytes per changed element, apply time)."""
    from murmur.simulations.bench.codec import run

    _run(run, params=params, steps=steps, seed=seed)


@bench_app.command("core")
def bench_core(
    json_out: JsonOpt = True,
    cores: Annotated[int, typer.Option(help="node cores built in this process", min=1)] = 2000,
    peers: Annotated[int, typer.Option(help="trainers (one lineage each) every core hears", min=1)] = 8,
) -> None:
    """Memory and time of many node cores (the state machine the simulator runs per node) in one process."""
    from murmur.simulations.bench.core import run

    _run(run, cores=cores, peers=peers)


@bench_app.command("gossip")
def bench_gossip(
    json_out: JsonOpt = True,
    nodes: Annotated[int, typer.Option(help="node processes, one of them adversarial")] = 8,
    batches_per_node: Annotated[int, typer.Option(help="batches each honest node publishes")] = 10,
    rate_per_node: Annotated[float, typer.Option(help="batches per second per honest node")] = 0.5,
    exchange_only: Annotated[bool, typer.Option("--exchange-only", help="only the rollout exchange run")] = False,
    demand: Annotated[float, typer.Option(help="exchange run: rollouts/s each consumer uses")] = 8.0,
    duration: Annotated[float, typer.Option(help="exchange run: seconds of publishing")] = 30.0,
    real_producers: Annotated[
        bool,
        typer.Option(
            "--real-producers",
            help="exchange run: producers make 5x a consumer's demand and publish by the "
            "exchange's publish rule, as trainers do",
        ),
    ] = False,
) -> None:
    """Rollout gossip between real libp2p nodes: the exchange's per-node load at a fixed rate and demand;
    delivery, latency, verification rate and an adversary on one shard."""
    from murmur.simulations.bench.gossip import run

    _run(
        run,
        nodes=nodes,
        batches_per_node=batches_per_node,
        rate_per_node=rate_per_node,
        exchange_only=exchange_only,
        demand=demand,
        duration_s=duration,
        real_producers=real_producers,
    )


@bench_app.command("broadcast")
def bench_broadcast(
    json_out: JsonOpt = True,
    peers: Annotated[int, typer.Option(help="followers")] = 16,
    sim: Annotated[bool, typer.Option("--sim", help="virtual time instead of real processes")] = False,
    size: Annotated[int, typer.Option("--bytes", help="patch size S")] = 8 * 2**20,
    chunk_bytes: Annotated[int, typer.Option(help="chunk size")] = 256 * 2**10,
    upload: Annotated[int, typer.Option("--upload-bytes-per-s", help="per-node upload cap B")] = 2 * 2**20,
    seed: SeedOpt = 0,
) -> None:
    """Pipelined peer-assisted patch broadcast against the lower bound T*."""
    from murmur.simulations.bench.broadcast import run

    _run(run, peers=peers, sim=sim, bytes=size, chunk_bytes=chunk_bytes, upload_bytes_per_s=upload, seed=seed)


@bench_app.command("learn")
def bench_learn(
    json_out: JsonOpt = True,
    budget_s: Annotated[float, typer.Option("--budget-s", help="wall-clock budget, warm-up included")] = 300.0,
    seed: SeedOpt = 0,
) -> None:
    """One node, built-in tiny model and tasks: how much RL raises held-out accuracy in a fixed budget."""
    from murmur.simulations.bench.learn import run

    _run(run, budget_s=budget_s, seed=seed)


@bench_app.command("swarm")
def bench_swarm(
    json_out: JsonOpt = True,
    rounds: Annotated[int, typer.Option(help="training rounds per run (0 = the benchmark's default)")] = 0,
    seed: SeedOpt = 0,
    seeds: Annotated[
        int,
        typer.Option(
            min=1, help="run this many seeds from --seed, one process each (cores at a time), and report their means"
        ),
    ] = 1,
    nodes: Annotated[
        int,
        typer.Option(
            min=0, max=64, help="nodes in the swarm (0 = the benchmark's 4); same per-node compute at every size"
        ),
    ] = 0,
    matched: Annotated[
        bool,
        typer.Option(
            "--matched",
            help="compute-matched: equal measured CPU per node, "
            "held-out accuracy, speedup with a bootstrap interval "
            "over --seeds paired seeds",
        ),
    ] = False,
    cpu_s: Annotated[float, typer.Option(min=0.1, help="with --matched: CPU seconds per node")] = 48.0,
    followers: Annotated[
        int,
        typer.Option(
            min=0, max=16, help="with --matched: one trainer with this many followers instead of a swarm of --nodes"
        ),
    ] = 0,
    adversary: Annotated[
        bool,
        typer.Option(
            "--adversary",
            help="with --matched: one of the --nodes sends valid but useless rollouts and some forged ones",
        ),
    ] = False,
    workers: Annotated[
        int, typer.Option(min=1, max=64, help="with --matched: seeds run this many processes at a time")
    ] = 1,
    answers: Annotated[
        str,
        typer.Option(
            help="with --matched: the answer regime, short (the built-in set) or "
            "worked (worked steps, >= 64 completion tokens)"
        ),
    ] = "short",
    default_roles: Annotated[
        bool,
        typer.Option(
            "--default-roles",
            help="with --matched: the swarm of --nodes with roles chosen by the node's own rule, nothing forced",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            help="with --matched: also write the run's JSON, its curves and an HTML page (index.html) into this folder"
        ),
    ] = None,
    select_groups: Annotated[
        int,
        typer.Option(
            min=0,
            max=1024,
            help="with --matched: the swarm arm's trainers "
            "train only this many of a step's informative "
            "groups, those of largest reward variance "
            "(PODS; 0 = all)",
        ),
    ] = 0,
    follower_oversample: Annotated[
        float,
        typer.Option(
            min=1.0,
            max=8.0,
            help="with --matched --followers: each follower generates this many times I groups per trainer step",
        ),
    ] = 1.0,
    schedule_share: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="with --matched: the share of every trainer's prompts drawn from the shared prompt schedule "
            "(both arms), so that peers answer the same prompts and pool them",
        ),
    ] = 0.0,
    foreign: Annotated[
        list[str] | None,
        typer.Option(
            help="with --matched: KEY=VALUE, a [training] key of how a trainer uses swarm rollouts (foreign_pool, "
            "foreign_share_max, ..., pod_yield) for every trainer of both arms, in place of its default; repeatable",
        ),
    ] = None,
    same_start: Annotated[
        bool,
        typer.Option(
            "--same-start",
            help="with --matched: every node of both arms starts from one warm-up of the model (as volunteers who "
            "fetch one base model), not each from its own",
        ),
    ] = False,
) -> None:
    """Isolated vs swarm vs swarm-with-adversary cumulative reward (SAPO-style); with --matched, held-out
    accuracy at equal CPU per node."""
    from murmur.simulations.bench.swarm import run, run_seeds

    if matched:
        from murmur.simulations.bench.matched import ANSWERS
        from murmur.simulations.bench.matched import run as run_matched

        if answers not in ANSWERS:
            raise typer.BadParameter(f"one of {', '.join(ANSWERS)}", param_hint="--answers")
        if default_roles and followers:
            raise typer.BadParameter("roles are the nodes' own choice: no --followers", param_hint="--default-roles")
        if adversary and (followers or 0 < nodes < 3):
            raise typer.BadParameter("needs a swarm of --nodes >= 3 (no --followers)", param_hint="--adversary")
        if default_roles and (select_groups or follower_oversample != 1.0):
            raise typer.BadParameter("applies to forced arms, not to --default-roles", param_hint="--select-groups")
        if default_roles and schedule_share:
            raise typer.BadParameter("applies to forced arms, not to --default-roles", param_hint="--schedule-share")
        overrides = _foreign_overrides(foreign or [])
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        result = run_matched(
            nodes=nodes or 4,
            seeds=seeds,
            seed=seed,
            cpu_s=cpu_s,
            followers=followers,
            adversary=adversary,
            workers=workers,
            answers=answers,
            default_roles=default_roles,
            select_groups=select_groups,
            follower_oversample=follower_oversample,
            schedule_share=schedule_share,
            foreign=overrides,
            same_start=same_start,
        )
        if out is not None:
            from murmur.simulations.bench.matched_page import write_page

            result["page"] = str(write_page(result, out))
        emit_json(result)
    elif seeds == 1:
        _run(run, rounds=rounds, seed=seed, nodes=nodes)
    else:
        _run(run_seeds, seeds=seeds, rounds=rounds, seed=seed, nodes=nodes)


def _foreign_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--foreign KEY=VALUE` pairs as `TrainerConfig` values: true/false for a switch, an integer or a number
    as the key's default is."""
    from murmur.simulations.bench.matched import check_foreign
    from murmur.training.trainer import TrainerConfig

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        default = getattr(TrainerConfig(), key.strip(), None) if sep else None
        try:
            if default is None:
                raise ValueError(f"{pair!r}: not KEY=VALUE with a swarm-rollout key")
            if isinstance(default, bool):
                if raw.strip().lower() not in ("true", "false"):
                    raise ValueError(f"{key} takes true or false, not {raw!r}")
                out[key.strip()] = raw.strip().lower() == "true"
            elif isinstance(default, int):
                out[key.strip()] = int(raw)
            else:
                out[key.strip()] = float(raw)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--foreign") from e
    try:
        check_foreign(out)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--foreign") from e
    return out


@bench_app.command("soak")
def bench_soak(
    json_out: JsonOpt = True,
    minutes: Annotated[
        float, typer.Option(help="minutes of running after the first node starts working", min=0.5)
    ] = 60.0,
) -> None:
    """A local swarm (trainer, follower+validator, trainer) for N minutes: memory, disk, errors, drops, progress."""
    from murmur.simulations.bench.soak import run

    _run(run, minutes=minutes)


@bench_app.command("reachability")
def bench_reachability(json_out: JsonOpt = True) -> None:
    """Direct, relayed, hole-punched and WebRTC paths across emulated NATs."""
    from murmur.simulations.bench.reachability import run

    _run(run)


@bench_app.command("attacks")
def bench_attacks(
    json_out: JsonOpt = True,
    window_s: Annotated[
        float,
        typer.Option(
            "--window-s",
            min=10.0,
            help="least seconds the attack window lasts "
            "(and until the catalogue ran once); the "
            "control swarm is measured as long",
        ),
    ] = 60.0,
) -> None:
    """Live trainer + follower/validator under hostile peers running the catalogue, against a control swarm."""
    from murmur.simulations.bench.attacks import run

    _run(run, window_s=window_s)


@bench_app.command("engines")
def bench_engines(
    json_out: JsonOpt = True,
    patches: Annotated[int, typer.Option(help="versions each engine applies")] = 5,
    batch: Annotated[int, typer.Option(help="prompts per generation batch")] = 32,
    max_new: Annotated[int, typer.Option(help="new tokens per completion at most")] = 32,
    models: Annotated[str, typer.Option(help="comma-separated: murmur-tiny, qwen2-28m")] = "murmur-tiny,qwen2-28m",
    seed: SeedOpt = 0,
) -> None:
    """transformers vs vLLM on the same models, prompts and patches (vLLM from .venv-vllm)."""
    from murmur.simulations.bench.engines import run

    _run(run, patches=patches, batch=batch, max_new=max_new, models=models, seed=seed)
