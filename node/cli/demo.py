"""`murmur demo`: a local swarm of real nodes on loopback, learning the built-in task set (or, with
`--task-set FILE.toml`, a coordinator's set: try it locally before publishing it).

Every node is a real `murmur node start` subprocess with its own generated
home and config; the demo reads their state over their control sockets only,
shows one swarm dashboard, and ends with a summary table. Nothing leaves
loopback and nothing is downloaded: murmur-tiny is built locally once and
shared by every node (same base model, so followers start from patches).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from murmur.node.cli import launch
from murmur.node.status import NodeStatus
from murmur.sync.ids import Relation

STARTUP_ALLOWANCE_S = 240.0  # process start + model load on a busy 2-core machine, on top of --duration
DEMO_SWARM = "murmur-demo"


AUTO = "auto"  # a demo node with no configured roles: it trains or generates by the swarm's need


def node_config(
    roles: list[str],
    model: str,
    swarm: str = DEMO_SWARM,
    task_set: str = "builtin",
    coordinator: str = "",
    max_new_tokens: int = 8,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """A demo node's config sections (`launch.NodeLaunch.config`); `seed`: its trainer's (task draws, sampling),
    so that demo nodes differ as volunteers' do."""
    return {
        "node": {"swarm": swarm, "roles": roles, "memory_budget_mb": 1536},
        "network": {"dht": False},
        # a version every 2 steps: with K = 4 a follower may lag ~8 optimizer steps (several seconds on 2 busy cores)
        "sync": {"publish_every": 2, "anchor_every": 16, "retain_versions": 32, "max_staleness": 4},
        # `murmur bench learn` settings: the built-in answers fit in 8 tokens, and 16 own groups per step. With 4
        # groups a trainer whose only external rollouts come from another lineage (HACPO) does not learn within a
        # demo (measured on one-digit sums: 60 steps, greedy eval 0.36 -> 0.35 alone, 0.36 -> 0.365 with 4 HACPO
        # groups). 8-group updates: the compute-matched benchmark's regime with 16 own groups a step
        "training": {
            "model": model,
            "threads": 1,
            "max_new_tokens": max_new_tokens,
            "local_rollouts": 16,
            "minibatch_groups": 8,
            "seed": seed,
            "task_sets": [task_set],
        },
        "trust": {"coordinators": [coordinator] if coordinator else []},
    }


class DemoTaskSet:
    """A coordinator's task-set file, checked and signed by a throwaway demo coordinator key, stored in
    every node home before the node starts, so the nodes train on it exactly as on a published set."""

    def __init__(self, path: Path) -> None:
        from murmur.gossip.identity import Identity
        from murmur.gossip.wire import content_id, decode_envelope
        from murmur.training.evaluation import check_evaluation
        from murmur.training.tasksets import load_task_set_toml, sign_task_set
        from murmur.training.tiny import warmup_generators

        self.manifest = load_task_set_toml(path)  # one-line TaskError on any bad key, generator or overlap
        check_evaluation([self.manifest], warmup_generators())  # eval held out from murmur-tiny's warm-up too
        self.coordinator = Identity.generate()
        # signed for the swarm the demo's nodes talk to
        self.envelope = sign_task_set(self.coordinator, self.manifest, swarm=DEMO_SWARM)
        self.id = content_id(decode_envelope(self.envelope, swarm=DEMO_SWARM).body)
        self.max_new_tokens = answer_tokens(self.manifest)

    def install(self, home: Path) -> None:
        from murmur.node.store import open_store

        store = open_store(home)
        try:
            store.add_task_set(
                self.id, self.manifest.name, self.manifest.version, self.coordinator.public, self.envelope
            )
        finally:
            store.close()


def answer_tokens(m: Any, samples: int = 64, cap: int = 32) -> int:
    """Completion budget for murmur-tiny (one token per character): the longest sampled answer plus EOS."""
    from murmur.training.tasks import generate

    longest = max(
        len(generate(g.generator, g.config, s).answer)
        for g in m.generators
        for s in range(g.seed_start, min(g.seed_end, g.seed_start + samples))
    )
    return max(2, min(cap, longest + 1))


