"""The shared prompt schedule: the prompts of a task set that every node answers in a round of wall-clock time.

Peers that train their own lineages on one task set meet on the same prompts only if they draw them
from something they all derive. Round r of a task set is `PROMPTS_PER_ROUND` task references, each
drawn from blake2b(task set id || r || i): the i-th picks one of the set's training generators by the
generators' weights and a seed in its range. Held-out `-eval` generators are never scheduled, so a
scheduled prompt is a training prompt like any other: the schedule changes which prompts peers share,
not what they are drawn from. The round is the wall clock's (`round_at`: `1 + unix_ms // ROUND_MS`), so
it needs no lineage, no coordinator and no message: any node with the set's manifest and a clock within
a minute of the others computes the same prompts. Round 0 is never a round: a rollout's
`schedule_round` of 0 says "not scheduled" (gossip/wire.py).

A producer (`ScheduledDraw`) takes a configured share of its prompts from the current round, walking its
prompts in order, so that nodes drawing at different rates still answer the same first prompts of a
round; past the round's last prompt it draws freely until the next round. Its rollouts carry the round.

A receiver (`ScheduleBook`, injected into `gossip.validation.Pipeline`) refuses a claimed round outside its
window around its own clock (`PAST_ROUNDS` back, `FUTURE_ROUNDS` ahead: `schedule_window`, uncharged,
since it rests on the receiver's clock), and a rollout whose task is not one of its claimed round's
prompts (`misscheduled`, charged: the task reference, the set's manifest and this module prove it). Each
check is a set lookup: a round's prompts are derived once per (task set, round) and cached, and only for
rounds inside the window, so no claimed number makes a receiver derive more.

Pure: no I/O; every time is passed in (unix milliseconds).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from murmur.gossip.wire import TaskRef, TaskSetManifest
from murmur.training.tasksets import TaskRegistry, train_generators

# Protocol constants: every node must derive the same rounds and prompts, so these change only with the
# wire's format version.
ROUND_MS: Final = 60_000
# Enough prompts that a node drawing a share of a step's prompts every second still draws from the round
# all round long (a CPU node of murmur-tiny steps about once a second), while nodes that draw at different
# rates still meet on a round's first prompts.
PROMPTS_PER_ROUND: Final = 1024
# A receiver accepts claims for rounds from PAST_ROUNDS before its own to FUTURE_ROUNDS after. Back: the
# replay TTL's 900 s (a batch older than that is `expired` anyway), so a batch the pipeline can still prove
# fresh is not refused for the round it was drawn in. Ahead: one round, the clock skew the pipeline
# allows (60 s) being no more than a round.
PAST_ROUNDS: Final = 15
FUTURE_ROUNDS: Final = 1
# A producer clears its claim when its round is this close to leaving the window: what it signs now must
# still be inside every receiver's window when it arrives (batching, gossip, a verification queue).
PUBLISH_MARGIN_ROUNDS: Final = 2
_PERSON: Final = b"murmur/schedule"  # blake2b personalisation: no other hash in Murmur collides with these
# (task set, round) entries a book keeps, about 180 KB each: the whole window (17 rounds) of three task sets,
# the current rounds of many more
CACHE_ROUNDS: Final = 64


def round_at(wall_ms: int) -> int:
    """The schedule round at unix time `wall_ms` (milliseconds): 1 + wall_ms // ROUND_MS, so never 0."""
    return 1 + max(0, int(wall_ms)) // ROUND_MS


def in_window(round_no: int, wall_ms: int) -> bool:
    """Whether a receiver whose clock reads `wall_ms` accepts a claim for `round_no`."""
    now = round_at(wall_ms)
    return round_no >= 1 and now - PAST_ROUNDS <= round_no <= now + FUTURE_ROUNDS


def publishable(round_no: int, wall_ms: int) -> int:
    """The claim a producer signs at `wall_ms` for a prompt drawn in `round_no`: the round while it stays inside
    receivers' windows with `PUBLISH_MARGIN_ROUNDS` to spare, else 0 (published unscheduled: the task is as
    valid as ever, only the meeting is missed)."""
    now = round_at(wall_ms)
    if round_no >= 1 and now - PAST_ROUNDS + PUBLISH_MARGIN_ROUNDS <= round_no <= now:
        return round_no
    return 0


def scheduled_prompts(
    task_set: bytes, manifest: TaskSetManifest, round_no: int, count: int = PROMPTS_PER_ROUND
) -> tuple[TaskRef, ...]:
    """The prompts of round `round_no` of the task set `task_set` (its id) whose manifest is `manifest`: the i-th
    from blake2b(task_set || round || i), a training generator by weight and a seed in its range. Empty when
    the set has no training generator or `round_no` is 0."""
    gens = train_generators(manifest)
    if not gens or round_no < 1:
        return ()
    cumulative: list[float] = []
    total = 0.0
    for g in gens:  # the manifest's order, which its id pins: the same sums on every node (IEEE doubles)
        total += g.weight
        cumulative.append(total)
    tid = bytes(task_set)
    out = []
    for i in range(count):
        h = hashlib.blake2b(
            tid + round_no.to_bytes(8, "big") + i.to_bytes(4, "big"), digest_size=32, person=_PERSON
        ).digest()
        u = int.from_bytes(h[:8], "big") / 2.0**64 * total
        k = next((j for j, c in enumerate(cumulative) if u < c), len(gens) - 1)
        g = gens[k]
        # 128 bits of hash over a range of at most 2^63 seeds: every seed equally likely to within 2^-65
        seed = g.seed_start + int.from_bytes(h[8:24], "big") % (g.seed_end - g.seed_start)
        out.append(TaskRef(tid, g.name, seed))
    return tuple(out)


