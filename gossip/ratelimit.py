"""Per-peer token buckets with an injected clock (sans-IO).

py-libp2p's own spam protection drops silently and is turned off; these let
the pipeline name the rejection and charge the sender only when the limit is
the sender's own promise:
- `TokenBuckets`: the default bucket for a peer that announced no rate. Its
  drops cost nothing, since the peer never promised to stay under it.
- `AnnouncedRates`: a peer's NodeAnnounce states how many rollout batches per
  second it has been publishing (`RateMeter` measures that at the sender). Its
  bucket allows `HEADROOM` times that rate with a `BURST_WINDOW_S` burst, never
  less than the default bucket and never more than `MAX_BATCHES_PER_S`; only
  publishing above that is charged. It is spent on the producer's clock (the
  batches' signed creation times), not on arrival: how batches queue on the
  way (a relay's backlog, the receiver's own busy loop) is not the producer's
  doing.
- `NewKeys`: a node-wide bucket that every key not heard before draws on for
  its first announce (keys are free, so a per-key limit passes each fresh
  key's first one); keys it admitted are remembered and pass freely.
Every table is bounded: idle peers are forgotten first.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any, Final

HEADROOM: Final = 2.0  # an honest rate varies; twice the announced rate is provably above it
BURST_WINDOW_S: Final = 60.0  # a minute of the allowed rate may arrive at once
MAX_BATCHES_PER_S: Final = 50.0  # whatever a peer announces, no more is admitted (a Sybil bound is per key anyway)
NEW_KEYS_PER_S: Final = 4.0  # keys not heard before admitted node-wide, per second ...
NEW_KEYS_BURST: Final = 64.0  # ... and at once (a swarm's worth of peers met at start)
METER_WINDOW_S: Final = 60.0
MIN_SPAN_S: Final = 1.0  # a meter that has counted for less than this divides by it


class Bucket:
    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.last = float(rate), float(burst), float(burst), now

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` tokens; False (and nothing spent) when the bucket lacks them."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = max(self.last, now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


class TokenBuckets:
    def __init__(self, rate_per_s: float, burst: float, max_peers: int = 10_000) -> None:
        if not (rate_per_s > 0 and burst >= 1 and math.isfinite(rate_per_s) and math.isfinite(burst)):
            raise ValueError("token bucket needs finite rate_per_s > 0 and burst >= 1")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.max_peers = max_peers
        self._b: OrderedDict[str, Bucket] = OrderedDict()

    def take(self, peer: str, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` tokens of `peer`'s bucket; False (and nothing spent) when it lacks them."""
        b = self._b.get(peer)
        if b is None:
            b = self._b[peer] = Bucket(self.rate, self.burst, now)
        self._b.move_to_end(peer)
        while len(self._b) > self.max_peers:
            self._b.popitem(last=False)
        return b.take(now, cost)


class NewKeys:
    """Node-wide admission of keys not heard before: one bucket shared by all of them (sans-IO)."""

    def __init__(
        self, rate_per_s: float = NEW_KEYS_PER_S, burst: float = NEW_KEYS_BURST, max_known: int = 10_000
    ) -> None:
        if not (rate_per_s > 0 and burst >= 1 and math.isfinite(rate_per_s) and math.isfinite(burst)):
            raise ValueError("new-key admission needs finite rate_per_s > 0 and burst >= 1")
        self.rate, self.burst, self.max_known = float(rate_per_s), float(burst), max_known
        self._bucket: Bucket | None = None
        self._known: OrderedDict[str, None] = OrderedDict()
        self.refused = 0

    def admit(self, key: str, now: float, direct: bool = False) -> bool:
        """Whether `key` may be heard now: a key admitted before always; a new one while the shared bucket
        holds a token, or without one when it speaks on its own connection (`direct`: connections are
        limited per address); then it is remembered. A refusal is counted."""
        if key in self._known:
            self._known.move_to_end(key)
            return True
        if not direct:
            if self._bucket is None:
                self._bucket = Bucket(self.rate, self.burst, now)
            if not self._bucket.take(now):
                self.refused += 1
                return False
        self._known[key] = None
        while len(self._known) > self.max_known:
            self._known.popitem(last=False)
        return True


class AnnouncedRates:
    """Buckets for peers that announced their publishing rate (batches per second)."""

    def __init__(self, floor_rate: float = 20.0, floor_burst: float = 40.0, max_peers: int = 10_000) -> None:
        self.floor_rate = floor_rate
        self.floor_burst = floor_burst
        self.max_peers = max_peers
        self._b: OrderedDict[str, Bucket] = OrderedDict()
        self._newest: OrderedDict[str, int] = OrderedDict()  # the highest announce seq seen per peer
        self.stale = 0  # announces ignored as older than one already applied

    def limits(self, announced: float) -> tuple[float, float]:
        """(rate, burst) allowed to a peer that announced `announced` batches/s."""
        rate = min(MAX_BATCHES_PER_S, max(self.floor_rate, HEADROOM * announced))
        return rate, max(self.floor_burst, min(MAX_BATCHES_PER_S, HEADROOM * announced) * BURST_WINDOW_S)

    def update(self, peer: str, announce: Any, now: float) -> None:
        """Hold `peer` to the rate `announce` states. The bucket runs on the producer's own clock (its
        batches' signed `created_ms`, see `take`), so it starts full at the first batch it meets.

        Only an announce newer (a higher `seq`) than every one already seen from `peer` counts: gossip
        replays old messages to late joiners and any relay may re-send one, and an old, lower rate
        applied after a newer one would get a fast honest producer throttled and charged."""
        seq = int(getattr(announce, "seq", 0))
        newest = self._newest.get(peer)
        if newest is not None and seq <= newest:
            self.stale += 1
            return
        self._newest[peer] = seq
        self._newest.move_to_end(peer)
        while len(self._newest) > self.max_peers:
            self._newest.popitem(last=False)
        announced = float(getattr(announce, "publish_batches_per_s", 0.0))
        if not (announced > 0 and math.isfinite(announced)):
            self._b.pop(peer, None)  # no promise: the default (uncharged) bucket applies
            return
        rate, burst = self.limits(announced)
        b = self._b.get(peer)
        if b is None:
            self._b[peer] = Bucket(rate, burst, -math.inf)
        else:
            b.rate, b.burst, b.tokens = rate, burst, min(burst, b.tokens)
        self._b.move_to_end(peer)
        while len(self._b) > self.max_peers:
            self._b.popitem(last=False)

    def bucket(self, peer: str) -> Bucket | None:
        return self._b.get(peer)


class RateMeter:
    """The sender's side: how many batches it published per second over the last minute, which
    is what it announces (a bounded deque of timestamps). The count is divided by the time it was
    counted over (at least `MIN_SPAN_S`), not by the whole window: a producer that started, or
    resumed, a few seconds ago states the rate it publishes at, where a whole window would dilute
    it and get it charged by every receiver for publishing above its own statement."""

    def __init__(self, window_s: float = METER_WINDOW_S, max_events: int = 100_000) -> None:
        self.window_s = window_s
        self._t: deque[float] = deque(maxlen=max_events)

    def tick(self, now: float) -> None:
        self._t.append(now)

    def rate(self, now: float) -> float:
        while self._t and self._t[0] <= now - self.window_s:
            self._t.popleft()
        if not self._t:
            return 0.0
        return len(self._t) / max(MIN_SPAN_S, min(self.window_s, now - self._t[0]))
