"""The rollout exchange (sans-IO): sharded rollout topics, sized by the swarm, joined by demand.

Rollout batches move on GossipSub topics, and GossipSub hands every message of
a topic to every subscriber; so what a node receives and verifies is set by the
topics it joins. The rollouts of one lineage go to one shard topic,
`shard_of(lineage, S)`; the shard count S is a power of two that follows the
number of producers the node hears announce (`shard_count`, about
`PRODUCERS_PER_SHARD` lineages a shard, with hysteresis so views a few
producers apart agree). A node subscribes to:
- its *home* shards: the shard of its own lineage when followers produce for
  it (a trainer hears its followers), and of the lineage it validates (every
  producer of that lineage reaches it, whatever N);
- *rotating* shards, in an order drawn from (node, epoch) that changes every
  `ROTATE_S` (staggered per node): those whose announced supply is at most twice
  what is still missing of its demand first (so at least half of it is used), then the smallest
  that covers the rest, and one more while the rollouts it measures fall
  short (a producer that announces and does not publish cannot starve it).
  At most `MAX_SUBSCRIBED` in all.
A node publishes to the shard of its batch's lineage whether it subscribes
to it or not (GossipSub's fanout). So a node's inbound is at most twice its demand
plus one shard's supply plus its home shards, none of which
grows with N; and a shard holds a couple of lineages, so a trainer that takes
about as much as it makes uses a large share of what it verifies.

What goes on a shard follows its demand. GossipSub hands every batch of a shard to
every subscriber, so a shard should carry about what one consumer takes: a trainer
publishes its own rollouts within `publish_budget` (the median of the other
trainers' counted demands, `consumer_demand`, with a margin, less what followers
publish there, shared by the shard's trainers but one), in whole groups
(`Outbox`), and keeps the rest local; a follower publishes all it generates (its
generation is paced to its lineage's demand). A validator that does not train
verifies a keyed-hash sample of each producer's batches (`Sample`).

A receiver's gate (`ShardGate`) runs after the cheap checks and before verification: a batch whose lineage
does not belong to the shard it came on is dropped (`wrong_shard`; uncharged, a
view of S can differ by a factor of two, so S/2, S and 2S are all accepted), a
message naming several topics is refused (`multi_topic`; its originator signed
the topic list, so it is charged), and producers this node has not heard
announce for `ESTABLISHED_S` share one small bucket per shard
(`newcomer_budget`), so many fresh keys flooding one shard cost a bounded rate
and never starve the producers already known.

Pure: every function takes `now`; nothing here does I/O.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import math
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from murmur.gossip.ratelimit import Bucket

PRODUCERS_PER_SHARD: Final = 2  # swarm-wide: every node must size S alike, so it is a protocol constant
MAX_KNOWN: Final = 10_000  # producers remembered by a gate (least recently announced forgotten)
# the largest power of two that keeps PRODUCERS_PER_SHARD lineages a shard for as many producers as a gate
# remembers: past it shards fill up instead of multiplying (swarm-wide, like PRODUCERS_PER_SHARD)
MAX_SHARDS: Final = 1 << ((MAX_KNOWN // PRODUCERS_PER_SHARD).bit_length() - 1)
MAX_SUBSCRIBED: Final = 8  # shard topics one node joins at most (home ones included)
ROTATE_S: Final = 120.0  # a node's rotating shards are re-drawn this often (staggered per node)
DEMAND_MARGIN: Final = 1.0  # announced supply subscribed, as a multiple of demand (shortfall adds more)
SHORTFALL: Final = 0.9  # measured inbound below this share of demand counts as short
SHORTFALL_WINDOW_S: Final = 30.0  # measured inbound below demand this long: one more shard
ESTABLISHED_S: Final = 10.0  # a producer heard announcing this long ago is no newcomer (an announce is cheap)
NEWCOMER_BATCHES_PER_S: Final = 5.0  # per shard, shared by every newcomer producer
NEWCOMER_BURST: Final = 40.0


def _h(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"\x00".join(parts), digest_size=8).digest(), "big")


def shard_count(producers: int, current: int = 1) -> int:
    """The power-of-two shard count for `producers` producers, moving from `current` only past a margin:
    up when every shard would hold 2 x PRODUCERS_PER_SHARD, down below 3/4 x PRODUCERS_PER_SHARD."""
    s = min(MAX_SHARDS, max(1, 1 << max(0, int(current).bit_length() - 1)))  # a power of two
    n = max(0, int(producers))
    while s < MAX_SHARDS and n >= 2 * s * PRODUCERS_PER_SHARD:
        s *= 2
    while s > 1 and n < s * PRODUCERS_PER_SHARD * 3 // 4:
        s //= 2
    return s


@functools.lru_cache(maxsize=65_536)
def _lineage_hash(lineage: bytes) -> int:
    return _h(b"murmur/shard", lineage)


def shard_of(lineage: bytes, shards: int) -> int:
    """The shard of a lineage's rollouts under `shards` (a power of two): its hash mod S, so a lineage's
    shard under 2S is its shard under S or that plus S."""
    return _lineage_hash(bytes(lineage)) % max(1, shards)


def on_shard(lineage: bytes, shard: int, shards: int) -> bool:
    """Whether a batch of `lineage` belongs on `shard` for a node that counts `shards` shards, allowing
    a publisher whose count is half or double ours (announces reach nodes at different times)."""
    return any(shard == shard_of(lineage, s) for s in (max(1, shards // 2), shards, min(MAX_SHARDS, shards * 2)))


@dataclass(frozen=True)
class Plan:
    shards: int  # S
    subscribe: tuple[int, ...]  # shard indexes to be subscribed to, sorted
    home: tuple[int, ...]  # the pinned ones among them
    epoch: int  # the rotation epoch the plan was drawn in


def _rotation_ab(node: bytes, epoch: int) -> tuple[int, int]:
    r = _h(b"murmur/rotate", node, epoch.to_bytes(8, "big", signed=True))
    return (r >> 32) | 1, r & 0xFFFFFFFF


def rotation(node: bytes, shards: int, epoch: int) -> Iterator[int]:
    """All shards (a power of two) in the order node `node` takes them in `epoch`, lazily: j -> a*j + b
    mod S with a odd is a permutation, drawn afresh each epoch."""
    a, b = _rotation_ab(node, epoch)
    return ((a * i + b) % shards for i in range(shards))


def first_in_rotation(node: bytes, shards: int, epoch: int, among: Iterable[int], k: int) -> list[int]:
    """The first `k` of the shards `among` in `rotation(node, shards, epoch)`'s order, without walking it:
    shard j comes at position (j - b) / a mod S (a is odd, so invertible mod a power of two)."""
    a, b = _rotation_ab(node, epoch)
    inv = pow(a, -1, shards) if shards > 1 else 0
    return heapq.nsmallest(k, among, key=lambda j: (j - b) * inv % shards)


def candidates_by_position(
    node: bytes,
    s: int,
    epoch: int,
    avail: Callable[[int], float],
    supplied: Collection[int],
    taken: Collection[int],
    k: int,
) -> list[int]:
    """The first `k` shards of `rotation(node, s, epoch)` that are not `taken` and offer supply (`avail` above
    1e-9), found by sorting `supplied` by position; `supplied` must hold every shard that offers any."""
    return first_in_rotation(node, s, epoch, [j for j in supplied if j not in taken and avail(j) > 1e-9], k)


def candidates_by_walk(
    node: bytes,
    s: int,
    epoch: int,
    avail: Callable[[int], float],
    supplied: Collection[int],
    taken: Collection[int],
    k: int,
) -> list[int]:
    """`candidates_by_position`'s shards, found by walking the rotation; with nothing `supplied`, the first
    `k` shards not `taken`."""
    return list(
        itertools.islice(
            (j for j in rotation(node, s, epoch) if j not in taken and (avail(j) > 1e-9 or not supplied)), k
        )
    )


class Supply:
    """What producers announce, per lineage, and summed per shard (what the planner reads); any unit
    (the node uses batches/s). Updated in place, the per-shard sums kept for the last shard count asked."""

    def __init__(self, by_lineage: Mapping[bytes, float] | None = None) -> None:
        self.by_lineage: dict[bytes, float] = {}
        self._s = 0
        self._per: defaultdict[int, float] = defaultdict(float)
        for lid, r in (by_lineage or {}).items():
            self.add(lid, r)

    def add(self, lineage: bytes, rate: float) -> None:
        """Add `rate` (negative: remove) to a lineage's supply."""
        if not (math.isfinite(rate) and rate):
            return
        lid = bytes(lineage)
        left = self.by_lineage.get(lid, 0.0) + rate
        if left > 1e-9:
            self.by_lineage[lid] = left
        else:
            self.by_lineage.pop(lid, None)
        if self._s:
            j = shard_of(lid, self._s)
            self._per[j] += rate
            if self._per[j] <= 1e-9:
                del self._per[j]

    def of(self, lineage: bytes) -> float:
        return self.by_lineage.get(bytes(lineage), 0.0)

    def per_shard(self, shards: int) -> Mapping[int, float]:
        if shards != self._s:
            self._s, self._per = shards, defaultdict(float)
            for lid, r in self.by_lineage.items():
                self._per[shard_of(lid, shards)] += r
        return self._per


