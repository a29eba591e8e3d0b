"""The worker link as the runtime sees a real worker process die: a worker killed with SIGKILL (as an
out-of-memory kill would) reads as gone, with its exit code, and what is sent to it afterwards is dropped
and counted. The runtime's restart of it is covered in virtual time (`tests/test_runtime_virtual.py`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import trio

from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.config import Config
from murmur.node.shell.runtime import RunOptions
from murmur.node.shell.workerlink import spawn, worker_spec


def test_a_killed_worker_reads_as_gone_with_its_exit_code(tmp_path: Path) -> None:
    ident = Identity.from_seed(b"\x41" * 32)
    spec = worker_spec(Config(), tmp_path / "home", ident, ["follower"], RunOptions(model_home=str(tmp_path / "m")))
    (tmp_path / "home").mkdir()
    got: dict[str, object] = {}

    async def main() -> None:
        link = await spawn(spec)
        try:
            first = None
            with trio.fail_after(120):
                while first is None:
                    first = await link.receive()
            got["first"] = first  # the worker is up and its pipe works: it says it is loading
            assert link.exitcode is None and link.pid > 0
            os.kill(link.pid, signal.SIGKILL)  # now the link sees the pipe close before the process is reaped
            deadline = time.monotonic() + 60
            while (m := await link.receive()) is not False:
                assert time.monotonic() < deadline, m
            got["exitcode"] = link.exitcode
            link.send(pipe.Pace(1.0))
            got["dropped"] = link.dropped
        finally:
            await link.stop(0.5)

    trio.run(main)
    assert got["first"] == pipe.State(pipe.WorkerState.LOADING)
    assert got["exitcode"] == -signal.SIGKILL
    assert got["dropped"] == 1


def test_importing_node_leaves_sys_path_alone_and_the_worker_entry_swaps_a_foreign_environment(tmp_path: Path) -> None:
    """A worker spawned under another environment's interpreter is handed the network process's sys.path:
    importing `node` keeps it as it is; the worker's entry point (`node.worker.boot`) drops that other
    environment's site-packages and puts this interpreter's own on it."""
    import subprocess
    import sys

    foreign = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    foreign.mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    code = (
        "import sys, sysconfig; foreign = sys.argv[1]; sys.path.insert(1, foreign); before = list(sys.path)\n"
        "import murmur.node, murmur.node.shell.workerlink\n"
        "assert sys.path == before, 'importing node changed sys.path'\n"
        "from murmur.node.worker.boot import own_site_packages\n"
        "own_site_packages()\n"
        "assert foreign not in sys.path and sysconfig.get_path('purelib') in sys.path, sys.path\n"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", code, str(foreign)],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
