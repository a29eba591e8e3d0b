"""Shared fixtures and the CI skip check. Threads are capped before torch loads: the machine has 2 shared cores."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

SWARM = "test"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from murmur.gossip.identity import Identity  # noqa: E402


@pytest.fixture
def identity() -> Identity:
    return Identity.from_seed(bytes(range(32)))


@pytest.fixture
def other_identity() -> Identity:
    return Identity.from_seed(bytes(range(1, 33)))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh node home, also exported as MURMUR_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("MURMUR_HOME", str(h))
    return h


_TINY_BUILD: list[Any] = []  # the session's murmur-tiny build (node.cli.launch.TinyBuild), once started


_SHARED_TINY = "MURMUR_TEST_TINY_ROOT"  # set by an xdist controller: its workers build murmur-tiny there, once


def _tiny_build() -> Any:
    from murmur.node.cli.launch import TinyBuild

    if not _TINY_BUILD:
        shared = os.environ.get(_SHARED_TINY)
        # ensure_tiny's lock file makes the workers' builders of one root take turns: one builds, the rest reuse
        _TINY_BUILD.append(TinyBuild(Path(shared) if shared else Path(tempfile.mkdtemp(prefix="murmur-tiny-"))))
    return _TINY_BUILD[0]


_SOLO_ROOT = "MURMUR_TEST_SOLO_ROOT"  # set by an xdist controller: its workers' solo lock files live there


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_SHARED_TINY] = tempfile.mkdtemp(prefix="murmur-tiny-")  # the workers inherit it
        os.environ[_SOLO_ROOT] = tempfile.mkdtemp(prefix="murmur-solo-")


def is_solo(item: pytest.Item) -> bool:
    """WebRTC (aiortc's SCTP in Python) misses py-libp2p's 10 s negotiation bounds when live swarms on
    other workers take the cores, so tests that run it run with no live swarm beside them; so do the
    network-namespace swarms (marked `solo`), whose reachability checks wait on bounded dial-backs."""
    return item.get_closest_marker("solo") is not None or "webrtc_extra" in getattr(item, "fixturenames", ())


SOLO, HEAVY, LIGHT = "solo", "heavy", "light"


def weight(item: pytest.Item) -> str:
    """What a test may run beside: a solo test excludes the live swarms and long multi-process runs
    (marked `slow`); an ordinary test holds one core at most (threads are capped above), which leaves a solo
    test's waits on dials and reservations the other core, so it runs beside anything; so does a `slow` test
    marked `onecore` (one process, one thread: a simulation in virtual time)."""
    if is_solo(item):
        return SOLO
    if item.get_closest_marker("slow") is None or item.get_closest_marker("onecore") is not None:
        return LIGHT
    return HEAVY


HEAVY_SLOTS = 2  # live swarms at once: one per core; a third worker runs ordinary tests beside them
SLOT_POLL_S = 0.05


class SoloLock:
    """A readers-writer lock across xdist workers (flock on two files): a heavy test holds `main` shared, a
    solo test holds it exclusive, an ordinary test takes neither. A waiting solo test holds `gate`, which a
    heavy test must pass to take `main`, so the other workers' stream of heavy tests cannot starve it. A heavy
    test also holds one of `HEAVY_SLOTS` slot files, trying its own (`slot`) first; flock cannot wait for
    whichever of several frees first, so a heavy test with none free polls them, holding `slotgate` while it
    does: a worker that ends a heavy test and starts the next one passes that gate first, so it cannot take
    the slot it just gave up before the waiting one sees it free."""

    def __init__(self, root: Path, slot: int = 0) -> None:
        self._gate = open(root / "gate", "a+b")  # held for the worker's life
        self._main = open(root / "main", "a+b")
        self._slots = [open(root / f"heavy{i}", "a+b") for i in range(HEAVY_SLOTS)]
        self._slotgate = open(root / "slotgate", "a+b")
        self._own = slot % HEAVY_SLOTS
        self._slot: Any = None
        self.held: str | None = None

    def _try_slots(self) -> bool:
        for i in range(HEAVY_SLOTS):
            f = self._slots[(self._own + i) % HEAVY_SLOTS]
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._slot = f
            return True
        return False

    def _take_slot(self) -> None:
        fcntl.flock(self._slotgate, fcntl.LOCK_SH)  # behind a test already waiting for a slot
        fcntl.flock(self._slotgate, fcntl.LOCK_UN)
        if self._try_slots():
            return
        fcntl.flock(self._slotgate, fcntl.LOCK_EX)
        try:
            while not self._try_slots():  # unbounded like the other waits here: a heavy test may run for minutes
                time.sleep(SLOT_POLL_S)
        finally:
            fcntl.flock(self._slotgate, fcntl.LOCK_UN)

    def acquire(self, mode: str) -> None:
        if self.held == mode:
            return
        self.release()
        if mode == SOLO:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            fcntl.flock(self._main, fcntl.LOCK_EX)
        elif mode == HEAVY:
            fcntl.flock(self._gate, fcntl.LOCK_SH)
            fcntl.flock(self._main, fcntl.LOCK_SH)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            self._take_slot()
        else:
            return
        self.held = mode

    def release(self) -> None:
        if self._slot is not None:
            fcntl.flock(self._slot, fcntl.LOCK_UN)
            self._slot = None
        if self.held is not None:
            fcntl.flock(self._main, fcntl.LOCK_UN)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            self.held = None


_SOLO: list[SoloLock] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Setup, call and teardown (module fixtures too) run under the lock; a run of solo tests holds it
    throughout, any other test gives it up at once so that a waiting solo test gets in."""
    root = os.environ.get(_SOLO_ROOT)
    if not root or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    if not _SOLO:
        _SOLO.append(SoloLock(Path(root), slot=int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)))
    mode = weight(item)
    _SOLO[0].acquire(mode)
    try:
        yield
    finally:
        if mode != SOLO or nextitem is None or not is_solo(nextitem):
            _SOLO[0].release()


