"""Per-peer token buckets with an injected clock (sans-IO).

py-libp2p's own spam protection drops silently and is turned off; this one
lets the pipeline name the rejection (RATE_LIMITED) and penalise the sender.
The table of buckets is bounded: idle peers' full buckets are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict


class TokenBuckets:
    def __init__(self, rate_per_s: float, burst: float, max_peers: int = 10_000) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("token bucket needs rate_per_s > 0 and burst >= 1")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.max_peers = max_peers
        self._b: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, last)

    def tokens(self, peer: str, now: float) -> float:
        tokens, last = self._b.get(peer, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - last) * self.rate)

    def take(self, peer: str, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` tokens of `peer`'s bucket; False (and nothing spent) when it lacks them."""
        tokens = self.tokens(peer, now)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        self._b[peer] = (tokens, now)
        self._b.move_to_end(peer)
        while len(self._b) > self.max_peers:
            self._b.popitem(last=False)
        return ok
