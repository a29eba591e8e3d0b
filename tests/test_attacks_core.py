"""Attacks on the node's decisions by hostile peers with valid keys, replayed against the core in-process.

Each test is the attack first (the messages a hostile peer signs), then what the honest node must
still do. Live-network versions of these attacks belong to the live attack test.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.node.core import catchup as CM
from murmur.node.core import machine as C
from murmur.node.core import roles
from murmur.node.core.lineages import MAX_AHEAD
from murmur.sync.catchup import choose
from murmur.sync.ids import lineage_id
from murmur.sync.patchstore import StoredItem
from tests import samples
from tests.test_core import (
    BASE,
    MODEL_BYTES,
    SWARM,
    W,
    announce,
    demand,
    follow_trainer,
    hear_consumer,
    key,
    make_core,
    manifest,
    of,
)
from tests.workbound import lines_run


def test_capture_first_announcer_is_not_recorded_as_publisher() -> None:
    core, clock = make_core()
    honest, attacker = key(9), key(66)
    lid = lineage_id(honest.public, BASE, "lin")
    # the attacker announces the honest lineage first, with a huge head and demand
    acts = core.handle(announce(attacker, 1, [demand(lid, "lin", 10**12, rollouts=16384)]))
    assert of(acts, C.Log)[0].msg == "lineage claim refused"
    assert of(acts, C.Penalise) == []  # not provable yet: the lineage could grow from a base model we lack
    assert lid not in core.lineages or not core.lineages[lid].publisher
    core.handle(announce(honest, 1, [demand(lid, "lin", 3)]))
    assert core.lineages[lid].publisher == honest.public and core.head_of(lid) == 3
    # later hints from the attacker (announce or manifest it signs) change nothing
    acts = core.handle(announce(attacker, 2, [demand(lid, "lin", 10**12)]))
    # provably not the publisher: impersonation costs as much as a bad signature (graylisted at once)
    assert [(p.peer, p.amount) for p in of(acts, C.Penalise)] == [(attacker.peer_id, C.FORGERY_PENALTY)]
    acts = core.handle(C.ManifestHeard(manifest(attacker, "lin", 10**12 - 1, 10**12, lineage=lid)))
    assert "derive" in of(acts, C.Log)[0].fields["why"]
    assert [(p.peer, p.amount) for p in of(acts, C.Penalise)] == [(attacker.peer_id, C.FORGERY_PENALTY)]
    assert C.FORGERY_PENALTY > 50.0  # past the default graylist threshold in one message
    assert core.lineages[lid].publisher == honest.public and core.head_of(lid) == 3
    core.handle(C.Tick())
    assert core.serving == lid
    assert not core.offer_manifest(manifest(attacker, "lin", 3, 4, lineage=lid))


def test_freeze_far_ahead_head_is_refused_and_planning_is_o_items() -> None:
    core, clock = make_core()
    honest = key(9)
    lid = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(lid, "lin", 3)]))
    core.handle(C.Tick())
    # even the publisher's own key cannot make the node chase a version far past its signed head
    acts = core.handle(C.ManifestHeard(manifest(honest, "lin", 2**62 - 1, 2**62)))
    assert "far ahead" in of(acts, C.Log)[0].fields["why"] and core.head_of(lid) == 3
    # its own signature, its own fault; a claim about its own lineage is not impersonation
    assert [(p.peer, p.amount) for p in of(acts, C.Penalise)] == [(honest.peer_id, C.CLAIM_PENALTY)]
    acts = core.handle(C.ManifestHeard(manifest(honest, "lin", 3, 3 + MAX_AHEAD)))
    assert not [a for a in of(acts, C.Log) if "refused" in a.msg] and core.head_of(lid) == 3 + MAX_AHEAD
    # and planning to any head costs O(items), not O(versions): a few hundred Python lines (tests/workbound.py)
    plan, _ = lines_run(
        choose,
        0,
        2**62,
        [StoredItem("patch", 0, 1, 5), StoredItem("anchor", 2**62, 2**62, 9), StoredItem("union", 1, 2**62, 3)],
        limit=2_000,
    )
    assert plan.total_bytes == 8
    lines_run(
        core.handle, C.CatalogReceived(honest.peer_id, lid, (StoredItem("anchor", 2**62, 2**62, 9),)), limit=2_000
    )


def test_crash_tiny_step_time_is_refused_and_roles_do_not_overflow() -> None:
    core, clock = make_core()
    attacker = key(66)
    lid = lineage_id(attacker.public, BASE, "evil")
    acts = core.handle(announce(attacker, 1, [demand(lid, "evil", 1, step_time_s=5e-324)]))
    assert "step_time_s" in of(acts, C.Log)[0].fields["why"]
    assert [p.peer for p in of(acts, C.Penalise)] == [attacker.peer_id]
    core.handle(C.Tick())
    assert core.serving is None
    d = roles.Demand(32, 5e-324, 4)
    assert roles.staleness_versions(d, 1.0, 1.0) > d.max_staleness  # no OverflowError
    assert not roles.fits_staleness(d, 1.0, 1.0)
    assert roles.choose_lineage(roles.Offer("me", 1.0, 1.0), [roles.LineageOption(lid, d, 0.0)]).lineage is None


def test_demand_cannot_pull_followers_off_a_training_lineage() -> None:
    core, clock = make_core()
    honest, attacker = key(9), key(66)
    good = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(good, "lin", 3, step_time_s=5.0)]))
    core.handle(C.ManifestHeard(manifest(honest, "lin", 3, 4)))  # seen to advance: proven
    core.handle(C.Tick())
    assert core.serving == good
    evil = lineage_id(attacker.public, BASE, "evil")
    for i in range(20):  # a huge claimed demand, re-announced, but the lineage never advances
        clock.t += 2.5
        core.handle(announce(attacker, i + 1, [demand(evil, "evil", 1, step_time_s=0.5, rollouts=16384)]))
        core.handle(announce(honest, i + 2, [demand(good, "lin", 4, step_time_s=5.0)]))
        core.handle(C.Tick())
        assert core.serving == good


def test_oversized_manifest_is_refused_before_any_chunk() -> None:
    core, clock = make_core()
    honest = key(9)
    lid = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(lid, "lin", 3)]))
    core.handle(C.Tick())
    huge = manifest(honest, "lin", 3, 4, total=8 * MODEL_BYTES)
    assert not core.offer_manifest(huge)
    assert core.offer_manifest(manifest(honest, "lin", 3, 4, total=MODEL_BYTES // 2))
    lying = manifest(honest, "lin", 4, 5, total=1000)
    lying.total_bytes = 10  # chunk sizes do not add up
    assert not core.offer_manifest(lying)


def test_tables_stay_bounded_under_a_flood_of_keys() -> None:
    core, clock = make_core(max_peers=16, max_lineages=8)
    honest = key(9)
    good = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(good, "lin", 3)]))
    core.handle(C.Tick())
    assert core.serving == good
    for i in range(100):
        a = key(100 + i)
        clock.t += 0.01
        lid = lineage_id(a.public, BASE, f"l{i}")
        core.handle(announce(a, 1, [demand(lid, f"l{i}", 1)]))
        core.handle(C.ManifestHeard(manifest(a, f"l{i}", 1, 2)))
    assert len(core.peers) <= 16 and len(core.lineages) <= 8
    assert good in core.lineages and core.serving == good
    assert core.stats()["peers_evicted"] > 0 and core.table.evicted > 0


def test_out_of_range_worker_numbers_do_not_poison_the_announce() -> None:
    core, clock = make_core()
    core.handle(W("perf", {"gen_tokens_per_s": float("inf"), "rollout_latency_s": float("nan")}))
    core.handle(
        W(
            "step",
            {
                "step": 1,
                "version": 0,
                "reward_mean": float("nan"),
                "loss": None,
                "n_external_groups": 0,
                "step_s": float("inf"),
            },
        )
    )
    acts = core.handle(C.Tick())
    assert of(acts, C.Publish)  # the announce still seals within the wire's ranges


demands = st.builds(
    wire.LineageDemand,
    lineage=st.binary(min_size=32, max_size=32),
    name=st.text(min_size=1, max_size=8),
    head_version=st.integers(0, 2**63 - 1),
    rollouts_per_step=st.integers(0, 1_000_000),
    step_time_s=st.one_of(st.floats(0.0, 1e6), st.just(5e-324)),
    max_staleness=st.integers(0, 1_000_000),
    standby=st.lists(st.text(max_size=8), max_size=4),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ds=st.lists(demands, max_size=4),
    heads=st.lists(st.integers(0, 2**63 - 1), max_size=4),
    total=st.integers(0, 64 * MODEL_BYTES),
)
def test_any_well_signed_numbers_leave_the_core_alive_with_bounded_work(ds, heads, total) -> None:
    core, clock = make_core()
    honest = key(9)
    good = lineage_id(honest.public, BASE, "lin")
    ds = ds + [demand(good, "lin", h) for h in heads]

    def feed() -> None:
        core.handle(announce(honest, 1, ds[:16]))
        for h in heads:
            m = manifest(honest, "lin", h, h, total=min(total, 1 << 16), codec="anchor-v1")
            core.handle(C.ManifestHeard(m))
            core.offer_manifest(m)
            core.handle(
                C.CatalogReceived(honest.peer_id, good, (StoredItem("anchor", h, h, 1), StoredItem("union", 0, h, 1)))
            )
        clock.t += 3
        core.handle(C.Tick())

    lines_run(feed, limit=50_000)  # bounded work whatever the numbers (lines counted, not seconds timed)
    for lin in core.lineages.values():
        assert lin.head <= max([0] + heads + [d.head_version for d in ds])


def test_a_publisher_spamming_distinct_manifests_gets_a_bounded_number_of_transfers() -> None:
    core, clock = make_core()
    honest = key(9)
    lid = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(lid, "lin", 3)]))
    core.handle(C.Tick())
    accepted = sum(
        core.offer_manifest(manifest(honest, "lin", b, b + 1 + (i % 7))) for i, b in enumerate(range(3, 3 + 1000))
    )
    assert accepted == CM.MAX_IN_FLIGHT and len(core.in_flight) == CM.MAX_IN_FLIGHT


def test_honest_traffic_costs_no_one_anything() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    penalties = []
    for v in range(1, 30):
        clock.t += 2.0
        penalties += of(core.handle(announce(trainer, v, [demand(lid, "lin", v, step_time_s=0.002)])), C.Penalise)
        penalties += of(core.handle(C.ManifestHeard(manifest(trainer, "lin", v, v + 1))), C.Penalise)
        penalties += of(
            core.handle(C.ManifestHeard(manifest(trainer, "lin", v + 1, v + 1, codec="anchor-v1"))), C.Penalise
        )
        penalties += of(core.handle(C.Tick()), C.Penalise)
    assert penalties == [] and core.serving == lid and core.head_of(lid) == 30


def test_own_rollouts_with_poisoned_logprobs_are_never_signed() -> None:
    """Receivers ban a signer of a non-finite or positive log-prob (`bad_number`): the node never signs
    one of its worker's (an engine that lost a token's log-prob reports NaN), and counts what it held back."""
    core, clock = make_core(roles=("trainer",))
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 2}))

    def rollout(lp: float, reward: float = 1.0) -> bytes:
        return wire.encode(
            wire.Rollout(
                task=wire.TaskRef(task_set=bytes(32), generator="g", seed=1),
                lineage=lid,
                version=2,
                completion_ids=[2, 3],
                text="x",
                tokenizer_hash=bytes(32),
                logprobs=struct.pack("<2f", -0.5, lp),
                token_versions=[(0, 2)],
                sampling=wire.SamplingParams(),
                reward=reward,
                created_ms=1,
            )
        )

    hear_consumer(core, clock)  # a peer's demand: our rollouts go out
    clock.t += 10
    acts = core.handle(
        W("rollouts", [rollout(-1.0), rollout(math.nan), rollout(math.inf), rollout(0.5), rollout(-2.0, reward=0.0)])
    )
    sent = [wire.open_envelope(p.data, swarm=SWARM)[1] for p in of(acts, C.Publish) if p.topic == C.Topic.ROLLOUTS]
    assert [len(b.rollouts) for b in sent] == [2]  # only the honest ones, and they still open cleanly
    assert core.stats()["rollouts_unpublishable"] == 3
    assert sum(1 for a in of(acts, C.Log) if a.msg == "worker rollout not published") == 3


def test_a_patch_that_would_make_weights_non_finite_costs_its_publisher() -> None:
    """The worker refused a patch whose signed, hash-checked content makes a weight NaN
    (`sync.versions`, `tests/test_weights_finite.py`): the publisher signed it, so it is charged, and the
    item is dropped to be fetched again; any other failure to apply charges no one."""
    core, clock = make_core()
    poisoner = key(70)
    lid = lineage_id(poisoner.public, BASE, "lin")
    core.handle(announce(poisoner, 1, [demand(lid, "lin", 3)]))
    acts = core.handle(W("apply_failed", {"lineage": lid.hex(), "base": 1, "target": 2, "error": "target hash"}))
    assert of(acts, C.Penalise) == [] and of(acts, C.DropItem)
    acts = core.handle(
        W(
            "apply_failed",
            {"lineage": lid.hex(), "base": 1, "target": 2, "error": "makes 2 values", "fault": "non_finite_patch"},
        )
    )
    assert [(p.peer, p.reason, p.amount) for p in of(acts, C.Penalise)] == [
        (poisoner.peer_id, "non_finite_patch", C.FORGERY_PENALTY)
    ]
    assert of(acts, C.DropItem) and core.stats()["patches_not_finite"] == 1


def _trainer_with_need(step_s: float = 4.0) -> tuple[C.NodeCore, object, bytes]:
    """A trainer whose versions come every `step_s`: it needs (1+m)*16/step_s rollouts/s from followers."""
    core, clock = make_core(roles=("trainer",))
    lid = lineage_id(key(1).public, BASE, "mine")
    core.handle(
        W(
            "ready",
            {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 0, "tokenizer_hash": TOK.hex()},
        )
    )
    for v in (1, 2, 3):
        clock.t += step_s
        core.handle(W("published", {"version": v, "envelope": b"env"}))
    return core, clock, lid


TOK = b"\x03" * 32  # the trainer's tokenizer


def delivered(k: Identity, lid: bytes, n: int, tok: bytes = TOK) -> C.RolloutsVerified:
    """`n` verified rollouts of `lid` in informative groups under tokenizer `tok`, from `k`."""
    return C.RolloutsVerified(k.peer_id, ((lid, n),), ((lid, tok, n),))


def vouch(core: C.NodeCore, k: Identity, ok: bool = True) -> list[C.Action]:
    """A sampled log-prob check of one of `k`'s rollouts, passed or failed, by the trainer's worker."""
    return core.handle(W("spot", {"ok": ok, "producer": k.public.hex(), "diff": 0.0 if ok else 0.9}))


def _rate_tps(rollouts_per_s: float) -> float:
    return rollouts_per_s * 64  # the announce states tokens/s; the trainer counts max_new_tokens per rollout


def test_a_claimed_throughput_no_delivery_backs_does_not_stand_honest_followers_by() -> None:
    core, clock, lid = _trainer_with_need()
    honest, attacker = [key(20), key(21)], key(66)
    # two honest followers that generate for the lineage and deliver verified rollouts at what they state
    seq = {k.peer_id: 0 for k in honest + [attacker]}

    def round_(claims: dict) -> list[C.Action]:
        clock.t += C.ANNOUNCE_EVERY_S
        for k, tps in claims.items():
            seq[k.peer_id] += 1
            core.handle(announce(k, seq[k.peer_id], serving=lid, roles=("follower",), gen_tps=tps))
        return core.handle(C.Tick())

    for k in honest:
        vouch(core, k)
    for _ in range(30):
        for k in honest:
            core.handle(delivered(k, lid, 6))  # 3 rollouts/s at one round per 2 s
        round_({honest[0]: _rate_tps(3.0), honest[1]: _rate_tps(3.0)})
    act = core.lineages[lid].activation
    assert sorted(act.active) == sorted(k.peer_id for k in honest) and act.standby == []
    # the attacker claims to meet the whole demand a million times over, and delivers nothing
    for _ in range(30):
        for k in honest:
            core.handle(delivered(k, lid, 6))
        acts = round_({honest[0]: _rate_tps(3.0), honest[1]: _rate_tps(3.0), attacker: 1e9})
        a = wire.decode_struct(
            wire.decode_envelope(of(acts, C.Publish)[0].data, swarm=SWARM).body, wire.NodeAnnounce, 1 << 16
        )
        assert not {k.peer_id for k in honest} & set(a.owned[0].standby)  # no honest follower is told to stand by
    act = core.lineages[lid].activation
    assert {k.peer_id for k in honest} <= set(act.active) and act.met
    assert attacker.peer_id in act.standby  # the followers that deliver meet the demand: the claim is not needed
    # a flood of such keys at a trainer no follower has delivered to yet: together they count for the
    # trial share of the need at most, so the demand stays unmet and no honest follower stands by
    core, clock, lid = _trainer_with_need()
    sybils = [key(100 + i) for i in range(50)]
    seq.update({k.peer_id: 0 for k in sybils})
    round_({**{k: _rate_tps(3.0) for k in honest}, **{k: 1e9 for k in sybils}})
    act = core.lineages[lid].activation
    assert {k.peer_id for k in honest} <= set(act.active) and act.standby == []
    assert act.supply <= 0.25 * act.need + 1e-9 and len(act.capped) == 52
    assert core.stats()["claims_capped"] > 0


def test_credit_farming_with_work_nobody_can_use_or_check_stands_no_honest_follower_by() -> None:
    """Attack (issue 43): one key delivers rollouts for the trainer's lineage at a high rate, but as
    one-rollout "groups" (dropped at the sampler's intake) or under another tokenizer (never checkable),
    and claims 1e9 tokens/s. None of it earns credit, so the honest follower that delivers usable,
    checked work stays active; a key that passes a check earns credit, and failing one withdraws it."""
    core, clock, lid = _trainer_with_need()
    honest, farmer = key(20), key(66)
    vouch(core, honest)
    vouch(core, farmer)  # even a key that once passed a check earns nothing for unusable work
    r = samples.rollout(seed=1)
    single = [
        msgspec.structs.replace(
            r, lineage=lid, tokenizer_hash=TOK, reward=1.0, task=msgspec.structs.replace(r.task, seed=i)
        )
        for i in range(32)
    ]
    foreign = [
        msgspec.structs.replace(r, lineage=lid, tokenizer_hash=b"\x77" * 32, reward=float(i % 2)) for i in range(32)
    ]
    batches = [
        wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=SWARM,
            producer=farmer.public,
            seq=i,
            created_ms=1,
            rollouts=single if i % 2 else foreign,
        )
        for i in range(2)
    ]
    seq = 0
    for _ in range(30):
        clock.t += C.ANNOUNCE_EVERY_S
        seq += 1
        core.handle(delivered(honest, lid, 6))
        for b in batches:
            ev = C.RolloutsVerified.of(b)
            assert sum(n for _, n in ev.lineages) == 32 and ev.usable == ((lid, b"\x77" * 32, 32),) * (b.seq == 0)
            core.handle(ev)
        core.handle(announce(honest, seq, serving=lid, roles=("follower",), gen_tps=_rate_tps(3.0)))
        core.handle(announce(farmer, seq, serving=lid, roles=("follower",), gen_tps=1e9))
        core.handle(C.Tick())
    act = core.lineages[lid].activation
    assert honest.peer_id in act.active and honest.peer_id not in act.standby
    assert core.deliveries.credit(farmer.peer_id, clock.t) == 0.0
    assert core.deliveries.credit(honest.peer_id, clock.t) > 0
    vouch(core, honest, ok=False)
    assert core.deliveries.credit(honest.peer_id, clock.t) == 0.0  # a failed check withdraws it
    unproven = key(21)
    core.handle(delivered(unproven, lid, 60))
    assert core.deliveries.credit(unproven.peer_id, clock.t) == 0.0  # no check passed yet: no credit


def test_uniform_groups_on_scheduled_prompts_earn_no_delivery_credit() -> None:
    """Attack: a follower sends, for the trainer's lineage, groups of scheduled prompts whose rewards are all
    equal (all wrong costs nothing to write). A receiver's sampler keeps such a group, but only to join an own
    group of its task, so it is not usable work: it backs no claimed throughput. The same groups with one right
    answer each count."""
    r = samples.rollout(seed=1)

    def batch(rewards: list[float]) -> wire.RolloutBatch:
        rows = [
            msgspec.structs.replace(
                r,
                tokenizer_hash=TOK,
                reward=rewards[i % 4],
                schedule_round=5,
                task=msgspec.structs.replace(r.task, seed=i // 4),
            )
            for i in range(32)
        ]
        return wire.RolloutBatch(
            v=wire.FORMAT_VERSION, swarm=SWARM, producer=key(66).public, seq=1, created_ms=1, rollouts=rows
        )

    lid = bytes(r.lineage)
    assert C.RolloutsVerified.of(batch([0.0] * 4)).usable == ()
    assert C.RolloutsVerified.of(batch([1.0, 0.0, 0.0, 0.0])).usable == ((lid, TOK, 32),)


def test_delivery_earns_credit_so_a_surplus_follower_still_stands_by() -> None:
    """The defence keeps the capacity rule: followers that deliver are credited, and once they meet the
    demand the rest stand by (need here: 1.2 * 16 / 4 = 4.8 rollouts/s)."""
    core, clock, lid = _trainer_with_need()
    fs = [key(20), key(21), key(22)]
    for k in fs:
        vouch(core, k)
    for i in range(30):
        clock.t += C.ANNOUNCE_EVERY_S
        for k in fs[:2]:
            core.handle(delivered(k, lid, 6))
            core.handle(delivered(k, b"\x01" * 32, 50))  # another lineage's: not ours
        for k in fs:
            core.handle(announce(k, i + 1, serving=lid, roles=("follower",), gen_tps=_rate_tps(3.0)))
        core.handle(C.Tick())
    act = core.lineages[lid].activation
    assert sorted(act.active) == sorted(k.peer_id for k in fs[:2]) and act.standby == [fs[2].peer_id]
    assert act.met and 3.0 <= core.deliveries.rate(fs[0].peer_id, clock.t) <= 3.2  # 180 rollouts over 58 s


def test_a_head_moved_by_announces_alone_does_not_pull_followers_off_a_publishing_lineage() -> None:
    core, clock = make_core()
    honest, attacker = key(9), key(66)
    good = lineage_id(honest.public, BASE, "lin")
    core.handle(announce(honest, 1, [demand(good, "lin", 3, step_time_s=5.0)]))
    core.handle(C.ManifestHeard(manifest(honest, "lin", 2, 3)))  # it publishes
    core.handle(C.Tick())
    assert core.serving == good
    evil = lineage_id(attacker.public, BASE, "evil")
    for i in range(40):  # a rising head and a huge demand, by announces only
        clock.t += 2.5
        core.handle(announce(attacker, i + 1, [demand(evil, "evil", i + 1, step_time_s=0.5, rollouts=16384)]))
        core.handle(announce(honest, i + 2, [demand(good, "lin", 3, step_time_s=5.0)]))
        core.handle(C.Tick())
        assert core.serving == good


def test_a_follower_that_cannot_fetch_a_lineage_leaves_it_and_remembers_why() -> None:
    """The attacker signs manifests too (cheap), so its lineage looks published, but it never serves a
    chunk: the follower that moved to it applies nothing, leaves it, and does not come back."""
    core, clock = make_core()
    honest, attacker = key(9), key(66)
    good = lineage_id(honest.public, BASE, "lin")
    evil = lineage_id(attacker.public, BASE, "evil")
    core.handle(announce(honest, 1, [demand(good, "lin", 3, step_time_s=5.0)]))
    core.handle(C.ManifestHeard(manifest(honest, "lin", 2, 3)))
    core.handle(C.Tick())
    core.handle(W("applied", {"lineage": good.hex(), "version": 3}))
    served, left = [], []
    for i in range(200):
        clock.t += 2.5
        acts = core.handle(announce(attacker, i + 1, [demand(evil, "evil", i + 1, step_time_s=0.5, rollouts=16384)]))
        acts += core.handle(C.ManifestHeard(manifest(attacker, "evil", i, i + 1)))
        acts += core.handle(announce(honest, i + 2, [demand(good, "lin", 3, step_time_s=5.0)]))
        acts += core.handle(C.Tick())
        assert of(acts, C.Penalise) == []  # an unreachable publisher is not provably lying: no charge
        served.append(core.serving)
        left += [a for a in of(acts, C.Log) if a.msg == "left lineage"]
    assert evil in served  # the claim did pull it (it cannot know before it tries) ...
    first = served.index(evil)
    assert served[first:].count(evil) * 2.5 <= C.LEAVE_AFTER_S + 2.5  # ... for one patience at most
    assert served[-1] == good and len(left) == 1 and core.stats()["lineages_left"] == 1
    assert attacker.public in core.table.avoided and "no version applied" in core.table.avoided[attacker.public][1]
    # the memory is bounded: many keys that each cannot be fetched
    for i in range(3 * 64):
        core.table.avoid(key(100 + i % 150).public, "x", clock.t + i)
    assert len(core.table.avoided) <= 64


def test_a_follower_paused_longer_than_the_patience_does_not_leave_its_lineage() -> None:
    """This node's own pause (a closed laptop lid) is not the publisher's fault: the demand it heard
    went stale meanwhile, so on waking it chooses anew and its patience starts over."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    core.handle(C.ManifestHeard(manifest(trainer, "lin", 3, 4)))
    core.handle(C.Tick())
    clock.t += 3600  # suspended for an hour
    core.handle(C.Tick())
    for i in range(20):
        clock.t += 0.5
        core.handle(announce(trainer, 2 + i, [demand(lid, "lin", 4)]))
        core.handle(C.Tick())
    assert core.serving == lid and core.stats()["lineages_left"] == 0


def test_a_flood_of_sybil_producers_cannot_widen_a_nodes_subscriptions() -> None:
    """3,000 keys announce themselves as producers, each of its own lineage at a vanishing rate: the swarm
    looks huge and covering the trainer's demand would take every shard. Its exchange still joins at most
    MAX_SUBSCRIBED shards (no more inbound than a few shards carry), and the shard count stays capped."""
    import hashlib

    from murmur.gossip import exchange
    from murmur.gossip.identity import Identity

    core, clock = make_core(roles=("trainer",))
    for i in range(3000):
        ident = Identity.from_seed(hashlib.blake2b(b"sybil%d" % i, digest_size=32).digest())
        lid = lineage_id(ident.public, BASE, "s")
        body = wire.NodeAnnounce(
            v=1,
            peer_id=ident.peer_id,
            seq=1,
            created_ms=1,
            hardware="cpu",
            gen_tokens_per_s=0.0,
            rollout_latency_s=0.5,
            upload_bytes_per_s=0.0,
            memory_bytes=0,
            roles=["trainer"],
            lineages_followed=[],
            owned=[demand(lid, "s", 1)],
            publish_batches_per_s=1e-6,
        )
        core.handle(C.AnnounceHeard(ident.public, body, b""))
    clock.t += C.ANNOUNCE_EVERY_S
    subs = of(core.handle(C.Tick()), C.Subscribe)
    assert subs, "the trainer plans its shards on its announce tick"
    assert 1024 <= subs[-1].shards <= exchange.MAX_SHARDS  # 3,000 producers heard (estimated)
    assert len(subs[-1].subscribe) == exchange.MAX_SUBSCRIBED


def test_a_follower_whose_own_worker_is_down_does_not_blame_the_publisher() -> None:
    """No version applies while this node's own worker restarts (a slow start on a loaded machine): that
    time is not the publisher's, so the follower stays; once its worker is up, the patience runs again."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(C.WorkerExited(-9))
    for i in range(int(2 * C.LEAVE_AFTER_S / 2.0)):  # twice the patience, the head moving on
        clock.t += 2.0
        core.handle(announce(trainer, 2 + i, [demand(lid, "lin", 4 + i)]))
        core.handle(C.Tick())
    assert core.serving == lid and core.stats()["lineages_left"] == 0
    core.handle(C.WorkerStarted())
    core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": MODEL_BYTES}))
    seq, up_at = 1000, clock.t
    while core.serving == lid and seq < 1000 + C.LEAVE_AFTER_S:  # up, yet nothing applies: the publisher's
        clock.t += 2.0
        seq += 1
        core.handle(announce(trainer, seq, [demand(lid, "lin", seq)]))
        core.handle(C.Tick())
    assert core.stats()["lineages_left"] == 1
    assert clock.t - up_at >= C.TRIAL_S  # the whole patience from when its worker came up, none of the time down


class _WorkerView:
    """The worker as the core drives it: the lineage it follows, whether it may generate for it, and
    what it replies on opening a lineage (`Applied` at the version it holds of it: the base model's 0)."""

    def __init__(self, core: C.NodeCore) -> None:
        self.core = core
        self.follows: bytes | None = None
        self.admit: dict[bytes, bool] = {}
        self.held: dict[bytes, int] = {}

    def see(self, acts) -> None:
        opened = None
        for a in of(acts, C.ToWorker):
            if type(a.msg).__name__ == "Follow":
                self.follows = opened = bytes.fromhex(a.msg.info.id) if a.msg.info is not None else None
            elif type(a.msg).__name__ == "Admit":
                self.admit[bytes.fromhex(a.msg.lineage)] = a.msg.generate
        if opened is not None:  # its reply comes after what the core sent with the Follow
            self.see(self.core.handle(W("applied", {"lineage": opened.hex(), "version": self.held.get(opened, 0)})))

    def applied(self, lid: bytes, version: int) -> None:
        self.held[lid] = version
        self.see(self.core.handle(W("applied", {"lineage": lid.hex(), "version": version})))

    def generating(self) -> bytes | None:
        return self.follows if self.follows is not None and self.admit.get(self.follows) else None


def _follower_of_an_honest_trainer() -> tuple[Any, Any, Any, Any, bytes, bytes, _WorkerView]:
    """A follower whose worker generates for an honest trainer's lineage (v3 applied), and a bait's key."""
    core, clock = make_core()
    honest, attacker = key(9), key(66)
    good = lineage_id(honest.public, BASE, "lin")
    evil = lineage_id(attacker.public, BASE, "evil")
    worker = _WorkerView(core)
    worker.see(core.handle(announce(honest, 1, [demand(good, "lin", 3, step_time_s=5.0)])))
    worker.see(core.handle(C.ManifestHeard(manifest(honest, "lin", 2, 3))))
    worker.see(core.handle(C.Tick()))
    worker.applied(good, 3)
    return core, clock, honest, attacker, good, evil, worker


def test_a_lineage_baited_with_manifests_never_served_costs_one_catch_up_not_generation() -> None:
    """Manifest bait: a fresh key signs manifests (within the staleness bound of the base model) and a huge
    demand for a lineage whose chunks it never serves. Without the trial the follower's worker switched to
    it and generated for it for the whole 180 s patience; now the worker is switched only to a lineage
    that delivered, keeps generating for the honest one meanwhile, and the bait is left after one
    catch-up attempt, its publisher avoided. No one is charged (not serving is not provably lying)."""
    core, clock, honest, attacker, good, evil, worker = _follower_of_an_honest_trainer()
    assert worker.generating() == good
    gen: dict[bytes | None, float] = {}
    served, penalties, asked = [], [], []
    for i in range(160):  # 400 s
        clock.t += 2.5
        acts = core.handle(
            announce(attacker, i + 1, [demand(evil, "evil", 1 + min(3, i // 30), step_time_s=0.5, rollouts=16384)])
        )
        acts += core.handle(C.ManifestHeard(manifest(attacker, "evil", min(3, i // 30), 1 + min(3, i // 30))))
        acts += core.handle(announce(honest, i + 2, [demand(good, "lin", 3 + i // 40, step_time_s=5.0)]))
        if i % 40 == 39:  # the honest trainer publishes, and its patch still comes while the bait is tried
            v = 4 + i // 40
            m = manifest(honest, "lin", v - 1, v)
            acts += core.handle(C.ManifestHeard(m))
            assert core.offer_manifest(m)
            acts += core.handle(C.PatchStored(m, 1000, 0.5))
            worker.see(acts)
            worker.applied(good, v)
        acts += core.handle(C.Tick())
        worker.see(acts)
        asked += [a for a in of(acts, C.FetchCatalog) if a.lineage == evil]
        penalties += of(acts, C.Penalise)
        served.append(core.serving)
        gen[worker.generating()] = gen.get(worker.generating(), 0.0) + 2.5
    assert evil in served  # the claim did pull it (it cannot know before it tries) ...
    assert served.count(evil) * 2.5 <= C.TRIAL_S + 2.5  # ... for one catch-up attempt ...
    assert len(asked) == 1  # ... of one catalog request ...
    assert gen.get(evil, 0.0) == 0.0 and worker.follows == good  # ... and not one rollout generated for it
    assert gen.get(good, 0.0) == 400.0  # the worker served the honest trainer throughout
    assert served[-1] == good and core.stats()["lineages_left"] == 1 and penalties == []
    assert core.table.is_avoided(attacker.public, clock.t) and not core.table.is_avoided(honest.public, clock.t)


def test_an_honest_lineage_is_adopted_as_soon_as_before() -> None:
    """The trial costs an honest trainer's new follower nothing: it serves the lineage and asks for its
    catalog on the first tick as before, its worker switches when the first item is stored, and it may
    generate once that version applies (before, too, it could generate only then: 6 > K behind)."""
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    worker = _WorkerView(core)
    worker.see(core.handle(announce(trainer, 1, [demand(lid, "lin", 6)])))
    worker.see(core.handle(C.ManifestHeard(manifest(trainer, "lin", 5, 6))))
    acts = core.handle(C.Tick())
    worker.see(acts)
    assert core.serving == lid and of(acts, C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, (StoredItem("anchor", 6, 6, 900),)))
    assert [(a.item.kind, a.item.target) for a in of(acts, C.RequestOffer)] == [("anchor", 6)]
    anchor = manifest(trainer, "lin", 6, 6, codec="anchor-v1")
    assert core.offer_manifest(anchor)
    acts = core.handle(C.PatchStored(anchor, 900, 0.5))
    worker.see(acts)
    assert worker.follows == lid and [type(a.msg).__name__ for a in of(acts, C.ToWorker)][-1] == "Patch"
    worker.applied(lid, 6)
    assert worker.generating() == lid and core.lineages[lid].delivered


def test_a_lineage_on_trial_shows_in_the_status_and_dashboard() -> None:
    """While a bait (or any new lineage) is on trial, the status says so: `serving` is the bait, `following`
    the lineage the worker still generates for, and the dashboard marks the trial."""
    from rich.console import Console

    from murmur.node.shell.views import lineage_views
    from murmur.node.status import NodeStatus
    from murmur.node.ui.dashboard import node_panel

    core, clock, honest, attacker, good, evil, worker = _follower_of_an_honest_trainer()
    assert core.on_trial is None  # a lineage that delivered is followed, not on trial
    for i in range(4):
        clock.t += 2.5
        worker.see(core.handle(announce(attacker, i + 1, [demand(evil, "evil", 2, step_time_s=0.5, rollouts=16384)])))
        worker.see(core.handle(C.ManifestHeard(manifest(attacker, "evil", 1, 2))))
        worker.see(core.handle(C.Tick()))
    assert core.serving == evil and core.on_trial == evil and core.committed == good
    views = {v.lineage: v for v in lineage_views(core)}
    assert views[evil.hex()].on_trial and not views[good.hex()].on_trial
    s = NodeStatus(
        peer_id="p",
        swarm="s",
        roles=["follower"],
        hardware="cpu",
        listen=[],
        state="running",
        lineages=list(views.values()),
        serving=evil.hex(),
        following=good.hex(),
    )
    con = Console(width=120, record=True)
    con.print(node_panel(s))
    assert "on trial" in con.export_text()
