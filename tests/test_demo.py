"""README's first command, `murmur demo`, end to end (short): three real node processes on loopback train,
publish versions, follow, verify each other's rollouts, and the summary says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_publishes_follows_and_verifies(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # it ends on events (--until-steps), not after a time: the duration is only the backstop
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "murmur.node",
            "demo",
            "--duration",
            "400",
            "--until-steps",
            "3",
            "--no-tui",
            "--json",
            "--dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=590,
        env=env,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    nodes = {n["node"].split("-", 1)[1]: n for n in s["nodes"]}
    assert set(nodes) == {"trainer", "trainer+validator", "follower+validator"}, s
    assert not [n for n in s["nodes"] if "error" in n], s
    for name in ("trainer", "trainer+validator"):  # they step and publish their lineages
        assert nodes[name]["steps"] >= 3 and nodes[name]["versions_published"] >= 1, nodes[name]
    assert nodes["follower+validator"]["versions_applied"] >= 1, nodes["follower+validator"]
    # the follower shows the held-out accuracy of the weights it holds, as the trainers do
    assert all(nodes[name]["heldout_end"] is not None for name in nodes), s
    assert sum(n["rollouts_accepted"] for n in s["nodes"]) > 0, s  # peers verified and used each other's rollouts
    assert s["families"], s  # held-out accuracy per task family


def test_demo_stops_once_it_has_shown_the_swarm_working() -> None:
    from murmur.node.cli.demo import shown
    from murmur.node.status import NodeStatus

    def st(steps: int = 0, applied: int = 0, heldout: float | None = 0.5, published: int = 1) -> NodeStatus:
        return NodeStatus(
            peer_id="p",
            swarm="s",
            roles=[],
            state="running",
            worker="training",
            steps=steps,
            versions_applied=applied,
            heldout_now=heldout,
            versions_published=published,
        )

    roles = [["trainer"], ["trainer", "validator"], ["follower", "validator"]]
    assert shown(roles, [st(3), st(5), st(applied=1)], 3)
    assert not shown(roles, [st(3), st(2), st(applied=1)], 3)  # a trainer short of its steps
    assert not shown(roles, [st(3), st(3, published=0), st(applied=1)], 3)  # steps that updated nothing yet
    assert not shown(roles, [st(3), st(3), st(applied=0)], 3)  # the follower applied nothing yet
    assert not shown(roles, [st(3), st(3), st(applied=1, heldout=None)], 3)  # ... or has not measured it yet
    assert not shown(roles, [st(3), None, st(applied=1)], 3)  # a node not answering
    assert not shown(roles, [st(9), st(9), st(applied=9)], 0)  # 0: run the whole duration


def test_demo_nodes_differ_and_load_as_node_configs(tmp_path: Path) -> None:
    from murmur.node.cli.demo import node_config
    from murmur.node.cli.launch import write_config
    from murmur.node.config import load_config

    seeds = []
    for i in range(3):
        (tmp_path / f"n{i}").mkdir()
        cfg = load_config(write_config(tmp_path / f"n{i}", node_config(["trainer"], "murmur-tiny", seed=i)), environ={})
        seeds.append(cfg.training.seed)
        assert cfg.training.minibatch_groups == 8 and cfg.training.local_rollouts == 16
    assert seeds == [0, 1, 2]
