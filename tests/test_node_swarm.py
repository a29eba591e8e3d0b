"""Three real nodes started through the CLI on 127.0.0.1 (one trainer, two followers).

Followers track the trainer's versions within the staleness bound, rollouts
flow both ways, the trainer's reward rises; a follower killed with -9 resumes
where it was with the same identity and ledger; SIGTERM exits 0 within 5 s. (A worker that dies and is
restarted is covered in virtual time, `tests/test_runtime_virtual.py`, and the link's view of a killed
worker process by `tests/test_workerlink.py`.) Everything is read over the nodes' control sockets; every
wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from murmur.node.cli import launch
from murmur.node.cli.launch import status as _status
from murmur.node.status import NodeStatus
from murmur.node.worker import main as worker

pytestmark = pytest.mark.slow

MAX_STALENESS = 4
WAIT_S = 300.0


def _config(roles: list[str], model: Path) -> dict[str, dict[str, object]]:
    return {
        "node": {"swarm": "test-swarm", "roles": roles, "memory_budget_mb": 1536},
        "network": {"dht": False},
        "sync": {"publish_every": 2, "anchor_every": 8, "retain_versions": 32, "max_staleness": MAX_STALENESS},
        # a demand two followers cannot meet, so neither is put on standby by the capacity rule
        "training": {"model": str(model), "external_rollouts": 64},
    }


def _start(home: Path, bootstrap: list[str], config: dict | None = None) -> launch.NodeProcess:
    """A node on 127.0.0.1; config None: a restart on the config the home has."""
    return launch.start(launch.NodeLaunch(home=str(home), config=config, bootstrap=bootstrap))


def _json_line(line: str) -> dict:
    """A node log line as a dict; {} for anything else (a partly written last line, a worker's print)."""
    try:
        r = json.loads(line)
    except ValueError:
        return {}
    return r if isinstance(r, dict) else {}


def _lin(s: NodeStatus | None, relation: str):
    if s is None:
        return None
    if relation == "own":
        return next((x for x in s.lineages if x.relation == "own"), None)
    return next((x for x in s.lineages if x.lineage == s.serving), None)


def _wait(what: str, pred: Callable[[], bool], procs: list[launch.NodeProcess], timeout: float = WAIT_S) -> None:
    launch.wait_until(what, pred, procs, timeout)


@pytest.fixture
def model(tiny_model: Path) -> Path:
    return tiny_model


def test_three_nodes_learn_follow_resume_and_stop(tmp_path: Path, model: Path) -> None:
    homes = {n: tmp_path / n for n in ("trainer", "f1", "f2")}
    procs: dict[str, launch.NodeProcess] = {}
    try:
        procs["trainer"] = _start(homes["trainer"], [], _config(["trainer"], model))
        boot = [procs["trainer"].wait_listening(WAIT_S)]
        # the launcher's contract: the node listens where it says, on the config the launcher wrote
        first = procs["trainer"].status()
        assert first is not None and first.listen[0].startswith("/ip4/127.0.0.1/tcp/")
        assert first.listen[0].endswith(f"/p2p/{first.peer_id}") and "/tcp/0/" not in first.listen[0]
        assert (first.swarm, first.roles) == ("test-swarm", ["trainer"])  # the written config, not the defaults
        for n in ("f1", "f2"):
            procs[n] = _start(homes[n], boot, _config(["follower", "validator"], model))
        allp = lambda: list(procs.values())  # noqa: E731

        def followers_track(min_version: int) -> bool:
            t = _lin(_status(homes["trainer"]), "own")
            if t is None:
                return False
            for f in ("f1", "f2"):
                lin = _lin(_status(homes[f]), "follow")
                if lin is None or lin.lineage != t.lineage or lin.held < min_version:
                    return False
                if t.held - lin.held > MAX_STALENESS + 2:  # +2: the snapshots are not taken at one instant
                    return False
            return True

        _wait("followers tracking the trainer's lineage", lambda: followers_track(6), allp())

        def flows() -> bool:
            t, f1, f2 = (_status(homes[n]) for n in ("trainer", "f1", "f2"))
            return (
                t is not None
                and f1 is not None
                and f2 is not None
                and t.rollouts_accepted > 0
                and t.rollouts_used > 0  # follower rollouts reach the trainer
                and f1.rollouts_accepted > 0
                and f2.rollouts_accepted > 0  # trainer rollouts reach followers
                and f1.rollouts_produced > 0
                and f2.rollouts_produced > 0
            )

        _wait("rollouts flowing both ways", flows, allp())
        for n, p in procs.items():  # each worker yields the cores to its node's network process
            pid = _status(homes[n]).worker_pid
            assert (
                pid > 0
                and os.getpriority(os.PRIO_PROCESS, pid)
                == os.getpriority(os.PRIO_PROCESS, p.proc.pid) + worker.WORKER_NICE
            ), n

        # kill -9 a follower, restart it: same identity, ledger kept, resumes at its held version
        before = _status(homes["f1"])
        held_before = _lin(before, "follow").held
        procs["f1"].proc.kill()
        procs["f1"].proc.wait(10)
        log_offset = (homes["f1"] / "stderr.log").stat().st_size
        procs["f1"] = _start(homes["f1"], boot)
        _wait("f1 back", lambda: _status(homes["f1"]) is not None, allp())
        _wait(
            "f1 resumed",
            lambda: (
                (_lin(_status(homes["f1"]), "follow") or NodeStatus()).held >= held_before
                if _lin(_status(homes["f1"]), "follow")
                else False
            ),
            allp(),
        )
        after = _status(homes["f1"])
        assert after.peer_id == before.peer_id
        assert after.rollouts_accepted >= before.rollouts_accepted
        assert after.rollouts_produced >= before.rollouts_produced
        # what it held was replayed from disk: every patch it fetched since the restart ends past that
        # version (the bytes counter alone cannot say this: it counts transfers still in flight)
        with open(homes["f1"] / "stderr.log", "rb") as fh:
            fh.seek(log_offset)
            lines = fh.read().decode(errors="replace").splitlines()
        events = [r for r in map(_json_line, lines) if r]
        assert events, "the restarted node wrote no log lines"
        received = [r for r in events if r.get("msg") == "patch received"]
        assert all(int(r["target"]) > held_before for r in received), [
            (r["kind"], r["base"], r["target"]) for r in received
        ]

        # the trainer's reward rises
        def reward_rose() -> bool:
            t = _status(homes["trainer"])
            return (
                t is not None
                and t.reward_start is not None
                and t.reward_now is not None
                and t.reward_now > t.reward_start + 0.05
            )

        _wait("trainer reward rising", reward_rose, allp())

        # SIGTERM: exit 0 within 5 s
        for n in ("f2", "trainer"):
            t0 = time.monotonic()
            procs[n].proc.send_signal(signal.SIGTERM)
            assert procs[n].proc.wait(10) == 0
            assert time.monotonic() - t0 < 5.0 + 0.5  # +0.5: process reaping on a loaded machine
        assert launch.stop_all([procs["f1"]]) == [0]  # the launcher's stop: SIGTERM, a clean exit
    finally:
        launch.stop_all(procs.values())