def family_results(homes: list[Path], names: list[str]) -> list[dict[str, Any]]:
    """Per node and task family: recent local reward and held-out accuracy (first and last eval: at a
    trainer's step, at the version a follower held), from the status the node's worker keeps in its state
    database."""
    from murmur.node.store import open_store
    from murmur.node.worker.taskmix import STATUS_KEY
    from murmur.training.evaluation import family_of

    out = []
    for name, home in zip(names, homes):
        if not (home / "state.db").exists():
            continue
        store = open_store(home)
        try:
            st = store.get(STATUS_KEY, {}) or {}
        finally:
            store.close()
        for ts in st.get("sets", []):
            if not ts.get("training"):
                continue
            ev = ts.get("eval", {})
            first = ev.get("start", {}).get("accuracy", {})
            last = ev.get("last", {}).get("accuracy", {})
            fams = sorted({family_of(g) for g in ts.get("reward_by_generator", {})} | set(first) - {"all"})
            for f in fams:
                out.append(
                    {
                        "node": name,
                        "task_set": f"{ts['name']} v{ts['version']}",
                        "family": f,
                        "reward": ts.get("reward_by_generator", {}).get(f),
                        "eval_start": first.get(f),
                        "eval_end": last.get(f),
                        "eval_steps": [ev.get("start", {}).get("step"), ev.get("last", {}).get("step")],
                    }
                )
    return out


def summarize(names: list[str], statuses: list[NodeStatus | None]) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    for name, s in zip(names, statuses):
        if s is None:
            nodes.append({"node": name, "error": "not answering"})
            continue
        # a trainer turned follower keeps its lineage (relation own) on disk: what it holds now is what it serves
        own = next((x for x in s.lineages if x.relation == Relation.OWN), None) if "trainer" in s.roles else None
        fol = next((x for x in s.lineages if x.lineage == s.serving), None)
        held = own or fol
        nodes.append(
            {
                "node": name,
                "peer_id": s.peer_id,
                "roles": s.roles,
                "roles_reason": s.roles_reason,
                "roles_chosen": s.roles_chosen,
                "role_switches": s.role_switches,
                "reward_start": s.reward_start,
                "reward_end": s.reward_now,
                "versions_published": s.versions_published,
                "versions_applied": s.versions_applied,
                "held_version": held.held if held else None,
                "serving": s.serving,
                "rollouts_made": s.exchange.produced_rollouts,
                "rollouts_produced": s.rollouts_produced,
                "rollouts_published": s.rollouts_published,
                "rollouts_withheld": s.exchange.withheld_rollouts,
                "rollouts_uninformative": s.exchange.uninformative_rollouts,
                "groups_generated": s.exchange.groups_generated,
                "groups_sent": s.exchange.groups_sent,
                "groups_trained": s.exchange.groups_trained,
                "rollouts_unsent": s.exchange.unsent_rollouts,
                "rollouts_received": s.exchange.received_rollouts,
                "rollouts_verified": s.exchange.verified_rollouts,
                "batches_unsampled": s.exchange.unsampled_batches,
                "sample_fraction": s.exchange.sample_fraction,
                "sample_floor_per_min": s.exchange.sample_floor_per_min,
                "sample_rate": s.exchange.sample_rate,
                "rollouts_accepted": s.rollouts_accepted,
                "rollouts_rejected": sum(s.rejected.values()),
                "rejected": s.rejected,
                "rollouts_used": s.rollouts_used,
                "spot_checked": s.spot_checked,
                "bytes_up": s.bytes_up,
                "bytes_down": s.bytes_down,
                "steps": s.steps,
                "used_over_verified": s.used_over_verified,
                "external_groups_per_step": s.external_groups_per_step,
                "heldout_start": s.heldout_start,
                "heldout_end": s.heldout_now,
            }
        )
    return {"nodes": nodes}


