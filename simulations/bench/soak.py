"""`murmur bench soak`: a local swarm left running for N minutes; does memory, disk or the error count grow?

Three real `murmur node start` processes on loopback (a trainer, a follower+validator and a
second trainer, the demo's configuration plus a small log budget) run for `minutes` after the
first node starts working. Every `SAMPLE_S` the harness measures each node from outside:
resident memory of the node process and its children (psutil), the bytes under its home, and
its status over the control socket. The warm-up before the "start" figures is 5 minutes, or a
quarter of the run when that is shorter (`warmup_s` in the output says which was used).
Worker restarts are the node's own count (`worker_restarts` in its status). An error is a log
line at error level, or a Python traceback, in the node's stderr log. RSS is also split into the
network process and its children (worker, verifier pool) to show where growth happens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from murmur.node.cli import demo, launch
from murmur.node.status import NodeStatus

ROLES = [["trainer"], ["follower", "validator"], ["trainer"]]
SAMPLE_S = 10.0
WARMUP_S = 300.0
LATE_WINDOW_S = 600.0  # "still advancing" is checked over the last 10 minutes (or the last half of a shorter run)
DISK_CONFIG = {"logs_max_mb": 16, "ledger_max_rows": 50000, "ledger_payload_rows": 1000}


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """RSS in MiB of a process, and of its descendants together."""
    try:
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
        own = p.memory_info().rss
    except psutil.Error:
        return 0.0, 0.0
    children = 0
    for k in kids:
        try:
            children += k.memory_info().rss
        except psutil.Error:
            pass
    return own / 2**20, children / 2**20


def disk_mb(home: Path) -> dict[str, float]:
    """Bytes under a node home by part: the state database, lineage stores, partial downloads, logs, the rest."""
    parts = {"state_db": 0, "lineages": 0, "partial": 0, "logs": 0, "other": 0}
    for root, _dirs, files in os.walk(home):
        rel = Path(root).relative_to(home).parts
        for f in files:
            try:
                n = (Path(root) / f).stat().st_size
            except OSError:
                continue
            if not rel and f.startswith("state.db"):
                parts["state_db"] += n
            elif not rel and (f.startswith("node.log") or f == "stderr.log"):
                parts["logs"] += n
            elif rel and rel[0] == "partial":
                parts["partial"] += n
            elif rel and rel[0] == "lineages":
                parts["lineages"] += n
            else:
                parts["other"] += n
    out = {k: round(v / 2**20, 2) for k, v in parts.items()}
    out["total"] = round(sum(parts.values()) / 2**20, 2)
    return out


def count_errors(home: Path) -> int:
    n = 0
    try:
        with open(home / "stderr.log", "rb") as f:
            for line in f:
                if line.startswith(b"Traceback"):
                    n += 1
                elif b'"level": "error"' in line or b'"level":"error"' in line:
                    n += 1
    except OSError:
        pass
    return n


def _progress(s: NodeStatus | None) -> tuple[int, int]:
    return (0, 0) if s is None else (s.steps, s.versions_applied)


def run(minutes: float = 60.0, workdir: Path | None = None) -> dict[str, Any]:
    duration = minutes * 60.0
    warmup = min(WARMUP_S, duration / 4)
    late = min(LATE_WINDOW_S, duration / 2)
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="murmur-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    model = launch.build_tiny_model(root)
    names = [f"node{i}-{'+'.join(r)}" for i, r in enumerate(ROLES)]
    homes = [root / f"node{i}" for i in range(len(ROLES))]
    specs = [
        launch.NodeLaunch(home=str(h), config={**demo.node_config(roles, str(model)), "disk": DISK_CONFIG})
        for h, roles in zip(homes, ROLES)
    ]
    rss_start: list[float | None] = [None] * len(ROLES)
    parts_start: list[tuple[float, float] | None] = [None] * len(ROLES)
    parts_now = [(0.0, 0.0)] * len(ROLES)
    disk_start: list[dict[str, float] | None] = [None] * len(ROLES)
    late_mark: list[tuple[int, int] | None] = [None] * len(ROLES)
    rss_now = [0.0] * len(ROLES)
    statuses: list[NodeStatus | None] = [None] * len(ROLES)
    exited: list[str] = []
    t0: float | None = None
    procs = launch.start_bootstrapped(specs, demo.STARTUP_ALLOWANCE_S)
    try:
        hard_deadline = time.monotonic() + duration + demo.STARTUP_ALLOWANCE_S + 60
        next_sample = time.monotonic()
        while time.monotonic() < hard_deadline:
            time.sleep(max(0.0, next_sample - time.monotonic()))
            next_sample += SAMPLE_S
            now = time.monotonic()
            statuses = [p.status() for p in procs]
            for i, p in enumerate(procs):
                parts_now[i] = tree_rss_mb(p.pid)
                rss_now[i] = sum(parts_now[i])
            if t0 is None and any(s is not None and s.worker in ("training", "generating") for s in statuses):
                t0 = now
            if t0 is None:
                continue
            elapsed = now - t0
            if elapsed >= warmup:
                for i in range(len(ROLES)):
                    if rss_start[i] is None:
                        rss_start[i], parts_start[i] = rss_now[i], parts_now[i]
                        disk_start[i] = disk_mb(homes[i])
            if elapsed >= duration - late:
                for i in range(len(ROLES)):
                    if late_mark[i] is None:
                        late_mark[i] = _progress(statuses[i])
            exited = [n for n, p in zip(names, procs) if not p.alive()]
            print(
                json.dumps(
                    {
                        "t_s": round(elapsed),
                        "rss_mb": [round(r) for r in rss_now],
                        "steps": [_progress(s)[0] for s in statuses],
                        "applied": [_progress(s)[1] for s in statuses],
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
            if exited or elapsed >= duration:
                break
    finally:
        launch.stop_all(procs)
    end = [disk_mb(h) for h in homes]
    rejected: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for s in statuses:
        for k, v in (s.rejected if s else {}).items():
            rejected[k] = rejected.get(k, 0) + v
        for k, v in (s.dropped if s else {}).items():
            dropped[k] = dropped.get(k, 0) + v
    growth = [now / start - 1 for now, start in zip(rss_now, rss_start) if start]
    steps_end = [_progress(s)[0] for s in statuses]
    applied_end = [_progress(s)[1] for s in statuses]
    return {
        "minutes": minutes,
        "measured_s": round(time.monotonic() - t0, 1) if t0 is not None else 0.0,
        "warmup_s": warmup,
        "nodes": names,
        "exited_early": exited,
        "rss_mb_start": {n: None if r is None else round(r, 1) for n, r in zip(names, rss_start)},
        "rss_mb_end": {n: round(r, 1) for n, r in zip(names, rss_now)},
        "rss_growth": round(max(growth), 4) if growth else None,
        "disk_mb_start": {n: d for n, d in zip(names, disk_start)},
        "disk_mb_end": {n: d for n, d in zip(names, end)},
        "rss_mb_parts_start": {
            n: None if p is None else {"network": round(p[0], 1), "children": round(p[1], 1)}
            for n, p in zip(names, parts_start)
        },
        "rss_mb_parts_end": {
            n: {"network": round(p[0], 1), "children": round(p[1], 1)} for n, p in zip(names, parts_now)
        },
        "worker_restarts": {n: (s.worker_restarts if s is not None else None) for n, s in zip(names, statuses)},
        "errors": {n: count_errors(h) for n, h in zip(names, homes)},
        "rejected": rejected,
        "dropped": dropped,
        "steps": dict(zip(names, steps_end)),
        "versions_applied": dict(zip(names, applied_end)),
        "late_window_s": late,
        "steps_in_late_window": {n: e - m[0] for n, e, m in zip(names, steps_end, late_mark) if m is not None},
        "versions_applied_in_late_window": {
            n: e - m[1] for n, e, m in zip(names, applied_end, late_mark) if m is not None
        },
        "workdir": str(root),
    }