def first_subscription() -> tuple[int, tuple[int, ...]]:
    """What a node joins before its exchange's first plan, as (shard count, shards): shard 0 of one shard, where
    every swarm starts and where a node that has heard no producer yet can reach the others."""
    return 1, (0,)


class Exchange:
    """One node's side of the exchange: the shard count it believes, and what it subscribes to."""

    def __init__(self, node: bytes) -> None:
        self.node = bytes(node)
        shards, first = first_subscription()
        self.shards = shards
        self.plan_: Plan = Plan(shards, first, first, 0)
        self.extra = 0  # rotating shards added because measured inbound fell short of demand
        self.short_since: float | None = None
        self._rotating_n = 0  # rotating shards in the last plan (a shortfall's extra one changes it)
        self.offset = (_h(b"murmur/offset", self.node) % 1_000_000) / 1_000_000 * ROTATE_S

    def epoch(self, now: float) -> int:
        return math.floor((now + self.offset) / ROTATE_S)

    def publish_shard(self, lineage: bytes) -> int:
        return shard_of(lineage, self.shards)

    def plan(
        self,
        now: float,
        producers: int,
        supply: Supply | Mapping[bytes, float],
        demand_rps: float,
        home: Iterable[bytes],
        measured_rps: float | None = None,
        own: tuple[bytes, float] | None = None,
    ) -> Plan:
        """Re-plan: `producers` counts the publishing nodes heard (self included), `supply` what others
        announce per lineage, `demand_rps` what this node uses from others in the same unit (0: it consumes
        nothing), `home` the lineages it must hear (published for, validated), `measured_rps` what it
        accepted lately (None: not measured yet), `own` this node's lineage and rate when `supply` counts
        it (not offered to itself)."""
        self.shards = s = shard_count(producers, self.shards)
        pinned = sorted({shard_of(lid, s) for lid in home})[:MAX_SUBSCRIBED]
        sup = supply if isinstance(supply, Supply) else Supply(supply)
        per_shard = sup.per_shard(s)
        own_j, own_r = (shard_of(own[0], s), own[1]) if own is not None and own[1] > 0 else (-1, 0.0)

        def avail(j: int) -> float:  # what others offer on shard j
            return per_shard.get(j, 0.0) - (own_r if j == own_j else 0.0)

        demand = demand_rps if math.isfinite(demand_rps) and demand_rps > 0 else 0.0
        self._shortfall(now, demand, measured_rps)
        chosen = list(pinned)
        if demand > 0:
            missing = DEMAND_MARGIN * demand - sum(avail(j) for j in chosen)
            kept = [j for j in self.plan_.subscribe if j not in self.plan_.home and j not in chosen]
            have = [avail(j) for j in kept]
            if (
                s == self.plan_.shards
                and self.epoch(now) == self.plan_.epoch
                and kept
                and len(kept) == self._rotating_n
                and missing <= sum(have) <= 2 * missing
            ):
                chosen += kept  # within an epoch a plan that covers the demand without twice too much stays
            else:
                rot = self._rotating(now, s, avail, per_shard.keys(), missing, set(chosen))
                self._rotating_n = len(rot)
                chosen += rot
        self.plan_ = Plan(s, tuple(sorted(chosen)), tuple(pinned), self.epoch(now))
        return self.plan_

    def _rotating(
        self,
        now: float,
        s: int,
        avail: Callable[[int], float],
        supplied: Collection[int],
        missing: float,
        taken: set[int],
    ) -> list[int]:
        """Rotating shards for `missing` rollouts/s: in this epoch's order, those offering at most twice what is
        still missing, then the smallest that covers the rest; at least one (diversity), plus `extra`.
        `supplied`: the shards with announced supply (no other has any to offer)."""
        room = MAX_SUBSCRIBED - len(taken)
        epoch = self.epoch(now)
        # the candidates: this epoch's first shards with supply (and a few without, for when none has). Both
        # forms give the same list (tests/test_exchange.py pins it); they differ in cost: finding k = 4 x
        # MAX_SUBSCRIBED of n supplied shards walks about k x S / n of the order, sorting touches the n, so
        # sorting is cheaper below n^2 = k x S, and each form is about a hundred times slower than the other
        # at its far end (measured at S = 4096: 4 supplied shards 2 us sorted, 660 us walked; all 4096 supplied
        # 570 us sorted, 6 us walked)
        if supplied and len(supplied) ** 2 < 4 * MAX_SUBSCRIBED * s:  # few: sorting them beats walking the order
            order = candidates_by_position(self.node, s, epoch, avail, supplied, taken, 4 * MAX_SUBSCRIBED)
        else:
            order = candidates_by_walk(self.node, s, epoch, avail, supplied, taken, 4 * MAX_SUBSCRIBED)
        order = order or [j for j in itertools.islice(rotation(self.node, s, epoch), MAX_SUBSCRIBED) if j not in taken]
        out: list[int] = []
        for j in order:
            if len(out) >= room or missing <= 0:
                break
            if 1e-9 < avail(j) <= 2 * missing:  # up to twice what is missing: half of it used at worst
                out.append(j)
                missing -= avail(j)
        if missing > 0 and len(out) < room:
            rest = [j for j in order if j not in out and avail(j) > 1e-9]
            cover = [j for j in rest if avail(j) >= missing]
            if rest:  # the smallest that covers the rest, or else the largest there is
                out.append(min(cover, key=avail) if cover else max(rest, key=avail))
        if not out and order and room > 0:
            out.append(next((j for j in order if avail(j) > 1e-9), order[0]))
        extra = self.extra
        for j in order:
            if extra <= 0 or len(out) >= room:
                break
            if j not in out:
                out.append(j)
                extra -= 1
        return out

    def _shortfall(self, now: float, demand: float, measured: float | None) -> None:
        if demand <= 0 or measured is None or not math.isfinite(measured):
            return
        if measured >= SHORTFALL * demand:
            self.short_since = None
            if measured >= 3 * demand and self.extra > 0:
                self.extra -= 1
                self._rotating_n = -1  # re-plan
            return
        if self.short_since is None:
            self.short_since = now
        elif now - self.short_since >= SHORTFALL_WINDOW_S:
            self.extra = min(MAX_SUBSCRIBED, self.extra + 1)
            self._rotating_n = -1  # re-plan
            self.short_since = now


