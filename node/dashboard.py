"""Terminal dashboards rendered from NodeStatus snapshots (rich): one node, or a whole demo swarm.

Rendering is a pure function of the snapshot, so what the dashboard shows is
exactly what `murmur node status` and the metrics report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from node.status import NodeStatus

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


def node_panel(s: NodeStatus) -> Panel:
    head = Table.grid(padding=(0, 2))
    head.add_row("peer", s.peer_id, "roles", ", ".join(s.roles) or "—")
    head.add_row("state", f"{s.state} / worker {s.worker}", "uptime", f"{s.uptime_s:.0f} s")
    serving = short(s.serving) if s.serving else "—"
    head.add_row("serving", f"{serving}  ({s.serving_reason})" if s.serving_reason else serving, "hardware", s.hardware)
    head.add_row("reward", f"{_fmt_reward(s.reward_start)} → {_fmt_reward(s.reward_now)}  {sparkline(s.reward_trend)}",
                 "memory", f"{s.memory_rss_mb:.0f} / {s.memory_budget_mb} MiB")
    head.add_row("bytes", f"up {human_bytes(s.bytes_up)}  down {human_bytes(s.bytes_down)}",
                 "gen", f"{s.gen_tokens_per_s:.0f} tok/s, {s.rollout_latency_s:.2f} s/rollout")
    head.add_row("reach", f"{s.reach.path} ({s.reach.status}): {s.reach.reason}", "", "")
    head.add_row("engine", s.engine or "—", "", "")
    note = next((lin.admission_note for lin in s.lineages if lin.lineage == s.serving and lin.admission_note), "")
    if note:
        head.add_row("staleness", note, "", "")
    if s.worker_error:
        head.add_row("error", Text(s.worker_error, style="red"), "", "")

    lins = Table("lineage", "name", "relation", "held", "head", "lag", "admission", "need/s", "supply/s", "active",
                 "standby", title="lineages", expand=True)
    for lin in s.lineages:
        lins.add_row(short(lin.lineage), lin.name, lin.relation, str(lin.held), str(lin.head), str(lin.lag),
                     lin.admission or "",
                     f"{lin.need_rollouts_per_s:.1f}" if lin.relation == "own" else "",
                     f"{lin.supply_rollouts_per_s:.1f}" if lin.relation == "own" else "",
                     ", ".join(short(p) for p in lin.active), ", ".join(short(p) for p in lin.standby))

    roll = Table("produced", "published", "received", "accepted", "used", "rejected (by reason)", "spot checks",
                 title="rollouts", expand=True)
    rej = ", ".join(f"{k} {v}" for k, v in sorted(s.rejected.items())) or "0"
    roll.add_row(str(s.rollouts_produced), str(s.rollouts_published), str(s.rollouts_received),
                 str(s.rollouts_accepted), str(s.rollouts_used), rej, f"{s.spot_checked} ({s.spot_failed} failed)")

    peers = Table("peer", "roles", "hardware", "tok/s", "latency", "serves", "seen", title=f"peers ({len(s.peers)})",
                  expand=True)
    for p in s.peers[:16]:
        peers.add_row(short(p.peer_id), ", ".join(p.roles), p.hardware, f"{p.gen_tokens_per_s:.0f}",
                      f"{p.rollout_latency_s:.2f} s", short(p.serving) if p.serving else "—", f"{p.last_seen_s:.0f} s ago")
    return Panel(Group(head, lins, roll, peers), title=f"murmur node · {s.swarm}", border_style="cyan")


def swarm_table(statuses: Sequence[tuple[str, NodeStatus | None]], title: str = "swarm") -> Table:
    """One row per node: the demo's live view."""
    t = Table("node", "roles", "worker", "lineage / serving", "version", "lag", "reward", "trend", "produced",
              "accepted", "rejected", "patch bytes ↑/↓", title=title, expand=True)
    for name, s in statuses:
        if s is None:
            t.add_row(name, "—", "not answering", "", "", "", "", "", "", "", "", "")
            continue
        own = next((lin for lin in s.lineages if lin.relation == "own"), None)
        fol = next((lin for lin in s.lineages if lin.lineage == s.serving), None)
        lin = own or fol
        where = f"own {short(own.lineage, 8)}" if own else (f"→ {short(s.serving, 8)}" if s.serving else "—")
        if fol is not None and fol.admission == "stale":
            where += " (stale: paused, catching up)"
        elif not own and s.serving_reason:
            where += f" ({s.serving_reason[:40]})"
        t.add_row(name, ",".join(s.roles), s.worker, where, str(lin.held) if lin else "—", str(lin.lag) if lin else "—",
                  f"{_fmt_reward(s.reward_start)}→{_fmt_reward(s.reward_now)}", sparkline(s.reward_trend, 20),
                  str(s.rollouts_produced), str(s.rollouts_accepted), str(sum(s.rejected.values())),
                  f"{human_bytes(s.bytes_up)}/{human_bytes(s.bytes_down)}")
    return t
