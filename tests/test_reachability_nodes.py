"""Real nodes (`murmur node start`) behind emulated NATs: a public relay node and two NATed homes.

h1 (trainer) and h2 (follower) sit behind separate MASQUERADE routers; pub (follower, relay service) is
public. The homes must find out they are private, reserve on the relay, find each other from the signed
announces, connect (relayed, or hole-punched), and the swarm must work across: h1's patches reach pub
and h2, rollouts reach h1. `murmur doctor` must report each case: a running NATed node, a one-shot
probe from a symmetric-NAT home (relayed, ports not preserved) and from a home with port forwarding
(direct, public). Needs root, iproute2, iptables; skips with the reason otherwise. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from murmur.node.cli import launch
from murmur.node.cli.launch import status as _status
from murmur.node.status import NodeStatus
from murmur.simulations.netns import Network, netns_unavailable

REASON = netns_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.solo,
    pytest.mark.skipif(REASON is not None, reason=f"no emulated networks: {REASON}"),
]

REPO = Path(__file__).resolve().parent.parent
PORT = 4001
WAIT_S = 360.0


def _config(
    roles: list[str], model: Path, relay_service: bool = False, relays: list[str] | None = None
) -> dict[str, dict[str, object]]:
    return {
        "node": {"swarm": "nat-swarm", "roles": roles, "memory_budget_mb": 1536},
        "network": {
            "listen": [f"/ip4/0.0.0.0/tcp/{PORT}"],
            "dht": False,
            "relay_service": relay_service,
            "relays": relays or [],
        },
        # This test is about paths, not staleness (tests/test_node_swarm.py covers that): on a quiet
        # machine the trainer publishes so fast that followers behind a relay would be 20+ versions
        # late, and the capacity rule rightly puts them on standby. A wide bound keeps them serving.
        "sync": {"publish_every": 8, "anchor_every": 8, "max_staleness": 256},
        "training": {"model": str(model), "external_rollouts": 64},
    }


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _start(net: Network, ns: str, home: Path, config: dict, bootstrap: list[str]) -> launch.NodeProcess:
    """A node in namespace `ns`, listening where its config says (the doctor reads the port from it)."""
    return launch.start(
        launch.NodeLaunch(
            home=str(home),
            config=config,
            listen=[],
            bootstrap=bootstrap,
            prefix=net.exec_prefix(ns),
            env={"PYTHONPATH": str(REPO)},
        )
    )


def _doctor(net: Network, ns: str, home: Path, extra: list[str]) -> dict:
    cmd = (
        net.exec_prefix(ns)
        + [sys.executable, "-m", "murmur.node", "doctor", "--json", "--home", str(home), "--timeout", "5"]
        + extra
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=str(REPO))
    return json.loads(r.stdout.strip().splitlines()[-1])


def _wait(what: str, pred: Callable[[], bool], procs: list[launch.NodeProcess], timeout: float = WAIT_S) -> None:
    launch.wait_until(what, pred, procs, timeout)


@pytest.fixture
def model(tiny_model: Path) -> Path:
    return tiny_model


def _check(out: dict, name: str) -> dict:
    return next(c for c in out["checks"] if c["name"] == name)


def test_real_nodes_behind_nats(tmp_path: Path, model: Path) -> None:
    homes = {n: tmp_path / n for n in ("pub", "h1", "h2", "h3", "h4")}
    for h in homes.values():
        h.mkdir()
    procs: dict[str, launch.NodeProcess] = {}
    with Network() as net:
        h1, h2 = net.add_home(), net.add_home()
        h3 = net.add_home(symmetric=True)  # one-shot doctor only
        h4 = net.add_home()
        net.forward_port(h4, PORT)  # one-shot doctor only
        pool = ThreadPoolExecutor(2)
        try:
            procs["pub"] = _start(
                net, net.pub_ns, homes["pub"], _config(["follower", "validator"], model, relay_service=True), []
            )
            allp = lambda: list(procs.values())  # noqa: E731
            _wait("pub listening", lambda: bool((_status(homes["pub"]) or NodeStatus()).peer_id), allp())
            pub_id = _status(homes["pub"]).peer_id
            pub_addr = f"/ip4/{net.pub_ip}/tcp/{PORT}/p2p/{pub_id}"
            # The one-shot doctors need only pub: they run while the swarm below forms (mostly waiting on
            # dials and reservations), and are read at the end.
            for h in ("h3", "h4"):
                launch.write_config(homes[h], {"network": {"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"]}})
            one_shot = {
                h: pool.submit(_doctor, net, home.ns, homes[h], ["--bootstrap", pub_addr])
                for h, home in (("h3", h3), ("h4", h4))
            }
            # h1 lists the relay explicitly; h2 relies on the fallback (its bootstrap peer as relay)
            procs["h1"] = _start(net, h1.ns, homes["h1"], _config(["trainer"], model, relays=[pub_addr]), [pub_addr])
            procs["h2"] = _start(net, h2.ns, homes["h2"], _config(["follower", "validator"], model), [pub_addr])
            _wait("h1, h2 up", lambda: all(_status(homes[n]) for n in ("h1", "h2")), allp())
            ids = {n: _status(homes[n]).peer_id for n in ("pub", "h1", "h2")}

            def reach(n: str):
                s = _status(homes[n])
                return s.reach if s else None

            _wait(
                "homes private with a relay reservation",
                lambda: all((r := reach(n)) and r.status == "private" and r.reservations for n in ("h1", "h2")),
                allp(),
                120,
            )
            _wait("pub public", lambda: (r := reach("pub")) is not None and r.status == "public", allp(), 120)

            def homes_connected() -> bool:
                r1, r2 = reach("h1"), reach("h2")
                return bool(
                    r1
                    and r2
                    and r1.peer_paths.get(ids["h2"], "none") != "none"
                    and r2.peer_paths.get(ids["h1"], "none") != "none"
                )

            _wait("h1 and h2 connected to each other (relayed or hole-punched)", homes_connected, allp(), 180)

            def lin(n: str, lineage: str | None = None):
                s = _status(homes[n])
                if s is None:
                    return None
                if lineage is None:
                    return next((x for x in s.lineages if x.relation == "own"), None)
                return next((x for x in s.lineages if x.lineage == lineage), None)

            def swarm_works() -> bool:
                own = lin("h1")
                if own is None or own.held < 2:
                    return False
                for f in ("pub", "h2"):  # h1's patches verified and applied at both
                    x = lin(f, own.lineage)
                    if x is None or x.held < 2:
                        return False
                t, s2 = _status(homes["h1"]), _status(homes["h2"])
                return bool(t and s2 and t.rollouts_accepted > 0 and s2.rollouts_accepted > 0)

            _wait("patches from NATed h1 reach pub and h2; rollouts reach h1", swarm_works, allp())
            s2 = _status(homes["h2"])
            assert s2.bytes_down > 0
            r1, r2, rp = reach("h1"), reach("h2"), reach("pub")
            assert rp.path == "direct" and rp.relay_service, rp
            for r in (r1, r2):
                assert r.path in ("relayed", "hole-punched"), r
                assert any("/p2p-circuit/p2p/" in a for a in r.announce_addrs), r.announce_addrs
                assert r.observed_ips, "pub told the home how it sees it (its router's WAN address)"
            assert r1.port_preserved is True, "MASQUERADE keeps free source ports"

            # doctor on a home with a running node: its live path and why
            d1 = _doctor(net, h1.ns, homes["h1"], [])
            c = _check(d1, "reachability")
            assert c["detail"].startswith("running node: path: ") and "behind NAT" in c["detail"], c
            assert r1.path in c["detail"] and "forward TCP port 4001" in c["fix"], c

            # one-shot doctor, symmetric NAT: private, reservation on the bootstrap peer, relayed, why
            d3 = one_shot["h3"].result()
            c3 = _check(d3, "reachability")
            assert "path: relayed" in c3["detail"] and "changes source ports" in c3["detail"], c3
            assert _check(d3, "relay")["ok"] and "1 reservation" in _check(d3, "relay")["detail"], d3

            # one-shot doctor, port forwarded: public, direct
            d4 = one_shot["h4"].result()
            c4 = _check(d4, "reachability")
            assert c4["ok"] and "path: direct" in c4["detail"] and "publicly reachable" in c4["detail"], c4
        finally:
            launch.stop_all(procs.values())
            pool.shutdown(wait=True)  # before the namespaces go


def test_udp_only_home_reaches_public_trainer_over_webrtc(tmp_path: Path, model: Path, webrtc_extra: None) -> None:
    """A home whose router drops all outbound TCP (only UDP gets out): a real follower+validator node
    there, given the public trainer's TCP and /webrtc-direct addresses as bootstrap, reaches it over
    WebRTC-direct only; the home's signed rollouts are verified and accepted by the trainer, the
    trainer's signed patch manifests and chunks reach the home (>= 2 patches verified and applied, over
    /murmur/catalog/1 and /murmur/chunks/1 streams opened under that gossip load), and `murmur doctor`
    reports the path as webrtc. Chunks arrive only with `gossip.webrtc`'s bytearray-write workaround
    (docs/reachability.md, "WebRTC-direct: what is real")."""
    homes = {n: tmp_path / n for n in ("pub", "udp")}
    for h in homes.values():
        h.mkdir()
    procs: dict[str, launch.NodeProcess] = {}
    with Network() as net:
        home = net.add_home(block_tcp=True)
        try:
            procs["pub"] = _start(net, net.pub_ns, homes["pub"], _config(["trainer"], model), [])
            allp = lambda: list(procs.values())  # noqa: E731

            def pub_rtc() -> list[str]:
                s = _status(homes["pub"])
                addrs = s.reach.listen_addrs if s and s.reach else []
                return [a for a in addrs if "/webrtc-direct/" in a and f"/ip4/{net.pub_ip}/" in a]

            _wait("pub listening on /webrtc-direct", lambda: bool(pub_rtc()), allp())
            pub_id = _status(homes["pub"]).peer_id
            pub_tcp = f"/ip4/{net.pub_ip}/tcp/{PORT}/p2p/{pub_id}"
            procs["udp"] = _start(
                net, home.ns, homes["udp"], _config(["follower", "validator"], model), [pub_tcp, pub_rtc()[0]]
            )

            def reach(n: str):
                s = _status(homes[n])
                return s.reach if s else None

            _wait(
                "the UDP-only home connected to pub over WebRTC-direct",
                lambda: (r := reach("udp")) is not None and r.peer_paths.get(pub_id) == "webrtc",
                allp(),
                180,
            )

            def own_lineage():
                s = _status(homes["pub"])
                return next((x for x in s.lineages if x.relation == "own"), None) if s else None

            def home_lineage():
                own, s = own_lineage(), _status(homes["udp"])
                return next((x for x in s.lineages if x.lineage == own.lineage), None) if own and s else None

            # the home learns pub's lineage from its signed announce and manifests, serves it, and pub
            # verifies and accepts the home's signed rollouts: gossip both ways over WebRTC-direct
            _wait(
                "the home's rollouts accepted by pub; pub's lineage known at the home",
                lambda: bool((t := _status(homes["pub"])) and t.rollouts_accepted > 0 and home_lineage()),
                allp(),
            )
            r = reach("udp")
            assert r.path == "webrtc" and set(r.peer_paths.values()) == {"webrtc"}, r
            assert reach("pub").peer_paths.get(_status(homes["udp"]).peer_id) == "webrtc", reach("pub")
            d = _doctor(net, home.ns, homes["udp"], [])
            c = _check(d, "reachability")
            assert c["detail"].startswith("running node: path: webrtc") and "1 webrtc" in c["detail"], c
            assert "TCP" in c["fix"], c
            _wait(
                "pub's patches verified and applied at the home",
                lambda: bool((x := home_lineage()) and x.held >= 2 and _status(homes["udp"]).bytes_down > 0),
                allp(),
                120,
            )
            assert reach("udp").path == "webrtc", "the patches came over WebRTC-direct (TCP stays dropped)"
        finally:
            launch.stop_all(procs.values())