class ShardGate:
    """A receiver's checks between a rollout batch's arrival on shard `j` and its verification."""

    def __init__(self) -> None:
        self.first_heard: OrderedDict[str, float] = OrderedDict()
        self.newcomers: dict[int, Bucket] = {}
        self.counts: Counter[str] = Counter()

    def announced(self, peer: str, now: float) -> None:
        """`peer` announced itself (a verified NodeAnnounce): it stops being a newcomer ESTABLISHED_S later."""
        if peer not in self.first_heard:
            self.first_heard[peer] = now
        self.first_heard.move_to_end(peer)
        while len(self.first_heard) > MAX_KNOWN:
            self.first_heard.popitem(last=False)

    def established(self, peer: str, now: float) -> bool:
        t = self.first_heard.get(peer)
        return t is not None and now - t >= ESTABLISHED_S

    def admit(self, origin: str, shard: int, now: float) -> str | None:
        """After the cheap checks, before verification: None, or the drop reason (`newcomer_budget`) for
        this originator on `shard` (a batch refused earlier never spends a newcomer token)."""
        if self.established(origin, now):
            return None
        b = self.newcomers.get(shard)
        if b is None:
            if len(self.newcomers) >= MAX_SHARDS:
                self.newcomers.clear()
            b = self.newcomers[shard] = Bucket(NEWCOMER_BATCHES_PER_S, NEWCOMER_BURST, now)
        if b.take(now):
            return None
        self.counts["newcomer_budget"] += 1
        return "newcomer_budget"

    def screen(self, origin: str, lineages: Iterable[bytes], shard: int, shards: int, now: float) -> str | None:
        """The gate for a batch that passed the cheap checks: None, or why it is dropped unverified."""
        return self.admit(origin, shard, now) or self.belongs(lineages, shard, shards)

    def belongs(self, lineages: Iterable[bytes], shard: int, shards: int) -> str | None:
        """After decoding: None, or `wrong_shard` when a lineage of the batch does not map to `shard`."""
        if all(on_shard(lid, shard, shards) for lid in set(lineages)):
            return None
        self.counts["wrong_shard"] += 1
        return "wrong_shard"


