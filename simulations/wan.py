"""WAN link emulation: per-node upload/download bandwidth, latency, jitter and loss.

Two ways, one link description (`LinkSpec`, from a scenario node):

1. In-process model (`LinkModel`), used by the virtual-time simulator and
   available to any driver: a sans-IO queue per direction with an injected
   clock. A message of `n` bytes leaves the sender's upload queue at
   `up_bps`, crosses one-way `latency` (+ uniform jitter), and drains through
   the receiver's download queue at `down_bps` (0 = unlimited). Streams are
   reliable, so loss is modelled as TCP does it: a lost segment costs one
   retransmission timeout (`rto_s`), not a lost message.

2. Real processes (`simulations.emulate`):
   - upload bandwidth always through the node's own limiter, by the config key
     the node honours: `MURMUR_NETWORK_UPLOAD_BYTES_PER_S` (`node_env`), which
     shapes bulk (patch chunk) traffic in the node's transfer layer (a node has
     no download limit);
   - download bandwidth, latency, jitter and loss only with `tc netem`, in network namespaces
     created here (`NetnsLab`), when running as root with iproute2; without
     them the emulator runs on loopback with bandwidth shaping only and says
     so in the report.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from murmur.gossip.errors import MurmurError

if TYPE_CHECKING:
    from murmur.simulations.scenario import NodeSpec

DEFAULT_RTO_S = 0.2
MSS = 1400  # bytes per segment, for the loss model


@dataclass(frozen=True)
class LinkSpec:
    up_bps: float
    down_bps: float = 0.0  # 0 = unlimited
    latency_s: float = 0.02
    jitter_s: float = 0.0
    loss: float = 0.0
    rto_s: float = DEFAULT_RTO_S

    @classmethod
    def of(cls, node: NodeSpec) -> LinkSpec:
        return cls(
            up_bps=node.upload_bytes_per_s,
            down_bps=node.download_bytes_per_s,
            latency_s=node.latency_ms / 1000.0,
            jitter_s=node.jitter_ms / 1000.0,
            loss=node.loss,
        )


class LinkModel:
    """Per-node upload and download queues in virtual time (sans-IO: the caller passes `now`)."""

    def __init__(self, links: list[LinkSpec], seed: int = 0) -> None:
        self.links = links
        self.rng = random.Random(seed)
        self.up_free = [0.0] * len(links)
        self.down_free = [0.0] * len(links)
        self.bytes_up = [0] * len(links)
        self.bytes_down = [0] * len(links)

    def send(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """Queue `nbytes` from src to dst at `now`; return the time the last byte is delivered."""
        s, d = self.links[src], self.links[dst]
        start = max(now, self.up_free[src])
        left = start + nbytes / s.up_bps
        self.up_free[src] = left
        arrive = (
            left
            + s.latency_s
            + d.latency_s
            + (self.rng.uniform(0, s.jitter_s + d.jitter_s) if s.jitter_s or d.jitter_s else 0.0)
        )
        p = 1.0 - (1.0 - s.loss) * (1.0 - d.loss) if s.loss or d.loss else 0.0
        if p > 0:
            segments = max(1, -(-nbytes // MSS))
            # each lost segment stalls the stream one RTO; count them without drawing per segment
            draw, lost = self.rng.random, 0
            for _ in range(min(segments, 64)):
                if draw() < p:
                    lost += 1
            if segments > 64:
                lost = round(lost * segments / 64)
            arrive += lost * s.rto_s
        if d.down_bps > 0:
            first = start + s.latency_s + d.latency_s
            self.down_free[dst] = max(self.down_free[dst], first) + nbytes / d.down_bps
            arrive = max(arrive, self.down_free[dst])
        self.bytes_up[src] += nbytes
        self.bytes_down[dst] += nbytes
        return arrive

    def reset(self, node: int, now: float) -> None:
        """A node restarted: its queues are empty."""
        self.up_free[node] = now
        self.down_free[node] = now


def broadcast_lower_bound(size: int, n: int, up_bps: float, chunks: int, rtt_s: float = 0.0) -> float:
    """T* = (S/B)(1 + floor(log2 N)/M) + log2(N+1)*RTT/2 (Mundinger-Weber-Weiss, equal capacities)."""
    import math

    if n <= 0 or size <= 0:
        return 0.0
    return (size / up_bps) * (1 + math.floor(math.log2(n)) / max(1, chunks)) + math.log2(n + 1) * rtt_s / 2


# ------------------------------------------------------------------ real processes


def node_env(link: LinkSpec) -> dict[str, str]:
    """Environment for a node process: upload bandwidth through the node's own limiter (download: netem only)."""
    return {"MURMUR_NETWORK_UPLOAD_BYTES_PER_S": str(int(link.up_bps))}


def netns_available() -> str | None:
    """None when namespaces + netem can be used here; otherwise why not."""
    import os

    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) not installed"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError) as e:
        return f"ip netns unusable: {e}"
    return None


def netem_args(link: LinkSpec, direction: str) -> list[str]:
    """`tc qdisc` arguments for one direction ('up' = egress of the node, 'down' = egress towards it)."""
    args = ["netem", "delay", f"{link.latency_s * 1000:.3f}ms"]
    if link.jitter_s:
        args += [f"{link.jitter_s * 1000:.3f}ms"]
    if link.loss:
        args += ["loss", f"{link.loss * 100:.4f}%"]
    rate = link.up_bps if direction == "up" else link.down_bps
    if rate:
        args += ["rate", f"{int(rate * 8)}bit"]
    return args


class NetnsLab:
    """A bridge plus one network namespace per node, each joined by a veth pair shaped with netem.

    Node i lives in namespace `<prefix>i` at 10.77.<i // 250>.<i % 250 + 2>/16. Egress of the
    namespace side carries the node's upload shape (latency, loss, upload rate); egress of the
    bridge side carries its download rate and the same latency, so a round trip between two
    nodes costs the sum of both one-way latencies, as in the in-process model.
    """

    def __init__(self, prefix: str = "mmsim") -> None:
        why = netns_available()
        if why:
            raise MurmurError(f"network namespaces unavailable: {why}")
        self.prefix = prefix[:8]
        self.bridge = f"{self.prefix}br"
        self.nodes: list[int] = []

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
        if r.returncode:
            raise MurmurError(f"{' '.join(args)}: {r.stderr.strip()}")

    def address(self, i: int) -> str:
        return f"10.77.{i // 250}.{i % 250 + 2}"

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def up(self, links: list[LinkSpec]) -> None:
        self._ip("ip", "link", "add", self.bridge, "type", "bridge")
        self._ip("ip", "link", "set", self.bridge, "up")
        for i, link in enumerate(links):
            ns, host, peer = self.ns(i), f"{self.prefix}h{i}", f"{self.prefix}n{i}"
            self._ip("ip", "netns", "add", ns)
            self.nodes.append(i)
            self._ip("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            self._ip("ip", "link", "set", peer, "netns", ns)
            self._ip("ip", "link", "set", host, "master", self.bridge)
            self._ip("ip", "link", "set", host, "up")
            self._ip("ip", "-n", ns, "addr", "add", f"{self.address(i)}/16", "dev", peer)
            self._ip("ip", "-n", ns, "link", "set", peer, "up")
            self._ip("ip", "-n", ns, "link", "set", "lo", "up")
            self._ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", peer, "root", *netem_args(link, "up"))
            self._ip("tc", "qdisc", "add", "dev", host, "root", *netem_args(link, "down"))

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def down(self) -> None:
        for i in self.nodes:
            subprocess.run(["ip", "netns", "del", self.ns(i)], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)
        self.nodes.clear()
