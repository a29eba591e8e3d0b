"""Dashboards and the demo summary at 80 columns and in a pipe; peer-chosen strings never parsed as markup."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from rich.console import Console

from murmur.node.cli.demo import summarize, summary_table
from murmur.node.status import DROP_REASONS, DiskView, Drops, LineageView, NodeStatus, PeerView
from murmur.node.ui.dashboard import node_panel, swarm_table
from murmur.node.ui.metrics import Metrics

HOSTILE = ["[/]", "[bold red]x[/", "[link=http://x]y", "\\[/]"]


def _status(i: int, hostile: str = "cpu") -> NodeStatus:
    return NodeStatus(
        peer_id=f"12D3KooWnode{i}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        swarm="murmur-demo",
        roles=["trainer"] if i != 1 else ["follower", "validator"],
        hardware=hostile,
        state="running",
        worker="training",
        serving="ab" * 32,
        serving_reason=hostile,
        peers=[
            PeerView(
                peer_id="12D3KooWpeer" + "y" * 40,
                roles=["trainer", hostile],
                hardware=hostile,
                gen_tokens_per_s=1234.0,
                serving="cd" * 32,
            )
        ],
        lineages=[
            LineageView(
                lineage="ab" * 32,
                name=hostile,
                relation="own",
                head=123456,
                held=123450,
                lag=6,
                need_rollouts_per_s=12.5,
                supply_rollouts_per_s=3.0,
                active=["12D3KooWa" * 3],
                admission="fresh",
                admission_note=hostile,
            )
        ],
        rollouts_produced=1_234_567,
        rollouts_accepted=987_654,
        rejected={"forged_reward": 3, "rate_limited": 12},
        dropped={"worker_inbox_full": 7},
        disk=[DiskView(name="logs", used_mb=3.2, limit_mb=64)],
        worker_error=hostile,
        reward_trend=[0.1, 0.4, 0.8],
        reward_start=0.1,
        reward_now=0.8,
        bytes_up=10**9,
        bytes_down=5 * 10**8,
    )


def _render(obj: object, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(obj)
    return buf.getvalue()


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("width", [80, 160])
def test_node_panel_fits_and_escapes(hostile: str, width: int) -> None:
    text = _render(node_panel(_status(0, hostile)), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text  # nothing truncated: values wrap
    assert hostile in text.replace("\n", "").replace("│", "").replace(" ", "") or hostile.replace(
        " ", ""
    ) in text.replace("\n", "").replace("│", "").replace(" ", "")
    assert "worker_inbox_full 7" in text and "forged_reward 3" in text
    assert "logs 3.2 of 64 MiB" in text


@pytest.mark.parametrize("width", [80, 200])
def test_swarm_and_summary_fit_80_columns_without_cutting_cells(width: int) -> None:
    names = ["node0-trainer", "node1-follower+validator", "node2-trainer"]
    statuses = [_status(0, "[/]"), _status(1), None]
    for obj in (swarm_table(list(zip(names, statuses)), title="swarm"), summary_table(summarize(names, statuses))):
        text = _render(obj, width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text
        assert "1234567" in text and "987654" in text  # counts shown whole
        assert "not answering" in text
    assert "counts" in _render(swarm_table(list(zip(names, statuses))), 80)  # the legend says what numbers are


def test_summary_in_a_pipe_at_80_columns() -> None:
    """A real pipe: rich falls back to 80 columns; the summary still shows every cell whole."""
    code = (
        "from murmur.node.cli.demo import summary_table, summarize\n"
        "from tests.test_dashboard_layout import _status\n"
        "from rich.console import Console\n"
        "Console().print(summary_table(summarize(['node0-trainer', 'node1-follower+validator'], "
        "[_status(0), _status(1)])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0] if sys.path[0] else ".", "COLUMNS": "80"},
    )
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80
    assert "…" not in out.stdout and "1234567" in out.stdout


def test_drop_reasons_in_status_and_metrics() -> None:
    d = Drops()
    d.add("announce_unpublished")
    d.add("task_set_refused", 2)
    d.from_worker({"worker_inbox_full": 5, "below_min_version": -1, "invented": 9})
    view = d.view(worker_queue_full=4)
    assert view == {"announce_unpublished": 1, "task_set_refused": 2, "worker_inbox_full": 5, "worker_queue_full": 4}
    with pytest.raises(KeyError):
        d.add("not_a_reason")
    m = Metrics()
    m.update(NodeStatus(dropped=view, disk=[DiskView(name="ledger", used_mb=2.0)]))
    from prometheus_client import generate_latest

    body = generate_latest(m.registry).decode()
    assert 'murmur_dropped_total{reason="worker_inbox_full"} 5.0' in body
    assert all(f'murmur_dropped_total{{reason="{r}"}}' in body for r in DROP_REASONS)
    assert 'murmur_disk_bytes{budget="ledger"} 2.097152e+06' in body


def test_every_drop_reason_and_disk_key_is_documented() -> None:
    from pathlib import Path

    from murmur.node.config import DiskSection

    doc = (Path(__file__).resolve().parents[1] / "docs" / "volunteer.md").read_text()
    for reason in DROP_REASONS:
        assert f"`{reason}`" in doc, reason
    for key in DiskSection.__struct_fields__:
        assert f"`disk.{key}`" in doc, key
