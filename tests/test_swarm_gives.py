"""What the swarm gives a trainer, as a volunteer sees it: the worker's step reports (external groups and
rows trained, their lineages, updates, held-out accuracy) through the node core into `murmur node status`,
the dashboard, the demo summary and the Prometheus metrics."""

from __future__ import annotations

import io

from prometheus_client import generate_latest
from rich.console import Console

from murmur.node.cli.demo import summarize, summary_table
from murmur.node.core import machine as C
from murmur.node.status import NodeStatus
from murmur.node.ui.dashboard import node_panel
from murmur.node.ui.metrics import Metrics
from tests.test_core import W, make_core


def _step(
    k: int, used: int, groups: int, lineages: int, updates: int, heldout: float | None = None, trained: int = 0
) -> C.FromWorker:
    return W(
        "step",
        {
            "step": k,
            "version": k,
            "reward_mean": 0.5,
            "loss": 0.1,
            "n_external_groups": 9,
            "step_s": 0.1,
            "used": used,
            "external_groups": groups,
            "external_lineages": lineages,
            "updates": updates,
            "heldout": heldout,
            "trained_groups": trained,
        },
    )


def test_the_core_counts_what_entered_updates_not_what_was_collected() -> None:
    core, _ = make_core(roles=("trainer",), group_size=8)
    core.handle(_step(1, used=24, groups=3, lineages=2, updates=2, heldout=0.25, trained=8))
    core.handle(_step(2, used=0, groups=0, lineages=0, updates=1, trained=4))
    core.handle(_step(3, used=16, groups=2, lineages=1, updates=1, heldout=0.5, trained=4))
    # n_external_groups (collected, 9 a step) no longer counts as used: 9 x 8 x 3 was the old figure
    assert core.stats()["used"] == 40
    assert core.stats()["groups_trained"] == 16  # own and external groups that entered updates
    assert list(core.swarm_gave) == [(3, 2, 2), (0, 0, 1), (2, 1, 1)]
    assert list(core.heldout) == [(1, 0.25), (3, 0.5)]


def _render(obj: object) -> str:
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False, color_system=None).print(obj)
    return buf.getvalue()


def test_status_dashboard_summary_and_metrics_show_it() -> None:
    s = NodeStatus(
        peer_id="12D3KooWx",
        swarm="s",
        roles=["trainer"],
        rollouts_accepted=200,
        rollouts_used=50,
        used_over_verified=0.25,
        external_groups_per_step=3.5,
        external_lineages_per_step=2.0,
        updates_per_step=1.5,
        heldout_trend=[0.2, 0.3, 0.45],
        heldout_start=0.2,
        heldout_now=0.45,
    )
    text = _render(node_panel(s))
    assert "3.5 groups per step from 2.0 lineages" in text and "used 50 of 200 verified (25%)" in text
    assert "0.20 → 0.45" in text
    table = _render(summary_table(summarize(["node0-trainer"], [s])))
    assert "25%" in table and "0.20→0.45" in table
    m = Metrics()
    m.update(s)
    body = generate_latest(m.registry).decode()
    assert 'murmur_external_per_step{kind="groups"} 3.5' in body
    assert "murmur_used_over_verified 0.25" in body and "murmur_heldout_accuracy 0.45" in body
