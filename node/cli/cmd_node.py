"""`murmur node start|status`, `murmur doctor`, `murmur demo`: registered on the lead's typer apps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from murmur.node.cli.app import HomeOpt, app, config_path, console, emit_json, node_app, resolve_home

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="config file (default <home>/config.toml)")]


@node_app.command("start")
def node_start(
    home: HomeOpt = None,
    config: ConfigOpt = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option("--bootstrap", help="bootstrap peer multiaddr (repeatable)")
    ] = None,
    listen: Annotated[list[str] | None, typer.Option("--listen", help="listen multiaddr (repeatable)")] = None,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="JSON log lines on stderr instead of the dashboard")] = False,
) -> None:
    """Join a swarm: pick roles for this hardware, train/follow/validate, show a live dashboard."""
    import logging

    from murmur.node import logs
    from murmur.node.config import load_config
    from murmur.node.home import ensure_home
    from murmur.node.shell.runtime import RunOptions, run_node
    from murmur.node.worker import modelplan

    h = resolve_home(home)
    ensure_home(h)
    path = config_path(h, config)
    base = load_config(path)
    tui = not no_tui and sys.stdout.isatty()
    logs.setup(
        base.node.log_level,
        stream=None if tui else sys.stderr,
        logfile=h / "node.log",
        max_bytes=base.disk.logs_max_mb * 2**20,
    )
    cfg, notes, warnings = modelplan.start_config(path)
    log = logging.getLogger("murmur.node")
    for note in notes:
        log.info(note)
    for warning in warnings:
        log.warning(warning)
        if tui:  # the dashboard takes the screen and the log goes to node.log: say it before it starts
            console.print(f"warning: {warning}")
    run_node(cfg, h, RunOptions(tui=tui, listen=list(listen or []), bootstrap=list(bootstrap or [])))


@node_app.command("status")
def node_status(
    home: HomeOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the node")] = 5.0,
) -> None:
    """Read a running node's state over its control socket (does not disturb it)."""
    import msgspec

    from murmur.node.config import load_config
    from murmur.node.shell import control
    from murmur.node.ui.dashboard import node_panel

    h = resolve_home(home)
    cfg = load_config(config_path(h))
    s = control.status(h, cfg.metrics.control_socket, timeout)
    if json_out:
        emit_json(msgspec.to_builtins(s))
    else:
        console.print(node_panel(s))


@app.command()
def doctor(
    home: HomeOpt = None,
    config: ConfigOpt = None,
    bootstrap: Annotated[list[str] | None, typer.Option("--bootstrap", help="extra bootstrap peer to test")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object as the last line")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds per dial")] = 5.0,
) -> None:
    """Check Python, torch, libp2p, ports, bootstrap peers, reachability, disk and memory; each with a fix."""
    from murmur.gossip.errors import MurmurError
    from murmur.node.cli.doctor import passed, render, run_checks
    from murmur.node.config import load_config_with_sources
    from murmur.node.worker.modelplan import sized_lr

    h = resolve_home(home)
    cfg, sources = load_config_with_sources(config_path(h, config))
    try:  # the learning rate `node start` would use; a model it cannot plan is the model check's finding
        cfg, _ = sized_lr(cfg, lr_is_default=sources["training.lr"] == "default")
    except MurmurError:
        pass
    checks = run_checks(cfg, h, extra_bootstrap=list(bootstrap or []), timeout_s=timeout)
    if json_out:
        emit_json({"ok": passed(checks), "checks": [c.to_dict() for c in checks]})
    else:
        render(checks, console)
    if not passed(checks):
        raise typer.Exit(1)


@app.command()
def demo(
    duration: Annotated[float, typer.Option("--duration", help="seconds of training")] = 180.0,
    nodes: Annotated[
        str,
        typer.Option(
            "--nodes",
            help="roles of the demo nodes, e.g. trainer,trainer,follower; "
            "auto: roles chosen by the node, as with no node.roles",
        ),
    ] = "trainer,trainer+validator,follower+validator",
    workdir: Annotated[
        Path | None, typer.Option("--dir", help="keep the demo homes here (default: a temp dir)")
    ] = None,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="plain progress lines instead of the live dashboard")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the summary as one JSON line last")] = False,
    task_set: Annotated[
        Path | None,
        typer.Option("--task-set", help="a coordinator's task-set TOML to train on instead of the built-in set"),
    ] = None,
    until_steps: Annotated[
        int,
        typer.Option(
            "--until-steps",
            help="stop early once every trainer made N steps and published a version and every "
            "follower applied a version and measured its held-out accuracy",
        ),
    ] = 0,
) -> None:
    """A local swarm on loopback with the built-in model and tasks (or --task-set FILE.toml): watch it learn,
    then a summary with reward and held-out accuracy per task family."""
    from murmur.node.cli.demo import run_demo

    summary = run_demo(
        duration_s=duration,
        node_roles=[n.split("+") for n in nodes.split(",") if n],
        workdir=workdir,
        tui=not no_tui and sys.stdout.isatty(),
        console=console,
        task_set=task_set,
        until_steps=until_steps,
    )
    if json_out:
        emit_json(summary)
