"""A real node trains on the task set its config names: it waits (and says so) until the set arrives,
trains on it, follows the coordinator's new version by name without a new lineage, and `murmur tasks
list` shows the per-set counters. One `murmur node start` process; the coordinator is the node's own key
(`murmur tasks publish` stores the set in the home, as a set received from the swarm is stored)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmur.node.cli import launch
from murmur.node.home import ensure_home
from murmur.node.store import open_store
from murmur.node.worker.taskmix import STATUS_KEY
from murmur.training.tasksets import BUILTIN_NAME, BUILTIN_VERSION

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _set_file(tmp: Path, version: int) -> Path:
    f = tmp / f"e2e-v{version}.toml"
    f.write_text(
        f'name = "e2e"\nversion = {version}\nverifier = "exact"\n'
        '[[generators]]\nname = "sort"\ngenerator = "sorting"\nseed_end = 100000\n'
        'config = { length = 3, min_length = 2, split = "train" }\n'
        '[[generators]]\nname = "sort-eval"\ngenerator = "sorting"\nseed_end = 100000\n'
        'config = { length = 3, min_length = 2, split = "eval" }\n'
    )
    return f


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "murmur.node", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=str(ROOT),
    )


def _status(home: Path) -> dict:
    db = open_store(home)
    try:
        return db.get(STATUS_KEY, {}) or {}
    finally:
        db.close()


def _training(home: Path, version: int) -> bool:
    return any(
        s["name"] == "e2e" and s["version"] == version and s["training"] and s["produced"] > 0
        for s in _status(home).get("sets", [])
    )


def test_node_waits_for_its_task_set_trains_on_it_and_follows_new_versions(tmp_path: Path, tiny_model: Path) -> None:
    model = tiny_model
    home = tmp_path / "node"
    key = ensure_home(home).public.hex()
    proc = launch.start(
        launch.NodeLaunch(
            home=str(home),
            config={
                "node": {"roles": ["trainer"], "memory_budget_mb": 1536},
                "network": {"dht": False},
                "training": {
                    "model": str(model),
                    "local_rollouts": 2,
                    "group_size": 4,
                    "max_new_tokens": 6,
                    "task_sets": ["e2e"],
                },
                "trust": {"coordinators": [key]},
            },
        )
    )
    try:
        launch.wait_until("the worker to wait for 'e2e'", lambda: _status(home).get("waiting") == ["e2e"], [proc], 300)
        # the control socket says so too (it must answer: a node that does not is a failure, not a pass)
        launch.wait_until(
            "the node to report waiting-for-tasks",
            lambda: (s := proc.status()) is not None and s.worker == "waiting-for-tasks",
            [proc],
            60,
        )
        assert not any(x["produced"] for x in _status(home).get("sets", []))  # nothing trained meanwhile
        assert _cli("tasks", "publish", str(_set_file(tmp_path, 1)), home=home).returncode == 0
        launch.wait_until("training on e2e v1", lambda: _training(home, 1), [proc], 300)
        db = open_store(home)
        lineage = db.get("own_lineage")
        db.close()
        assert _cli("tasks", "publish", str(_set_file(tmp_path, 2)), home=home).returncode == 0
        launch.wait_until("training on e2e v2", lambda: _training(home, 2), [proc], 300)
        db = open_store(home)
        assert db.get("own_lineage") == lineage  # a new task-set version is not a new lineage
        db.close()
        r = _cli("tasks", "list", "--json", home=home)
        listed = json.loads(r.stdout.strip().splitlines()[-1])
        rows = {(x["name"], x["version"]): x for x in listed["sets"]}
        assert rows[("e2e", 2)]["training"] and rows[("e2e", 2)]["produced"] > 0
        assert not rows[("e2e", 1)]["training"] and rows[("e2e", 1)]["produced"] > 0
        builtin = rows[(BUILTIN_NAME, BUILTIN_VERSION)]
        assert not builtin["training"] and builtin["produced"] == 0
        assert listed["waiting"] == []
    finally:
        launch.stop_all([proc])
    log = (home / "stderr.log").read_text()
    assert "waiting for task set(s) e2e" in log
