"""What a follower's claimed throughput counts for: what it delivered (sans-IO, `now` given by the caller).

A follower's NodeAnnounce states its throughput; nothing checks it. A trainer
that believed it would tell every honest follower to stand by as soon as one
key claimed to cover the whole demand. So the trainer counts, per follower,
the rollouts for its own lineage that passed its verification pipeline over
the last `WINDOW_S`, and the capacity rule (`node.core.roles.activate`) credits a
follower with at most `SLACK` times that delivered rate, plus a trial credit
that all followers without enough delivery share: at most `TRIAL_SHARE` of
the trainer's need, however many keys claim it. A new follower starts at that
trial credit and earns more by delivering; a claim larger than the credit is
not refused (an honest follower paced below its capacity claims more than it
delivers) but counts only as far as the delivery backs it.

Only usable, checkable work counts as delivered: rollouts of the trainer's own
lineage and tokenizer in informative groups (the sampler's rule: a one-rollout
"group" or one whose rewards are all equal is dropped at intake, or, on a
shared-schedule prompt, kept only to join a receiver's own group), and only from
a producer that has passed one of the trainer's sampled log-prob checks
(`vouch`); a failed check withdraws it. So rollouts that can never be trained
on, or never checked, earn no credit, however many are delivered.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Final

WINDOW_S: Final = 60.0  # delivery counted over this recent window
MIN_SPAN_S: Final = 10.0  # a follower counted for less than this divides by it (one batch is not a rate)
SLACK: Final = 2.0  # delivered rate counts this many times over: batching and pacing jitter
TRIAL_SHARE: Final = 0.25  # of the need: what all undelivered claims count for together
MAX_EVENTS: Final = 256  # deliveries kept per follower (older ones fall out of the window anyway)


class Deliveries:
    """Verified rollouts per follower for one lineage, over a sliding window; bounded in followers and events."""

    def __init__(self, window_s: float = WINDOW_S, max_peers: int = 1024) -> None:
        self.window_s = window_s
        self.max_peers = max(1, max_peers)
        self._d: OrderedDict[str, tuple[float, deque[tuple[float, int]]]] = OrderedDict()
        self._vouched: OrderedDict[str, None] = OrderedDict()  # passed a sampled check (bounded like `_d`)

    def vouch(self, peer: str) -> None:
        """`peer` passed a sampled log-prob check: its deliveries count from now on."""
        self._vouched.pop(peer, None)
        self._vouched[peer] = None
        while len(self._vouched) > self.max_peers:
            self._vouched.popitem(last=False)

    def unvouch(self, peer: str) -> None:
        """`peer` failed a check: nothing it delivers counts until it passes one again."""
        self._vouched.pop(peer, None)

    def add(self, peer: str, count: int, now: float) -> None:
        if count <= 0:
            return
        row = self._d.get(peer)
        if row is None:
            row = self._d[peer] = (now, deque(maxlen=MAX_EVENTS))
        self._d.move_to_end(peer)
        row[1].append((now, int(count)))
        while len(self._d) > self.max_peers:
            self._d.popitem(last=False)

    def rate(self, peer: str, now: float) -> float:
        """Rollouts per second `peer` delivered over the window (0 for a peer never seen)."""
        row = self._d.get(peer)
        if row is None:
            return 0.0
        first, events = row
        while events and events[0][0] <= now - self.window_s:
            events.popleft()
        if not events:
            del self._d[peer]
            return 0.0
        span = max(MIN_SPAN_S, min(self.window_s, now - first))
        return sum(c for _, c in events) / span

    def backed(self, peer: str, now: float) -> float:
        """The rate a claim of `peer` may count for, as far as verified delivery backs it (no check needed)."""
        return SLACK * self.rate(peer, now)

    def credit(self, peer: str, now: float) -> float:
        """The rate a claim of `peer` may count for before the shared trial credit (0 until it is vouched for)."""
        return self.backed(peer, now) if peer in self._vouched else 0.0
