"""Which received rollouts a node re-scores to check their behaviour log-probs (spot checks).

Only a node holding the exact weights that produced a rollout can check it: its lineage at its
version, for every token (a partial rollout continued under a newer version cannot be checked
against one). A trainer holds its own lineage at the version it last published (and checks before
it publishes the next); a validator holds the version it follows. Older tokens are the stale-token
mask's (M2PO) job, newer ones are refused by validation (`future_version`).

Each eligible rollout is checked with probability `rate`, at most `per_round` per round, drawn
uniformly over all eligible rollouts of the round, so every producer faces the same chance however
many rollouts it sends. A producer that has not yet passed `TRUST_AFTER` checks is unproven: its
eligible rollouts are drawn first and every time (rate 1) until it has, so fabricated log-probs from a
fresh key are caught in its first batches, and the trainer drops what it pooled from a producer that
fails (`training.sampler.Sampler.drop_producer`). Counters per producer measure it (`ProducerSpot`);
the table is bounded.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from murmur.gossip.wire import Rollout, RolloutBatch

SPOT_TOLERANCE = 0.05  # mean |delta log-prob| per token allowed between a claim and the recomputation
SPOT_RATE = 0.25  # of the rollouts a node could check, each drawn with this probability ...
SPOT_PER_ROUND = 4  # ... and at most this many a round (a trainer's step, a follower's group)
TRUST_AFTER = 3  # passed checks before a producer's rollouts are sampled at `rate` instead of always


@dataclass
class ProducerSpot:
    eligible: int = 0  # rollouts this node could check (it held their weights)
    checked: int = 0
    failed: int = 0

    @property
    def proven(self) -> bool:
        return self.checked - self.failed >= TRUST_AFTER and self.failed == 0

    @property
    def fraction(self) -> float:
        return self.checked / self.eligible if self.eligible else 0.0


def checkable(r: Rollout, lineage: bytes, version: int, tokenizer_hash: bytes) -> bool:
    """Whether every token of `r` came from (lineage, version) and names our tokenizer."""
    return (
        bytes(r.lineage) == lineage
        and r.version == version
        and bool(r.completion_ids)
        and bytes(r.tokenizer_hash) == tokenizer_hash
        and all(v == version for _, v in r.token_versions)
    )


def mean_abs_diff(got: Sequence[float], claim: Sequence[float]) -> float:
    return sum(abs(a - b) for a, b in zip(got, claim)) / max(1, len(got))


class SpotSampler:
    def __init__(self, rate: float, per_round: int, seed: int = 0, max_producers: int = 1024) -> None:
        self.rate = min(1.0, max(0.0, rate))
        self.per_round = max(0, per_round)
        self.rng = random.Random(seed)
        self.max_producers = max_producers
        self.producers: OrderedDict[bytes, ProducerSpot] = OrderedDict()

    def _rec(self, producer: bytes) -> ProducerSpot:
        rec = self.producers.get(producer)
        if rec is None:
            rec = self.producers[producer] = ProducerSpot()
            while len(self.producers) > self.max_producers:
                self.producers.popitem(last=False)
        else:
            self.producers.move_to_end(producer)
        return rec

    def pick(
        self,
        batches: Iterable[tuple[bytes, RolloutBatch]],
        lineage: bytes,
        version: int,
        tokenizer_hash: bytes,
        usable: Callable[[Rollout], bool] | None = None,
    ) -> tuple[int, list[tuple[bytes, Rollout]]]:
        """(eligible rollouts this round, the (producer, rollout) pairs to check). `usable` (the
        caller's costlier checks: ids in our vocabulary, a task set we hold) runs on drawn ones only;
        a drawn rollout it refuses is not counted as eligible."""
        cands = [
            (producer, r)
            for producer, batch in batches
            for r in batch.rollouts
            if checkable(r, lineage, version, tokenizer_hash)
        ]
        self.rng.shuffle(cands)
        unproven = {p for p, _ in cands if not (p in self.producers and self.producers[p].proven)}
        cands.sort(key=lambda c: c[0] not in unproven)  # stable: still a uniform draw within each class
        chosen: list[tuple[bytes, Rollout]] = []
        eligible = 0
        for producer, r in cands:
            rate = 1.0 if producer in unproven else self.rate
            if len(chosen) < self.per_round and self.rng.random() < rate:
                if usable is not None and not usable(r):
                    continue
                chosen.append((producer, r))
                self._rec(producer).checked += 1
            eligible += 1
            self._rec(producer).eligible += 1
        return eligible, chosen

    def failed(self, producer: bytes) -> None:
        self._rec(producer).failed += 1
