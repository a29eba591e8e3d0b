"""The one node launcher (node/cli/launch.py): the config it writes is the node's, a node that dies is
reported at once with its last log line, and a stop leaves no process of the node's group behind. Live nodes
started, bootstrapped and stopped through it: tests/test_node_swarm.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from murmur.gossip.errors import ConfigError
from murmur.node.cli import launch
from murmur.node.config import load_config

START_S = 180.0  # a loaded 2-core machine starts a node (imports, host) well within this


def test_the_written_config_is_the_one_the_node_loads(tmp_path: Path) -> None:
    cfg = {
        "node": {"swarm": "s", "roles": ["follower", "validator"]},
        "network": {"dht": False},
        "sync": {"publish_every": 3},
        "trust": {"coordinators": []},
    }
    loaded = load_config(launch.write_config(tmp_path, cfg), environ={})
    assert (loaded.node.swarm, loaded.node.roles, loaded.network.dht, loaded.sync.publish_every) == (
        "s",
        ["follower", "validator"],
        False,
        3,
    )


def test_a_bad_key_is_refused_before_a_process_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sync.no_such_key"):
        launch.start(launch.NodeLaunch(home=str(tmp_path / "h"), config={"sync": {"no_such_key": 1}}))
    assert not (tmp_path / "h" / "stderr.log").exists()


@pytest.mark.slow  # a `murmur node start` process, if a short one
def test_a_node_that_exits_is_reported_at_once_with_its_last_log_line(tmp_path: Path) -> None:
    """The environment names no config key: the node exits 2 at start; the wait says so, not a timeout."""
    n = launch.start(
        launch.NodeLaunch(
            home=str(tmp_path / "h"), config={"network": {"dht": False}}, env={"MURMUR_NETWORK_NO_SUCH_KEY": "1"}
        )
    )
    try:
        with pytest.raises(launch.LaunchError, match="exited with 2: .*MURMUR_NETWORK_NO_SUCH_KEY names no config"):
            n.wait_listening(START_S)
    finally:
        launch.stop_all([n])


def test_stop_kills_a_process_that_ignores_sigterm_and_its_children(tmp_path: Path) -> None:
    """A stuck node (SIGTERM ignored) and the worker it started both go: the kill reaches the group."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    n = launch.spawn([sys.executable, "-c", code], tmp_path, "out.log")
    launch.wait_until("the child started", lambda: (tmp_path / "out.log").read_text().strip() != "", [n], 60.0)
    child = int((tmp_path / "out.log").read_text().split()[0])
    codes = launch.stop_all([n], deadline_s=1.0)
    assert codes[0] is not None and codes[0] < 0  # killed, not exited
    for _ in range(200):  # the orphaned child is reaped by init: wait (bounded) until its pid is gone
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the child {child} survived the stop")


def test_a_dead_nodes_last_line_is_its_exception_not_the_traceback_frame() -> None:
    trace = (
        '{"level": "info", "msg": "starting"}\n  + Exception Group Traceback (most recent call last):\n'
        '  |   File "node/shell/runtime.py", line 1, in run\n  | ExceptionGroup: unhandled errors (1 sub-exception)\n'
        "  +-+---------------- 1 ----------------\n    | Traceback (most recent call last):\n"
        "    | RuntimeError: Nursery is closed to new arrivals\n    +------------------------------------\n"
    )
    assert launch.last_line(trace) == "RuntimeError: Nursery is closed to new arrivals"
    assert (
        launch.last_line("error: environment: MURMUR_X names no config key\n")
        == "error: environment: MURMUR_X names no config key"
    )
    assert launch.last_line("") == ""
