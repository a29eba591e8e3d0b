"""`murmur simulate` end to end: bad scenarios are one line + exit 2; --virtual writes a report; emulation (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _murmur(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "node", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_bad_scenario_is_one_line_exit_2(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[[group]]\ncount = 2\nloss = 2.0\n")
    r = _murmur("simulate", str(p), "--virtual")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {p}: key 'group[0].loss'"), r.stderr


def test_virtual_run_writes_report_and_json(tmp_path) -> None:
    p = tmp_path / "s.toml"
    p.write_text('name = "cli"\nduration_s = 15.0\n[[group]]\ncount = 3\n[training]\nstep_s = 1.0\n'
                 "[sync]\npatch_bytes = 65536\nchunk_bytes = 16384\nbroadcasts = 1\n")
    out = tmp_path / "rep"
    r = _murmur("simulate", str(p), "--virtual", "--out", str(out), "--json", "--seed", "5")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "virtual" and summary["seed"] == 5 and summary["nodes"] == 3
    assert (out / "index.html").is_file() and (out / "reward.png").is_file()
    assert 'seed = 5' in (out / "scenario.toml").read_text()


@pytest.mark.slow
def test_emulation_runs_real_nodes_and_rejects_a_forger(tmp_path, tiny_model) -> None:
    p = tmp_path / "emu.toml"
    p.write_text('name = "emu"\nduration_s = 90.0\n[[group]]\ncount = 2\nupload_bytes_per_s = 2000000.0\n'
                 '[[adversary]]\nbehaviour = "forged_reward"\nrate_per_s = 1.0\nstart_s = 30.0\n'
                 "[report]\nsample_every_s = 5.0\n")
    out = tmp_path / "rep"
    (out / "shared-model" / "models").mkdir(parents=True)  # the session's build, where the emulator keeps its own
    (out / "shared-model" / "models" / tiny_model.name).symlink_to(tiny_model)
    r = _murmur("simulate", str(p), "--out", str(out), "--json", timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["mode"] == "emulate" and s["nodes"] == 3
    assert s["reward_samples"] >= 1
    assert s["rejections"].get("forged_reward", 0) >= 1, s["rejections"]  # the forger's rollouts were rejected
    assert (out / "index.html").is_file()
    # every node process was stopped
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "nodes") not in ps