class ScheduleBook:
    """The rounds of every task set a node holds, cached: what a receiver checks a claim against (the
    `gossip.validation.ScheduleView` a pipeline is given) and what a producer draws from.

    `manifest(task_set_id)` returns the set's manifest, or None for a set not held here. A task set's id is the
    hash of its signed manifest, so a round's prompts never change once derived."""

    def __init__(self, manifest: Callable[[bytes], TaskSetManifest | None], entries: int = CACHE_ROUNDS) -> None:
        self.manifest = manifest
        self.entries = entries
        self._rounds: OrderedDict[tuple[bytes, int], tuple[tuple[TaskRef, ...], frozenset[tuple[str, int]]]] = (
            OrderedDict()
        )
        self.derived = 0  # rounds derived (not from the cache): what the cost bound is about

    @classmethod
    def of(cls, registry: TaskRegistry) -> ScheduleBook:
        """The book of the task sets `registry` holds."""
        return cls(lambda tid: registry.get(tid) if tid in registry else None)

    def _round(self, task_set: bytes, round_no: int) -> tuple[tuple[TaskRef, ...], frozenset[tuple[str, int]]] | None:
        key = (bytes(task_set), int(round_no))
        hit = self._rounds.get(key)
        if hit is not None:
            self._rounds.move_to_end(key)
            return hit
        m = self.manifest(key[0])
        if m is None:
            return None
        refs = scheduled_prompts(key[0], m, key[1])
        entry = (refs, frozenset((r.generator, int(r.seed)) for r in refs))
        self.derived += 1
        self._rounds[key] = entry
        while len(self._rounds) > self.entries:
            self._rounds.popitem(last=False)
        return entry

    def prompts(self, task_set: bytes, round_no: int) -> tuple[TaskRef, ...]:
        """Round `round_no`'s prompts of `task_set` (empty for a set not held here)."""
        got = self._round(task_set, round_no)
        return () if got is None else got[0]

    def in_window(self, round_no: int, now_s: float) -> bool:
        """Whether a claim for `round_no` is inside this node's window at unix time `now_s` (seconds)."""
        return in_window(round_no, int(now_s * 1000))

    def scheduled(self, ref: TaskRef, round_no: int) -> bool | None:
        """Whether `ref` is one of round `round_no`'s prompts of its task set; None when that set is not held
        here. Call it for rounds inside the window only (`in_window`): each new round is derived once."""
        got = self._round(bytes(ref.task_set), round_no)
        if got is None:
            return None
        return (ref.generator, int(ref.seed)) in got[1]


class ScheduledDraw:
    """A producer's share of prompts from the shared schedule: of every `1 / share` prompts it draws, one is the
    next unanswered prompt of the current round of the chosen task set (by a running credit, so the share holds
    exactly over time with no randomness); past the round's last prompt, and for a set not held, it draws
    freely until the next round."""

    def __init__(self, book: ScheduleBook, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"schedule share {share!r} is not in 0..1")
        self.book = book
        self.share = float(share)
        self._credit = 0.0
        self._round = 0
        self._next: dict[bytes, int] = {}  # task set -> index of its next prompt in the current round
        self.drawn = 0  # scheduled prompts handed out

    def draw(self, task_set: bytes, wall_ms: int) -> tuple[TaskRef, int] | None:
        """(a scheduled prompt of `task_set`, its round) for this draw, or None: draw this one freely."""
        self._credit += self.share
        if self._credit < 1.0 - 1e-9:  # float sums of e.g. 0.1 fall just short of 1
            return None
        self._credit -= 1.0
        r = round_at(wall_ms)
        if r != self._round:
            self._round, self._next = r, {}
        tid = bytes(task_set)
        prompts = self.book.prompts(tid, r)
        i = self._next.get(tid, 0)
        if i >= len(prompts):
            return None
        self._next[tid] = i + 1
        self.drawn += 1
        return prompts[i], r


__all__ = [
    "CACHE_ROUNDS",
    "FUTURE_ROUNDS",
    "PAST_ROUNDS",
    "PROMPTS_PER_ROUND",
    "PUBLISH_MARGIN_ROUNDS",
    "ROUND_MS",
    "ScheduleBook",
    "ScheduledDraw",
    "in_window",
    "publishable",
    "round_at",
    "scheduled_prompts",
]
