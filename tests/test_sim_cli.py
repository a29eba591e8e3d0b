"""`murmur simulate` end to end: bad scenarios are one line + exit 2; --virtual writes a report. A whole emulation
run, end to end, is in tests/test_emulation_nodes.py (`full_run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _murmur(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "murmur.node", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_bad_scenario_is_one_line_exit_2(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[[group]]\ncount = 2\nloss = 2.0\n")
    r = _murmur("simulate", str(p), "--virtual")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {p}: key 'group[0].loss'"), r.stderr


def test_virtual_run_writes_report_and_json(tmp_path) -> None:
    p = tmp_path / "s.toml"
    p.write_text(
        'name = "cli"\nduration_s = 15.0\n[[group]]\ncount = 3\n[training]\nstep_s = 1.0\n'
        "[sync]\npatch_bytes = 65536\nchunk_bytes = 16384\nbroadcasts = 1\n"
    )
    out = tmp_path / "rep"
    r = _murmur("simulate", str(p), "--virtual", "--out", str(out), "--json", "--seed", "5")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "virtual" and summary["seed"] == 5 and summary["nodes"] == 3
    assert (out / "index.html").is_file() and (out / "reward.png").is_file()
    assert "seed = 5" in (out / "scenario.toml").read_text()
