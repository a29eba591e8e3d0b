"""The external-rollout sampler: which verified swarm rollouts a trainer learns from (sans-IO, bounded).

One rule, used by the node's worker (`node/worker/main.py`), `murmur bench swarm`
(`simulations/bench/swarm.py`) and the virtual-time simulator
(`simulations/virtual.py`), so a benchmark or a simulation samples exactly as
a node does. Swarm sampling (SAPO): each step mixes I local and J external
prompt groups (`[training] local_rollouts` / `external_rollouts`, default
4 / 4); this module supplies the J.

- **Intake** (`split`, then `add`): a verified batch is cut into groups, one per
  (task reference, lineage): the completions one producer sampled for one
  task. A group of fewer than two rollouts, or whose rewards are all equal
  (zero advantage, nothing to learn), is dropped at once, unless it answers
  a shared-schedule prompt (training/schedule.py): then it is kept as
  `uniform` and taken only to join a trainer's own group of the same task
  (HACPO's pooled group, where another model's all-right answers to a task
  the learner got all wrong teach most), never alone. Rewards are the
  batch's claims, which the validation pipeline has already recomputed and
  matched, so no reward is trusted that was not checked.
- **Pool**: groups in arrival order, at most `max_groups` groups and, if set,
  `max_rollouts` rollouts (the oldest group goes first when either is
  exceeded). A group holds at most one batch's rollouts (the wire bounds a
  batch), so memory stays within both bounds whatever peers send.
- **Staleness**: a group is usable while `head - version <= max_staleness`,
  where `head` is the newest version its owner reported for the group's
  lineage (`observe_head`: a trainer reports its own lineage every step, and
  heads it learns from verified manifests). Only a lineage's publisher
  advances its head, so a rollout's claimed version never does: a peer
  claiming version 10**9 for someone's lineage cannot age that lineage's
  other groups out. A group of a lineage with no reported head is dropped
  when met (`unowned`): the node reports heads only of lineages whose
  publisher has had a signed manifest accepted, so a lineage no one owns is
  never trained on and cannot escape the staleness rule. Stale groups are
  dropped when met, never sampled.
- **Take** (`take(J)`): J usable groups drawn uniformly at random (SAPO's
  `random.sample`, from the sampler's own seeded generator), each used once;
  returned in arrival order. Newest-first made every node of a round-robin
  swarm learn from the same two or three predecessors whatever N was; a
  uniform draw spreads what a trainer learns over every fresh producer.
  With `max_tokens`, the groups taken hold at most that many completion
  tokens: a step's external work is bounded in tokens, not only in groups (a
  group may hold a whole batch's 64 rollouts). A group larger than the whole
  budget is dropped (`over_budget`); the draw goes on past one that does not
  fit what is left, which waits for a later step. Groups of lineages other
  than the sampler's own (`own`) carry weights no receiver can re-score, so
  one producer (the key that signed their batch) fills at most
  `producer_cap(J)` of a step's J groups; the rest of its groups wait.
  A trainer with rescue selection on passes `prefer` (its own groups' tasks
  this step, ranked): the draw then takes those tasks first, then groups of
  medium difficulty, the random draw breaking ties (`preference_order`); the
  caps above hold alike.

Counters (`counts`): `added`, `uninformative` and `too_small` (dropped at
intake), `evicted` (pool full), `stale`, `unowned` and `over_budget` (dropped
at take), `producer_share` (held back by the per-producer cap), `producer_failed` (dropped when
their producer failed a log-prob check, `drop_producer`), `taken`.

Usage (the simulator, per receiving node)::

    cut = sampler.split(batch.rollouts, batch.producer)  # once per verified message; Groups are shareable
    node_sampler.add_split(cut)              # per receiver: its groups, and the dropped ones counted
    node_sampler.observe_head(lineage, v)    # whenever the node learns a head (its own: every step)
    picked = node_sampler.take(4)            # list[Group]: .rollouts, .lineage, .version, .key (random draw)
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from murmur.gossip import wire

TaskKey = tuple[bytes, str, int]  # (task set id, generator, seed)

MAX_GROUPS_LIMIT = 1 << 20
MAX_HEADS = 4096  # lineages whose reported head is remembered (least recently reported forgotten first)


@dataclass(frozen=True, slots=True)
class Group:
    """Completions of one task by one lineage, from one verified batch."""

    key: TaskKey
    lineage: bytes
    version: int  # the oldest policy version among its rollouts
    rollouts: tuple[wire.Rollout, ...]
    producer: bytes = b""  # the key that signed the batch (b"": not known to the caller)
    # all rewards equal, kept because it answers a shared-schedule prompt: taken only to join the own group of
    # its task a trainer names in `prefer` (pooled, it may teach), never on its own (it cannot)
    uniform: bool = False


class Signed(NamedTuple):
    """A verified rollout and the key that signed its batch: what the trainer's `external` hook hands over,
    so that HACPO's capability of another model's samples is kept per producer key."""

    producer: bytes
    rollout: wire.Rollout


def task_key(ref: wire.TaskRef) -> TaskKey:
    return (bytes(ref.task_set), ref.generator, int(ref.seed))


def informative(rewards: Iterable[float]) -> bool:
    """Whether a group with these rewards has something to learn: rewards not all equal (GRPO's advantage is
    zero otherwise), up to float noise."""
    rs = list(rewards)
    return max(rs) - min(rs) > 1e-9


def split(rollouts: Iterable[wire.Rollout], producer: bytes = b"") -> tuple[list[Group], dict[str, int]]:
    """Cut a verified batch (signed by `producer`) into groups; returns (informative groups, counts of the
    dropped ones)."""
    by: dict[tuple[TaskKey, bytes], list[wire.Rollout]] = {}
    for r in rollouts:
        by.setdefault((task_key(r.task), bytes(r.lineage)), []).append(r)
    out: list[Group] = []
    dropped = {"too_small": 0, "uninformative": 0}
    for (key, lineage), rs in by.items():
        if len(rs) < 2:
            dropped["too_small"] += 1
            continue
        uniform = not informative(r.reward for r in rs)
        if uniform and not all(r.schedule_round for r in rs):
            dropped["uninformative"] += 1
            continue
        out.append(Group(key, lineage, min(r.version for r in rs), tuple(rs), bytes(producer), uniform))
    return out, dropped


def producer_cap(groups: int) -> int:
    """The most groups of other lineages one producer may fill of a step's `groups` external groups: half,
    at least one. Those groups' weights cannot be re-scored, so no single key steers a step."""
    return max(1, groups // 2)


def _tokens(g: Group) -> int:
    return sum(len(r.completion_ids) for r in g.rollouts)


class Sampler:
    """A trainer's pool of verified external groups and the rule that picks J of them per step."""

    def __init__(
        self,
        max_groups: int = 256,
        max_staleness: int = 4,
        max_rollouts: int | None = None,
        seed: int = 0,
        own: bytes | None = None,
    ) -> None:
        if not 1 <= max_groups <= MAX_GROUPS_LIMIT:
            raise ValueError(f"max_groups must be in 1..{MAX_GROUPS_LIMIT}")
        if max_rollouts is not None and max_rollouts < 2:
            raise ValueError("max_rollouts must be >= 2 (a group has at least two)")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.max_groups = max_groups
        self.max_staleness = max_staleness
        self.max_rollouts = max_rollouts
        self._rollouts = 0  # in the pool
        self._pool: collections.deque[Group] = collections.deque()
        self._heads: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._rng = random.Random(seed)
        self.own = None if own is None else bytes(own)  # the lineage this sampler's trainer publishes
        self.counts = {
            "added": 0,
            "too_small": 0,
            "uninformative": 0,
            "evicted": 0,
            "stale": 0,
            "over_budget": 0,
            "unowned": 0,
            "taken": 0,
            "producer_share": 0,
            "producer_failed": 0,
        }

    def __len__(self) -> int:
        return len(self._pool)

    def add(self, groups: Iterable[Group]) -> int:
        """Pool already-split groups (see `split`); returns how many were added."""
        n = 0
        for g in groups:
            self._pool.append(g)
            self._rollouts += len(g.rollouts)
            n += 1
            while len(self._pool) > self.max_groups or (
                self.max_rollouts is not None and self._rollouts > self.max_rollouts
            ):
                self._rollouts -= len(self._pool.popleft().rollouts)
                self.counts["evicted"] += 1
        self.counts["added"] += n
        return n

    def add_split(self, cut: tuple[Iterable[Group], dict[str, int]]) -> int:
        """Pool what `split` returned for one batch: its groups, and the counts of those it dropped; returns
        groups added. A caller with many receivers of one batch splits it once and hands each the same cut."""
        groups, dropped = cut
        for k, v in dropped.items():
            self.counts[k] += v
        return self.add(groups)

    def add_rollouts(self, rollouts: Iterable[wire.Rollout], producer: bytes = b"") -> int:
        """Split a verified batch's rollouts and pool its informative groups; returns groups added."""
        return self.add_split(split(rollouts, producer))

    def drop_producer(self, producer: bytes) -> int:
        """Drop every pooled group `producer` signed (it failed a log-prob check); returns how many."""
        keep = [g for g in self._pool if g.producer != producer]
        n = len(self._pool) - len(keep)
        if n:
            self._pool = collections.deque(keep)
            self._rollouts = sum([len(g.rollouts) for g in keep])
            self.counts["producer_failed"] += n
        return n

    def observe_head(self, lineage: bytes, version: int) -> None:
        """The newest version of `lineage` its publisher announced (never lowers what was known)."""
        lineage = bytes(lineage)
        old = self._heads.pop(lineage, None)
        self._heads[lineage] = version if old is None else max(old, version)
        while len(self._heads) > MAX_HEADS:
            self._heads.popitem(last=False)

    def head(self, lineage: bytes) -> int | None:
        """Newest reported version of `lineage` (None: none reported)."""
        return self._heads.get(bytes(lineage))

    def take(
        self, groups: int, max_tokens: int | None = None, prefer: Mapping[TaskKey, int] | None = None
    ) -> list[Group]:
        """Up to `groups` usable groups drawn uniformly at random, each used once, holding at most
        `max_tokens` completion tokens, with at most `producer_cap(groups)` groups of other lineages from
        any one producer; every stale group in the pool, every group of a lineage with no reported head,
        and every group larger than the whole budget, is dropped on the way. Returned in arrival order
        (oldest first).

        With `prefer` (the trainer's rescue selection, `preference_order`), groups are drawn in that order
        instead: the tasks it ranks first, then medium difficulty, the random draw breaking ties."""
        if groups <= 0 or not self._pool:
            return []
        usable: list[Group] = []
        heads, bound, stale, unowned = self._heads, self.max_staleness, 0, 0
        for g in self._pool:
            head = heads.get(g.lineage)
            if head is None:
                unowned += 1
            elif head - g.version > bound:
                stale += 1
            elif max_tokens is not None and _tokens(g) > max_tokens:
                self.counts["over_budget"] += 1
            else:
                usable.append(g)
        self.counts["stale"] += stale
        self.counts["unowned"] += unowned
        cap = producer_cap(groups)
        chosen: set[int] = set()
        per: dict[bytes, int] = {}
        room = max_tokens
        draw = self._rng.sample(range(len(usable)), len(usable))
        if prefer is not None:
            draw = preference_order([usable[i] for i in draw], prefer, draw)
        for i in draw:
            if len(chosen) >= groups:
                break
            g = usable[i]
            if g.uniform and (prefer is None or g.key not in prefer):
                continue  # alone it teaches nothing: it waits for a trainer's own group of its task
            foreign = g.lineage != self.own
            if foreign and per.get(g.producer, 0) >= cap:
                self.counts["producer_share"] += 1  # waits for a later step (or its eviction)
                continue
            if room is not None and _tokens(g) > room:
                continue
            chosen.add(i)
            if foreign:
                per[g.producer] = per.get(g.producer, 0) + 1
            if room is not None:
                room -= _tokens(g)
        picked: list[Group] = []
        keep: list[Group] = []
        for i, g in enumerate(usable):
            (picked if i in chosen else keep).append(g)
        self._pool = collections.deque(keep)
        self._rollouts = sum([len(g.rollouts) for g in keep])
        self.counts["taken"] += len(picked)
        return picked

    def take_rollouts(
        self,
        groups: int,
        _min_version: int = 0,
        max_tokens: int | None = None,
        prefer: Mapping[TaskKey, int] | None = None,
    ) -> list[Signed]:
        """`take` flattened, each rollout with its producer: the shape of `training.trainer.Trainer`'s
        `external` hook.

        The trainer's version floor is not needed: the owner reports its own head with
        `observe_head`, and the staleness rule above applies to every lineage alike."""
        return [Signed(g.producer, r) for g in self.take(groups, max_tokens, prefer) for r in g.rollouts]


RANK_OTHER = 2  # a task the trainer has no own group of this step (see `preference_order`)


def preference_order(groups: list[Group], prefer: Mapping[TaskKey, int], ids: list[int] | None = None) -> list[int]:
    """Rescue selection: `ids` (default 0..n-1, one per group, in the caller's order) sorted by the rank
    `prefer` gives a group's task (the trainer ranks 0 a task whose own group this step was all right or
    all wrong, so another model's answers make it informative; 1 one whose own group was informative;
    unranked tasks come after, `RANK_OTHER`), then by medium difficulty (success rate nearest 1/2, where
    a group teaches most: ExGRPO), then the caller's order."""
    ids = list(range(len(groups))) if ids is None else ids

    def key(k: int) -> tuple[int, float, int]:
        g = groups[k]
        return (*rescue_rank(prefer, g.key, [r.reward for r in g.rollouts]), k)

    return [ids[k] for k in sorted(range(len(groups)), key=key)]


def rescue_rank(prefer: Mapping[TaskKey, int], key: TaskKey, rewards: list[float]) -> tuple[int, float]:
    """Rescue selection's sort key of one task's rows (`preference_order`, and the trainer's order of what it
    got): the rank `prefer` gives the task, then the distance of its success rate from 1/2."""
    rate = sum(r > 0 for r in rewards) / max(1, len(rewards))
    return prefer.get(key, RANK_OTHER), abs(rate - 0.5)
