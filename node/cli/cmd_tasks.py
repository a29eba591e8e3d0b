"""`murmur tasks publish|list|show`: coordinators sign task sets; every node can inspect them.

Publishing signs the set with the node's identity and stores the signed
envelope in the state database; a running node announces the task sets its
own key signed on the swarm's announce topic (at start and whenever a new one
appears), so publishing works the same whether or not the node is up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from murmur.gossip.errors import MurmurError
from murmur.node.cli.app import HomeOpt, console, emit_json, resolve_home, tasks_app

if TYPE_CHECKING:
    from murmur.gossip.wire import TaskSetManifest


def _known(home: Path) -> list[tuple[bytes, TaskSetManifest, bytes, str]]:
    """(id, manifest, envelope, origin) for the built-in set and every stored one."""
    from murmur.gossip.wire import TASK_SET, content_id, open_envelope
    from murmur.node.home import load_home_config, open_home_store
    from murmur.training.tasksets import builtin_task_set

    swarm = load_home_config(home).node.swarm  # stored envelopes were signed for it
    out = []
    env_bytes = builtin_task_set(swarm)
    env, m = open_envelope(env_bytes, TASK_SET, swarm=swarm)
    out.append((content_id(env.body), m, env_bytes, "built-in"))
    if (home / "state.db").exists():
        store = open_home_store(home)
        try:
            for row in store.task_sets():
                env, m = open_envelope(row["envelope"], TASK_SET, swarm=swarm)
                out.append((row["task_set_id"], m, row["envelope"], "stored"))
        finally:
            store.close()
    return out


@tasks_app.command("publish")
def publish(
    file: Annotated[Path, typer.Argument(help="task set TOML")],
    home: HomeOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Sign a task set with this node's key, store it, and queue it for announcement."""
    from murmur.gossip.wire import content_id, decode_envelope
    from murmur.node.home import ensure_home, load_home_config, open_home_store
    from murmur.training.tasksets import load_task_set_toml, sign_task_set

    h = resolve_home(home)
    ident = ensure_home(h)
    swarm = load_home_config(h).node.swarm  # signed for the swarm the home's node talks to
    manifest = load_task_set_toml(file)
    envelope = sign_task_set(ident, manifest, swarm=swarm)
    tid = content_id(decode_envelope(envelope, swarm=swarm).body)
    store = open_home_store(h)
    try:
        new = store.add_task_set(tid, manifest.name, manifest.version, ident.public, envelope)
    finally:
        store.close()
    (h / "tasksets").mkdir(exist_ok=True)
    path = h / "tasksets" / f"{tid.hex()}.msg"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(envelope)
    tmp.replace(path)
    if json_out:
        emit_json(
            {
                "task_set_id": tid.hex(),
                "name": manifest.name,
                "version": manifest.version,
                "coordinator": ident.public.hex(),
                "new": new,
                "path": str(path),
            }
        )
        return
    console.print(f"task set    {manifest.name} v{manifest.version} ({len(manifest.generators)} generators)")
    console.print(f"id          {tid.hex()}")
    console.print(f"coordinator {ident.public.hex()}")
    console.print(
        "stored; a running node announces it to the swarm. Nodes accept it only if their "
        "config lists this coordinator key under \\[trust] coordinators."
    )


def _status(home: Path) -> dict:
    """What the node's worker last wrote: the sets it trains on, waits for, and per-set counters."""
    from murmur.node.home import open_home_store
    from murmur.node.worker.taskmix import STATUS_KEY

    if not (home / "state.db").exists():
        return {}
    store = open_home_store(home)
    try:
        return store.get(STATUS_KEY, {}) or {}
    finally:
        store.close()


@tasks_app.command("list")
def list_sets(home: HomeOpt = None, json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Task sets this node knows (built-in and stored), which it trains on, and per set the rollouts it
    produced, accepted from the swarm and used in its loss (as of the node's last step)."""
    h = resolve_home(home)
    rows = _known(h)
    status = _status(h)
    live = {x["task_set_id"]: x for x in status.get("sets", [])}
    zero = {"training": False, "weight": 0.0, "produced": 0, "accepted": 0, "used": 0}
    if json_out:
        emit_json(
            {
                "sets": [
                    {
                        "task_set_id": t.hex(),
                        "name": m.name,
                        "version": m.version,
                        "coordinator": m.coordinator.hex(),
                        "generators": [g.name for g in m.generators],
                        "origin": o,
                        **{k: live.get(t.hex(), zero).get(k, v) for k, v in zero.items()},
                    }
                    for t, m, _, o in rows
                ],
                "waiting": status.get("waiting", []),
                "refused": status.get("refused", {}),
            }
        )
        return
    table = Table(
        "id", "name", "version", "generators", "coordinator", "origin", "trains", "produced", "accepted", "used"
    )
    for t, m, _, o in rows:
        x = {**zero, **live.get(t.hex(), {})}
        table.add_row(
            t.hex()[:16],
            m.name,
            str(m.version),
            ", ".join(g.name for g in m.generators),
            m.coordinator.hex()[:16],
            o,
            f"x{x['weight']:g}" if x["training"] else "-",
            str(x["produced"]),
            str(x["accepted"]),
            str(x["used"]),
        )
    console.print(table)
    if not status:
        console.print("no training status yet: the node has not run (or not reached its first step) in this home")
    for w in status.get("waiting", []):
        console.print(f"waiting for {w}: not received from a trusted coordinator yet")
    for t, why in status.get("refused", {}).items():
        console.print(f"refused {t[:16]}: {why}")


@tasks_app.command("show")
def show(
    task_set_id: Annotated[str, typer.Argument(help="id or unique hex prefix")],
    home: HomeOpt = None,
    samples: Annotated[int, typer.Option(help="example tasks to print per generator")] = 2,
) -> None:
    """A task set's generators, verifiers and seed ranges, with example tasks."""
    import msgspec

    from murmur.training.tasks import generate

    prefix = task_set_id.lower()
    matches = [r for r in _known(resolve_home(home)) if r[0].hex().startswith(prefix)]
    if not prefix or len(matches) != 1:
        raise MurmurError(f"task set '{task_set_id}': {'no' if not matches else 'more than one'} match")
    tid, m, _, origin = matches[0]
    out = msgspec.structs.asdict(m)
    out["generators"] = [msgspec.structs.asdict(g) for g in m.generators]
    out["coordinator"] = m.coordinator.hex()
    out["id"] = tid.hex()
    out["origin"] = origin
    out["examples"] = {
        g.name: [
            msgspec.structs.asdict(
                generate(
                    g.generator, g.config, g.seed_start + i, verifier=g.verifier or m.verifier, tolerance=m.tolerance
                )
            )
            for i in range(min(samples, g.seed_end - g.seed_start))
        ]
        for g in m.generators
    }
    console.print_json(json.dumps(out, default=str))
