"""Launch `murmur node start` processes on this machine: the one way the demo, the emulator, the
benchmarks and the tests write a node's config, start it, wait for it and stop it.

A `NodeLaunch` says what to start; `start` writes `<home>/config.toml` from its sections (checked
by the node's own config loader first, so a bad key is an error here, not a node that exits),
starts the process in its own session with its output appended to a log in the home, and returns
a `NodeProcess`. `wait_listening` returns once the node's control socket reports a listen address
(the node answers only after its host is bound), or raises `LaunchError` with the last line of
the node's log as soon as the process exits. `stop_all` sends SIGTERM to every node, waits for
them under one deadline, then kills each remaining process group (the node and its workers).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from murmur.gossip.errors import MurmurError
from murmur.gossip.tomlfile import toml_value
from murmur.node.shell import control
from murmur.node.status import NodeStatus

STOP_WAIT_S = 10.0
POLL_S = 0.25
LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # the node binds a free port and reports it: no port is picked in advance
# Many nodes on one machine: one torch thread each, and nothing fetched from a model hub.
LOCAL_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


class LaunchError(MurmurError):
    """A node process exited, or did not reach a state, while its launcher waited for it."""


class NodeLaunch(msgspec.Struct, kw_only=True, frozen=True):
    """One node to start. `config` is written as `<home>/config.toml`, section by section; None keeps
    the file the home has. `listen` and `bootstrap` become `--listen`/`--bootstrap` flags; `env` is
    added to this process's environment and `LOCAL_ENV`; `prefix` runs the command inside something
    (a network namespace); `log` (relative to the home) receives stdout and stderr, appended."""

    home: str
    config: dict[str, dict[str, Any]] | None = None
    listen: list[str] = msgspec.field(default_factory=lambda: [LOOPBACK])
    bootstrap: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    prefix: list[str] = msgspec.field(default_factory=list)
    log: str = "stderr.log"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a node that must listen where others already expect it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_config(sections: Mapping[str, Mapping[str, Any]]) -> str:
    lines: list[str] = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    return "\n".join(lines)


def write_config(home: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write `<home>/config.toml` and load it as the node will (environment left out): ConfigError on a bad key."""
    from murmur.node.config import load_config

    path = Path(home) / "config.toml"
    path.write_text(render_config(sections))
    load_config(path, environ={})
    return path


def node_command(spec: NodeLaunch) -> list[str]:
    cmd = [*spec.prefix, sys.executable, "-m", "murmur.node", "node", "start", "--home", spec.home, "--no-tui"]
    for a in spec.listen:
        cmd += ["--listen", a]
    for b in spec.bootstrap:
        cmd += ["--bootstrap", b]
    return cmd


_DECORATION = re.compile(r"^[\s|+\-^~=]*$")
_EXCEPTION = re.compile(r"^[\w.]*(?:Error|Exception|Exit|Interrupt|Group)\b")


def last_line(log: str) -> str:
    """What a dead node's log says last: its final exception line when it ends in a traceback (the innermost
    of an exception group's boxes), else its last line; at most 500 characters."""
    lines = [ln.strip().lstrip("|").strip() for ln in log.strip().splitlines()]
    lines = [ln for ln in lines if not _DECORATION.match(ln)]
    for ln in reversed(lines[-60:]):
        if _EXCEPTION.match(ln):
            return ln[:500]
    return lines[-1][:500] if lines else ""


def status(home: Path, name: str = "control.sock", timeout_s: float = 3.0) -> NodeStatus | None:
    """The node's status, or None while its control socket is not up (or the node is busy)."""
    try:
        return control.status(Path(home), name, timeout_s)
    except control.ControlError:
        return None