# ---------------------------------------------------------------- producers publish to demand
PUBLISH_MARGIN: Final = 1.5  # a shard's demand is published with this margin (groups go stale, arrive in bursts)
DEMAND_BOUND: Final = 2.0  # one consumer's demand counts at most this multiple of the producer's own
OUTBOX_BURST_S: Final = 4.0  # a producer's unspent publish budget carries over at most this long
SAMPLE_FRACTION: Final = 0.1  # a validator that does not train verifies this share of each producer's batches
SAMPLE_FLOOR_PER_MIN: Final = 2.0  # ... and at least this many of each producer's batches a minute (all, if fewer)
SAMPLE_WINDOW_S: Final = 60.0


def consumer_demand(rollouts_per_step: float, step_time_s: float, bound: float) -> float:
    """Rollouts/s one consumer's announced demand counts for: its external rollouts per version over its
    version interval (the caller passes the interval as its own observation of the consumer's signed versions
    bounds it, so only training backs a demand), and never more than `bound` (per consumer)."""
    if not (
        math.isfinite(rollouts_per_step) and math.isfinite(step_time_s) and step_time_s > 0 and rollouts_per_step > 0
    ):
        return 0.0
    b = bound if math.isfinite(bound) and bound > 0 else 0.0
    return min(rollouts_per_step / step_time_s, b)


