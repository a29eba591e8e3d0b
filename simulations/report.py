"""Run reports: metrics rows (JSONL or CSV) plus an HTML page of PNG plots.

Every simulator and emulator run writes the same folder layout, so one plot
code path serves both and a report can be rebuilt later from its metrics
alone (`murmur simulate report DIR`):

    <dir>/scenario.toml      the scenario that ran (repeat the run from it)
    <dir>/metrics.jsonl      one JSON object per row, with a "kind" field
      or metrics-<kind>.csv  one CSV per kind (format = "csv")
    <dir>/summary.json       headline numbers
    <dir>/index.html         the page; <dir>/*.png its plots

Row kinds and their fields (docs/researcher.md lists them too):
  reward     t, node, reward, isolated, version, group       (reward over time)
  lag        t, node, lag                                    (follower version lag)
  staleness  t, node, staleness                              (age of consumed rollouts, versions)
  broadcast  n, receiver, completion_s, lower_bound_s, bytes (one per receiver per broadcast)
  bytes      node, group, bytes_up, bytes_down               (totals at the end)
  rejection  t, node, peer, reason                           (one per rejected message)
  score      t, peer, behaviour, score                       (mean score honest peers give an adversary)
  event      t, node, action                                 (joins, leaves, restarts, bans)
"""

from __future__ import annotations

import csv
import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from murmur.gossip.errors import MurmurError

KINDS = ("reward", "lag", "staleness", "broadcast", "bytes", "rejection", "score", "event")


