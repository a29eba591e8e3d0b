"""Helpers for tests that run real `murmur node start` processes and read them over the control socket."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from node import control
from node.demo import free_port  # noqa: F401 - the helpers' one free-port rule
from node.status import NodeStatus


def status(home: Path) -> NodeStatus | None:
    """The node's status, or None while its control socket is not up (or it is busy)."""
    try:
        return control.status(home, timeout=5.0)
    except control.ControlError:
        return None


def wait_for(what: str, pred: Callable[[], bool], procs: list[subprocess.Popen], timeout: float) -> None:
    """Poll `pred` twice a second until true; fail at once if a node exits, or after `timeout`."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout * 2) + 1):
        if pred():
            return
        dead = [p.args[-4:] for p in procs if p.poll() is not None]
        assert not dead, f"node exited while waiting for {what}: {dead}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def build_tiny_model(root: Path, env: dict[str, str]) -> Path:
    """Build (or reuse) murmur-tiny under `root` in a subprocess, as a node would, and return its folder."""
    code = "import sys; from training.tiny import ensure_tiny; print(ensure_tiny(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=600,
                       env=env, cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(r.stdout.strip().splitlines()[-1])


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every node still running, then wait; kill what does not exit within 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