# Live swarms that take longest start first among the heavy tests, so that short ones end the run on every
# worker instead of one long swarm running alone at the end.
LONGEST_FIRST = (
    "test_vllm.py",
    "test_attacks_live.py",
    "test_node_swarm.py",
    "test_emulation_nodes.py",
    "test_demo.py",
    "test_training.py",
    "test_modelplan.py",
    "test_broadcast.py",
)
# Within the solo unit: the WebRTC pairs and the namespace benches mostly wait, and the ordinary tests beside
# them fill the cores; the NATed live swarms, which fill both cores themselves, end the unit, so the slow
# tests that follow start on a machine that was busy anyway.
SOLO_ORDER = (
    "test_reachability_webrtc.py",
    "test_reachability.py",
    "test_reachability_netns.py",
    "test_reachability_nodes.py",
)


def _shares_module_state(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "package", "class") for d in defs)


_UNITS = "units.json"  # in MURMUR_TEST_SOLO_ROOT: each worker's collection writes it, the controller schedules by it


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order and the work units the controller hands out (`WorkUnits`): every solo test in one unit at the
    front (one worker runs them in a row, in `SOLO_ORDER`, while the others run ordinary tests beside them), then
    the ordinary tests, then the heavy ones longest first. Tests that share a module-scoped fixture stay one unit, as
    `loadfile` kept them, so the fixture is built once."""
    root = os.environ.get(_SOLO_ROOT)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not root or not worker:
        return
    unit = {id(it): SOLO if is_solo(it) else (it.path.name if _shares_module_state(it) else it.nodeid) for it in items}
    rank = {SOLO: 0, LIGHT: 1, HEAVY: 2}
    unit_rank: dict[str, int] = {}
    for it in items:
        u = unit[id(it)]
        unit_rank[u] = max(unit_rank.get(u, 0), rank[weight(it)])
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    solo_first = {name: i for i, name in enumerate(SOLO_ORDER)}
    order = {id(it): i for i, it in enumerate(items)}

    def place(it: pytest.Item) -> int:
        ranks = solo_first if unit[id(it)] == SOLO else first
        return ranks.get(it.path.name, len(ranks))

    items.sort(key=lambda it: (unit_rank[unit[id(it)]], place(it), order[id(it)]))
    tmp = Path(root) / f"{_UNITS}.{worker}"
    tmp.write_text(json.dumps({it.nodeid: unit[id(it)] for it in items if unit[id(it)] != it.nodeid}))
    tmp.replace(Path(root) / _UNITS)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler over the workers' own units and order (its `loadgroup` marks name no unit under
    this pytest, whose node ids it cannot extend)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False
    units_file = Path(os.environ[_SOLO_ROOT]) / _UNITS

    class WorkUnits(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # asked only once every worker has collected, so the file is there
                self.units = json.loads(units_file.read_text())
            return self.units.get(nodeid, nodeid)

    return WorkUnits(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building murmur-tiny as soon as a selected test needs it: the build then runs beside the
    in-process tests that come first (one core each) instead of holding up the first live test."""
    if session.config.option.collectonly:
        return
    if any("tiny_model" in getattr(item, "fixturenames", ()) for item in session.items):
        _tiny_build()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """murmur-tiny (the default build every node starts from) built once per session, in a subprocess as a node
    builds it; nodes only read it, so every live-node test shares this one."""
    return _tiny_build().path()