def summary_table(summary: dict[str, Any]) -> Any:
    """One column per node, one row per measure: fits 80 columns (a pipe, a CI log) without cutting cells."""
    from rich.table import Table
    from rich.text import Text

    from murmur.node.ui.dashboard import human_bytes

    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    t = Table(
        title="murmur demo: summary",
        caption="rollouts are counts; accepted/rejected: peers' rollouts this node verified; "
        "used: external rollouts trained on; spot checks: log-prob re-computations",
    )
    t.add_column("", style="bold", no_wrap=True)
    rows: dict[str, list[str]] = {
        k: []
        for k in (
            "roles",
            "reward start→end",
            "versions published",
            "versions applied",
            "rollouts made",
            "signed",
            "published",
            "verified",
            "accepted",
            "rejected",
            "used",
            "used/verified",
            "validator sample",
            "held-out start→end",
            "spot checks",
            "patch bytes ↑/↓",
        )
    }
    for n in summary["nodes"]:
        t.add_column(Text(n["node"].replace("-", " ")), overflow="fold")
        if "error" in n:
            for i, k in enumerate(rows):
                rows[k].append(n["error"] if i == 0 else "—")
            continue
        auto = f" (auto, {n['role_switches']}×)" if n.get("roles_chosen") else ""
        for k, v in zip(
            rows,
            (
                ",".join(n["roles"]) + auto,
                f"{f(n['reward_start'])}→{f(n['reward_end'])}",
                str(n["versions_published"]),
                str(n["versions_applied"]),
                str(n["rollouts_made"]),
                str(n["rollouts_produced"]),
                str(n["rollouts_published"]),
                str(n["rollouts_verified"]),
                str(n["rollouts_accepted"]),
                str(n["rollouts_rejected"]),
                str(n["rollouts_used"]),
                "—" if n["used_over_verified"] is None else f"{n['used_over_verified']:.0%}",
                "all"
                if n["sample_fraction"] is None
                else f"{n['sample_fraction']:.0%} + {n['sample_floor_per_min']:g}/min (checked {n['sample_rate']:.0%})",
                f"{f(n['heldout_start'])}→{f(n['heldout_end'])}",
                str(n["spot_checked"]),
                f"{human_bytes(n['bytes_up'])}/{human_bytes(n['bytes_down'])}",
            ),
        ):
            rows[k].append(v)
    for label, cells in rows.items():
        t.add_row(label, *cells)
    return t


def family_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(
        "node",
        "task set",
        "family",
        "reward (recent)",
        "held-out accuracy",
        "eval at step/version",
        title="per task family: local reward and greedy accuracy on held-out problems (first → last eval)",
    )

    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    for r in rows:
        t.add_row(
            r["node"].split("-")[0],
            r["task_set"],
            r["family"],
            f(r["reward"]),
            f"{f(r['eval_start'])}→{f(r['eval_end'])}",
            "→".join("—" if x is None else str(x) for x in r["eval_steps"]),
        )
    return t


def shown(node_roles: list[list[str]], statuses: list[NodeStatus | None], until_steps: int) -> bool:
    """Every trainer has made `until_steps` steps and published a version, and every follower applied a
    version and measured the held-out accuracy of the weights it holds (0: never). A step with no
    informative group updates nothing, so steps alone do not say a trainer published."""
    if until_steps <= 0 or any(s is None for s in statuses):
        return False
    return all(
        (s.steps >= until_steps and s.versions_published >= 1 if "trainer" in now else True)
        and (s.versions_applied >= 1 and s.heldout_now is not None if "follower" in now else True)
        for roles, s in zip(node_roles, statuses)
        if s is not None
        for now in [s.roles if roles == [AUTO] else roles]
    )