class NodeProcess:
    """A started process (a node, or another program `spawn` started) and where its log goes."""

    def __init__(self, proc: subprocess.Popen[bytes], home: Path, log: Path, control_socket: str) -> None:
        self.proc = proc
        self.home = home
        self.log = log
        self.control_socket = control_socket

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll()

    def status(self, timeout_s: float = 3.0) -> NodeStatus | None:
        return status(self.home, self.control_socket, timeout_s)

    def last_log_line(self) -> str:
        try:
            return last_line(self.log.read_bytes()[-65536:].decode("utf-8", "replace"))
        except OSError:
            return ""

    def exited(self) -> str:
        """'' while running, else why it is not: exit code and the log's last line."""
        rc = self.proc.poll()
        return "" if rc is None else f"node in {self.home} exited with {rc}: {self.last_log_line()} (log: {self.log})"

    def wait_listening(self, timeout_s: float) -> str:
        """The node's first listen address (with /p2p/<id>), once its control socket reports one."""
        found: list[str] = []

        def listening() -> bool:
            s = self.status()
            found[:] = s.listen if s is not None else []
            return bool(found)

        wait_until(f"the node in {self.home} listening", listening, [self], timeout_s)
        return found[0]


def spawn(
    cmd: list[str],
    home: Path,
    log: str = "stderr.log",
    env: Mapping[str, str] | None = None,
    control_socket: str = "control.sock",
) -> NodeProcess:
    """Start `cmd` in its own session (a stop reaches its children), output appended to `<home>/<log>`."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / log
    with open(path, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=out, env={**os.environ, **LOCAL_ENV, **(env or {})}, start_new_session=True
        )
    return NodeProcess(proc, home, path, control_socket)


def start(spec: NodeLaunch) -> NodeProcess:
    home = Path(spec.home)
    home.mkdir(parents=True, exist_ok=True)
    if spec.config is not None:
        write_config(home, spec.config)
    sock = (spec.config or {}).get("metrics", {}).get("control_socket", "control.sock")
    return spawn(node_command(spec), home, spec.log, spec.env, sock)


def start_bootstrapped(specs: Sequence[NodeLaunch], timeout_s: float) -> list[NodeProcess]:
    """Start the first node, wait until it listens, then start the others with it as a bootstrap peer;
    on any failure stop what was started."""
    nodes = [start(specs[0])]
    try:
        first = nodes[0].wait_listening(timeout_s)
        for spec in specs[1:]:
            nodes.append(start(msgspec.structs.replace(spec, bootstrap=[*spec.bootstrap, first])))
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def wait_until(what: str, pred: Callable[[], bool], nodes: Iterable[NodeProcess], timeout_s: float) -> None:
    """Poll `pred` until true; LaunchError at once when one of `nodes` exits, or after `timeout_s`."""
    nodes = list(nodes)
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return
        dead = [n.exited() for n in nodes if not n.alive()]
        if dead:
            raise LaunchError(f"while waiting for {what}: " + "; ".join(dead))
        if time.monotonic() >= deadline:
            raise LaunchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def stop_all(nodes: Iterable[NodeProcess], deadline_s: float = STOP_WAIT_S) -> list[int | None]:
    """SIGTERM every running process, wait for all under one deadline, then kill each one's process group;
    their exit codes (None for one that could not be reaped)."""
    nodes = list(nodes)
    for n in nodes:
        if n.alive():
            n.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for n in nodes:
        try:
            codes.append(n.proc.wait(max(0.0, deadline - time.monotonic())))
            continue
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(n.proc.pid, signal.SIGKILL)  # its own session: the group is the node and its workers
        except ProcessLookupError:
            pass
        try:
            codes.append(n.proc.wait(deadline_s))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


class TinyBuild:
    """murmur-tiny built (or reused) under `root` in a child process, as a node builds it (the launching
    process need not load torch); it runs while the caller does other work, and `path()` waits for it."""

    def __init__(self, root: Path) -> None:
        code = "import sys; from murmur.training.tiny import ensure_tiny; print(ensure_tiny(sys.argv[1]))"
        self.root = Path(root)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **LOCAL_ENV},
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        self._path: Path | None = None

    def path(self, timeout_s: float = 900.0) -> Path:
        if self._path is None:
            try:
                out, err = self.proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.cancel()
                raise LaunchError(f"building murmur-tiny in {self.root} took over {timeout_s:.0f} s") from None
            if self.proc.returncode != 0:
                raise LaunchError(f"building murmur-tiny in {self.root} failed: {last_line(err)}")
            self._path = Path(out.strip().splitlines()[-1])
        return self._path

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def build_tiny_model(root: Path, timeout_s: float = 900.0) -> Path:
    return TinyBuild(root).path(timeout_s)
