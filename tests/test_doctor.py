"""`murmur doctor`: every check passes or fails with a fix; an unreachable bootstrap peer fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from murmur.gossip.identity import Identity
from murmur.node.cli.doctor import CHECKS, Check, Context, check_listen_ports, passed, run_checks
from murmur.node.cli.launch import free_port
from murmur.node.config import Config


def test_unreachable_bootstrap_is_a_failed_check_with_fix(tmp_path: Path) -> None:
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[network]\nlisten = ["/ip4/127.0.0.1/tcp/{free_port()}"]\nbootstrap = ["{dead}"]\n')
    env = dict(os.environ, MURMUR_HOME=str(tmp_path / "home"))
    r = subprocess.run(
        [sys.executable, "-m", "murmur.node", "doctor", "--json", "--config", str(cfg), "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is False
    boot = [c for c in out["checks"] if c["name"] == f"bootstrap {dead}"]
    assert len(boot) == 1 and boot[0]["ok"] is False and boot[0]["fix"]
    names = {c["name"].split(" ")[0] for c in out["checks"]}
    assert {"python", "torch", "libp2p", "listen", "bootstrap", "reachability", "disk", "memory"} <= names
    assert all(c["ok"] or c["fix"] for c in out["checks"])  # every failure says what to do


def test_busy_port_fails_with_fix(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = s.getsockname()[1]
        cfg = Config()
        cfg.network.listen = [f"/ip4/127.0.0.1/tcp/{port}"]
        [c] = check_listen_ports(Context(cfg, tmp_path))
    finally:
        s.close()
    assert not c.ok and str(port) in c.fix


def test_checks_are_extensible_and_crashes_are_findings(tmp_path: Path) -> None:
    def check_nat(ctx: Context) -> list[Check]:
        return [Check(name="nat", ok=False, detail="symmetric", fix="use a relay", severity="warning")]

    def check_broken(ctx: Context) -> list[Check]:
        raise RuntimeError("boom")

    out = run_checks(Config(), tmp_path, checks=[check_nat, check_broken])
    assert [c.name for c in out] == ["nat", "broken"]
    assert not out[1].ok and "boom" in out[1].detail and out[1].fix
    assert not passed(out)
    assert passed(out[:1])  # warnings alone do not fail the doctor
    assert len(CHECKS) >= 8
