"""Rollout sealing (`node.core.sealing`) on its own: batch limits and one lineage per batch, record before publish,
what is never signed, seqs that keep rising, and the published rate."""

from __future__ import annotations

import math
import struct

import pytest

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.node.core.events import Log, Publish, RecordRollouts, Topic
from murmur.node.core.sealing import BATCH_MAX_ROLLOUTS, RolloutSealer

SWARM = "t"
ME = Identity.from_seed(b"\7" * 32)
A, B = b"\1" * 32, b"\2" * 32
SHARDS = {A: 3, B: 5}


def rollout(lineage: bytes = A, lps: tuple[float, ...] = (-0.5, -1.0), seed: int = 1, reward: float = 1.0) -> bytes:
    return wire.encode(
        wire.Rollout(
            task=wire.TaskRef(task_set=bytes(32), generator="g", seed=seed),
            lineage=lineage,
            version=2,
            completion_ids=[2, 3],
            text="x",
            tokenizer_hash=bytes(32),
            logprobs=struct.pack(f"<{len(lps)}f", *lps),
            token_versions=[(0, 2)],
            sampling=wire.SamplingParams(),
            reward=reward,
            created_ms=1,
        )
    )


def group(lineage: bytes = A, seed: int = 1) -> list[bytes]:
    """Two completions of one task whose rewards differ: a group a receiver's sampler keeps."""
    return [rollout(lineage, seed=seed, reward=1.0), rollout(lineage, seed=seed, reward=0.0)]


def seal(sealer: RolloutSealer, encoded: list[bytes], now: float = 1.0, wall_ms: int = 1_700_000_000_000) -> list:
    out: list = []
    sealer.seal(encoded, now, wall_ms, SHARDS.__getitem__, out)
    return out


def opened(out: list) -> list[wire.RolloutBatch]:
    return [wire.open_envelope(a.data, swarm=SWARM)[1] for a in out if isinstance(a, Publish)]


def test_batches_hold_at_most_the_limit_and_each_is_recorded_before_it_is_published() -> None:
    n = BATCH_MAX_ROLLOUTS + 3  # groups of 2
    out = seal(RolloutSealer(SWARM, ME), [r for i in range(n) for r in group(seed=i)])
    assert [type(a) for a in out] == [RecordRollouts, Publish] * 3
    pubs = [a for a in out if isinstance(a, Publish)]
    assert [p.count for p in pubs] == [BATCH_MAX_ROLLOUTS, BATCH_MAX_ROLLOUTS, 6]
    assert {p.topic for p in pubs} == {Topic.ROLLOUTS} and {p.shard for p in pubs} == {SHARDS[A]}
    batches = opened(out)
    assert [len(b.rollouts) for b in batches] == [p.count for p in pubs]
    assert [r.task.seed for b in batches for r in b.rollouts] == [i for i in range(n) for _ in (0, 1)]  # in order
    recs = [a for a in out if isinstance(a, RecordRollouts)]
    assert [len(r.entries) for r in recs] == [p.count for p in pubs]
    # the envelope is kept once per batch, with its first rollout
    assert all(
        r.entries[0]["payload"] == p.data and all(e["payload"] is None for e in r.entries[1:])
        for r, p in zip(recs, pubs)
    )
    assert {e["direction"] for r in recs for e in r.entries} == {"produced"}


def test_a_batch_holds_one_lineage_and_goes_to_that_lineages_shard() -> None:
    out = seal(RolloutSealer(SWARM, ME), group(A) + group(B) + group(A, seed=2))
    pubs = [a for a in out if isinstance(a, Publish)]
    assert [(p.shard, p.count) for p in pubs] == [(SHARDS[A], 4), (SHARDS[B], 2)]
    assert [{bytes(r.lineage) for r in b.rollouts} for b in opened(out)] == [{A}, {B}]


def test_batches_are_signed_by_this_node_and_stamped_with_the_wall_clock_given() -> None:
    out = seal(RolloutSealer(SWARM, ME), group(), wall_ms=1_234_567)
    (b,) = opened(out)
    assert bytes(b.producer) == ME.public and b.swarm == SWARM and b.created_ms == 1_234_567
    assert b.seq == 1_234_567 * 1000


@pytest.mark.parametrize("lps", [(-0.5, math.nan), (-0.5, math.inf), (-0.5, 0.5), (-0.5,)])
def test_a_rollout_receivers_would_refuse_is_never_signed_and_is_counted(lps: tuple[float, ...]) -> None:
    sealer = RolloutSealer(SWARM, ME)
    out = seal(sealer, [rollout(lps=lps)] + group())
    assert [len(b.rollouts) for b in opened(out)] == [2]
    assert sealer.unpublishable == 1
    assert [a.msg for a in out if isinstance(a, Log)] == ["worker rollout not published"]


def test_an_undecodable_rollout_is_logged_not_counted() -> None:
    sealer = RolloutSealer(SWARM, ME)
    out = seal(sealer, [b"\xc1not msgpack"] + group())
    assert [a.msg for a in out if isinstance(a, Log)] == ["worker rollout undecodable"]
    assert sealer.unpublishable == 0 and [len(b.rollouts) for b in opened(out)] == [2]


def test_seqs_rise_within_one_millisecond_and_jump_to_the_wall_clock_after() -> None:
    sealer = RolloutSealer(SWARM, ME)
    wall = 1_700_000_000_000
    seqs = [b.seq for b in opened(seal(sealer, group(A) + group(B), wall_ms=wall))]
    seqs += [b.seq for b in opened(seal(sealer, group(), wall_ms=wall))]
    assert seqs == [wall * 1000, wall * 1000 + 1, wall * 1000 + 2]
    assert [b.seq for b in opened(seal(sealer, group(), wall_ms=wall + 5))] == [(wall + 5) * 1000]
    # a sealer after a restart, whose wall clock has moved on, starts above every seq before it
    assert opened(seal(RolloutSealer(SWARM, ME), group(), wall_ms=wall + 6))[0].seq > seqs[-1]


def test_the_published_rate_counts_batches() -> None:
    sealer = RolloutSealer(SWARM, ME)
    assert sealer.rate(10.0) == 0.0
    seal(sealer, group(A) + group(B), now=10.0)
    two = sealer.rate(10.0)
    seal(sealer, [], now=10.0)  # nothing to seal: nothing published
    assert two > 0 and sealer.rate(10.0) == two
    seal(sealer, group(A), now=10.0)
    assert sealer.rate(10.0) == pytest.approx(1.5 * two)


def test_only_groups_a_receiver_can_learn_from_are_signed() -> None:
    """A receiver's sampler drops a group whose rewards are all equal and a lone completion (GRPO learns
    nothing from them): they stay local, counted, and only the informative group goes out."""
    sealer = RolloutSealer(SWARM, ME)
    flat = [rollout(seed=2, reward=1.0), rollout(seed=2, reward=1.0)]
    out = seal(sealer, flat + group(seed=3) + [rollout(seed=4)])
    assert [[r.task.seed for r in b.rollouts] for b in opened(out)] == [[3, 3]]
    assert sealer.produced == 5 and sealer.uninformative == 3 and sealer.sealed == 2
    assert sealer.groups_generated == 3 and sealer.groups_sent == 1  # the flat group and the lone one stay local
