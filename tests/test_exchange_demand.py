"""Producers publish to demand, validators check a sample (gossip/exchange.py, node/core/machine.py, gossip/service.py).
The attacks first: an inflated demand, a producer steering a validator's sample."""

from __future__ import annotations

import hashlib
import time

import pytest
import trio

from murmur.gossip import exchange as X
from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.service import GossipService
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.node.core import machine as C
from murmur.sync.ids import lineage_id
from tests.test_core import (
    BASE,
    Clock,
    W,
    announce,
    demand,
    hear_consumer,
    key,
    make_core,
    manifest,
    of,
)


def own_trainer(**kw: object) -> tuple[C.NodeCore, Clock, bytes]:
    core, clock = make_core(roles=("trainer",), **kw)
    lid = lineage_id(key(1).public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 2}))
    return core, clock, lid


def rollouts_of(lid: bytes, tasks: int, group: int = 8) -> list[bytes]:
    return [
        wire.encode(
            wire.Rollout(
                task=wire.TaskRef(task_set=bytes(32), generator="g", seed=t),
                lineage=lid,
                version=2,
                completion_ids=[2],
                text="x",
                tokenizer_hash=bytes(32),
                logprobs=bytes(4),
                token_versions=[(0, 2)],
                sampling=wire.SamplingParams(),
                reward=float(i == 0),
                created_ms=1,
            )
        )
        for t in range(tasks)
        for i in range(group)
    ]


def published(acts: list[object]) -> int:
    return sum(a.count for a in of(acts, C.Publish) if a.topic == C.Topic.ROLLOUTS)


# ---------------------------------------------------------------- bad input


def test_an_inflated_demand_draws_no_more_than_the_per_consumer_bound() -> None:
    """A peer announcing the largest demand the wire allows, with signed versions at a fast pace, is counted at
    DEMAND_BOUND times our own demand: our budget is what an honest peer asking that much would get."""
    core, clock, _ = own_trainer()
    hear_consumer(core, clock, key(5), rollouts=1_000_000, step_time_s=0.001)
    for v in range(3, 40):  # its signed versions keep coming as fast as it claims
        clock.t += 0.001
        core.handle(C.ManifestHeard(manifest(key(5), "theirs", v - 1, v)))
    clock.t += C.ANNOUNCE_EVERY_S
    core.handle(C.Tick())
    bound = X.DEMAND_BOUND * core.external_demand()
    assert core.outbox is not None and core.outbox.rate == pytest.approx(X.PUBLISH_MARGIN * bound)
    honest, hclock, _ = own_trainer()
    hear_consumer(honest, hclock, key(5), rollouts=int(bound * 10), step_time_s=10.0)  # asks exactly the bound
    hclock.t += C.ANNOUNCE_EVERY_S
    honest.handle(C.Tick())
    assert core.outbox.rate <= honest.outbox.rate + 1e-9  # type: ignore[union-attr]


def test_a_demand_its_versions_do_not_back_fades() -> None:
    """A demand whose lineage publishes no signed versions counts as no faster than the time since we heard
    it (`LineageTable.effective_demand`): a claim of training alone draws less and less."""
    core, clock, _ = own_trainer()
    ident = key(6)
    lid = lineage_id(ident.public, BASE, "idle")
    core.handle(announce(ident, 1, [demand(lid, "idle", 2, step_time_s=0.01, rollouts=64)]))
    core.handle(C.Tick())
    first = core.outbox.rate  # type: ignore[union-attr]
    for seq in range(2, 12):  # it keeps announcing the claim, and never signs a version
        clock.t += 10
        core.handle(announce(ident, seq, [demand(lid, "idle", 2, step_time_s=0.01, rollouts=64)]))
    core.handle(C.Tick())
    assert 0 < core.outbox.rate < first / 5  # type: ignore[union-attr]
    assert core.outbox.rate <= X.PUBLISH_MARGIN * 64 / 100 + 1e-9  # type: ignore[union-attr]


