"""Verification CPU per peer and per node, in CPU-seconds per second (sans-IO, injected clock).

A batches-per-second limit does not bound work: within one key's announced
rate, large valid batches cost far more to verify than an honest producer's.
So the pipeline also budgets what verifying a peer's batches *costs*, which
the I/O layer measures after each batch (`time.thread_time` of the verifying
thread plus the CPU the verifier pool's process spent on it) and reports with
`spend`:

- **Node-wide**: all peers together draw on a bucket of `node_cpu_per_s`
  (burst `BURST_S` seconds of it).
- **Fair share**: each proven peer has its own bucket, refilled at
  `min(peer_cpu_per_s, node_cpu_per_s / active buckets)` (active: spent within
  `ACTIVE_S`); the shares add up to the node's rate. Keys are free, so a share
  per key would shrink with every key minted: keys without a verified history
  (`verified`: at least `PROVEN_BATCHES` accepted batches, the first
  `PROVEN_S` ago) all draw on ONE bucket, `UNPROVEN`, which counts as one
  active peer however many keys feed it; the rest is reserved for producers
  with a history. Proving a key takes batches through that one share, so the
  rate at which an attacker can add proven keys is bounded too. A peer whose own bucket
  is not in debt is admitted (its share is reserved for it); a peer in debt
  is admitted only from the node's spare capacity (node bucket not in debt),
  and every batch, either way, is charged to both buckets. So the node's
  verification stays within its rate over time (shares never exceed it, and
  spare is what they leave), and a few keys that send costly batches use
  what others leave idle, never what an honest producer's share needs. A
  bucket starts empty: one batch, then its share's refill (a flood of fresh
  keys is the exchange's newcomer gate's to bound, and shares one bucket here).

Cost is charged after it is measured, so a bucket may go into debt by one
batch (at most the verifier's time limit plus the pipeline's own work); a
peer in debt waits until it is repaid. Refusals cost the sender nothing (its
batch was valid as far as anyone knows): they are counted by the pipeline as
`cpu_budget`. Tables are bounded (idle peers forgotten first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Final

NODE_CPU_PER_S: Final = 1.0  # CPU-seconds per second of verification for the whole node (one core)
PEER_CPU_PER_S: Final = 0.5  # ... for one peer, at most, however few peers are active
BURST_S: Final = 4.0  # seconds of its rate a bucket holds
ACTIVE_S: Final = 10.0  # a peer that spent within this counts toward the fair share's divisor
RECOUNT_S: Final = 1.0  # the active count is recomputed at most this often
PROVEN_BATCHES: Final = 4  # accepted batches before a key has a verified history ...
PROVEN_S: Final = 30.0  # ... the first of them at least this long ago
UNPROVEN: Final = "\x00unproven"  # the bucket every key without a verified history shares (no peer id)


class _Bucket:
    __slots__ = ("tokens", "last", "spent_at")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens, self.last, self.spent_at = tokens, now, -math.inf


class CpuBudget:
    def __init__(
        self,
        node_cpu_per_s: float = NODE_CPU_PER_S,
        peer_cpu_per_s: float = PEER_CPU_PER_S,
        burst_s: float = BURST_S,
        max_peers: int = 10_000,
    ) -> None:
        if not (node_cpu_per_s > 0 and peer_cpu_per_s > 0 and burst_s > 0):
            raise ValueError("cpu budget rates and burst must be > 0")
        self.node_rate = float(node_cpu_per_s)
        self.peer_rate = float(peer_cpu_per_s)
        self.burst_s = float(burst_s)
        self.max_peers = max_peers
        self.node = _Bucket(self.node_rate * burst_s, -math.inf)
        self._peers: OrderedDict[str, _Bucket] = OrderedDict()
        self._active = 1
        self._counted_at = -math.inf
        self.spent_s = 0.0
        self._history: OrderedDict[str, list[float]] = OrderedDict()  # peer -> [first accepted, accepted batches]

    def verified(self, peer: str, now: float) -> None:
        """One of `peer`'s batches passed verification: its history grows toward `proven`."""
        h = self._history.get(peer)
        if h is None:
            h = self._history[peer] = [now, 0.0]
            while len(self._history) > self.max_peers:
                self._history.popitem(last=False)
        h[1] += 1
        self._history.move_to_end(peer)

    def proven(self, peer: str, now: float) -> bool:
        """Whether `peer` has a verified history: its own share instead of the one all unproven keys share."""
        h = self._history.get(peer)
        return h is not None and h[1] >= PROVEN_BATCHES and now - h[0] >= PROVEN_S

    def _key(self, peer: str, now: float) -> str:
        return peer if self.proven(peer, now) else UNPROVEN

    def share(self, now: float) -> float:
        """CPU-seconds per second one proven peer (or all unproven keys together) is guaranteed now."""
        if now - self._counted_at >= RECOUNT_S:
            self._counted_at = now
            self._active = max(1, sum(1 for b in self._peers.values() if now - b.spent_at <= ACTIVE_S))
        return min(self.peer_rate, self.node_rate / self._active)

    def _refill_node(self, now: float) -> None:
        n = self.node
        cap = self.node_rate * self.burst_s
        n.tokens = min(cap, n.tokens + max(0.0, now - n.last) * self.node_rate) if n.last > -math.inf else cap
        n.last = max(n.last, now)

    def _peer(self, peer: str, now: float) -> _Bucket:
        b = self._peers.get(peer)
        if b is None:  # a new key starts with nothing saved: one batch, then its share's refill
            b = self._peers[peer] = _Bucket(0.0, now)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            rate = self.share(now)
            b.tokens = min(rate * self.burst_s, b.tokens + max(0.0, now - b.last) * rate)
            b.last = max(b.last, now)
        self._peers.move_to_end(peer)
        return b

    def admit(self, peer: str, now: float) -> str | None:
        """None when `peer`'s next batch may be verified; otherwise why not (uncharged)."""
        self._refill_node(now)
        b = self._peer(self._key(peer, now), now)
        if b.tokens >= 0.0 or self.node.tokens >= 0.0:
            return None  # within its own share, or from spare capacity no one else is using
        return (
            f"over its share of verification CPU ({self.share(now):.3g} CPU-s/s, "
            f"{-b.tokens:.2f} s owed) while the node is busy"
        )

    def spend(self, peer: str, cpu_s: float, now: float) -> None:
        """What verifying one of `peer`'s batches cost (measured by the I/O layer)."""
        if not (cpu_s > 0 and math.isfinite(cpu_s)):
            return
        self._refill_node(now)
        b = self._peer(self._key(peer, now), now)
        b.tokens -= cpu_s
        b.spent_at = now
        self.node.tokens -= cpu_s
        self.spent_s += cpu_s
