"""The `murmur` command line.

Every command turns the project's own errors into a one-line message and exit
code 2; anything else is a bug and keeps its traceback. Heavy imports (torch,
libp2p) happen inside the commands that need them, so `murmur --help` and
`murmur id` stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from murmur.gossip.errors import MurmurError
from murmur.node import __version__

app = typer.Typer(
    name="murmur",
    help="Murmur: a peer-to-peer swarm for reinforcement-learning post-training of language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect the node configuration.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks; each prints one JSON object as its last line.", no_args_is_help=True)
tasks_app = typer.Typer(help="Signed task sets: publish, list, show.", no_args_is_help=True)
node_app = typer.Typer(help="Run and inspect a node.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
app.add_typer(tasks_app, name="tasks")
app.add_typer(node_app, name="node")

console = Console()

HomeOpt = Annotated[Path | None, typer.Option("--home", help="node home (default $MURMUR_HOME or ~/.murmur)")]


def resolve_home(home: Path | None) -> Path:
    from murmur.node.config import default_home

    return Path(home) if home else default_home()


def config_path(home: Path, explicit: Path | None = None) -> Path:
    from murmur.node.config import CONFIG_FILE

    return Path(explicit) if explicit else home / CONFIG_FILE


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"murmur {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="print the version")
    ] = False,
) -> None:
    pass


def emit_json(obj: Any) -> None:
    """Benchmarks and --json commands: one JSON object on the last line of stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ init / id / config


@app.command()
def init(
    home: HomeOpt = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing identity key")] = False,
) -> None:
    """Create a node home: identity key (0600), commented config.toml, state database."""
    from murmur.node.home import init_home

    h = resolve_home(home)
    ident = init_home(h, force=force)
    console.print(f"node home   {h}")
    console.print(f"peer id     {ident.peer_id}")


@app.command("id")
def show_id(home: HomeOpt = None, json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print this node's libp2p peer ID and ed25519 public key."""
    from murmur.node.home import load_identity

    ident = load_identity(resolve_home(home))
    if json_out:
        emit_json({"peer_id": ident.peer_id, "public_key": ident.public.hex()})
    else:
        console.print(f"peer id     {ident.peer_id}")
        console.print(f"public key  {ident.public.hex()}")


@config_app.command("show")
def config_show(
    home: HomeOpt = None,
    config: Annotated[Path | None, typer.Option("--config", help="config file (default <home>/config.toml)")] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the effective configuration and where each value came from."""
    from murmur.node.config import flatten, load_config_with_sources
    from murmur.node.worker.modelplan import sized_lr

    h = resolve_home(home)
    cfg, sources = load_config_with_sources(config_path(h, config))
    try:  # what `node start` would train at: an unset lr follows the model's size
        sized, notes = sized_lr(cfg, lr_is_default=sources["training.lr"] == "default")
    except MurmurError:  # a model path that is not there: `doctor` and `node start` say so
        sized, notes = cfg, []
    if notes:
        cfg, sources["training.lr"] = sized, "default for the model's size"
    values = flatten(cfg)
    if json_out:
        emit_json({k: {"value": v, "source": sources[k]} for k, v in values.items()})
        return
    table = Table("key", "value", "source", title=f"effective configuration ({h})")
    for key, value in values.items():
        table.add_row(key, json.dumps(value), sources[key])
    console.print(table)


def main() -> None:
    """Console entry point: project errors become one line on stderr and exit code 2."""
    try:
        app()
    except MurmurError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


# Command groups that live in their own modules register themselves on the apps above, in the order
# `murmur --help` lists them.
# isort: off
from murmur.node.cli import cmd_bench  # noqa: E402, F401 - imported for that registration
from murmur.node.cli import cmd_sim  # noqa: E402, F401 - imported for that registration
from murmur.node.cli import cmd_tasks  # noqa: E402, F401 - imported for that registration
from murmur.node.cli import cmd_node  # noqa: E402, F401 - imported for that registration
# isort: on
