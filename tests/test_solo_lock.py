"""The lock that keeps WebRTC and network-namespace tests away from live swarms: a solo holder excludes every
heavy test, a waiting solo test shuts the gate to new ones instead of waiting for a gap in the other worker's
stream, and ordinary tests take no lock."""

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
    reader.acquire("heavy")
    assert _free(tmp_path / "main", fcntl.LOCK_SH) and not _free(tmp_path / "main", fcntl.LOCK_EX)

    got = threading.Event()

    def solo() -> None:
        writer.acquire("solo")
        got.set()

    t = threading.Thread(target=solo, daemon=True)
    t.start()
    # the waiting solo test holds the gate: a new test could not start now
    assert _until(lambda: not _free(tmp_path / "gate", fcntl.LOCK_SH))
    assert not got.is_set(), "the solo test started beside a running test"
    reader.release()
    assert got.wait(5), "the solo test never started after the running test ended"
    assert not _free(tmp_path / "main", fcntl.LOCK_SH), "a test could start beside the solo test"
    writer.acquire("solo")  # a run of solo tests keeps the lock it holds
    assert writer.held == "solo"
    writer.release()
    t.join(5)
    assert _free(tmp_path / "gate", fcntl.LOCK_EX) and _free(tmp_path / "main", fcntl.LOCK_EX)


def test_tests_beside_each_other_share_the_lock(tmp_path: Path) -> None:
    a, b = SoloLock(tmp_path), SoloLock(tmp_path)
    a.acquire("heavy")
    b.acquire("heavy")
    assert a.held == b.held == "heavy"
    assert not _free(tmp_path / "main", fcntl.LOCK_EX)
    a.release()
    b.release()
    assert _free(tmp_path / "main", fcntl.LOCK_EX)


def test_at_most_two_heavy_tests_run_at_once_and_a_third_starts_when_one_ends(tmp_path: Path) -> None:
    a, b, c = (SoloLock(tmp_path, slot=i) for i in range(3))
    a.acquire("heavy")
    b.acquire("heavy")  # its own slot is free
    got = threading.Event()

    def third() -> None:
        c.acquire("heavy")  # slot 2 % 2 = 0: a holds it, and b holds the other
        got.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    assert not got.wait(0.3), "a third heavy test started beside two"
    b.release()  # not the third one's own slot: it takes whichever frees first
    assert got.wait(5), "the third heavy test never started after a slot came free"
    assert not _free(tmp_path / "heavy0", fcntl.LOCK_EX) and not _free(tmp_path / "heavy1", fcntl.LOCK_EX)
    a.release()
    b.acquire("heavy")  # c holds slot 1: b takes slot 0
    assert b.held == c.held == "heavy"
    for x in (b, c):
        x.release()
    t.join(5)
    assert all(_free(tmp_path / f"heavy{i}", fcntl.LOCK_EX) for i in range(2))


def test_a_worker_that_ends_a_heavy_test_cannot_take_its_slot_back_before_a_waiting_one(tmp_path: Path) -> None:
    a, b, c = (SoloLock(tmp_path, slot=i) for i in range(3))
    a.acquire("heavy")
    b.acquire("heavy")
    waiting, again = threading.Event(), threading.Event()

    def third() -> None:
        c.acquire("heavy")
        waiting.set()

    def next_test_on_a() -> None:
        a.acquire("heavy")
        again.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    assert _until(lambda: not _free(tmp_path / "slotgate", fcntl.LOCK_SH)), "the waiting test holds no gate"
    a.release()
    t2 = threading.Thread(target=next_test_on_a, daemon=True)
    t2.start()  # at once, as a worker starts its next test
    assert waiting.wait(5), "the waiting heavy test never got the slot"
    assert not again.wait(0.3), "the worker took its slot back past the waiting test"
    b.release()
    assert again.wait(5)
    for x in (a, c):
        x.release()
    t.join(5)
    t2.join(5)


def test_an_ordinary_test_takes_no_lock_and_runs_beside_a_solo_one(tmp_path: Path) -> None:
    solo, plain = SoloLock(tmp_path), SoloLock(tmp_path)
    solo.acquire("solo")
    plain.acquire("light")  # would block for good if it took `main` or `gate`
    assert plain.held is None and solo.held == "solo"
    solo.release()
    assert _free(tmp_path / "main", fcntl.LOCK_EX) and _free(tmp_path / "gate", fcntl.LOCK_EX)


def test_under_xdist_a_solo_test_runs_beside_ordinary_tests_but_no_heavy_one(tmp_path: Path) -> None:
    """Two workers, files of solo, heavy (`slow`) and ordinary tests: each test logs when and where it runs; the
    solo tests of both solo files run on one worker, no heavy test's interval overlaps a solo one's, and ordinary
    tests run beside the solo ones (one unit at the front: one worker runs it while the other takes the rest)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "log.jsonl"
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import (pytest_configure, pytest_runtest_protocol, pytest_unconfigure,  # noqa: F401\n"
        "                            pytest_collection_modifyitems, pytest_xdist_make_scheduler)\n"
    )
    body = (
        "import json, os, time\nimport pytest\n\n"
        "def _run(name, s):\n    t0 = time.monotonic()\n    time.sleep(s)\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(json.dumps([name, t0, time.monotonic(), os.getpid()]) + '\\n')\n\n"
    )
    (tmp_path / "test_heavy.py").write_text(
        body + "".join(f"@pytest.mark.slow\ndef test_h{i}():\n    _run('heavy', 0.3)\n\n" for i in range(3))
    )
    for name, n in (("test_solo.py", 2), ("test_solo_too.py", 1)):  # two files, one unit
        (tmp_path / name).write_text(
            body + "".join(f"@pytest.mark.solo\ndef test_s{i}():\n    _run('solo', 0.6)\n\n" for i in range(n))
        )
    (tmp_path / "test_plain.py").write_text(
        body + "".join(f"def test_p{i}():\n    _run('plain', 0.2)\n\n" for i in range(6))
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MURMUR_TEST_SOLO_ROOT", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadfile",
            "-o",
            "markers=solo: alone",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    by = {k: [(a, b) for n, a, b, _ in runs if n == k] for k in ("solo", "heavy", "plain")}
    assert len({pid for n, _, _, pid in runs if n == "solo"}) == 1, f"the solo tests ran on both workers: {runs}"
    assert [len(by[k]) for k in ("solo", "heavy", "plain")] == [3, 3, 6], runs

    def overlapping(kind: str) -> list:
        return [(p, s) for p in by[kind] for s in by["solo"] if p[0] < s[1] and s[0] < p[1]]

    assert not overlapping("heavy"), f"heavy tests ran beside solo ones: {overlapping('heavy')}"
    assert overlapping("plain"), f"no ordinary test ran beside the solo ones: {runs}"


def test_a_slow_test_on_one_core_is_scheduled_as_an_ordinary_one() -> None:
    from tests.conftest import HEAVY, LIGHT, SOLO, weight

    class Item:
        def __init__(self, *marks: str, fixtures: tuple[str, ...] = ()) -> None:
            self.marks, self.fixturenames = set(marks), fixtures

        def get_closest_marker(self, name: str) -> object | None:
            return name if name in self.marks else None

    assert weight(Item("slow")) == HEAVY
    assert weight(Item("slow", "onecore")) == LIGHT
    assert weight(Item()) == LIGHT
    assert weight(Item("slow", "solo")) == SOLO
    assert weight(Item(fixtures=("webrtc_extra",))) == SOLO