class MetricsWriter:
    """Append-only metrics rows, streamed to disk as they come (a crash keeps what was written)."""

    def __init__(self, out_dir: str | Path, fmt: str = "jsonl") -> None:
        if fmt not in ("jsonl", "csv"):
            raise MurmurError(f"metrics format must be jsonl or csv, not {fmt!r}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        self.rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._jsonl = open(self.dir / "metrics.jsonl", "w", encoding="utf-8") if fmt == "jsonl" else None
        self._csv: dict[str, tuple[Any, csv.DictWriter]] = {}

    def add(self, kind: str, **fields: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown metrics kind {kind!r}")
        self.rows[kind].append(fields)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
        else:
            ent = self._csv.get(kind)
            if ent is None:
                f = open(self.dir / f"metrics-{kind}.csv", "w", newline="", encoding="utf-8")
                w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
                w.writeheader()
                ent = self._csv[kind] = (f, w)
            ent[1].writerow(fields)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for f, _ in self._csv.values():
            f.close()
        self._csv.clear()


def _num(v: str) -> Any:
    if v == "":
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v in ("True", "False"):
        return v == "True"
    return v


def load_metrics(out_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Rows by kind from a report folder (JSONL or CSV)."""
    d = Path(out_dir)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    j = d / "metrics.jsonl"
    if j.is_file():
        for n, line in enumerate(j.read_text("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                kind = obj.pop("kind")
            except (ValueError, KeyError, AttributeError):
                raise MurmurError(f"{j}:{n}: not a metrics row") from None
            rows[kind].append(obj)
        return rows
    csvs = sorted(d.glob("metrics-*.csv"))
    if not csvs:
        raise MurmurError(f"{d}: no metrics.jsonl or metrics-*.csv here")
    for p in csvs:
        kind = p.stem[len("metrics-") :]
        with open(p, newline="", encoding="utf-8") as f:
            rows[kind] = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return rows


# ------------------------------------------------------------------ plots


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path.name


def _bin_mean(points: Iterable[tuple[float, float]], width: float) -> tuple[list[float], list[float]]:
    acc: dict[int, list[float]] = defaultdict(list)
    for t, v in points:
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            acc[int(t // width)].append(v)
    keys = sorted(acc)
    return [(k + 0.5) * width for k in keys], [sum(acc[k]) / len(acc[k]) for k in keys]


def plot_reward(rows: list[dict[str, Any]], path: Path) -> str | None:
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_node: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        by_node[r["node"]].append((r["t"], r["reward"]))
    for _, pts in sorted(by_node.items(), key=lambda kv: str(kv[0]))[:64]:
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.6, alpha=0.35)
    tmax = max(r["t"] for r in rows) or 1.0
    width = max(tmax / 40, 1e-9)
    xs, ys = _bin_mean(((r["t"], r["reward"]) for r in rows), width)
    ax.plot(xs, ys, lw=2.5, color="black", label="swarm (mean over nodes)")
    iso = [(r["t"], r["isolated"]) for r in rows if r.get("isolated") is not None]
    if iso:
        xs, ys = _bin_mean(iso, width)
        ax.plot(xs, ys, lw=2.0, ls="--", color="tab:red", label="isolated (same nodes, no swarm)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("reward")
    ax.set_title("Reward over time: each node (thin), swarm vs isolated")
    ax.legend(loc="lower right")
    return save_figure(fig, path)


def plot_staleness(lag: list[dict[str, Any]], stale: list[dict[str, Any]], path: Path) -> str | None:
    if not lag and not stale:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, data, title in (
        (axes[0], [r["lag"] for r in lag], "follower version lag"),
        (axes[1], [r["staleness"] for r in stale], "staleness of consumed rollouts"),
    ):
        if data:
            top = max(data)
            ax.hist(data, bins=range(int(top) + 2), color="tab:blue", edgecolor="white", align="left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        ax.set_xlabel("versions behind")
        ax.set_ylabel("count")
        ax.set_title(title)
    return save_figure(fig, path)


def plot_broadcast(rows: list[dict[str, Any]], path: Path) -> str | None:
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_n: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_n[r["n"]].append(r)
    for n, rs in sorted(by_n.items()):
        times = sorted(
            r["completion_s"] for r in rs if r["completion_s"] is not None and math.isfinite(r["completion_s"])
        )
        if not times:
            continue
        line = ax.plot(times, [(i + 1) / len(rs) for i in range(len(times))], label=f"broadcast {n}: receivers")
        lb = rs[0].get("lower_bound_s")
        if lb:
            ax.axvline(lb, ls="--", color=line[0].get_color(), lw=1.0, label=f"broadcast {n}: lower bound T*")
    ax.set_xlabel("completion time (s)")
    ax.set_ylabel("fraction of receivers done")
    ax.set_title("Patch broadcast completion vs the lower bound")
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


def plot_bytes(rows: list[dict[str, Any]], path: Path) -> str | None:
    if not rows:
        return None
    plt = pyplot()
    rows = sorted(rows, key=lambda r: r["node"])[:128]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.25), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["bytes_up"] / 2**20 for r in rows], width=0.4, label="up")
    ax.bar([x + 0.2 for x in xs], [r["bytes_down"] / 2**20 for r in rows], width=0.4, label="down")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([str(r["node"]) for r in rows], fontsize=6, rotation=90)
    ax.set_xlabel("node")
    ax.set_ylabel("MiB on the wire")
    ax.set_title("Bytes on the wire per node")
    ax.legend()
    return save_figure(fig, path)


def plot_rejections(rows: list[dict[str, Any]], path: Path) -> str | None:
    if not rows:
        return None
    plt = pyplot()
    c = Counter(r["reason"] for r in rows)
    reasons = sorted(c, key=lambda k: -c[k])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(reasons, [c[r] for r in reasons], color="tab:red")
    ax.invert_yaxis()
    ax.set_xlabel("rejected messages (all receivers)")
    ax.set_title("Rejections by reason")
    return save_figure(fig, path)


def plot_scores(rows: list[dict[str, Any]], path: Path, threshold: float | None = None) -> str | None:
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_peer: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    label: dict[Any, str] = {}
    for r in rows:
        by_peer[r["peer"]].append((r["t"], r["score"]))
        label[r["peer"]] = f"{r['peer']} ({r.get('behaviour', '')})"
    for peer, pts in by_peer.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label[peer])
    if threshold is not None:
        ax.axhline(threshold, color="grey", ls=":", label="graylist threshold")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mean score given by honest peers")
    ax.set_title("Adversary scores over time")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


# ------------------------------------------------------------------ page


def _summary_table(summary: dict[str, Any]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in summary.items()
        if not isinstance(v, (dict, list))
    )
    return f"<table>{cells}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(
    out_dir: str | Path,
    rows: dict[str, list[dict[str, Any]]],
    summary: dict[str, Any],
    scenario_toml: str | None = None,
    title: str = "Murmur simulation",
    notes: str = "",
    threshold: float | None = None,
    plots: bool = True,
) -> Path:
    """Write summary.json, the PNG plots and index.html; returns the HTML path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    if scenario_toml is not None:
        (d / "scenario.toml").write_text(scenario_toml, "utf-8")
    (d / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str), "utf-8")
    images: list[tuple[str, str]] = []
    if plots:
        for caption, make in (
            ("Reward over time", lambda: plot_reward(rows.get("reward", []), d / "reward.png")),
            (
                "Version lag and staleness",
                lambda: plot_staleness(rows.get("lag", []), rows.get("staleness", []), d / "staleness.png"),
            ),
            ("Broadcast completion", lambda: plot_broadcast(rows.get("broadcast", []), d / "broadcast.png")),
            ("Bytes on the wire", lambda: plot_bytes(rows.get("bytes", []), d / "bytes.png")),
            ("Rejections by reason", lambda: plot_rejections(rows.get("rejection", []), d / "rejections.png")),
            ("Adversary scores", lambda: plot_scores(rows.get("score", []), d / "scores.png", threshold)),
        ):
            name = make()
            if name:
                images.append((caption, name))
    body = [f"<h1>{html.escape(title)}</h1>"]
    if notes:
        body.append(f"<p>{html.escape(notes)}</p>")
    body.append("<h2>Summary</h2>" + _summary_table(summary))
    for caption, name in images:
        body.append(f'<h2>{html.escape(caption)}</h2><img src="{html.escape(name)}" alt="{html.escape(caption)}">')
    if scenario_toml is not None:
        body.append("<h2>Scenario</h2><pre>" + html.escape(scenario_toml) + "</pre>")
    page = (
        '<!doctype html><html><head><meta charset="utf-8"><title>' + html.escape(title) + "</title>"
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        "img{max-width:100%}pre{background:#f4f4f4;padding:8px}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )
    out = d / "index.html"
    out.write_text(page, "utf-8")
    return out


def rebuild(out_dir: str | Path) -> Path:
    """Regenerate plots and index.html from a report folder's metrics."""
    d = Path(out_dir)
    rows = load_metrics(d)
    summary = json.loads((d / "summary.json").read_text("utf-8")) if (d / "summary.json").is_file() else {}
    toml = (d / "scenario.toml").read_text("utf-8") if (d / "scenario.toml").is_file() else None
    return write_report(
        d,
        rows,
        summary,
        toml,
        title=str(summary.get("title", "Murmur simulation")),
        threshold=summary.get("graylist_threshold"),
    )