def test_a_demand_with_no_step_measured_counts_as_the_default_step_then_fades() -> None:
    """A trainer that just started asks before it has measured a step (it plans with DEFAULT_STEP_S, as we
    do): its peers publish for it from the start; a claim that never measures a step fades."""
    core, clock, _ = own_trainer()
    ident = key(7)
    lid = lineage_id(ident.public, BASE, "new")
    core.handle(announce(ident, 1, [demand(lid, "new", 0, step_time_s=0.0, rollouts=32)]))
    core.handle(C.Tick())
    assert core.outbox.rate == pytest.approx(X.PUBLISH_MARGIN * 32 / C.DEFAULT_STEP_S)  # type: ignore[union-attr]
    for seq in range(2, 8):
        clock.t += 10
        core.handle(announce(ident, seq, [demand(lid, "new", 0, step_time_s=0.0, rollouts=32)]))
    core.handle(C.Tick())
    assert core.outbox.rate == pytest.approx(X.PUBLISH_MARGIN * 32 / 60)  # type: ignore[union-attr]


def test_a_minority_of_inflated_demands_cannot_move_the_shards_demand() -> None:
    honest = [10.0] * 5
    assert X.publish_budget(honest + [1e9] * 2, 0.0, 1, False, 8) == pytest.approx(X.PUBLISH_MARGIN * 10.0)


def test_a_producer_cannot_predict_or_steer_which_of_its_batches_a_validator_checks() -> None:
    """The draw is a hash keyed with the validator's secret: two validators (keys) check unrelated subsets
    of the same batches, and every producer is checked at the stated rate whatever its batches hold."""
    batches = [hashlib.blake2b(b"batch%d" % i).digest() * 4 for i in range(4000)]
    a, b = X.Sample(b"\x01" * 32, 0.1, 0.0), X.Sample(b"\x02" * 32, 0.1, 0.0)
    picked_a = {i for i, d in enumerate(batches) if a.check("p", d, 0.0)}
    picked_b = {i for i, d in enumerate(batches) if b.check("p", d, 0.0)}
    assert 300 < len(picked_a) < 500 and 300 < len(picked_b) < 500  # 10 %
    assert len(picked_a & picked_b) < 80  # independent: about 1 % of 4000 = 40, not 400
    # an unkeyed hash (what a producer could compute) does not tell which are checked
    unkeyed = {
        i
        for i, d in enumerate(batches)
        if int.from_bytes(hashlib.blake2b(d, digest_size=8).digest(), "big") / 2**64 < 0.1
    }
    assert len(unkeyed & picked_a) < 80
    # a producer grinding batches: the ones it sends are checked at the same rate as any
    c = X.Sample(b"\x03" * 32, 0.1, 0.0)
    ground = [d for d in batches if d[0] < 26]  # any selection it can make without the key
    assert 0.05 < sum(c.check("p", d, 0.0) for d in ground) / len(ground) < 0.16
    with pytest.raises(ValueError):
        X.Sample(b"short")


def test_every_producer_is_checked_at_least_the_floor_a_minute() -> None:
    """A producer sending a batch every 5 s (12 a minute) at a fraction of 10 % is still checked about the
    floor of 6 a minute; one sending at most the floor is checked on every batch."""
    s = X.Sample(b"\x04" * 32, 0.1, 6.0)
    slow = sum(s.check("slow", b"s%d" % i, i * 20.0) for i in range(60))  # 3 a minute
    assert slow == 60
    fast = sum(s.check("fast", b"f%d" % i, i * 5.0) for i in range(1200))  # 100 minutes of 12
    assert 450 < fast < 750  # ~6 a minute, not 1.2 (the fraction alone)
    flood = sum(s.check("flood", b"x%d" % i, i * 0.01) for i in range(60_000))  # 6,000 a minute for 10 min
    assert 0.08 < flood / 60_000 < 0.12  # the fraction
    assert s.rate() == pytest.approx(s.counts["checked_batches"] / s.counts["seen_batches"])


def test_a_validator_drops_what_is_not_in_its_sample_unverified_and_uncounted() -> None:
    from murmur.simulations.bench.gossip import SWARM, make_batch, registry
    from murmur.training.verifiers import score

    reg = registry()
    producer = Identity.from_seed(b"\x32" * 32)
    calls = [0]

    def counted(items):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return [score(task, text) for task, text in items]

    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, rate_per_s=50.0, burst=200, max_staleness=4),
        clock=time.time,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=reg.__contains__,
        reward_batch=counted,
    )
    service = GossipService(None, pipeline, SWARM)
    service.sample = X.Sample(b"\x05" * 32, 0.2, 0.0)

    async def main() -> None:
        p = producer.peer_id
        for seq in range(1, 101):
            await service._validate_rollouts(0, p, p, make_batch(producer, reg, seq, n=2, tokens=8))

    trio.run(main)
    st = service.stats.counts
    assert st["unsampled_batches"] + st["received_batches"] == 100
    assert 8 <= st["received_batches"] <= 35  # ~20 %
    assert st["verified_batches"] == st["received_batches"] == calls[0]  # only the sample was verified
    assert service.sample.counts["checked_batches"] == st["received_batches"]


