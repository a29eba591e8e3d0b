"""Benchmark and scenario harness: one public node and NATed homes in emulated networks (network namespaces).

`run()` builds: a public node (relay service + dial-back), home 1 and home 2 behind separate iptables
MASQUERADE routers; each node is a real subprocess in its namespace (`simulations.bench.reachability_node`). It
measures bulk MB/s direct (home -> public), relayed (home 1 -> home 2 through the public relay), after
hole punching (if it succeeds), WebRTC-direct on loopback, and the NATed node's time from process
start to its first verified rollout. Needs root, iproute2 and iptables; otherwise returns the reason.

`scenario(...)` is what the tests use; it returns every node's JSON events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the repository root: node subprocesses must run this checkout, not whatever the environment installed
REPO = Path(__file__).resolve().parents[2]
PORT = 4001
SEEDS = {"pub": 11, "h1": 12, "h2": 13, "udp": 14}


def peer_id_for(seed: int) -> str:
    from murmur.gossip.identity import Identity

    return Identity.from_seed(bytes([seed]) * 32).peer_id


@dataclass
class NodeProc:
    """A node subprocess; a reader thread appends its JSON events and sets `changed` on each."""

    name: str
    proc: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False

    def by(self, ev: str) -> list[dict[str, Any]]:
        with self.changed:
            return [e for e in self.events if e.get("ev") == ev]

    def first(self, ev: str) -> dict[str, Any] | None:
        got = self.by(ev)
        return got[0] if got else None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip().startswith("{"):
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                with self.changed:
                    self.events.append(ev)
                    self.changed.notify_all()
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wait_for(self, ev: str, timeout_s: float) -> bool:
        """True once the node printed event `ev`; False on timeout or exit."""
        end = time.monotonic() + timeout_s
        with self.changed:
            while not any(e.get("ev") == ev for e in self.events):
                left = end - time.monotonic()
                if self.closed or left <= 0:
                    return False
                self.changed.wait(left)
            return True


def _start(prefix: list[str], name: str, script: dict[str, Any]) -> NodeProc:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_dir = os.environ.get("MURMUR_NODE_LOG_DIR")
    err = open(os.path.join(log_dir, f"{name}.log"), "w") if log_dir else subprocess.DEVNULL
    p = subprocess.Popen(
        prefix + [sys.executable, "-m", "murmur.simulations.bench.reachability_node", json.dumps(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=str(REPO),
        env=env,
    )
    node = NodeProc(name, p)
    threading.Thread(target=node._read, daemon=True).start()
    return node


def _stop(nodes: list[NodeProc]) -> None:
    for n in nodes:
        try:
            if n.proc.stdin:
                n.proc.stdin.write("quit\n")
                n.proc.stdin.flush()
        except OSError:
            pass
    for n in nodes:
        try:
            n.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            n.proc.kill()
            n.proc.wait(timeout=5)


def scenario(
    bulk_bytes: int = 4 << 20,
    holepunch: bool = True,
    symmetric: bool = False,
    forward_h2: bool = False,
    timeout_s: float = 240.0,
) -> dict[str, NodeProc]:
    """Public node + two NATed homes; every node gossips and bulk-transfers to every other. Returns the nodes."""
    sys.path.insert(0, str(REPO))
    from murmur.simulations.netns import Network

    ids = {k: peer_id_for(s) for k, s in SEEDS.items()}
    with Network() as net:
        h1, h2 = net.add_home(symmetric=symmetric), net.add_home(symmetric=symmetric)
        if forward_h2:
            net.forward_port(h2, PORT)
        pub_addr = f"/ip4/{net.pub_ip}/tcp/{PORT}/p2p/{ids['pub']}"
        listen = f"/ip4/0.0.0.0/tcp/{PORT}"

        def home_script(me: str, other: str, other_home: Any, seed: int) -> dict[str, Any]:
            # what the other home's NodeAnnounce would carry: its WAN address (dialable only with port
            # forwarding) and its circuit through the relay; node.shell.reachability decides which side dials
            peer = {
                "name": other,
                "id": ids[other],
                "addrs": [
                    f"/ip4/{other_home.wan_ip}/tcp/{PORT}/p2p/{ids[other]}",
                    f"{pub_addr}/p2p-circuit/p2p/{ids[other]}",
                ],
            }
            return {
                "name": me,
                "seed": seed,
                "listen": listen,
                "relays": [pub_addr],
                "bootstrap": [pub_addr],
                "peers": [peer],
                "holepunch": holepunch,
                "bulk_bytes": bulk_bytes,
                "expect_hello": ["pub", other],
            }

        nodes: list[NodeProc] = []
        try:
            pub = _start(
                net.exec_prefix(net.pub_ns),
                "pub",
                {
                    "name": "pub",
                    "seed": SEEDS["pub"],
                    "listen": listen,
                    "relay_service": True,
                    "publish_rollouts": True,
                    "expect_hello": ["h1", "h2"],
                },
            )
            nodes.append(pub)
            if not pub.wait_for("ready", 30):
                raise RuntimeError("public node did not start")
            nodes.append(_start(net.exec_prefix(h1.ns), "h1", home_script("h1", "h2", h2, SEEDS["h1"])))
            nodes.append(_start(net.exec_prefix(h2.ns), "h2", home_script("h2", "h1", h1, SEEDS["h2"])))
            end = time.monotonic() + timeout_s
            for n in nodes[1:]:
                n.wait_for("done", max(0.0, end - time.monotonic()))
        finally:
            _stop(nodes)
    return {n.name: n for n in nodes}


def webrtc_scenario(bulk_bytes: int = 1 << 20, timeout_s: float = 180.0) -> dict[str, NodeProc]:
    """A public node and one home whose router drops all outbound TCP (UDP masqueraded): the home
    knows the public node's TCP and /webrtc-direct addresses, as its announce carries them; node.shell.reachability
    must try TCP, fail, and connect over WebRTC-direct; then rollouts, hellos and a bulk with hash flow.
    Needs aiortc in both processes (returns whatever they printed; callers check)."""
    sys.path.insert(0, str(REPO))
    from murmur.simulations.netns import Network

    ids = {k: peer_id_for(s) for k, s in SEEDS.items()}
    with Network() as net:
        home = net.add_home(block_tcp=True)
        listen = f"/ip4/0.0.0.0/tcp/{PORT}"
        nodes: list[NodeProc] = []
        try:
            pub = _start(
                net.exec_prefix(net.pub_ns),
                "pub",
                {
                    "name": "pub",
                    "seed": SEEDS["pub"],
                    "listen": listen,
                    "publish_rollouts": True,
                    "expect_hello": ["udp"],
                    "wait_webrtc_s": 60,
                    "check_s": 1,
                    "gossip_s": timeout_s,
                },
            )
            nodes.append(pub)
            if not pub.wait_for("ready", 90):
                raise RuntimeError("public node did not start")
            ready = pub.first("ready") or {}
            rtc = [a for a in ready.get("webrtc_addrs", []) if f"/ip4/{net.pub_ip}/" in a]
            if not rtc:
                raise RuntimeError(f"public node has no /webrtc-direct address: {ready.get('webrtc_error')!r}")
            tcp = f"/ip4/{net.pub_ip}/tcp/{PORT}/p2p/{ids['pub']}"
            nodes.append(
                _start(
                    net.exec_prefix(home.ns),
                    "udp",
                    {
                        "name": "udp",
                        "seed": SEEDS["udp"],
                        "listen": listen,
                        "bulk_bytes": bulk_bytes,
                        "peers": [{"name": "pub", "id": ids["pub"], "addrs": [tcp] + rtc[:1]}],
                        "reach_bootstrap": [tcp] + rtc[:1],  # configured, as a volunteer lists a known node
                        "expect_hello": ["pub"],
                        "holepunch": False,
                        "check_s": 0,
                        "connect_s": 90,
                    },
                )
            )
            nodes[1].wait_for("done", timeout_s)
        finally:
            _stop(nodes)
    return {n.name: n for n in nodes}


def _webrtc_nat(bulk_bytes: int) -> dict[str, Any]:
    """`webrtc_nat_*` keys: WebRTC-direct through an emulated NAT that lets only UDP out."""
    from murmur.gossip.webrtc import webrtc_unavailable

    reason = webrtc_unavailable()
    if reason:
        return {"webrtc_nat_mb_s": None, "webrtc_nat_reason": reason}
    try:
        nodes = webrtc_scenario(bulk_bytes=bulk_bytes)
    except RuntimeError as e:
        return {"webrtc_nat_mb_s": None, "webrtc_nat_reason": str(e)}
    h = nodes["udp"]
    conn = h.first("connected") or {}
    bulk = [e for e in h.by("bulk") if e["peer"] == "pub"]
    first = h.first("first_rollout") or {}
    ok = bool(bulk) and bulk[0]["hash_ok"]
    return {
        "webrtc_nat_mb_s": bulk[0]["mb_s"] if ok else None,
        "webrtc_nat_path": conn.get("path"),
        "webrtc_nat_connect_s": conn.get("s"),
        "webrtc_nat_first_rollout_after_ready_ms": first.get("after_ready_ms"),
        "webrtc_nat_doctor_path": (h.first("doctor") or {}).get("path"),
        "webrtc_nat_reason": None
        if ok
        else "no bulk transfer completed with the right hash: "
        + json.dumps([e for e in h.events if e.get("ev") in ("connect_failed", "bulk", "bulk_failed")])[:300],
    }


def run(bulk_bytes: int = 8 << 20, symmetric: bool = False) -> dict[str, Any]:
    """Measure every path once. Keys: direct_mb_s, relayed_mb_s, holepunched, holepunched_mb_s, webrtc_mb_s,
    time_to_first_message_ms (NATed node, from process start, incl. imports), plus reasons where null."""
    from murmur.simulations.netns import netns_unavailable

    out: dict[str, Any] = {"bench": "reachability", "bulk_bytes": bulk_bytes}
    reason = netns_unavailable()
    if reason:
        out.update(
            direct_mb_s=None,
            relayed_mb_s=None,
            holepunched=False,
            holepunched_mb_s=None,
            time_to_first_message_ms=None,
            netns_reason=reason,
        )
    else:
        nodes = scenario(bulk_bytes=bulk_bytes, symmetric=symmetric)
        out["symmetric_nat"] = symmetric
        h1, h2 = nodes["h1"], nodes["h2"]
        bulks = [(n.name, e) for n in (h1, h2) for e in n.by("bulk")]
        direct = [e["mb_s"] for name, e in bulks if e["peer"] == "pub" and e["hash_ok"]]
        relayed = [e["mb_s"] for name, e in bulks if e["path"] == "relayed" and e["hash_ok"]]
        punched = [e["mb_s"] for name, e in bulks if e["peer"] != "pub" and e["path"] == "direct" and e["hash_ok"]]
        hp = h1.first("holepunch") or h2.first("holepunch") or {}
        # honest: from the process's own start (interpreter start and imports included)
        firsts = [
            (f, (n.first("ready") or {}).get("before_t0_ms", 0.0)) for n in (h1, h2) if (f := n.first("first_rollout"))
        ]
        best = min(firsts, key=lambda x: x[0]["t_ms"] + x[1]) if firsts else None
        ttfm = [round(f["t_ms"] + pre, 1) for f, pre in firsts]
        out.update(
            direct_mb_s=max(direct) if direct else None,
            relayed_mb_s=max(relayed) if relayed else None,
            holepunched=bool(hp.get("ok")),
            holepunch_s=hp.get("s"),
            holepunch_error=hp.get("error") or None,
            holepunched_mb_s=max(punched) if punched else None,
            time_to_first_message_ms=min(ttfm) if ttfm else None,
            time_to_first_message_after_host_ready_ms=min(f["after_ready_ms"] for f, _ in firsts) if firsts else None,
            time_to_first_message_breakdown_ms=best[0].get("breakdown_ms") if best else None,
            port_preserved={n.name: (n.first("reachability") or {}).get("port_preserved") for n in (h1, h2)},
            reachability={n.name: (n.first("reachability") or {}).get("status") for n in nodes.values()},
            doctor_path={n.name: (n.first("doctor") or {}).get("path") for n in nodes.values()},
            gossip_ok=all((n.first("gossip") or {}).get("ok") for n in nodes.values()),
        )
    out.update(_webrtc())
    if not reason:
        out.update(_webrtc_nat(min(bulk_bytes, 4 << 20)))
    out["node_runtime_import_s"] = _import_cost("murmur.node.shell.runtime")
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    return out


def _import_cost(module: str) -> float | None:
    """Seconds a fresh interpreter takes to import `module`: what a real node pays before its host starts."""
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=str(REPO),
        capture_output=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
    )
    return round(time.perf_counter() - t, 2) if r.returncode == 0 else None


def _webrtc() -> dict[str, Any]:
    import trio

    from murmur.gossip.webrtc import WebRTCUnavailable, measure_loopback, webrtc_unavailable

    reason = webrtc_unavailable()
    if reason:
        return {"webrtc_mb_s": None, "webrtc_reason": reason}
    try:
        r = trio.run(measure_loopback, 4 << 20, 60.0)
    except WebRTCUnavailable as e:
        return {"webrtc_mb_s": None, "webrtc_reason": str(e)}
    return {
        "webrtc_mb_s": r["mb_s"],
        "webrtc_connect_s": r["connect_s"],
        "webrtc_hash_ok": r["hash_ok"],
        "webrtc_note": "py<->py /webrtc-direct on loopback (not through the emulated NATs)",
    }


if __name__ == "__main__":
    print(json.dumps(run()))
