"""The CLI as users run it: a real subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

MURMUR = [sys.executable, "-m", "murmur.node"]


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

    # the rest through typer's runner: what the commands do, the console script's start being covered above
    again = run_in_process("init", home=home)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr

    r = run_in_process("id", "--json", home=home)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["peer_id"] == peer and len(bytes.fromhex(info["public_key"])) == 32

    r = run_in_process("config", "show", "--json", home=home, env={"MURMUR_SYNC_MAX_STALENESS": "9"})
    cfg = json.loads(r.stdout.strip().splitlines()[-1])
    assert cfg["sync.max_staleness"] == {"value": 9, "source": "env MURMUR_SYNC_MAX_STALENESS"}


def test_errors_are_one_line(tmp_path):
    home = tmp_path / "h"
    assert run_in_process("init", home=home).returncode == 0
    (home / "config.toml").write_text("[network]\nbogus = 1\n")
    r = run("config", "show", home=home)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "network.bogus" in r.stderr and "config.toml" in r.stderr
    (home / "identity.pem").write_text("nope")
    r = run("id", home=home)
    assert r.returncode == 2 and "identity.pem" in r.stderr and "Traceback" not in r.stderr


def test_bench_swarm_rejects_a_seed_count_below_one():
    r = run("bench", "swarm", "--seeds", "0")
    assert r.returncode == 2 and "--seeds" in r.stderr and "Traceback" not in r.stderr


def test_bench_swarm_matched_takes_a_follower_count_and_rejects_a_negative_one():
    r = run("bench", "swarm", "--matched", "--followers", "1", "--seeds", "0")  # parsed: only --seeds is wrong
    assert r.returncode == 2 and "--seeds" in r.stderr and "followers" not in r.stderr
    r = run("bench", "swarm", "--matched", "--followers", "-1")
    assert r.returncode == 2 and "--followers" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("murmur ")


def run_in_process(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The same command through typer's runner in this process, with `main`'s error mapping: for tests of what a
    command does, where the console script's own start (covered by the subprocess tests here) is not the subject."""
    from typer.testing import CliRunner

    from murmur.gossip.errors import MurmurError
    from murmur.node.cli.app import app

    res = CliRunner().invoke(app, list(args), env={**(env or {}), "MURMUR_HOME": str(home)})
    if isinstance(res.exception, MurmurError):
        return subprocess.CompletedProcess(args, 2, res.stdout, res.stderr + f"error: {res.exception}\n")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


def test_tasks_publish_list_show(tmp_path):
    home = tmp_path / "h"
    example = Path(__file__).resolve().parents[1] / "training" / "tasksets" / "example.toml"
    r = run("tasks", "publish", str(example), "--json", home=home)
    assert r.returncode == 0, r.stderr
    pub = json.loads(r.stdout.strip().splitlines()[-1])
    ident = json.loads(run_in_process("id", "--json", home=home).stdout.strip().splitlines()[-1])
    assert pub["coordinator"] == ident["public_key"] and pub["new"]
    listed = json.loads(run_in_process("tasks", "list", "--json", home=home).stdout.strip().splitlines()[-1])
    assert {t["task_set_id"] for t in listed["sets"]} >= {pub["task_set_id"]}
    assert any(t["origin"] == "built-in" for t in listed["sets"])
    shown = run_in_process("tasks", "show", pub["task_set_id"][:10], home=home)
    assert shown.returncode == 0 and '"example-arith-digits"' in shown.stdout
    # publishing the same file again signs a new set (new created_ms), never corrupts the old one
    assert run_in_process("tasks", "publish", str(example), home=home).returncode == 0


def test_tasks_publish_bad_input(tmp_path):
    home = tmp_path / "h"
    cases = {
        "unknown_verifier.toml": (
            'name="x"\nversion=1\nverifier="nope"\n[[generators]]\nname="a"\ngenerator="arithmetic"\nseed_end=5\n',
            "unknown verifier",
        ),
        "unknown_generator.toml": (
            'name="x"\nversion=1\nverifier="exact"\n[[generators]]\nname="a"\ngenerator="nosuch"\nseed_end=5\n',
            "unknown generator",
        ),
        "malformed.toml": ("[[[", "not valid TOML"),
    }
    for i, (name, (text, needle)) in enumerate(cases.items()):
        path = tmp_path / name
        path.write_text(text)
        r = (run if i == 0 else run_in_process)("tasks", "publish", str(path), home=home)  # one console-script start
        assert r.returncode == 2 and needle in r.stderr and str(path) in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
    r = run_in_process("tasks", "show", "ffffffffff", home=home)
    assert r.returncode == 2 and "no match" in r.stderr


def test_bench_swarm_matched_adversary_needs_a_swarm_of_three():
    r = run("bench", "swarm", "--matched", "--adversary", "--nodes", "2")
    assert r.returncode == 2 and "--adversary" in r.stderr and "Traceback" not in r.stderr
    r = run("bench", "swarm", "--matched", "--adversary", "--followers", "1")
    assert r.returncode == 2 and "--adversary" in r.stderr and "Traceback" not in r.stderr


def test_bench_swarm_matched_foreign_takes_only_foreign_keys_with_valid_values(tmp_path):
    for bad, needle in [
        ("lr=1", "not a swarm-rollout key"),
        ("foreign_pool=maybe", "true or false"),
        ("foreign_share_max=2", "foreign_share_max"),
        ("foreign_alpha", "KEY=VALUE"),
    ]:
        r = run_in_process("bench", "swarm", "--matched", "--foreign", bad, home=tmp_path)
        assert r.returncode == 2 and "--foreign" in r.stderr and needle in r.stderr, (bad, r.stderr)
    from murmur.node.cli.cmd_bench import _foreign_overrides

    got = _foreign_overrides(
        ["foreign_pool=false", "foreign_share_max=0", "foreign_capability_max=10", "pod_yield=false"]
    )
    assert got == {"foreign_pool": False, "foreign_share_max": 0.0, "foreign_capability_max": 10.0, "pod_yield": False}
