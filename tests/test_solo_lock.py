"""The lock that keeps WebRTC tests alone: a solo holder excludes every other test, and a waiting solo test
shuts the gate to new ones instead of waiting for a gap in the other worker's stream."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

from tests.conftest import SoloLock


def _free(path: Path, op: int) -> bool:
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, op | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def _until(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_solo_test_waits_for_the_running_test_and_then_excludes_new_ones(tmp_path: Path) -> None:
    reader, writer = SoloLock(tmp_path), SoloLock(tmp_path)
    reader.acquire(solo=False)
    assert _free(tmp_path / "main", fcntl.LOCK_SH) and not _free(tmp_path / "main", fcntl.LOCK_EX)

    got = threading.Event()

    def solo() -> None:
        writer.acquire(solo=True)
        got.set()

    t = threading.Thread(target=solo, daemon=True)
    t.start()
    # the waiting solo test holds the gate: a new test could not start now
    assert _until(lambda: not _free(tmp_path / "gate", fcntl.LOCK_SH))
    assert not got.is_set(), "the solo test started beside a running test"
    reader.release()
    assert got.wait(5), "the solo test never started after the running test ended"
    assert not _free(tmp_path / "main", fcntl.LOCK_SH), "a test could start beside the solo test"
    writer.acquire(solo=True)  # a run of solo tests keeps the lock it holds
    assert writer.held == "solo"
    writer.release()
    t.join(5)
    assert _free(tmp_path / "gate", fcntl.LOCK_EX) and _free(tmp_path / "main", fcntl.LOCK_EX)


def test_tests_beside_each_other_share_the_lock(tmp_path: Path) -> None:
    a, b = SoloLock(tmp_path), SoloLock(tmp_path)
    a.acquire(solo=False)
    b.acquire(solo=False)
    assert a.held == b.held == "shared"
    assert not _free(tmp_path / "main", fcntl.LOCK_EX)
    a.release()
    b.release()
    assert _free(tmp_path / "main", fcntl.LOCK_EX)


def test_under_xdist_a_solo_test_runs_with_nothing_beside_it(tmp_path: Path) -> None:
    """Two workers, a file of solo tests and a file of ordinary ones: each test logs when it runs, and no
    ordinary test's interval overlaps a solo one's."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "log.jsonl"
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_protocol, pytest_unconfigure  # noqa: F401\n")
    body = ("import json, os, time\nimport pytest\n\n"
            "def _run(name):\n    t0 = time.monotonic()\n    time.sleep(0.4)\n"
            f"    with open({str(log)!r}, 'a') as f:\n"
            "        f.write(json.dumps([name, t0, time.monotonic()]) + '\\n')\n\n")
    (tmp_path / "test_solo.py").write_text(
        body + "".join(f"@pytest.mark.solo\ndef test_s{i}():\n    _run('solo')\n\n" for i in range(3)))
    (tmp_path / "test_plain.py").write_text(body + "".join(f"def test_p{i}():\n    _run('plain')\n\n" for i in range(6)))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MURMUR_TEST_SOLO_ROOT", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                        "loadfile", "-o", "markers=solo: alone", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    solo = [(a, b) for n, a, b in runs if n == "solo"]
    plain = [(a, b) for n, a, b in runs if n == "plain"]
    assert len(solo) == 3 and len(plain) == 6, runs
    beside = [(p, s) for p in plain for s in solo if p[0] < s[1] and s[0] < p[1]]
    assert not beside, f"ordinary tests ran beside solo ones: {beside}"