def run_demo(
    duration_s: float = 180.0,
    node_roles: list[list[str]] | None = None,
    workdir: Path | None = None,
    tui: bool = True,
    console: Any = None,
    task_set: Path | None = None,
    until_steps: int = 0,
) -> dict[str, Any]:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from murmur.node.core.roles import check_roles
    from murmur.node.ui.dashboard import swarm_table

    console = console or Console()
    node_roles = node_roles or [["trainer"], ["trainer", "validator"], ["follower", "validator"]]
    for r in node_roles:
        if r != [AUTO]:
            check_roles(r)
    demo_set = DemoTaskSet(task_set) if task_set is not None else None  # bad file: one-line error, nothing started
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="murmur-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]murmur demo[/]: {len(node_roles)} nodes on loopback, {duration_s:.0f} s of training, homes in {root}"
    )
    if demo_set is not None:
        console.print(
            f"task set {demo_set.manifest.name} v{demo_set.manifest.version} from {task_set} "
            f"({len(demo_set.manifest.generators)} generators, completions up to "
            f"{demo_set.max_new_tokens} tokens)"
        )
    with console.status("building the built-in model murmur-tiny (once, cached)…"):
        model = launch.build_tiny_model(root)
    names = [f"node{i}-{'+'.join(roles)}" for i, roles in enumerate(node_roles)]
    homes = [root / f"node{i}" for i in range(len(node_roles))]
    specs = []
    for index, (home, roles) in enumerate(zip(homes, node_roles)):
        home.mkdir(parents=True, exist_ok=True)
        if demo_set is None:
            cfg = node_config([] if roles == [AUTO] else roles, str(model), seed=index)
        else:
            demo_set.install(home)
            cfg = node_config(
                [] if roles == [AUTO] else roles,
                str(model),
                task_set=demo_set.manifest.name,
                coordinator=demo_set.coordinator.public.hex(),
                max_new_tokens=demo_set.max_new_tokens,
                seed=index,
            )
        specs.append(launch.NodeLaunch(home=str(home), config=cfg))
    with console.status("starting the first node…"):
        procs = launch.start_bootstrapped(specs, STARTUP_ALLOWANCE_S)
    try:
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn()
        )
        task = progress.add_task("training", total=duration_s)
        t_start: float | None = None
        hard_deadline = time.monotonic() + duration_s + STARTUP_ALLOWANCE_S
        statuses: list[NodeStatus | None] = [None] * len(homes)
        last_line = 0.0

        def view() -> Any:
            return Group(swarm_table(list(zip(names, statuses)), title="murmur demo swarm (loopback)"), progress)

        live = Live(view(), console=console, auto_refresh=False) if tui else None
        if live:
            live.start()
        try:
            for _ in range(int((duration_s + STARTUP_ALLOWANCE_S) * 2) + 10):
                statuses = [p.status() for p in procs]
                now = time.monotonic()
                busy = [s is not None and s.worker in ("training", "generating") for s in statuses]
                if t_start is None and any(busy):
                    t_start = now
                    progress.update(task, description="training")
                elapsed = 0.0 if t_start is None else now - t_start
                progress.update(
                    task, completed=min(duration_s, elapsed), description="training" if t_start else "loading models"
                )
                if live:
                    live.update(view(), refresh=True)
                elif now - last_line >= 10:
                    last_line = now
                    parts = []
                    for n, s in zip(names, statuses):
                        if s is None:
                            parts.append(f"{n}: —")
                        else:
                            reward = "—" if s.reward_now is None else f"{s.reward_now:.2f}"
                            parts.append(f"{n}: {s.worker}, reward {reward}, {s.rollouts_accepted} rollouts accepted")
                    console.print(f"[{elapsed:5.0f}s] " + " | ".join(parts))
                if not all(p.alive() for p in procs):
                    bad = [n for n, p in zip(names, procs) if not p.alive()]
                    console.print(f"[red]node(s) exited early: {', '.join(bad)}[/]")
                    break
                if (
                    (t_start is not None and elapsed >= duration_s)
                    or now >= hard_deadline
                    or shown(node_roles, statuses, until_steps)
                ):
                    break
                time.sleep(0.5)
        finally:
            if live:
                live.stop()
        statuses = [p.status() for p in procs]
    finally:
        launch.stop_all(procs)
    summary = summarize(names, statuses)
    summary["duration_s"] = duration_s
    summary["workdir"] = str(root)
    summary["families"] = family_results(homes, names)
    console.print(summary_table(summary))
    if summary["families"]:
        console.print(family_table(summary["families"]))
    return summary
