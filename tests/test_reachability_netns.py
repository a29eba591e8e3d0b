"""NAT traversal paths measured by the benchmark harness (simulations.bench.reachability_node: the real host and
node.shell.reachability wiring plus a raw bulk stream), one subprocess per network namespace behind iptables NATs.

The real node (`murmur node start`) behind NATs is tested in tests/test_reachability_nodes.py; here:
bulk transfers with hashes per path (direct, relayed, hole-punched), symmetric NAT staying relayed,
port forwarding making a home public. Needs root, iproute2 and iptables; skips with the reason otherwise.
The namespaces are deleted by `simulations.netns.Network` even when a node fails.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from murmur.simulations.netns import Network, netns_unavailable

REASON = netns_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.solo,
    pytest.mark.skipif(REASON is not None, reason=f"no emulated networks: {REASON}"),
]


@pytest.fixture(scope="module")
def networks() -> dict[str, dict]:
    """The three NAT cases at once, each in its own namespaces: cone NAT (hole-punch), port forwarding, and
    symmetric NAT. Most of a case's time is waiting (dials, reservations, a punch that must fail), so
    running them side by side costs about as long as the longest."""
    from murmur.simulations.bench.reachability import scenario

    cases = {
        "cone": dict(bulk_bytes=1 << 20, holepunch=True),
        "forwarded": dict(bulk_bytes=0, holepunch=False, forward_h2=True),
        "symmetric": dict(bulk_bytes=1 << 20, holepunch=True, symmetric=True),
    }
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(scenario, timeout_s=300, **kw) for name, kw in cases.items()}
        got = {name: f.result() for name, f in futures.items()}
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {n for n in after - before if n.startswith("m")}, "namespaces left behind"
    return got


@pytest.fixture(scope="module")
def nodes(networks: dict[str, dict]) -> dict:
    return networks["cone"]


def test_reachability_verdicts(nodes) -> None:
    for home in ("h1", "h2"):
        ev = nodes[home].first("reachability")
        assert ev and ev["status"] == "private", ev
        assert ev["observed"], "the public node reported how it sees the home (its router's WAN IP)"


def test_homes_hold_relay_reservations(nodes) -> None:
    for home in ("h1", "h2"):
        ev = nodes[home].first("reserved")
        assert ev and len(ev["circuits"]) == 1 and "/p2p-circuit/p2p/" in ev["circuits"][0], ev


def test_gossip_reaches_everyone(nodes) -> None:
    for name, n in nodes.items():
        ev = n.first("gossip")
        assert ev and ev["ok"], (name, ev)
    for home in ("h1", "h2"):
        assert nodes[home].first("first_rollout"), "signed rollouts from the public node verified at the home"


def test_bulk_with_hash_direct_and_between_homes(nodes) -> None:
    for home, other in (("h1", "h2"), ("h2", "h1")):
        bulks = nodes[home].by("bulk")
        to_pub = [b for b in bulks if b["peer"] == "pub"]
        assert to_pub and to_pub[0]["hash_ok"] and to_pub[0]["path"] == "direct", nodes[home].events
        to_other = [b for b in bulks if b["peer"] == other]
        assert to_other and all(b["hash_ok"] for b in to_other), nodes[home].events
        assert to_other[0]["path"] in ("relayed", "direct")
    relayed = [b for h in ("h1", "h2") for b in nodes[h].by("bulk") if b["path"] == "relayed"]
    assert relayed and all(b["hash_ok"] for b in relayed), "a bulk transfer through the relay completed"


def test_doctor_reports_each_case(nodes) -> None:
    pub = nodes["pub"].first("doctor")
    assert pub and pub["path"] == "direct", pub
    for home in ("h1", "h2"):
        d = nodes[home].first("doctor")
        hp = nodes[home].first("holepunch")
        # both routers keep source ports (cone NAT): the punch must succeed and the doctor must say so
        assert hp and hp["ok"], (home, hp)
        assert d and d["path"] == "hole-punched", (d, hp)
        text = " ".join(c["detail"] for c in d["checks"])
        assert "behind NAT" in text


def test_port_forwarding_makes_a_home_public(networks: dict[str, dict]) -> None:
    got = networks["forwarded"]
    assert got["h2"].first("reachability")["status"] == "public", got["h2"].events
    assert got["h1"].first("reachability")["status"] == "private"
    assert got["h2"].first("doctor")["path"] == "direct"
    # h1 reaches h2 directly at its forwarded WAN address (from h2's announced addresses), no relay needed
    conn = got["h1"].first("connected")
    assert conn and conn["peer"] == "h2" and conn["path"] == "direct", got["h1"].events


def test_symmetric_nat_stays_relayed_and_says_why(networks: dict[str, dict]) -> None:
    got = networks["symmetric"]
    for home, other in (("h1", "h2"), ("h2", "h1")):
        n = got[home]
        assert n.first("reachability")["port_preserved"] is False, n.events
        hp = n.first("holepunch")
        assert hp and not hp["ok"], n.events
        d = n.first("doctor")
        assert d and d["path"] == "relayed", d
        assert "changes source ports" in d["checks"][0]["detail"], d
        relayed = [b for b in n.by("bulk") if b["peer"] == other]
        assert relayed and relayed[0]["path"] == "relayed" and relayed[0]["hash_ok"], [
            e for e in n.events if e["ev"] in ("connected", "connect_failed", "bulk", "bulk_failed")
        ]


def test_network_cleanup_on_failure() -> None:
    name = None
    with pytest.raises(RuntimeError):
        with Network() as net:
            net.add_home()
            name = net.homes[0].ns
            raise RuntimeError("boom")
    assert name and name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_udp_only_home_reaches_public_node_over_webrtc_direct(webrtc_extra: None) -> None:
    """A home whose router drops all outbound TCP: the node tries the public node's TCP address (times
    out), then its announced /webrtc-direct address through the NAT (UDP masqueraded); a signed rollout
    verifies, hellos cross, a bulk keeps its hash, and the doctor says webrtc."""
    from murmur.simulations.bench.reachability import webrtc_scenario

    got = webrtc_scenario(bulk_bytes=1 << 20, timeout_s=240)
    h, pub = got["udp"], got["pub"]
    conn = h.first("connected")
    # the path, not `webrtc_dialled`: a dial cut off by its 10 s bound can still complete in py-libp2p
    assert conn and conn["path"] == "webrtc", h.events
    assert conn["s"] >= 2.5, f"the TCP dial should have been tried (and dropped) first: {conn}"
    assert h.first("first_rollout"), "a signed rollout from the public node verified over WebRTC-direct"
    assert (h.first("gossip") or {}).get("ok") and (pub.first("gossip") or {}).get("ok"), (h.events, pub.events)
    bulk = [b for b in h.by("bulk") if b["peer"] == "pub"]
    assert bulk and bulk[0]["hash_ok"] and bulk[0]["path"] == "webrtc", [e for e in h.events if "bulk" in e["ev"]]
    d = h.first("doctor")
    assert d and d["path"] == "webrtc" and "WebRTC-direct" in d["checks"][0]["detail"], d
    assert (pub.first("doctor") or {}).get("path") in ("webrtc", "direct"), pub.events
