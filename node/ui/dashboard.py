"""Terminal dashboards rendered from NodeStatus snapshots (rich): one node, or a whole demo swarm.

Rendering is a pure function of the snapshot, so what the dashboard shows is
exactly what `murmur node status` and the metrics report. Every string a peer
chose (hardware, lineage names, errors) is put in as `Text`, never parsed as
rich markup. Layouts fit 80 columns: key/value blocks, per-node columns, and
wide tables only where the console is wide enough (`Adaptive`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from murmur.node.status import NodeStatus, PeerView
from murmur.sync.ids import Relation
from murmur.sync.staleness import Admission

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 30) -> str:
    vals = [v for v in values if v is not None and not math.isnan(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, int((v - lo) / span * (len(_BARS) - 1)))] for v in vals)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def short(peer_or_hex: str, n: int = 10) -> str:
    return peer_or_hex[-n:] if peer_or_hex.startswith("12D3") else peer_or_hex[:n]


def _fmt_reward(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


WIDE = 120  # columns from which the lineage and peer tables are shown as tables rather than stacked


class Adaptive:
    """A renderable that picks its layout from the width it is given (a pipe or CI log gets 80)."""

    def __init__(
        self, wide: Callable[[], RenderableType], narrow: Callable[[], RenderableType], min_wide: int = WIDE
    ) -> None:
        self.wide, self.narrow, self.min_wide = wide, narrow, min_wide

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        yield self.wide() if options.max_width >= self.min_wide else self.narrow()


def _kv(rows: Sequence[tuple[str, str | Text]]) -> Table:
    """Label/value lines: fits any width, values wrap instead of being cut."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for label, value in rows:
        t.add_row(label, value if isinstance(value, Text) else Text(value))
    return t


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"


def _lineage_lines(s: NodeStatus) -> RenderableType:
    rows = []
    for lin in s.lineages:
        parts = [lin.relation, f"held {lin.held} of head {lin.head} (lag {lin.lag})"]
        if lin.admission:
            parts.append(f"admission {lin.admission}")
        if lin.relation == Relation.OWN:
            parts.append(f"need {lin.need_rollouts_per_s:.1f}/s, supply {lin.supply_rollouts_per_s:.1f}/s")
            parts.append(f"active {', '.join(short(p) for p in lin.active) or '—'}")
            if lin.standby:
                parts.append(f"standby {', '.join(short(p) for p in lin.standby)}")
        rows.append((short(lin.lineage), Text(f"{lin.name}: " + " · ".join(parts))))
    return _kv(rows or [("—", "no lineage yet")])


def _lineage_table(s: NodeStatus) -> Table:
    lins = Table(
        "lineage",
        "name",
        "relation",
        "held",
        "head",
        "lag",
        "admission",
        "need/s",
        "supply/s",
        "active",
        "standby",
        title="lineages",
        expand=True,
    )
    for lin in s.lineages:
        lins.add_row(
            short(lin.lineage),
            Text(lin.name),
            lin.relation,
            str(lin.held),
            str(lin.head),
            str(lin.lag),
            lin.admission or "",
            f"{lin.need_rollouts_per_s:.1f}" if lin.relation == Relation.OWN else "",
            f"{lin.supply_rollouts_per_s:.1f}" if lin.relation == Relation.OWN else "",
            ", ".join(short(p) for p in lin.active),
            ", ".join(short(p) for p in lin.standby),
        )
    return lins


def _peer_cells(p: PeerView) -> list[str | Text]:
    return [
        short(p.peer_id),
        Text(", ".join(p.roles)),
        Text(p.hardware),
        f"{p.gen_tokens_per_s:.0f}",
        f"{p.rollout_latency_s:.2f} s",
        short(p.serving) if p.serving else "—",
        f"{p.last_seen_s:.0f} s ago",
    ]


def _peer_lines(s: NodeStatus) -> RenderableType:
    rows = []
    for p in s.peers[:16]:
        c = _peer_cells(p)
        rows.append((str(c[0]), Text(f"{c[1]} · {c[2]} · {c[3]} tok/s · {c[4]}/rollout · serves {c[5]} · seen {c[6]}")))
    return _kv(rows or [("—", "no peers")])


