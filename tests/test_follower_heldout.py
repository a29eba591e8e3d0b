"""A follower shows the quality of the weights it holds: its worker measures their held-out accuracy (the
trainer's evaluation) whenever the version it holds changed, within a bounded share of its generation
time, and the status, dashboard, metrics and demo summary show it as they show a trainer's."""

from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

from murmur.node import pipe
from murmur.node.worker.main import FOLLOW_EVAL_SHARE, Worker, follower_eval_due
from tests.test_core import W, make_core

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

LINEAGE = b"\x0c" * 32
OTHER = b"\x0d" * 32


def test_a_follower_evaluates_each_new_version_while_evaluation_stays_within_its_share() -> None:
    assert follower_eval_due((LINEAGE, 0), None, 0.0, 0.0)  # the first measurement is free
    assert not follower_eval_due((LINEAGE, 3), (LINEAGE, 3), 0.0, 100.0)  # the same weights: not twice
    # a new version (or another lineage's), while evaluation stays within its share of generation time
    assert follower_eval_due((LINEAGE, 4), (LINEAGE, 3), 1.0, 1.0 / FOLLOW_EVAL_SHARE)
    assert follower_eval_due((OTHER, 3), (LINEAGE, 3), 1.0, 1.0 / FOLLOW_EVAL_SHARE)
    assert not follower_eval_due((LINEAGE, 4), (LINEAGE, 3), 1.0, 0.5 / FOLLOW_EVAL_SHARE)  # past it
    assert not follower_eval_due((OTHER, 3), (LINEAGE, 3), 1.0, 0.5 / FOLLOW_EVAL_SHARE)  # switching is no way round


@pytest.fixture
def follower(tmp_path: Path):  # type: ignore[no-untyped-def]
    from murmur.node.store import open_store
    from murmur.node.worker.taskmix import TaskMix
    from murmur.training.tasksets import TaskRegistry
    from murmur.training.tiny import new_tiny_engine, warmup_generators

    ours, theirs = multiprocessing.Pipe()
    w = Worker(ours, {"home": str(tmp_path), "swarm": "test", "roles": ["follower"], "trainer": {"max_new_tokens": 8}})
    w.engine = w.checker = new_tiny_engine(seed=0)
    w.registry = TaskRegistry("test")
    w.registry.add_builtin()
    w.db = open_store(tmp_path)
    w.tasks = TaskMix(w.registry, w.db, ["builtin"], set(), warmup_generators())
    w.tasks.refresh(force=True)
    yield w
    w.db.close()
    ours.close()
    theirs.close()


def test_a_followers_worker_measures_the_weights_it_holds_at_a_bounded_cadence(follower) -> None:  # type: ignore[no-untyped-def]
    from murmur.training.evaluation import accuracy_by_family

    w = follower
    got = w._follower_heldout(LINEAGE, 3)
    tid = w.tasks.mixture[0][0]
    # the trainer's evaluation, on the engine holding the follower's weights
    assert got == accuracy_by_family(w.checker, w.tasks.eval_tasks(tid), 8)["all"]
    assert w.eval_s > 0 and w.evaluated == (LINEAGE, 3)
    assert w.tasks.status()["sets"][0]["eval"]["last"]["step"] == 3  # recorded at the version held
    assert w._follower_heldout(LINEAGE, 3) is None  # the same weights: not again
    assert w._follower_heldout(LINEAGE, 4) is None  # no generation yet: evaluation's share is spent
    w.gen_s = w.eval_s / FOLLOW_EVAL_SHARE
    assert w._follower_heldout(LINEAGE, 4) is not None and w.evaluated == (LINEAGE, 4)
    spent = w.eval_s
    assert w._follower_heldout(OTHER, 4) is None and w.eval_s == spent  # another lineage's weights: the same budget


def test_a_followers_held_out_accuracy_shows_in_status_dashboard_metrics_and_demo_summary() -> None:
    from rich.console import Console

    from murmur.node.cli.demo import summarize, summary_table
    from murmur.node.shell.views import heldout_fields
    from murmur.node.status import NodeStatus
    from murmur.node.ui.dashboard import node_panel
    from murmur.node.ui.metrics import Metrics

    core, _ = make_core(roles=("follower",))
    core.handle(W("gen", {"reward_mean": 0.5, "version": 2, "tokens": 64, "latency_s": 0.1, "heldout": 0.4}))
    core.handle(W("gen", {"reward_mean": 0.5, "version": 2, "tokens": 64, "latency_s": 0.1}))  # not measured
    core.handle(W("gen", {"reward_mean": 0.6, "version": 5, "tokens": 64, "latency_s": 0.1, "heldout": 0.55}))
    assert list(core.heldout) == [(2, 0.4), (5, 0.55)]
    s = NodeStatus(
        peer_id="p", swarm="s", roles=["follower"], hardware="cpu", listen=[], state="running", **heldout_fields(core)
    )
    assert (s.heldout_start, s.heldout_now) == (0.4, 0.55)
    con = Console(width=120, record=True)
    con.print(node_panel(s))
    assert "0.40 → 0.55 greedy accuracy (2 checks)" in con.export_text()
    m = Metrics()
    m.update(s)
    assert m.registry.get_sample_value("murmur_heldout_accuracy") == 0.55
    summary = summarize(["node1-follower"], [s])
    assert (summary["nodes"][0]["heldout_start"], summary["nodes"][0]["heldout_end"]) == (0.4, 0.55)
    con = Console(width=80, record=True)
    con.print(summary_table(summary))
    assert "0.40→0.55" in con.export_text()


def test_a_held_out_accuracy_outside_zero_to_one_is_refused_at_the_pipe() -> None:
    from murmur.gossip.errors import DecodeError

    with pytest.raises(DecodeError, match="heldout"):
        pipe.decode(pipe.encode("gen", {"reward_mean": 0.5, "version": 2, "heldout": 1.5}))