def publish_budget(
    demands: Iterable[float], follower_supply: float, trainers: int, validated: bool, per_batch: float
) -> float:
    """Rollouts/s one trainer publishes to its lineage's shard. GossipSub hands every batch of a shard to
    every subscriber, so a shard carries what one consumer asks for, not the sum: the median of the counted
    demands (an inflated few cannot move it), times `PUBLISH_MARGIN`, less what followers already publish
    there, shared by the shard's `trainers` (this one included) but one, since a trainer there receives
    all of it but its own; at least `SAMPLE_FLOOR_PER_MIN` batches of `per_batch` rollouts a minute while a
    validator takes the shard (so it can spot-check this producer). The rest stay local."""
    ds = sorted(d for d in demands if math.isfinite(d) and d > 0)
    median = ds[len(ds) // 2] if ds else 0.0
    sup = follower_supply if math.isfinite(follower_supply) and follower_supply > 0 else 0.0
    share = max(0.0, PUBLISH_MARGIN * median - sup) / max(1, int(trainers) - 1)
    floor = SAMPLE_FLOOR_PER_MIN / 60.0 * max(1.0, per_batch) if validated else 0.0
    return max(share, floor)


class Outbox:
    """A trainer's own rollouts on their way out: whole groups published while the budget (`rate`,
    rollouts/s, set from `publish_budget`) allows; the others stay local (counted, never signed)."""

    def __init__(self, now: float) -> None:
        self.rate = 0.0
        self.tokens = 0.0
        self.last = now

    def set_rate(self, rate: float, now: float) -> None:
        """A new budget. One that opens (from none) starts full, as a token bucket does: a demand that
        appears is served at once, not after its burst has filled."""
        r = rate if math.isfinite(rate) and rate > 0 else 0.0
        if r > 0 and self.rate <= 0:
            self.tokens, self.last = r * OUTBOX_BURST_S, now
        self.rate = r

    def take(self, n: int, now: float) -> bool:
        """Whether a group of `n` rollouts goes out now (its budget spent) or stays local."""
        n = max(0, int(n))
        cap = max(self.rate * OUTBOX_BURST_S, float(n)) if self.rate > 0 else 0.0
        self.tokens = min(cap, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = max(self.last, now)
        if n and self.tokens >= n:
            self.tokens -= n
            return True
        return False


class Sample:
    """Which of a producer's batches a validator that does not train verifies: each with probability
    max(`fraction`, `floor_per_min` / that producer's batches here over the last minute), decided by a keyed
    hash of the batch bytes under this node's secret `key`, so a producer can neither predict nor steer
    which ones are checked (it would need the key); a producer that sends at most the floor is checked on
    every batch. Memory: one row per producer, at most `MAX_KNOWN`."""

    def __init__(
        self, key: bytes, fraction: float = SAMPLE_FRACTION, floor_per_min: float = SAMPLE_FLOOR_PER_MIN
    ) -> None:
        if len(key) < 16:
            raise ValueError("a validator's sample key must be at least 16 random bytes")
        self.key = bytes(key)[:64]
        self.fraction = min(1.0, max(0.0, float(fraction)))
        self.floor_per_min = max(0.0, float(floor_per_min))
        self._seen: OrderedDict[str, list[float]] = OrderedDict()  # producer -> [window start, previous, current]
        self.counts: Counter[str] = Counter()  # seen_batches, checked_batches

    def arrivals(self, producer: str, now: float) -> float:
        """The producer's batches seen over the last `SAMPLE_WINDOW_S` (two windows, the older one weighted
        by how much of it still falls inside), counting one more now."""
        row = self._seen.get(producer)
        if row is None:
            row = self._seen[producer] = [now, 0.0, 0.0]
            while len(self._seen) > MAX_KNOWN:
                self._seen.popitem(last=False)
        self._seen.move_to_end(producer)
        gone = (now - row[0]) // SAMPLE_WINDOW_S
        if gone >= 1:
            row[0] += gone * SAMPLE_WINDOW_S
            row[1], row[2] = (row[2] if gone == 1 else 0.0), 0.0
        row[2] += 1
        return row[2] + row[1] * max(0.0, 1.0 - (now - row[0]) / SAMPLE_WINDOW_S)

    def check(self, producer: str, batch: bytes, now: float) -> bool:
        """Whether this batch of `producer`'s is verified (True) or dropped unverified."""
        n = self.arrivals(producer, now)
        q = min(1.0, max(self.fraction, self.floor_per_min / max(1.0, n)))
        draw = int.from_bytes(hashlib.blake2b(bytes(batch), key=self.key, digest_size=8).digest(), "big") / 2**64
        self.counts["seen_batches"] += 1
        if draw < q:
            self.counts["checked_batches"] += 1
            return True
        return False

    def rate(self) -> float:
        """The share of the batches seen that were checked so far."""
        seen = self.counts["seen_batches"]
        return self.counts["checked_batches"] / seen if seen else 0.0


class Meter:
    """Rollouts/s over a sliding window (what the planner compares with demand)."""

    def __init__(self, window_s: float = SHORTFALL_WINDOW_S, max_events: int = 10_000) -> None:
        self.window_s = window_s
        self._t: deque[tuple[float, int]] = deque(maxlen=max_events)
        self.started: float | None = None

    def add(self, now: float, n: int) -> None:
        if self.started is None:
            self.started = now
        self._t.append((now, n))

    def rate(self, now: float) -> float | None:
        """None until a whole window has been measured (counted from the first call of either method)."""
        if self.started is None:
            self.started = now
        if now - self.started < self.window_s:
            return None
        while self._t and self._t[0][0] <= now - self.window_s:
            self._t.popleft()
        return sum(n for _, n in self._t) / self.window_s


DISTINCT_WINDOW_S: Final = 600.0  # "distinct producers" counts those verified within this window
RATE_WINDOW_S: Final = 30.0
MAX_TASK_SETS: Final = 64  # task sets counted per node (the rest under "other")
MAX_LINEAGES_PER_SET: Final = 32  # lineages whose generators are counted per task set (the rest not shown)
GENERATORS_K: Final = 64  # distinct producers counted exactly per lineage and task set (estimated beyond)


class Stats:
    """A node's exchange counters: received, verified, used, dropped by reason, distinct producers,
    per task set; and their rates over the last `RATE_WINDOW_S`. Every table is bounded."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # received_batches, received_rollouts, verified_*, used_rollouts
        self.dropped: Counter[str] = Counter()  # reason -> batches
        self.producers: OrderedDict[bytes, float] = OrderedDict()  # producer key -> last verified
        self.task_sets: dict[str, Counter[str]] = {}  # task set hex -> verified_rollouts, used_rollouts
        # task set hex -> lineage hex -> the producers whose verified rollouts of that lineage were on that set
        self.generators: dict[str, dict[str, DistinctCount]] = {}
        self._snaps: deque[tuple[float, dict[str, int]]] = deque(maxlen=64)

    def received(self, rollouts: int = 0) -> None:
        self.counts["received_batches"] += 1
        self.counts["received_rollouts"] += max(0, rollouts)

    def drop(self, reason: str) -> None:
        self.dropped[reason[:40]] += 1

    def unsampled(self) -> None:
        """A batch outside a validator's sample: dropped before any work, neither received nor dropped work."""
        self.counts["unsampled_batches"] += 1

    def verified(self, producer: bytes, work: Iterable[tuple[bytes, bytes]], rollouts: int, now: float) -> None:
        """A verified batch of `rollouts` from `producer`; `work`: each rollout's (task set, lineage)."""
        self.counts["verified_batches"] += 1
        self.counts["verified_rollouts"] += rollouts
        self.producers[bytes(producer)] = now
        self.producers.move_to_end(bytes(producer))
        while len(self.producers) > MAX_KNOWN:
            self.producers.popitem(last=False)
        pairs = set()
        for ts, lineage in work:
            self._per_set(ts)["verified_rollouts"] += 1
            pairs.add((bytes(ts), bytes(lineage)))
        for ts, lineage in pairs:
            count = self._generators(ts, lineage)
            if count is not None:
                count.add(bytes(producer), now)

    def _generators(self, ts: bytes, lineage: bytes) -> DistinctCount | None:
        """The producer count of `lineage` on task set `ts` (None past `MAX_LINEAGES_PER_SET` lineages)."""
        per = self.generators.setdefault(_set_key(self.generators, ts), {})
        got = per.get(lineage.hex())
        if got is None:
            if len(per) >= MAX_LINEAGES_PER_SET:
                return None
            got = per[lineage.hex()] = DistinctCount(GENERATORS_K, DISTINCT_WINDOW_S)
        return got

    def lineages_by_set(self, now: float) -> dict[str, dict[str, int]]:
        """Per task set: each lineage trained on it (a producer's verified rollouts of it within
        `DISTINCT_WINDOW_S`) and how many distinct producers generated for it on that set."""
        out: dict[str, dict[str, int]] = {}
        for ts, per in self.generators.items():
            counts = {lineage: c.count(now) for lineage, c in per.items()}
            for lineage in [k for k, n in counts.items() if not n]:
                del per[lineage], counts[lineage]
            if counts:
                out[ts] = counts
        return out

    def used(self, by_set: Mapping[str, int]) -> None:
        """External rollouts that entered the trainer's updates, per task set (hex id)."""
        for ts, n in by_set.items():
            try:
                key = bytes.fromhex(ts)
            except ValueError:
                continue
            k = max(0, int(n))
            self.counts["used_rollouts"] += k
            self._per_set(key)["used_rollouts"] += k

    def _per_set(self, ts: bytes) -> Counter[str]:
        return self.task_sets.setdefault(_set_key(self.task_sets, ts), Counter())

    def distinct_producers(self, now: float) -> int:
        while self.producers and now - next(iter(self.producers.values())) > DISTINCT_WINDOW_S:
            self.producers.popitem(last=False)
        return len(self.producers)

    def totals(self) -> dict[str, int]:
        return {**self.counts, "dropped_batches": sum(self.dropped.values())}

    def rates(self, now: float) -> dict[str, float]:
        """Per second over (up to) the last RATE_WINDOW_S; call about once a second."""
        cur = self.totals()
        if not self._snaps or now - self._snaps[-1][0] >= 1.0:
            self._snaps.append((now, cur))
        while len(self._snaps) > 1 and now - self._snaps[0][0] > RATE_WINDOW_S:
            self._snaps.popleft()
        t0, old = self._snaps[0]
        span = now - t0
        if span <= 0:
            return {}
        return {k + "_per_s": round((cur.get(k, 0) - old.get(k, 0)) / span, 3) for k in cur}


def _set_key(table: Mapping[str, object], ts: bytes) -> str:
    """A task set's key in a per-set table: its hex id, or "other" once the table holds `MAX_TASK_SETS`."""
    key = bytes(ts).hex()[:64]
    if key not in table and len(table) >= MAX_TASK_SETS - 1:  # "other" counts too
        key = "other"
    return key


@functools.lru_cache(maxsize=16_384)  # a node hashes the key of every announce it hears
def _kmv_hash(key: str | bytes) -> int:
    return _h(b"murmur/kmv", key.encode() if isinstance(key, str) else key)


class DistinctCount:
    """How many distinct keys were seen in the last `window_s`, in bounded memory (k minimum values):
    the k smallest hashes kept, with when each was last seen. Counts up to k exactly, then estimates
    (k-1) / (k-th smallest hash as a fraction of the hash space), within a few percent at k = 256."""

    def __init__(self, k: int = 256, window_s: float = 30.0) -> None:
        self.k = k
        self.window_s = window_s
        self._seen: dict[int, float] = {}  # hash -> last seen
        self._top: int | None = None  # max(self._seen) while full, cached
        self._sampled = False  # a key was left out (the table holds the k smallest, not every key)

    def add(self, key: str | bytes, now: float) -> None:
        h = _kmv_hash(key) if isinstance(key, str | bytes) else _kmv_hash(bytes(key))
        if h in self._seen or len(self._seen) < self.k:
            self._seen[h] = now
            self._top = None
            return
        self._sampled = True
        if self._top is None:
            self._top = max(self._seen)
        if h < self._top:  # most keys of a big swarm stop at this one comparison
            del self._seen[self._top]
            self._seen[h] = now
            self._top = None

    def count(self, now: float) -> int:
        for h in [h for h, t in self._seen.items() if now - t > self.window_s]:
            del self._seen[h]
            self._top = None
        if len(self._seen) < self.k:
            self._sampled = False
        if not self._sampled:  # every key seen is in the table: exactly k of them is k
            return len(self._seen)
        return int((self.k - 1) / (max(self._seen) / 2**64))