def _peer_table(s: NodeStatus) -> Table:
    peers = Table(
        "peer", "roles", "hardware", "tok/s", "latency", "serves", "seen", title=f"peers ({len(s.peers)})", expand=True
    )
    for p in s.peers[:16]:
        peers.add_row(*_peer_cells(p))
    return peers


def _exchange(s: NodeStatus) -> str:
    x = s.exchange
    r = x.rates
    return (
        f"shards {','.join(map(str, x.subscribed)) or '—'} of {x.shards}; per s: received "
        f"{r.get('received_rollouts_per_s', 0):.1f}, verified {r.get('verified_rollouts_per_s', 0):.1f}, "
        f"dropped {r.get('dropped_batches_per_s', 0):.1f} batches; used/verified {x.used_over_verified:.2f}; "
        f"{x.distinct_producers} producers"
        + f"; kept local: {x.uninformative_rollouts} uninformative"
        + (
            f", {x.withheld_rollouts} over the publish budget of {x.publish_budget_per_s:.1f}/s"
            if x.publish_budget_per_s is not None
            else ""
        )
        + (
            f"; sample {x.sample_fraction:.0%} + {x.sample_floor_per_min:g}/min a producer "
            f"(checked {x.sample_rate:.0%}, {x.unsampled_batches} batches unverified)"
            if x.sample_rate is not None and x.sample_fraction is not None
            else ""
        )
        + f"; groups generated {x.groups_generated}, sent {x.groups_sent}, trained {x.groups_trained}"
    )


def roles_line(s: NodeStatus) -> str:
    """The roles, and why: chosen by the swarm's need (with the switches so far), configured, or the hardware's."""
    roles = ", ".join(s.roles) or "—"
    how = (
        "chosen by the swarm's need" + (f", switched {s.role_switches}×" if s.role_switches else "")
        if s.roles_chosen
        else ""
    )
    why = "; ".join(x for x in (how, s.roles_reason) if x)
    return f"{roles}  ({why})" if why else roles


def node_panel(s: NodeStatus) -> Panel:
    serving = short(s.serving) if s.serving else "—"
    if any(lin.on_trial and lin.lineage == s.serving for lin in s.lineages):  # the worker still serves `following`
        serving += f" on trial; worker follows {short(s.following) if s.following else '—'}"
    rows: list[tuple[str, str | Text]] = [
        ("peer", s.peer_id),
        ("roles", Text(roles_line(s))),
        (
            "state",
            f"{s.state} / worker {s.worker}"
            + (f" (restarted {s.worker_restarts}×)" if s.worker_restarts else "")
            + f", up {s.uptime_s:.0f} s",
        ),
        ("serving", Text(f"{serving}  ({s.serving_reason})" if s.serving_reason else serving)),
        ("hardware", Text(s.hardware)),
        ("reward", f"{_fmt_reward(s.reward_start)} → {_fmt_reward(s.reward_now)}  {sparkline(s.reward_trend)}"),
        ("memory", f"{s.memory_rss_mb:.0f} of {s.memory_budget_mb} MiB"),
        ("gen", f"{s.gen_tokens_per_s:.0f} tok/s, {s.rollout_latency_s:.2f} s per rollout"),
        ("patch bytes", f"up {human_bytes(s.bytes_up)}, down {human_bytes(s.bytes_down)}"),
        ("reach", Text(f"{s.reach.path} ({s.reach.status}): {s.reach.reason}")),
        ("engine", Text(s.engine or "—")),
    ]
    note = next((lin.admission_note for lin in s.lineages if lin.lineage == s.serving and lin.admission_note), "")
    if note:
        rows.append(("staleness", Text(note)))
    if s.worker_error:
        rows.append(("error", Text(s.worker_error, style="red")))
    rows += [
        (
            "rollouts",
            f"made {s.exchange.produced_rollouts} since start, signed {s.rollouts_produced}, published "
            f"{s.rollouts_published}, received "
            f"{s.rollouts_received}, accepted {s.rollouts_accepted}, used in training {s.rollouts_used}",
        ),
        ("exchange", Text(_exchange(s))),
        (
            "swarm gives",
            f"{s.external_groups_per_step:.1f} groups per step from "
            f"{s.external_lineages_per_step:.1f} lineages, {s.updates_per_step:.1f} updates per step; "
            f"used {s.rollouts_used} of {s.rollouts_accepted} verified"
            + (f" ({s.used_over_verified:.0%})" if s.used_over_verified is not None else ""),
        ),
        (
            "held-out",
            "—"
            if s.heldout_now is None
            else f"{s.heldout_start:.2f} → {s.heldout_now:.2f} greedy accuracy ({len(s.heldout_trend)} checks)",
        ),
        ("rejected", Text(_counts(s.rejected))),
        ("spot checks", f"{s.spot_checked} of {s.spot_eligible} checkable ({s.spot_failed} failed)"),
        ("dropped", Text(_counts(s.dropped))),
        (
            "disk",
            "; ".join(
                f"{d.name} {d.used_mb:.1f}" + (f" of {d.limit_mb:.0f}" if d.limit_mb else "") + " MiB" for d in s.disk
            )
            or "—",
        ),
    ]
    body = Group(
        _kv(rows),
        Text(""),
        Text("lineages", style="bold"),
        Adaptive(lambda: _lineage_table(s), lambda: _lineage_lines(s)),
        Text(f"peers ({len(s.peers)})", style="bold"),
        Adaptive(lambda: _peer_table(s), lambda: _peer_lines(s)),
    )
    return Panel(body, title=Text(f"murmur node · {s.swarm}"), border_style="cyan")