# ---------------------------------------------------------------- the rules


def test_the_budget_is_the_median_demand_less_followers_supply_shared_by_the_shards_trainers() -> None:
    assert X.publish_budget([], 0.0, 1, False, 8) == 0.0  # no one asks: our rollouts stay local
    assert X.publish_budget([20.0, 40.0, 60.0], 0.0, 1, False, 8) == pytest.approx(X.PUBLISH_MARGIN * 40)
    assert X.publish_budget([40.0], 20.0, 2, False, 8) == pytest.approx(X.PUBLISH_MARGIN * 40 - 20)
    assert X.publish_budget([40.0], 20.0, 3, False, 8) == pytest.approx((X.PUBLISH_MARGIN * 40 - 20) / 2)
    assert X.publish_budget([40.0], 1000.0, 1, False, 8) == 0.0  # followers already cover it
    floor = X.SAMPLE_FLOOR_PER_MIN / 60 * 8
    assert X.publish_budget([40.0], 1000.0, 1, True, 8) == pytest.approx(floor)  # a validator's sample
    assert X.publish_budget([float("nan"), float("inf"), -1.0], float("nan"), 0, False, 8) == 0.0


def test_consumer_demand_is_bounded_and_needs_a_measured_step() -> None:
    assert X.consumer_demand(32, 2.0, 100.0) == 16.0
    assert X.consumer_demand(32, 0.0, 100.0) == 0.0  # not measured yet
    assert X.consumer_demand(1e6, 0.001, 100.0) == 100.0
    assert X.consumer_demand(32, float("nan"), 100.0) == 0.0


def test_the_outbox_publishes_whole_groups_within_its_rate_and_burst() -> None:
    o = X.Outbox(0.0)
    assert not o.take(8, 10.0)  # no budget: local
    o.set_rate(4.0, 10.0)  # a budget that opens starts full: OUTBOX_BURST_S of it
    assert o.take(16, 10.0) and not o.take(1, 10.0)
    assert o.take(8, 12.0) and not o.take(8, 12.0)  # 8 tokens in 2 s, spent
    assert o.take(16, 100.0) and not o.take(1, 100.0)  # at most OUTBOX_BURST_S of rate carried over
    assert o.take(40, 200.0)  # a group larger than the burst still goes out once the burst is full
    o.set_rate(float("nan"), 200.0)
    assert o.rate == 0.0 and not o.take(8, 300.0)


def test_a_trainer_no_one_asks_keeps_its_rollouts_local_and_counts_them() -> None:
    core, clock, lid = own_trainer()
    core.handle(C.Tick())
    clock.t += 10
    acts = core.handle(W("rollouts", rollouts_of(lid, 4)))
    assert published(acts) == 0 and of(acts, C.RecordRollouts) == []  # never signed nor recorded
    st = core.stats()
    assert st["rollouts_produced"] == 32 and st["rollouts_withheld"] == 32
    assert st["groups_generated"] == 4 and st["groups_sent"] == 0


def test_a_trainer_publishes_about_its_budget_in_whole_groups() -> None:
    core, clock, lid = own_trainer()
    clock.t += C.ANNOUNCE_EVERY_S
    hear_consumer(core, clock, rollouts=16, step_time_s=2.0)  # 8 rollouts/s asked
    rate = core.outbox.rate  # type: ignore[union-attr]
    assert rate == pytest.approx(X.PUBLISH_MARGIN * 8)
    sent = []
    for _ in range(60):  # a minute of steps making 32 rollouts a second
        clock.t += 1
        acts = core.handle(W("rollouts", rollouts_of(lid, 4)))
        sent.append(published(acts))
        for p in of(acts, C.Publish):
            if p.topic == C.Topic.ROLLOUTS:
                groups = {}
                for r in wire.open_envelope(p.data, swarm="t")[1].rollouts:
                    groups[r.task.seed] = groups.get(r.task.seed, 0) + 1
                assert set(groups.values()) == {8}  # whole groups only
    assert rate * 60 - 8 <= sum(sent) <= rate * 60 + rate * X.OUTBOX_BURST_S
    assert core.stats()["rollouts_withheld"] == 60 * 32 - sum(sent)


