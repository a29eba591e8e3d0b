"""Emulation notices nodes that die, and every packaged scenario runs: the emulatable ones start all their nodes
and reach a first step as real processes, the rest start in virtual time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmur.node.config import env_overrides
from murmur.simulations import scenario as sc_mod
from murmur.simulations.emulate import MAX_REAL_NODES
from murmur.simulations.wan import LinkSpec, node_env

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = sorted(p for p in (ROOT / "simulations" / "scenarios").glob("*.toml") if p.stem != "bench_swarm")


@pytest.fixture
def tiny(tiny_model: Path) -> Path:
    return tiny_model


def _out(tmp_path: Path, tiny: Path) -> Path:
    """A report folder whose shared model is the module's build, as the emulator would have built it."""
    out = tmp_path / "out"
    (out / "shared-model" / "models").mkdir(parents=True)
    (out / "shared-model" / "models" / tiny.name).symlink_to(tiny)
    return out


def _simulate(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> tuple[int, dict, str]:
    r = subprocess.run(
        [sys.executable, "-m", "murmur.node", "simulate", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return r.returncode, json.loads(lines[-1]) if lines else {}, r.stderr[-2000:]


def test_node_env_sets_only_keys_a_node_accepts() -> None:
    env = node_env(LinkSpec(up_bps=2_500_000.0, down_bps=12_500_000.0))
    assert set(env_overrides(env)) == {("network", "upload_bytes_per_s")}


@pytest.mark.slow
def test_an_emulated_node_that_exits_early_is_reported_and_fails_the_run(tmp_path: Path, tiny: Path) -> None:
    f = tmp_path / "two.toml"
    f.write_text('name = "two"\nduration_s = 60.0\n[[group]]\nname = "trainer"\ncount = 2\n')
    # a key the nodes refuse at start, as the removed download-rate key was
    rc, summary, err = _simulate(
        [str(f), "--smoke", "--out", str(_out(tmp_path, tiny))], env={"MURMUR_NETWORK_NO_SUCH_KEY": "1"}, timeout=300
    )
    assert rc == 1, err
    assert summary["nodes"] == 2 and summary["nodes_stepped"] == 0
    failed = summary["nodes_failed"]
    assert failed and {f["node"] for f in failed} <= {0, 1}
    for f in failed:
        assert f["exit_code"] != 0 and "MURMUR_NETWORK_NO_SUCH_KEY names no config key" in f["last_log_line"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[int, dict, str, Path]:
    """One whole (not --smoke) emulation that the tests below share: two trainers, a reward forger from 10 s,
    and a planned leave of node 1 at 30 s that comes back (the same home and key) at 40 s."""
    tmp = tmp_path_factory.mktemp("full-run")
    f = tmp / "emu.toml"
    f.write_text(
        'name = "emu"\nduration_s = 60.0\n[[group]]\ncount = 2\nupload_bytes_per_s = 2000000.0\n'
        '[[adversary]]\nbehaviour = "forged_reward"\nrate_per_s = 1.0\nstart_s = 10.0\n'
        '[[event]]\nat_s = 30.0\naction = "leave"\nnode = 1\n'
        '[[event]]\nat_s = 40.0\naction = "join"\nnode = 1\n'
        "[report]\nsample_every_s = 5.0\n"
    )
    out = _out(tmp, tiny_model)
    rc, summary, err = _simulate([str(f), "--out", str(out)], timeout=500)
    return rc, summary, err, out


@pytest.mark.slow
def test_emulation_runs_real_nodes_and_rejects_a_forger(full_run: tuple[int, dict, str, Path]) -> None:
    rc, s, err, out = full_run
    assert rc == 0, err
    assert s["mode"] == "emulate" and s["nodes"] == 3
    assert s["reward_samples"] >= 1
    assert s["rejections"].get("forged_reward", 0) >= 1, s["rejections"]  # the forger's rollouts were rejected
    assert (out / "index.html").is_file()
    # every node process was stopped
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "nodes") not in ps


@pytest.mark.slow
def test_a_planned_leave_and_rejoin_are_not_failures(full_run: tuple[int, dict, str, Path]) -> None:
    rc, summary, err, out = full_run
    assert rc == 0 and summary["nodes_failed"] == [], (summary.get("nodes_failed"), err)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    leaves = [r for r in rows if r["kind"] == "event" and r["action"] == "leave" and r["node"] == 1]
    assert leaves and leaves[0]["t"] < 60.0, leaves  # it left during the run, not only when the run ended
    joins = [
        r for r in rows if r["kind"] == "event" and r["action"] == "join" and r["node"] == 1 and r["t"] > leaves[0]["t"]
    ]
    assert joins and joins[0]["t"] < 60.0, joins  # and came back during it, as a restart does


def test_a_smoke_moves_on_to_the_next_event_only_once_no_running_node_waits_for_its_first_step() -> None:
    from murmur.simulations.emulate import smoke_skip

    assert smoke_skip(10.0, 60.0, waiting_for_a_step=True) == 0.0
    assert smoke_skip(10.0, 60.0, waiting_for_a_step=False) == 50.0
    assert smoke_skip(61.0, 60.0, waiting_for_a_step=False) == 0.0  # a due event is not moved back


def _fits_emulator(path: Path) -> bool:
    return len(sc_mod.expand(sc_mod.load(path))) <= MAX_REAL_NODES


# The default scenario is smoked as real processes here; every other packaged scenario's live smoke is a
# command (`murmur simulate -s NAME --smoke`, docs/researcher.md), since each costs one to two minutes of
# node starts on two cores, and the emulator's paths they take (real nodes, an adversary process, a planned
# leave and rejoin) are covered by `full_run` and the default smoke. Here they run in virtual time.
LIVE_SMOKE = {"default"}


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in PACKAGED if p.stem in LIVE_SMOKE], ids=lambda p: p.stem)
def test_packaged_scenario_starts_every_node_and_each_takes_a_step(path: Path, tmp_path: Path, tiny: Path) -> None:
    sc = sc_mod.load(path)
    honest = sum(1 for n in sc_mod.expand(sc) if n.role != "adversary")
    rc, summary, err = _simulate([str(path), "--smoke", "--out", str(_out(tmp_path, tiny))], timeout=900)
    assert rc == 0 and summary["nodes_failed"] == [], (summary.get("nodes_failed"), err)
    assert summary["nodes_stepped"] == honest, summary


# `huge` is `large`'s mix at ten times the size: setting up its 10,000 cores alone takes minutes here, so it is
# validated and expanded (--check) and `large` stands for it in virtual time.
TOO_BIG = [p for p in PACKAGED if not _fits_emulator(p)]
SETUP_ONLY = {"huge"}
IN_VIRTUAL_TIME = [p for p in PACKAGED if p.stem not in LIVE_SMOKE | SETUP_ONLY]


def test_every_packaged_scenario_is_smoked_live_started_virtually_or_checked() -> None:
    assert {p.stem for p in PACKAGED} == LIVE_SMOKE | SETUP_ONLY | {p.stem for p in IN_VIRTUAL_TIME}
    assert all(_fits_emulator(p) for p in PACKAGED if p.stem in LIVE_SMOKE)


@pytest.mark.slow
@pytest.mark.onecore  # one simulator process on one core: no live-swarm slot
@pytest.mark.parametrize("path", IN_VIRTUAL_TIME, ids=lambda p: p.stem)
def test_packaged_scenario_starts_in_virtual_time(path: Path, tmp_path: Path) -> None:
    # a scenario the emulator could run is run whole (its joins and restarts come late); a bigger one starts
    short = [] if _fits_emulator(path) else ["--duration", "2"]
    rc, summary, err = _simulate([str(path), "--virtual", *short, "--out", str(tmp_path)], timeout=900)
    assert rc == 0 and summary["mode"] == "virtual", err
    assert summary["nodes"] == len(sc_mod.expand(sc_mod.load(path)))


@pytest.mark.parametrize("path", [p for p in TOO_BIG if p.stem in SETUP_ONLY], ids=lambda p: p.stem)
def test_packaged_scenario_too_big_to_run_here_is_valid(path: Path) -> None:
    from typer.testing import CliRunner

    from murmur.node.cli.app import app

    r = CliRunner().invoke(app, ["simulate", str(path), "--check"])
    assert r.exit_code == 0 and f"{len(sc_mod.expand(sc_mod.load(path)))} nodes" in r.output, r.output[-500:]
