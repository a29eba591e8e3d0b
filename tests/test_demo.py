"""README's first command, `murmur demo`, end to end (short): three real node processes on loopback train,
publish versions, follow, verify each other's rollouts, and the summary says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_publishes_follows_and_verifies(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "node", "demo", "--duration", "45", "--no-tui", "--json",
                        "--dir", str(tmp_path / "demo")], capture_output=True, text=True, timeout=580, env=env,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    nodes = {n["node"].split("-", 1)[1]: n for n in s["nodes"]}
    assert set(nodes) == {"trainer", "trainer+validator", "follower+validator"}, s
    assert not [n for n in s["nodes"] if "error" in n], s
    for name in ("trainer", "trainer+validator"):  # they step and publish their lineages
        assert nodes[name]["steps"] > 0 and nodes[name]["versions_published"] >= 1, nodes[name]
    assert nodes["follower+validator"]["versions_applied"] >= 1, nodes["follower+validator"]
    assert sum(n["rollouts_accepted"] for n in s["nodes"]) > 0, s  # peers verified and used each other's rollouts
    assert s["families"], s  # held-out accuracy per task family
