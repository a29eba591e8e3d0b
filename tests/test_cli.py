"""The CLI as users run it: a real subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

MURMUR = [sys.executable, "-m", "node"]


def run(*args: str, home: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    if home is not None:
        e["MURMUR_HOME"] = str(home)
    return subprocess.run([*MURMUR, *args], capture_output=True, text=True, env=e, timeout=120)


def test_init_id_config(tmp_path):
    home = tmp_path / "h"
    r = run("init", home=home)
    assert r.returncode == 0, r.stderr
    peer = [ln.split()[-1] for ln in r.stdout.splitlines() if ln.startswith("peer id")][0]
    assert stat.S_IMODE(os.stat(home / "identity.pem").st_mode) == 0o600
    assert (home / "config.toml").exists() and (home / "state.db").exists()

    again = run("init", home=home)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr

    r = run("id", "--json", home=home)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["peer_id"] == peer and len(bytes.fromhex(info["public_key"])) == 32

    r = run("config", "show", "--json", home=home, env={"MURMUR_SYNC_MAX_STALENESS": "9"})
    cfg = json.loads(r.stdout.strip().splitlines()[-1])
    assert cfg["sync.max_staleness"] == {"value": 9, "source": "env MURMUR_SYNC_MAX_STALENESS"}


def test_errors_are_one_line(tmp_path):
    home = tmp_path / "h"
    assert run("init", home=home).returncode == 0
    (home / "config.toml").write_text("[network]\nbogus = 1\n")
    r = run("config", "show", home=home)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "network.bogus" in r.stderr and "config.toml" in r.stderr
    (home / "identity.pem").write_text("nope")
    r = run("id", home=home)
    assert r.returncode == 2 and "identity.pem" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("murmur ")
