"""The compute-matched benchmark's adversary: rollouts that pass every check and carry little to learn.

It holds a valid key and its own lineage, and it runs a weak policy (murmur-tiny after `WEAK_WARMUP_STEPS`
supervised steps instead of a node's 100, never trained further): its rollouts are real samples with
honest rewards and token ids that decode to their text, so nothing in them is provably wrong. It
sends only its informative groups (so none is dropped at intake) and claims behaviour log-probs far
below any real sample's, which a receiver cannot check without the adversary's weights: a learner's
truncated importance ratio (its own log-prob over the claimed one, capped at 1) then gives every row
full weight. Every `FORGE_EVERY`-th batch is provably bad and goes out under a fresh key: by turns it
claims a wrong reward on one row per group (`forge`), or claims the current round of the shared prompt
schedule for tasks that are not that round's prompts (`misschedule`). Neither may ever be trained on.
"""

from __future__ import annotations

import msgspec

from murmur.gossip import wire
from murmur.training.rollouts import logprobs_to_bytes
from murmur.training.sampler import split

WEAK_WARMUP_STEPS = 10
CLAIMED_LOGPROB = -8.0  # per token: below what a real sample of this vocabulary gets, so the ratio caps at 1
FORGE_EVERY = 4


def informative(rows: list[wire.Rollout]) -> list[wire.Rollout]:
    """The rows of the groups a receiver's sampler would keep (`training.sampler.split`, the rule itself)."""
    return [r for g in split(rows)[0] for r in g.rollouts]


def claim_low_logprobs(rows: list[wire.Rollout]) -> list[wire.Rollout]:
    return [
        msgspec.structs.replace(r, logprobs=logprobs_to_bytes([CLAIMED_LOGPROB] * len(r.completion_ids))) for r in rows
    ]


def forge(rows: list[wire.Rollout], group_size: int) -> list[wire.Rollout]:
    """`rows` with the first row of each group's reward flipped: the batch carrying them is provably bad."""
    return [msgspec.structs.replace(r, reward=1.0 - r.reward) if k % group_size == 0 else r for k, r in enumerate(rows)]


def misschedule(rows: list[wire.Rollout], round_no: int) -> list[wire.Rollout]:
    """`rows` each claiming schedule round `round_no`: their tasks were drawn freely, so (but for a chance
    in 32 over a generator's seed range per row) none is that round's prompt and the batch is provably bad."""
    return [msgspec.structs.replace(r, schedule_round=round_no) for r in rows]


def row_key(r: wire.Rollout) -> tuple[bytes, str, int, str, int]:
    """What identifies one of the adversary's rows among everything a trainer takes."""
    return bytes(r.lineage), r.task.generator, int(r.task.seed), r.text, int(r.created_ms)


def stamp(rows: list[wire.Rollout], created_ms: int) -> list[wire.Rollout]:
    return [msgspec.structs.replace(r, created_ms=created_ms) for r in rows]
