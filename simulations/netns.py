"""Emulated networks from Linux network namespaces: an "internet" bridge, public hosts, and home networks
behind iptables MASQUERADE routers.

Why namespaces: NAT traversal can only be tested honestly against a real NAT (conntrack, port mapping,
filtering). Everything here stays inside namespaces this module creates; the addresses are private test
ranges (10.N.x.y) that never leave the machine, and nothing is routed to the host's own network.

Topology built by `Network`:

    [pub ns] 10.N.0.10 --+
                         |  bridge "br0" inside the wan ns (the emulated internet, 10.N.0.0/24)
    [router k] 10.N.0.k --+   MASQUERADE out of its wan side; LAN 10.N.k.0/24
         |
    [home k] 10.N.k.2  (default route via the router)

A home router behaves like a typical consumer NAT: outbound connections are masqueraded (Linux keeps
the source port when it is free: endpoint-independent mapping), inbound packets pass only for
conntrack-established flows, and unsolicited packets to the router itself are dropped silently (no
RST). `symmetric=True` uses `--random-fully` port mapping, which defeats port prediction.
`forward_port` adds a DNAT rule, as a user who configured port forwarding would. `block_tcp=True`
makes a router that drops every outbound TCP packet but masquerades UDP (a network where only UDP
gets out, e.g. a firewall allowing DNS/QUIC-like traffic): the case WebRTC-direct is for.

Requires root, `ip` (iproute2) and `iptables` (nf_tables or legacy backend). `netns_unavailable()`
says why not, so tests can skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """A namespace command failed; the message carries the command and its stderr."""


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"timed out: {' '.join(args)}") from e
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(args)} -> rc {p.returncode}: {p.stderr.strip()}")
    return p


_REASON: list[str | None] = []


def netns_unavailable() -> str | None:
    """None if namespaces, veths, bridges and iptables NAT all work here; otherwise why not (cached)."""
    if _REASON:
        return _REASON[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif not shutil.which("ip"):
        reason = "`ip` (iproute2) is not installed"
    elif not shutil.which("iptables"):
        reason = "`iptables` is not installed (apt-get install -y iptables)"
    else:
        ns = f"mprobe-{uuid.uuid4().hex[:8]}"
        try:
            _run(["ip", "netns", "add", ns])
            try:
                _run(["ip", "netns", "exec", ns, "ip", "link", "add", "pb0", "type", "bridge"])
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "iptables",
                        "-t",
                        "nat",
                        "-A",
                        "POSTROUTING",
                        "-o",
                        "pb0",
                        "-j",
                        "MASQUERADE",
                    ]
                )
            finally:
                _run(["ip", "netns", "del", ns], check=False)
        except NetnsError as e:
            reason = f"cannot build namespaces with NAT here: {e}"
    _REASON.append(reason)
    return reason


@dataclass
class Home:
    """A home network: router namespace + one host namespace behind it."""

    index: int
    router_ns: str
    ns: str
    wan_ip: str  # the router's public address (what peers observe)
    lan_ip: str  # the host's private address
    wan_dev: str = ""  # the router's interface on the WAN


@dataclass
class Network:
    """An emulated internet with one public host and any number of NATed homes. Use as a context manager:
    everything created is deleted on exit, even when the body fails."""

    subnet: int = 0  # N in 10.N.0.0/16; 0 = pick from the process id
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    homes: list[Home] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.subnet:
            self.subnet = 100 + (os.getpid() + int(self.tag, 16)) % 150
        self.wan_ns = f"m{self.tag}-wan"
        self.pub_ns = f"m{self.tag}-pub"
        self.pub_ip = f"10.{self.subnet}.0.10"

    # ----------------------------------------------------------------- build
    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        _run(["ip", "link", "add", name_a, "type", "veth", "peer", "name", name_b])
        _run(["ip", "link", "set", name_a, "netns", ns_a])
        _run(["ip", "link", "set", name_b, "netns", ns_b])
        _run(["ip", "-n", ns_a, "link", "set", name_a, "up"])
        _run(["ip", "-n", ns_b, "link", "set", name_b, "up"])

    def _to_wan(self, ns: str, port: str, ip: str) -> str:
        """Plug `ns` into the internet bridge with address `ip`; returns its interface name."""
        wan_end = f"w{self.tag}{port}"
        dev = f"x{self.tag}{port}"
        self._veth(self.wan_ns, wan_end, ns, dev)
        _run(["ip", "-n", self.wan_ns, "link", "set", wan_end, "master", "br0"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
        return dev

    def __enter__(self) -> Network:
        try:
            self._ns(self.wan_ns)
            _run(["ip", "-n", self.wan_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.wan_ns, "link", "set", "br0", "up"])
            self._ns(self.pub_ns)
            self._to_wan(self.pub_ns, "p", self.pub_ip)
        except BaseException:
            self.close()
            raise
        return self

    def add_home(self, symmetric: bool = False, block_tcp: bool = False) -> Home:
        """A NATed home network; its host reaches the internet through a MASQUERADE router (with
        `block_tcp`, a router that silently drops outbound TCP: only UDP gets out)."""
        k = len(self.homes) + 1
        router, host = f"m{self.tag}-r{k}", f"m{self.tag}-h{k}"
        wan_ip, gw, lan_ip = f"10.{self.subnet}.0.{k}", f"10.{self.subnet}.{k}.1", f"10.{self.subnet}.{k}.2"
        try:
            self._ns(router)
            self._ns(host)
            wan_dev = self._to_wan(router, f"r{k}", wan_ip)
            lan_dev, host_dev = f"l{self.tag}{k}", f"h{self.tag}{k}"
            self._veth(router, lan_dev, host, host_dev)
            _run(["ip", "-n", router, "addr", "add", f"{gw}/24", "dev", lan_dev])
            _run(["ip", "-n", host, "addr", "add", f"{lan_ip}/24", "dev", host_dev])
            _run(["ip", "-n", host, "route", "add", "default", "via", gw])
            ipt = ["ip", "netns", "exec", router, "iptables"]
            _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            masq = ["-j", "MASQUERADE"] + (["--random-fully"] if symmetric else [])
            _run(ipt + ["-t", "nat", "-A", "POSTROUTING", "-o", wan_dev] + masq)
            if block_tcp:  # before the ACCEPT: SYNs vanish (no RST), as behind a filtering firewall
                _run(ipt + ["-A", "FORWARD", "-i", lan_dev, "-o", wan_dev, "-p", "tcp", "-j", "DROP"])
            _run(ipt + ["-A", "FORWARD", "-i", lan_dev, "-o", wan_dev, "-j", "ACCEPT"])
            _run(
                ipt
                + [
                    "-A",
                    "FORWARD",
                    "-i",
                    wan_dev,
                    "-o",
                    lan_dev,
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "RELATED,ESTABLISHED,DNAT",
                    "-j",
                    "ACCEPT",
                ]
            )
            _run(ipt + ["-A", "FORWARD", "-j", "DROP"])
            _run(
                ipt
                + ["-A", "INPUT", "-i", wan_dev, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"]
            )
            _run(ipt + ["-A", "INPUT", "-i", wan_dev, "-j", "DROP"])
        except BaseException:
            self.close()
            raise
        home = Home(k, router, host, wan_ip, lan_ip, wan_dev)
        self.homes.append(home)
        return home

    def forward_port(self, home: Home, port: int) -> None:
        """Port forwarding on the home router: wan_ip:port -> lan_ip:port (TCP)."""
        ipt = ["ip", "netns", "exec", home.router_ns, "iptables"]
        _run(
            ipt
            + [
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-i",
                home.wan_dev,
                "-p",
                "tcp",
                "--dport",
                str(port),
                "-j",
                "DNAT",
                "--to-destination",
                f"{home.lan_ip}:{port}",
            ]
        )

    def exec_prefix(self, ns: str) -> list[str]:
        """Prefix a command with this to run it inside namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Delete every namespace (their veths, bridge, iptables state go with them). Idempotent."""
        while self._namespaces:
            _run(["ip", "netns", "del", self._namespaces.pop()], check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()