@pytest.fixture(scope="module")
def registry() -> Any:
    """The built-in task set, one per test module."""
    from murmur.training.tasksets import TaskRegistry

    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    return reg


@pytest.fixture(scope="module")
def warm_engine() -> Any:
    """murmur-tiny after 40 warm-up steps, one per test module (trained on, so never shared across modules):
    format learnt and some answers right, so rewards vary within groups."""
    from murmur.training.tiny import new_tiny_engine, warmup

    e = new_tiny_engine(seed=0)
    warmup(e, 40, seed=0)
    return e


@pytest.fixture
def webrtc_extra() -> None:
    """Skip, with the reason, where aiortc (a core dependency) failed to install or import; CI must run these."""
    from murmur.gossip.webrtc import webrtc_unavailable

    reason = webrtc_unavailable()
    if reason:
        pytest.skip(f"WebRTC extra not installed: {reason}")


# Tests that may skip where CI runs (env CI=true), by node-id prefix, with the reason. Any other skip
# there fails the run: a test that quietly stops running (no root for network namespaces, aiortc not
# importable, the vLLM environment missing) guards nothing.
ALLOWED_CI_SKIPS: dict[str, str] = {}


def unexpected_skips(skipped: list[Any], allowed: dict[str, str]) -> list[str]:
    """Node ids of skipped (not xfailed) reports that no allowed prefix covers."""
    return sorted(
        {r.nodeid for r in skipped if not hasattr(r, "wasxfail") and not any(r.nodeid.startswith(p) for p in allowed)}
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    for build in _TINY_BUILD:
        build.cancel()
        if not os.environ.get(_SHARED_TINY):  # a shared root is the controller's to remove
            shutil.rmtree(build.root, ignore_errors=True)
    if os.environ.get(_SHARED_TINY) and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ.pop(_SHARED_TINY), ignore_errors=True)
    if os.environ.get(_SOLO_ROOT) and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ.pop(_SOLO_ROOT), ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI", "").lower() != "true":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    bad = unexpected_skips(reporter.stats.get("skipped", []) if reporter else [], ALLOWED_CI_SKIPS)
    if bad:
        if reporter:
            reporter.write_line(
                f"CI: {len(bad)} test(s) skipped that must run here (tests/conftest.py ALLOWED_CI_SKIPS):", red=True
            )
            for nodeid in bad:
                reporter.write_line(f"  {nodeid}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