def test_a_trainer_publishes_less_when_followers_already_publish_on_its_shard() -> None:
    core, clock, _ = own_trainer()
    clock.t += C.ANNOUNCE_EVERY_S
    theirs = hear_consumer(core, clock, rollouts=16, step_time_s=2.0)
    alone = core.outbox.rate  # type: ignore[union-attr]
    f = key(20)  # a follower of that trainer publishes half a batch/s of 8 rollouts on the same (only) shard
    body = wire.NodeAnnounce(
        v=1,
        peer_id=f.peer_id,
        seq=1,
        created_ms=1,
        hardware="cpu",
        gen_tokens_per_s=10.0,
        rollout_latency_s=0.5,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["follower", "validator"],
        lineages_followed=[theirs],
        serving=theirs,
        publish_batches_per_s=0.5,
    )
    core.handle(C.AnnounceHeard(f.public, body, wire.seal(f, wire.NODE_ANNOUNCE, body, swarm="t")))
    for _ in range(5):  # what it announces arrives: we verified batches of 8 from it, 4 rollouts/s
        core.handle(C.RolloutsVerified(f.peer_id, ((theirs, 8),)))
    clock.t += C.ANNOUNCE_EVERY_S
    core.handle(C.ManifestHeard(manifest(key(5), "theirs", 2, 3)))  # its versions keep coming
    core.handle(C.Tick())
    assert core.outbox.rate == pytest.approx(alone - 0.5 * core.batch_rollouts)  # type: ignore[union-attr]


def test_announced_follower_supply_that_never_arrives_cannot_silence_a_trainer() -> None:
    """A key announcing itself a follower of a lineage on our shard with the largest rate the wire allows
    counts only as far as what we verified from it backs that rate: nothing, so we publish as before."""
    core, clock, _ = own_trainer()
    clock.t += C.ANNOUNCE_EVERY_S
    theirs = hear_consumer(core, clock, rollouts=16, step_time_s=2.0)
    alone = core.outbox.rate  # type: ignore[union-attr]
    f = key(21)
    body = wire.NodeAnnounce(
        v=1,
        peer_id=f.peer_id,
        seq=1,
        created_ms=1,
        hardware="cpu",
        gen_tokens_per_s=10.0,
        rollout_latency_s=0.5,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["follower"],
        lineages_followed=[theirs],
        serving=theirs,
        publish_batches_per_s=1e6,
    )
    core.handle(C.AnnounceHeard(f.public, body, wire.seal(f, wire.NODE_ANNOUNCE, body, swarm="t")))
    clock.t += C.ANNOUNCE_EVERY_S
    core.handle(C.ManifestHeard(manifest(key(5), "theirs", 2, 3)))
    core.handle(C.Tick())
    assert core.outbox.rate == pytest.approx(alone)  # type: ignore[union-attr]


def test_a_follower_publishes_everything_it_generates_for_its_lineage() -> None:
    core, _ = make_core(roles=("follower",))
    assert core.outbox is None
    acts = core.handle(W("rollouts", rollouts_of(bytes(32), 2)))
    assert published(acts) == 16 and core.stats()["rollouts_withheld"] == 0


def test_a_demand_heard_since_the_last_plan_is_served_at_once() -> None:
    """A trainer that had no one to publish for hears a peer's demand between two plans: its next rollouts
    go out, not only after the next announce tick."""
    core, clock, lid = own_trainer()
    core.handle(C.Tick())  # planned: no one asks
    assert core.outbox.rate == 0.0  # type: ignore[union-attr]
    ident = key(5)
    theirs = lineage_id(ident.public, BASE, "theirs")
    core.handle(announce(ident, 1, [demand(theirs, "theirs", 2, step_time_s=1.0, rollouts=32)]))
    clock.t += 0.5  # before the next tick
    acts = core.handle(W("rollouts", rollouts_of(lid, 2)))
    assert published(acts) == 16 and core.outbox.rate > 0  # type: ignore[union-attr]