SWARM_LEGEND = (
    "version: held version (lag behind the announced head); rollouts: counts, not rates; "
    "accepted/rejected: peers' rollouts this node verified; patches: bytes up/down"
)


def swarm_table(statuses: Sequence[tuple[str, NodeStatus | None]], title: str = "swarm") -> Table:
    """The demo's live view: one column per node, one row per measure, so it fits 80 columns for a few nodes."""
    t = Table(title=title, caption=SWARM_LEGEND, show_lines=False)
    t.add_column("", style="bold", no_wrap=True)
    for name, _ in statuses:
        t.add_column(Text(name.replace("-", " ")), overflow="fold")
    cells: dict[str, list[str | Text]] = {
        k: []
        for k in (
            "roles",
            "worker",
            "lineage",
            "version",
            "reward",
            "trend",
            "rollouts made",
            "accepted",
            "rejected",
            "dropped",
            "patches ↑/↓",
        )
    }
    for _name, s in statuses:
        if s is None:
            for k in cells:
                cells[k].append("not answering" if k == "worker" else "—")
            continue
        # a trainer turned follower keeps its lineage (relation own) on disk: it shows what it serves now
        own = next((lin for lin in s.lineages if lin.relation == Relation.OWN), None) if "trainer" in s.roles else None
        fol = next((lin for lin in s.lineages if lin.lineage == s.serving), None)
        lin = own or fol
        where = f"own {short(own.lineage, 8)}" if own else (f"→ {short(s.serving, 8)}" if s.serving else "—")
        if fol is not None and fol.on_trial:
            where += " (on trial)"
        elif fol is not None and fol.admission == Admission.STALE:
            where += " (stale: paused, catching up)"
        elif not own and s.serving_reason:
            where += f" ({s.serving_reason[:40]})"
        cells["roles"].append(",".join(s.roles) + (f" (auto, {s.role_switches}×)" if s.roles_chosen else ""))
        cells["worker"].append(s.worker)
        cells["lineage"].append(Text(where))
        cells["version"].append(f"{lin.held} (lag {lin.lag})" if lin else "—")
        cells["reward"].append(f"{_fmt_reward(s.reward_start)}→{_fmt_reward(s.reward_now)}")
        cells["trend"].append(sparkline(s.reward_trend, 16))
        cells["rollouts made"].append(str(s.rollouts_produced))
        cells["accepted"].append(str(s.rollouts_accepted))
        cells["rejected"].append(str(sum(s.rejected.values())))
        cells["dropped"].append(str(sum(s.dropped.values())))
        cells["patches ↑/↓"].append(f"{human_bytes(s.bytes_up)}/{human_bytes(s.bytes_down)}")
    for label, row in cells.items():
        t.add_row(label, *row)
    return t
