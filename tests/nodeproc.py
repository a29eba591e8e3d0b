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


class TinyBuild:
    """murmur-tiny built under `root` in a subprocess, as a node builds it; `path()` waits for the build."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        code = "import sys; from training.tiny import ensure_tiny; print(ensure_tiny(sys.argv[1]))"
        self.root = root
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=str(Path(__file__).resolve().parents[1]))
        self._path: Path | None = None

    def path(self) -> Path:
        if self._path is None:
            out, err = self.proc.communicate(timeout=600)
            assert self.proc.returncode == 0, err[-2000:]
            self._path = Path(out.strip().splitlines()[-1])
        return self._path

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


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
