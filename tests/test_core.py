"""The node core as plain calls: for each rule, the events that trigger it and the actions it must
(and must not) produce. Attacks from hostile peers with valid keys are in tests/test_attacks_core.py."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from murmur.gossip import exchange, wire
from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.core import catchup as CM
from murmur.node.core import machine as C
from murmur.node.core import peertable as PT
from murmur.node.core import supervision as SV
from murmur.sync.ids import Relation, lineage_id
from murmur.sync.patchstore import StoredItem
from murmur.sync.staleness import Admission

SWARM = "t"

BASE = hashlib.blake2b(b"base model", digest_size=32).digest()
MODEL_BYTES = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ClockedCore(C.NodeCore):
    """The core as a driver runs it, at the test's `Clock`: `handle(ev)` is `handle(ev, clock.t, wall_ms())`
    (one reading per call), and the queries that take `now` read `clock.t` too."""

    def __init__(
        self,
        settings: C.CoreSettings,
        identity: Identity,
        clock: Clock,
        wall_ms: Callable[[], int] = wire.now_ms,
        **kw: Any,
    ) -> None:
        super().__init__(settings, identity, clock.t, **kw)
        self.test_clock, self.test_wall_ms = clock, wall_ms

    def handle(self, ev: C.Event, now: float | None = None, wall_ms: int | None = None) -> list[C.Action]:
        return super().handle(
            ev, self.test_clock.t if now is None else now, self.test_wall_ms() if wall_ms is None else wall_ms
        )

    def offer_manifest(self, m: wire.PatchManifest, now: float | None = None) -> bool:
        return super().offer_manifest(m, self.test_clock.t if now is None else now)

    def dissemination_s(self, now: float | None = None) -> float:
        return super().dissemination_s(self.test_clock.t if now is None else now)


def W(kind: str, body: object) -> C.FromWorker:
    """A worker message as the network process receives it: encoded and decoded by node.pipe."""
    return C.FromWorker(pipe.decode(pipe.encode(kind, body)))


def to_worker(actions, cls):
    return [a.msg for a in actions if isinstance(a, C.ToWorker) and isinstance(a.msg, cls)]


def key(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def make_core(roles=("follower", "validator"), seed: int = 1, start: float = 1000.0, **kw) -> tuple[C.NodeCore, Clock]:
    clock = Clock()
    clock.t = start
    core = ClockedCore(C.CoreSettings(swarm="t", roles=tuple(roles), **kw), key(seed), clock)
    core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": MODEL_BYTES}))
    return core, clock


def demand(
    lid: bytes,
    name: str,
    head: int,
    step_time_s: float = 2.0,
    rollouts: int = 32,
    standby: list[str] | None = None,
    supply: float = 0.0,
) -> wire.LineageDemand:
    return wire.LineageDemand(
        lineage=lid,
        name=name,
        head_version=head,
        rollouts_per_step=rollouts,
        step_time_s=step_time_s,
        max_staleness=4,
        standby=standby or [],
        supply_rollouts_per_s=supply,
    )


def announce(
    ident: Identity, seq: int, owned=(), serving: bytes = b"", roles=("trainer",), gen_tps: float = 0.0
) -> C.AnnounceHeard:
    body = wire.NodeAnnounce(
        v=1,
        peer_id=ident.peer_id,
        seq=seq,
        created_ms=1,
        hardware="cpu",
        gen_tokens_per_s=gen_tps,
        rollout_latency_s=0.5,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=list(roles),
        lineages_followed=[],
        serving=serving,
        owned=list(owned),
    )
    return C.AnnounceHeard(ident.public, body, wire.seal(ident, wire.NODE_ANNOUNCE, body, swarm=SWARM))


def manifest(
    ident: Identity,
    name: str,
    base_v: int,
    target_v: int,
    total: int = 1000,
    codec: str = "sparse-v1",
    lineage: bytes | None = None,
) -> wire.PatchManifest:
    lid = lineage if lineage is not None else lineage_id(ident.public, BASE, name)
    n = max(1, -(-total // 4096))
    chunks = [wire.ChunkRef(hash=bytes(32), size=min(4096, total - i * 4096)) for i in range(n)] if total else []
    return wire.PatchManifest(
        v=1,
        lineage=lid,
        lineage_name=name,
        base_model_hash=BASE,
        publisher=ident.public,
        base_version=base_v,
        target_version=target_v,
        base_hash=b"" if codec == "anchor-v1" else bytes(32),
        target_hash=bytes(32),
        codec=codec,
        total_bytes=total,
        chunk_bytes=4096,
        chunks=chunks,
        created_ms=1,
    )


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def follow_trainer(core: C.NodeCore, clock: Clock, trainer: Identity, name: str = "lin", head: int = 3) -> bytes:
    lid = lineage_id(trainer.public, BASE, name)
    core.handle(announce(trainer, 1, [demand(lid, name, head)]))
    core.handle(C.ManifestHeard(manifest(trainer, name, head - 1, head)))
    core.handle(C.Tick())
    return lid


def test_follower_serves_the_announced_lineage_and_tells_the_worker() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 3)]))
    acts = core.handle(C.Tick())
    assert core.serving == lid
    assert of(acts, C.LoadStored) == [C.LoadStored(lid)]
    assert of(acts, C.Publish)[0].topic == C.Topic.ANNOUNCE
    # on trial: the worker is switched once an item of the lineage is stored (fetched, hash-checked)
    assert to_worker(acts, pipe.Follow) == [] and core.committed is None
    acts = core.handle(C.PatchStored(manifest(trainer, "lin", 0, 1), 1000, 0.5))
    follow = to_worker(acts, pipe.Follow)
    assert follow and follow[0].info.publisher == trainer.public.hex() and follow[0].info.base == BASE.hex()
    assert core.committed == lid
    assert to_worker(acts, pipe.Admit)[0].generate is False  # applied nothing yet
    assert to_worker(acts, pipe.Patch) == [pipe.Patch(lid.hex(), "patch", 0, 1)]  # after the Follow


def test_staleness_admission_pauses_and_resumes_generation() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    acts = core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert [a.generate for a in to_worker(acts, pipe.Admit)] == [True]
    acts = core.handle(C.ManifestHeard(manifest(trainer, "lin", 8, 9)))  # 6 behind > bound 4
    assert [a.generate for a in to_worker(acts, pipe.Admit)] == [False]
    assert core.lineages[lid].admission == Admission.STALE
    acts = core.handle(W("applied", {"lineage": lid.hex(), "version": 9}))
    assert [a.generate for a in to_worker(acts, pipe.Admit)] == [True]


def test_patch_accept_rule_takes_only_new_items_of_the_served_lineage() -> None:
    core, clock = make_core()
    trainer, other = key(9), key(10)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(C.StoredItems(lid, (StoredItem("patch", 2, 3, 10),)))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.offer_manifest(manifest(trainer, "lin", 3, 4))
    assert not core.offer_manifest(manifest(trainer, "lin", 2, 3))  # held already
    assert not core.offer_manifest(manifest(other, "other", 3, 4))  # another lineage
    done = manifest(trainer, "lin", 3, 4)
    assert core.handle(C.TransferDone(b"p" * 32, done)) == [C.StorePatch(b"p" * 32)]
    acts = core.handle(C.PatchStored(done, 1000, 0.5))
    assert to_worker(acts, pipe.Patch) == [pipe.Patch(lid.hex(), "patch", 3, 4)]
    assert core.handle(C.TransferDone(b"p" * 32, done)) == []  # stored: not stored twice


def test_catch_up_asks_the_publisher_then_offers_the_cheapest_plan() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    acts = core.handle(C.Tick())
    assert core.serving == lid
    assert of(acts, C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    items = (
        StoredItem("anchor", 4, 4, 900),
        StoredItem("patch", 4, 5, 10),
        StoredItem("patch", 5, 6, 10),
        StoredItem("union", 0, 6, 5000),
    )
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [
        ("anchor", 4, 4),
        ("patch", 4, 5),
        ("patch", 5, 6),
    ]
    clock.t += 1
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []  # one attempt at a time


def test_catch_up_does_nothing_when_held_plus_in_flight_reach_the_head() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=4)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.offer_manifest(manifest(trainer, "lin", 3, 4))
    clock.t += 1
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []
    assert core.catching is None  # nothing is missing: the attempt begun when it chose the lineage is over


def hear_consumer(
    core: C.NodeCore, clock: Clock, ident: Identity | None = None, rollouts: int = 32, step_time_s: float = 0.5
) -> bytes:
    """Another trainer announces its demand (`rollouts` external rollouts a version, a version every
    `step_time_s`, its signed versions at that pace): our core's next tick budgets our publishing for it."""
    ident = ident or key(5)
    lid = lineage_id(ident.public, BASE, "theirs")
    core.handle(announce(ident, 1, [demand(lid, "theirs", 2, step_time_s=step_time_s, rollouts=rollouts)]))
    core.handle(C.ManifestHeard(manifest(ident, "theirs", 1, 2)))
    core.handle(C.Tick())
    return lid


def test_trainer_announces_its_demand_and_seals_rollouts_in_batches() -> None:
    core, clock = make_core(roles=("trainer",))
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 2}))
    acts = core.handle(C.Tick())
    env = wire.decode_envelope(of(acts, C.Publish)[0].data, swarm=SWARM)
    a = wire.decode_struct(env.body, wire.NodeAnnounce, 1 << 16)
    assert [bytes(d.lineage) for d in a.owned] == [lid] and a.owned[0].head_version == 2
    clock.t += C.ANNOUNCE_EVERY_S
    hear_consumer(core, clock)
    clock.t += 10  # the budget a peer's demand gives fills up
    r = wire.Rollout(
        task=wire.TaskRef(task_set=bytes(32), generator="g", seed=1),
        lineage=lid,
        version=2,
        completion_ids=[2],
        text="x",
        tokenizer_hash=bytes(32),
        logprobs=bytes(4),
        token_versions=[(0, 2)],
        sampling=wire.SamplingParams(),
        reward=1.0,
        created_ms=1,
    )
    acts = core.handle(W("rollouts", [wire.encode(r)] * 69 + [wire.encode(msgspec.structs.replace(r, reward=0.0))]))
    pubs = of(acts, C.Publish)
    assert len(pubs) == 2 and len(of(acts, C.RecordRollouts)) == 2
    assert acts.index(of(acts, C.RecordRollouts)[0]) < acts.index(pubs[0])  # recorded before it is sent


def test_published_version_is_seeded_and_moves_the_own_head() -> None:
    core, clock = make_core(roles=("trainer",))
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 0}))
    acts = core.handle(W("published", {"version": 1, "envelope": b"env"}))
    assert acts == [C.SeedVersion(b"env")]
    assert core.head_of(lid) == 1


def test_spot_check_failure_penalises_the_producer() -> None:
    core, clock = make_core()
    bad = key(7)
    acts = core.handle(W("spot", {"ok": False, "producer": bad.public.hex(), "diff": 3.0}))
    assert of(acts, C.Penalise) == [C.Penalise(bad.peer_id, "spot_check_failed", C.SPOT_PENALTY)]


def test_worker_exit_restarts_with_growing_backoff_and_resumes_following() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(C.PatchStored(manifest(trainer, "lin", 2, 3), 1000, 0.5))  # it delivered: the worker follows it
    delays = []
    for _ in range(3):
        acts = core.handle(C.WorkerExited(1))
        delays += [a.delay_s for a in of(acts, C.RestartWorker)]
        assert core.handle(C.WorkerExited(1)) == []  # one restart per exit
        core.handle(C.WorkerStarted())
    assert delays == sorted(delays) and delays[0] < delays[-1]
    assert core.stats()["worker_restarts"] == 3
    acts = core.handle(W("ready", {"base": BASE.hex(), "version": 0}))
    assert [a.info.id for a in to_worker(acts, pipe.Follow)] == [lid.hex()]
    clock.t += SV.WORKER_STABLE_S + 1
    acts = core.handle(C.WorkerExited(1))
    assert of(acts, C.RestartWorker) == [C.RestartWorker(SV.RESTART_BACKOFF_S[0])]  # a stable run resets it


def test_a_patch_lost_after_its_transfer_completed_is_offered_and_stored_again() -> None:
    """A completed transfer whose stored copy is lost (apply failed and it was dropped, or the write failed)
    leaves a gap the broadcast will not fill by itself: catch-up offers exactly that item, and the same
    completed transfer handed in again (`node.shell.runtime` re-feeds it after the offer) is stored anew."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(C.StoredItems(lid, (StoredItem("patch", 1, 2, 10), StoredItem("patch", 2, 3, 10))))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 1}))
    clock.t += 1
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []  # held items reach the head
    acts = core.handle(W("apply_failed", {"lineage": lid.hex(), "base": 1, "target": 2, "error": "no stored patch"}))
    assert of(acts, C.DropItem) == [C.DropItem(lid, 1, 2)]
    clock.t += 1
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    acts = core.handle(
        C.CatalogReceived(trainer.peer_id, lid, (StoredItem("patch", 1, 2, 10), StoredItem("patch", 2, 3, 10)))
    )
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [("patch", 1, 2)]
    lost = manifest(trainer, "lin", 1, 2)
    assert core.handle(C.TransferDone(b"q" * 32, lost)) == [C.StorePatch(b"q" * 32)]
    acts = core.handle(C.PatchStored(lost, 1000, 0.5))
    assert to_worker(acts, pipe.Patch) == [pipe.Patch(lid.hex(), "patch", 1, 2)]


def test_a_stored_chain_that_does_not_apply_is_re_read_from_the_store_then_fetched() -> None:
    """The cache of stored items says the chain reaches the head, but the worker does not move (a payload
    lost after it was stored): the core re-reads the store, sees the gap, and catches up over the network."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(C.StoredItems(lid, (StoredItem("patch", 1, 2, 10), StoredItem("patch", 2, 3, 10))))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 1}))
    clock.t += 1
    acts = core.handle(C.Tick())
    assert of(acts, C.FetchCatalog) == [] and of(acts, C.LoadStored) == []  # the worker may still be applying
    clock.t += CM.RESYNC_AFTER_S
    acts = core.handle(C.Tick())
    assert of(acts, C.LoadStored) == [C.LoadStored(lid)]
    core.handle(C.StoredItems(lid, (StoredItem("patch", 2, 3, 10),)))  # 1->2 is gone
    clock.t += 1
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]


def _rollout(reward: float = 1.0) -> wire.Rollout:
    return wire.Rollout(
        task=wire.TaskRef(b"\0" * 32, "arith", 1),
        lineage=b"\1" * 32,
        version=0,
        completion_ids=[1, 2],
        text="4",
        tokenizer_hash=b"\2" * 32,
        logprobs=bytes(8),
        token_versions=[],
        sampling=wire.SamplingParams(max_new_tokens=4),
        reward=reward,
        created_ms=5,
    )


def _group(n: int = 2) -> list[bytes]:
    """n completions of one task, one of them right: a group a receiver's sampler keeps (what is sealed)."""
    return [wire.encode(_rollout(1.0 if i == 0 else 0.0)) for i in range(n)]


def test_created_ms_comes_from_the_wall_ms_the_driver_gives() -> None:
    """Announces and rollout batches are stamped by `wall_ms`, not the host's clock: the simulator's virtual
    time reaches its receivers' freshness checks."""
    clock = Clock()
    core = ClockedCore(C.CoreSettings(swarm="t", roles=("trainer",)), key(7), clock, wall_ms=lambda: 1_234_567)
    core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": MODEL_BYTES}))
    sent = [a for a in core.handle(C.Tick()) if isinstance(a, C.Publish) and a.topic == C.Topic.ANNOUNCE]
    assert [wire.open_envelope(a.data, swarm=SWARM)[1].created_ms for a in sent] == [1_234_567]
    out = core.handle(W("rollouts", _group()))
    batches = [a for a in out if isinstance(a, C.Publish) and a.topic == C.Topic.ROLLOUTS]
    assert [wire.open_envelope(a.data, swarm=SWARM)[1].created_ms for a in batches] == [1_234_567]


def test_rollout_seq_keeps_increasing_across_a_restart_with_a_reset_clock() -> None:
    """A reused (producer, seq) reads as a replay at every receiver (charged): after a reboot the
    monotonic clock starts again near 0, so the seq follows the wall clock."""
    seqs = []
    for mono, wall in ((10_000.0, 1_700_000_000_000), (3.0, 1_700_000_060_000)):  # before, after the reboot
        clock = Clock()
        clock.t = mono
        core = ClockedCore(C.CoreSettings(swarm="t", roles=("trainer",)), key(7), clock, wall_ms=lambda w=wall: w)
        core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": MODEL_BYTES}))
        out = core.handle(W("rollouts", _group()))
        seqs += [
            wire.open_envelope(a.data, swarm=SWARM)[1].seq
            for a in out
            if isinstance(a, C.Publish) and a.topic == C.Topic.ROLLOUTS
        ]
    assert len(seqs) == 2 and seqs[1] > seqs[0]


def test_a_follower_standing_by_after_one_slow_patch_tries_again_once_that_measure_expires() -> None:
    """A follower that stands by fetches no patches, so the one slow delivery that put it there would
    keep it there for good: its measured delivery time expires and it serves again, and the next
    patches measure it anew."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    assert core.serving == lid
    core.handle(C.PatchStored(manifest(trainer, "lin", 3, 4), 1000, 60.0))  # 60 s: 30 steps of 2 s, bound 4
    start, seq = clock.t, 2
    standby_since = None
    while clock.t - start < C.MEASURE_TTL_S * 2:
        clock.t += C.ANNOUNCE_EVERY_S  # the trainer publishes one version per 2 s step, as it announces
        core.handle(announce(trainer, seq, [demand(lid, "lin", 2 + seq)]))
        seq += 1
        core.handle(C.Tick())
        if core.serving is None and standby_since is None:
            standby_since = clock.t
            assert "stale" in core.serving_reason
        if standby_since is not None and core.serving == lid:
            break
    assert standby_since is not None and core.serving == lid
    assert clock.t - start >= C.MEASURE_TTL_S  # not before the slow measure expired
    assert core.dissemination_s() == 0.0


def test_a_catalog_from_a_peer_not_asked_is_ignored() -> None:
    """Only the source asked may answer a catch-up (whichever way the peer ids sort)."""
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    items = (StoredItem("anchor", 4, 4, 900), StoredItem("patch", 4, 5, 10), StoredItem("patch", 5, 6, 10))
    lower = next(key(i) for i in range(10, 200) if key(i).peer_id < trainer.peer_id)
    higher = next(key(i) for i in range(10, 200) if key(i).peer_id > trainer.peer_id)
    for stranger in (lower, higher):
        assert of(core.handle(C.CatalogReceived(stranger.peer_id, lid, items)), C.RequestOffer) == []
    assert len(of(core.handle(C.CatalogReceived(trainer.peer_id, lid, items)), C.RequestOffer)) == 3


def test_a_follower_that_needs_an_anchor_plans_from_one() -> None:
    """A worker that cannot apply its chain any more (`need_anchor`) is caught up from an anchor, even
    when a chain from the version it holds is on offer."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=6)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 5, "need_anchor": True}))
    assert core.catching is not None and core.catching.source == trainer.peer_id  # asked when it began following
    items = (StoredItem("anchor", 6, 6, 900), StoredItem("patch", 5, 6, 10))
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [("anchor", 6, 6)]


def test_a_fresh_cores_counters_start_at_zero() -> None:
    core, _ = make_core()
    assert core.stats() and set(core.stats().values()) == {0}


def test_a_trainers_announce_states_its_memory_in_bytes_and_its_step_time_in_range() -> None:
    """The announce carries what receivers range-check: memory in bytes, a step time at most 1e6 s however
    long the worker measured a step (a stalled step must not make the announce invalid)."""
    core, clock = make_core(roles=("trainer",), memory_budget_mb=3)
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 2}))
    core.handle(
        W("step", {"step": 1, "version": 2, "reward_mean": 0.5, "loss": 0.1, "n_external_groups": 0, "step_s": 5e6})
    )
    env, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.memory_bytes == 3 * 1024 * 1024
    assert a.owned[0].step_time_s == 1e6


def test_a_follower_re_paces_only_when_its_trainers_need_moves_by_more_than_a_tenth() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 3, rollouts=100)]))
    first = to_worker(core.handle(C.Tick()), pipe.Pace)
    assert len(first) == 1 and first[0].rollouts_per_s > 0
    for seq, rollouts in ((2, 100), (3, 105)):  # the same need, then 5 % more: no new pace
        clock.t += C.ANNOUNCE_EVERY_S  # a tick that chooses (and paces) again; a version per 2 s step
        core.handle(announce(trainer, seq, [demand(lid, "lin", 2 + seq, rollouts=rollouts)]))
        assert to_worker(core.handle(C.Tick()), pipe.Pace) == []
    core.handle(announce(trainer, 4, [demand(lid, "lin", 6, rollouts=150)]))  # 50 % more
    clock.t += C.ANNOUNCE_EVERY_S
    again = to_worker(core.handle(C.Tick()), pipe.Pace)
    assert len(again) == 1 and again[0].rollouts_per_s > first[0].rollouts_per_s


def test_a_lineage_stored_as_seen_is_followed_once_a_version_of_it_applies() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    seen = Relation("".join(["se", "en"]))  # as the runtime reads the text the store returns
    core.handle(C.LineageKnown(lid, "lin", seen, trainer.public, BASE, 2))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.lineages[lid].relation == Relation.FOLLOW


def test_only_finite_rewards_reach_the_reward_trend() -> None:
    core, _ = make_core()
    for r in (1.0, float("nan"), float("inf"), 0.0, None):
        core.handle(W("gen", {"reward_mean": r, "version": 0}))
    assert list(core.rewards) == [1.0, 0.0]


def test_announces_made_within_one_millisecond_still_rise() -> None:
    """Receivers ignore an announce whose seq is not above the last one seen from its key."""
    clock = Clock()
    core = ClockedCore(C.CoreSettings(swarm="t", roles=("trainer",)), key(7), clock, wall_ms=lambda: 1_700_000_000_000)
    core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": MODEL_BYTES}))
    seqs = []
    for _ in range(3):
        clock.t += 60
        seqs += [
            wire.open_envelope(a.data, swarm=SWARM)[1].seq
            for a in of(core.handle(C.Tick()), C.Publish)
            if a.topic == C.Topic.ANNOUNCE
        ]
    assert len(seqs) == 3 and seqs[0] < seqs[1] < seqs[2]


def test_a_trainers_step_time_is_the_time_between_its_published_versions() -> None:
    core, clock = make_core(roles=("trainer",))
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 0}))
    core.handle(W("published", {"version": 1, "envelope": b""}))
    clock.t += 2500.0  # longer than the clock's reading at the first: a difference, not a remainder
    core.handle(W("published", {"version": 2, "envelope": b""}))
    env, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.owned[0].step_time_s == 2500.0


def test_rollout_batches_go_to_a_trainer_and_to_a_validator_of_their_lineage_only() -> None:
    trainer, _ = make_core(roles=("trainer",))
    assert trainer.external_wanted({b"\x01" * 32})
    core, clock = make_core(roles=("follower", "validator"))
    lid = follow_trainer(core, clock, key(9))
    assert not core.external_wanted({lid})  # on trial: its worker does not follow it yet
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.external_wanted({lid}) and not core.external_wanted({b"\x01" * 32})
    follower, clock = make_core(roles=("follower",))
    lid = follow_trainer(follower, clock, key(9))
    follower.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert not follower.external_wanted({lid})


def test_a_trainers_demand_counts_every_optimizer_step_of_a_version() -> None:
    """B in the capacity rule: external rollouts per published version, `publish_every` steps of
    `external_rollouts` groups of `group_size`."""
    core, clock = make_core(roles=("trainer",), publish_every=2, external_rollouts=3, group_size=4)
    me = key(1)
    lid = lineage_id(me.public, BASE, "mine")
    core.handle(W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 0}))
    env, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.owned[0].rollouts_per_step == 24


def test_measured_throughput_is_smoothed_and_the_announce_stays_in_range() -> None:
    core, clock = make_core()
    core.handle(W("perf", {"gen_tokens_per_s": 100.0, "rollout_latency_s": 5e6}))
    core.handle(W("perf", {"gen_tokens_per_s": 200.0, "rollout_latency_s": 5e6}))
    assert core.gen_tps == pytest.approx(0.7 * 100.0 + 0.3 * 200.0)
    clock.t += 60
    sent = [a for a in core.handle(C.Tick()) if isinstance(a, C.Publish) and a.topic == C.Topic.ANNOUNCE]
    _, a = wire.open_envelope(sent[0].data, swarm=SWARM)  # a latency past 1e6 s would make it invalid
    assert a.rollout_latency_s == 1e6 and a.gen_tokens_per_s == pytest.approx(130.0)


def test_a_catch_up_with_no_reply_is_retried_after_its_patience() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    core.handle(W("applied", {"lineage": lid.hex(), "version": 1}))  # it delivered: not left after one attempt
    start, fetches = clock.t, []
    for seq in range(2, 26):  # the publisher keeps announcing (its demand stays fresh); no catalog comes
        clock.t += 7.0  # steps that pass the patience without landing on it
        core.handle(announce(trainer, seq, [demand(lid, "lin", 6)]))
        fetches += [clock.t - start for a in of(core.handle(C.Tick()), C.FetchCatalog)]
    assert core.serving == lid and fetches and fetches[0] >= CM.CATCH_UP_PATIENCE_S
    assert fetches[0] <= CM.CATCH_UP_PATIENCE_S + 7.0


def test_a_catalog_item_beyond_the_signed_head_is_not_requested() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(C.Tick())
    items = (StoredItem("anchor", 6, 6, 900), StoredItem("patch", 6, 7, 10), StoredItem("anchor", 9, 9, 1))
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [("anchor", 6, 6)]


def test_a_trainers_external_demand_is_its_groups_per_measured_step() -> None:
    core, clock = make_core(roles=("trainer",), external_rollouts=3, group_size=4)
    for s in (2.0, 2.0, 2.0):
        core.handle(
            W("step", {"step": 1, "version": 0, "reward_mean": None, "loss": None, "n_external_groups": 0, "step_s": s})
        )
    assert core.external_demand() == pytest.approx(3 * 4 / 2.0)
    assert core.steps == 3
    follower, _ = make_core()
    assert follower.external_demand() == 0.0 and follower.steps == 0


def test_a_batch_of_own_rollouts_is_stored_once_with_its_first_row() -> None:
    core, clock = make_core(roles=("trainer",))
    acts = core.handle(W("rollouts", _group(3)))
    (rec,) = of(acts, C.RecordRollouts)
    (pub,) = [a for a in acts if isinstance(a, C.Publish) and a.topic == C.Topic.ROLLOUTS]
    assert [row["payload"] for row in rec.entries] == [pub.data, None, None]


def test_a_catalog_that_offers_only_versions_below_what_is_held_plans_nothing() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=6)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 5}))
    items = (StoredItem("anchor", 4, 4, 900), StoredItem("patch", 3, 4, 10))  # an old copy: nothing past 4
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert of(acts, C.RequestOffer) == []


def _producing(ident: Identity, seq: int, serving: bytes = b"", owned=(), rate: float = 2.0) -> C.AnnounceHeard:
    """An announce of a peer that states it publishes `rate` rollout batches/s."""
    body = wire.NodeAnnounce(
        v=1,
        peer_id=ident.peer_id,
        seq=seq,
        created_ms=1,
        hardware="cpu",
        gen_tokens_per_s=10.0,
        rollout_latency_s=0.5,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["follower"],
        lineages_followed=[],
        serving=serving,
        owned=list(owned),
        publish_batches_per_s=rate,
    )
    return C.AnnounceHeard(ident.public, body, wire.seal(ident, wire.NODE_ANNOUNCE, body, swarm=SWARM))


def _trainer_with_own_lineage() -> tuple[C.NodeCore, Clock, bytes]:
    clock = Clock()
    core = ClockedCore(C.CoreSettings(swarm=SWARM, roles=("trainer",)), key(1), clock)
    lid = lineage_id(key(1).public, BASE, "mine")
    core.handle(
        W("ready", {"base": BASE.hex(), "lineage": lid.hex(), "name": "mine", "version": 0, "model_bytes": MODEL_BYTES})
    )
    return core, clock, lid


def test_a_trainer_hears_its_own_shard_only_while_a_fresh_announce_says_someone_produces_for_it() -> None:
    """The own lineage's shard is home while a follower's announce of the last PEER_EXPIRY_S states it publishes
    for it; a silent follower's old announce (still in the peer table) no longer pins it."""
    core, clock, lid = _trainer_with_own_lineage()
    core.handle(C.Tick())
    assert core.exchange.plan_.home == ()  # nobody produces for it
    core.handle(_producing(key(9), 1, serving=lid))
    clock.t += C.ANNOUNCE_EVERY_S
    core.handle(C.Tick())
    assert core.exchange.plan_.home == (core.exchange.publish_shard(lid),)
    clock.t += PT.PEER_EXPIRY_S + 1  # the follower falls silent (it stays in the table until PEER_FORGET_S)
    core.handle(C.Tick())
    assert key(9).peer_id in core.peers and core.exchange.plan_.home == ()


def tick_hearing(core: C.NodeCore, supply: exchange.Supply, producers: int = 0) -> list[C.Action]:
    """A tick after the announce topic's swarm-wide sums (`SwarmHeard`), as the simulator feeds them."""
    core.handle(C.SwarmHeard(producers, supply))
    return core.handle(C.Tick())


def test_a_trainers_own_announced_rate_is_not_supply_for_its_own_lineage() -> None:
    """The announce topic's sums (`SwarmHeard`) count this node's own last announce: what it publishes
    itself is not offered to it, so no follower producing for its lineage leaves its shard unpinned."""
    core, clock, lid = _trainer_with_own_lineage()
    core.handle(W("rollouts", _group()))  # it publishes: its announce states a rate
    tick_hearing(core, exchange.Supply())
    assert core.announced_rate > 0
    own = exchange.Supply({lid: core.announced_rate})  # our own announce, counted for our lineage
    clock.t += C.ANNOUNCE_EVERY_S
    tick_hearing(core, own)
    assert core.exchange.plan_.home == ()
    clock.t += C.ANNOUNCE_EVERY_S
    tick_hearing(core, exchange.Supply({lid: own.of(lid) + 1.0}))  # a follower publishes for it too
    assert core.exchange.plan_.home == (core.exchange.publish_shard(lid),)


def test_the_swarm_sums_fed_stand_while_fresh_then_the_peer_table_counts() -> None:
    """Sums a driver fed (`SwarmHeard`) are planned from for `PEER_EXPIRY_S`, as a peer's announce counts;
    once stale, the core plans from the announces it took itself."""
    core, clock = make_core(roles=("trainer",))
    core.handle(C.SwarmHeard(2 * exchange.PRODUCERS_PER_SHARD, exchange.Supply()))
    core.handle(C.Tick())
    assert core.exchange.shards == 2
    clock.t += PT.PEER_EXPIRY_S
    core.handle(C.Tick())
    assert core.exchange.shards == 2
    clock.t += C.ANNOUNCE_EVERY_S  # no sums fed since: this node heard no producer
    core.handle(C.Tick())
    assert core.exchange.shards == 1


@pytest.mark.parametrize("name", ["lin", "other"])
def test_a_node_serving_another_lineage_counts_its_own_rate_there_not_for_its_own_lineage(name: str) -> None:
    """A trainer that also follows another lineage announces its rate for the lineage it serves: the supply
    topic's sums for its own lineage are all other producers', and pin its shard however the ids sort."""
    mine = lineage_id(key(1).public, BASE, "mine")
    served = lineage_id(key(9).public, BASE, name)
    assert (served > mine) == (name == "lin")  # one case each way
    clock = Clock()
    core = ClockedCore(C.CoreSettings(swarm=SWARM, roles=("trainer", "follower")), key(1), clock)
    core.handle(C.SwarmHeard(0, exchange.Supply()))
    core.handle(
        W(
            "ready",
            {"base": BASE.hex(), "lineage": mine.hex(), "name": "mine", "version": 0, "model_bytes": MODEL_BYTES},
        )
    )
    assert follow_trainer(core, clock, key(9), name=name) == served
    core.handle(C.PatchStored(manifest(key(9), name, 2, 3), 1000, 0.5))
    assert core.committed == served
    core.handle(W("rollouts", _group()))
    clock.t += C.ANNOUNCE_EVERY_S
    tick_hearing(core, exchange.Supply())
    rate = core.announced_rate
    assert rate > 0
    clock.t += C.ANNOUNCE_EVERY_S
    tick_hearing(core, exchange.Supply({served: rate, mine: rate}))  # ours for the served one, a follower's for ours
    assert core.exchange.plan_.home == (core.exchange.publish_shard(mine),)


def test_a_failed_offer_or_catalog_with_no_catch_up_under_way_is_ignored() -> None:
    core, clock = make_core()
    lid = lineage_id(key(9).public, BASE, "lin")
    assert core.handle(C.OfferFailed(key(9).peer_id, lid, "late")) == []
    assert core.handle(C.CatalogFailed(key(9).peer_id, lid, "late")) == []


def test_a_catalog_failure_reported_once_offers_are_out_does_not_skip_the_source() -> None:
    """Each report counts in the phase it belongs to: a catalog failure while that source's offers are out
    is stale and does not move catch-up on (only a failed offer does)."""
    core, clock = make_core()
    trainer, peer = key(9), key(11)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(announce(peer, 1, serving=lid, roles=("follower",)))
    core.handle(C.Tick())
    items = (StoredItem("anchor", 6, 6, 900),)
    assert len(of(core.handle(C.CatalogReceived(trainer.peer_id, lid, items)), C.RequestOffer)) == 1
    assert core.handle(C.CatalogFailed(trainer.peer_id, lid, "stale")) == []
    assert core.catching.phase is CM.CatchUpPhase.OFFERED and core.catching.source == trainer.peer_id


def test_measured_latency_is_smoothed_like_the_throughput() -> None:
    core, clock = make_core()
    core.handle(W("perf", {"gen_tokens_per_s": 100.0, "rollout_latency_s": 1.0}))
    core.handle(W("perf", {"gen_tokens_per_s": 100.0, "rollout_latency_s": 2.0}))
    assert core.latency == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)


def test_catch_up_runs_at_its_cadence_not_on_every_tick() -> None:
    """A tick before the catch-up deadline does not plan a catch-up, even when one became due since."""
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 3)]))
    core.handle(
        C.StoredItems(
            lid, (StoredItem("patch", 0, 1, 10), StoredItem("patch", 1, 2, 10), StoredItem("patch", 2, 3, 10))
        )
    )
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []  # what is stored reaches the head
    core.handle(C.ManifestHeard(manifest(trainer, "lin", 3, 4)))  # a new head, not offered to this node
    clock.t += C.CATCH_UP_EVERY_S / 2
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []
    clock.t += C.CATCH_UP_EVERY_S / 2
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]


def test_a_follower_chooses_the_lineage_its_trainer_says_is_short() -> None:
    """Supply is what each trainer signs in its demand (its followers' claims, capped by their verified
    deliveries): among two equal demands, the one whose trainer counts more supply is less short, whichever
    way the ids sort."""
    for serve_first in (True, False):
        core, clock = make_core()
        a, b = key(9), key(10)
        la, lb = lineage_id(a.public, BASE, "lin"), lineage_id(b.public, BASE, "lin")
        served, other = (la, lb) if serve_first == (la > lb) else (lb, la)
        core.handle(announce(a, 1, [demand(la, "lin", 3, supply=2.5 if la == served else 0.0)]))
        core.handle(announce(b, 1, [demand(lb, "lin", 3, supply=2.5 if lb == served else 0.0)]))
        core.handle(C.Tick())
        assert core.serving == other


def test_another_followers_claimed_throughput_does_not_move_a_follower() -> None:
    """Attack (issue 43): a key connected to the follower alone announces a huge throughput for the lineage
    the follower serves, so that the lineage looks over-supplied and the follower leaves its trainer. A
    follower weighs supply by what the trainer signs, so the claim moves nothing."""
    for serve_first in (True, False):
        core, clock = make_core()
        a, b = key(9), key(10)
        la, lb = lineage_id(a.public, BASE, "lin"), lineage_id(b.public, BASE, "lin")
        first, second = (la, lb) if serve_first == (la > lb) else (lb, la)
        core.handle(announce(a, 1, [demand(la, "lin", 3, rollouts=32 if la == first else 31)]))
        core.handle(announce(b, 1, [demand(lb, "lin", 3, rollouts=32 if lb == first else 31)]))
        core.handle(C.Tick())
        assert core.serving == first
        liar = key(66)
        for i in range(5):
            clock.t += C.ANNOUNCE_EVERY_S
            core.handle(announce(liar, i + 1, serving=first, roles=("follower",), gen_tps=1e9))
            core.handle(C.Tick())
            assert core.serving == first


def test_a_follower_silent_past_the_expiry_is_no_supply_on_a_clock_that_started_near_zero() -> None:
    """The virtual simulator's clock starts at 0: a follower heard at 10 s is stale at 45 s all the same."""
    core, clock = make_core()
    a, b = key(9), key(10)
    la, lb = lineage_id(a.public, BASE, "lin"), lineage_id(b.public, BASE, "lin")
    served, other = (la, lb) if la > lb else (lb, la)  # equal demands: the tie goes to the larger id
    clock.t = 10.0
    core.handle(announce(key(11), 1, serving=served, roles=("follower",), gen_tps=160.0))
    clock.t = 45.0
    core.handle(announce(a, 1, [demand(la, "lin", 3)]))
    core.handle(announce(b, 1, [demand(lb, "lin", 3)]))
    core.handle(C.Tick())
    assert core.serving == served


def test_applied_counts_the_versions_applied() -> None:
    core, clock = make_core()
    lid = follow_trainer(core, clock, key(9), head=6)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.stats()["applied"] == 3
    core.handle(W("applied", {"lineage": lid.hex(), "version": 5}))
    assert core.stats()["applied"] == 5


def test_an_announce_is_taken_only_from_its_own_key_and_never_our_own() -> None:
    core, clock = make_core()
    me, other, signer = key(1), key(9), key(10)
    body = announce(other, 1).body
    forged = C.AnnounceHeard(signer.public, body, wire.seal(signer, wire.NODE_ANNOUNCE, body, swarm=SWARM))
    assert core.handle(forged) == [] and other.peer_id not in core.peers
    assert core.handle(announce(me, 1)) == [] and me.peer_id not in core.peers  # our own, relayed back
    assert of(core.handle(announce(other, 1)), C.SeePeer)


@pytest.mark.parametrize("start", [1000.0, 2.0])  # the virtual simulator's clock starts at 0
def test_a_stored_chain_unapplied_for_ten_seconds_is_re_read(start: float) -> None:
    """docs/architecture.md: held versions that reach the head but have not moved for 10 s make the core re-read
    the store (a payload lost after it was stored)."""
    core, clock = make_core(start=start)
    lid = follow_trainer(core, clock, key(9), head=3)
    core.handle(C.StoredItems(lid, (StoredItem("patch", 1, 2, 10), StoredItem("patch", 2, 3, 10))))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 1}))
    clock.t += C.CATCH_UP_EVERY_S
    assert of(core.handle(C.Tick()), C.LoadStored) == []  # the worker's version moved now
    start = clock.t
    clock.t = start + 9.5
    assert of(core.handle(C.Tick()), C.LoadStored) == []
    clock.t = start + 10.0
    assert of(core.handle(C.Tick()), C.LoadStored) == [C.LoadStored(lid)]


def test_a_followed_lineage_the_store_reports_again_still_gets_its_admission() -> None:
    """The worker hears the staleness verdict for the lineage it follows, however the row was (re)loaded."""
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.committed == lid
    core.handle(C.LineageKnown(bytes(bytearray(lid)), "lin", Relation.FOLLOW, trainer.public, BASE, 3))
    acts = core.handle(C.ManifestHeard(manifest(trainer, "lin", 8, 9)))
    assert [a.generate for a in to_worker(acts, pipe.Admit)] == [False]
    core.handle(announce(trainer, 2, [demand(lid, "lin", 9)]))
    clock.t += C.ANNOUNCE_EVERY_S
    assert of(core.handle(C.Tick()), C.LoadStored) == []  # still the lineage it serves: not chosen anew
    assert core.serving == lid


def test_a_crashing_worker_is_restarted_with_the_documented_backoff() -> None:
    """docs/architecture.md: restart with backoff 1, 2, 5, 15, 30, 60 s, reset after 120 s of stable running."""
    core, clock = make_core()
    delays = []
    for _ in range(8):
        delays += [a.delay_s for a in of(core.handle(C.WorkerExited(1)), C.RestartWorker)]
        clock.t += 1
        core.handle(C.WorkerStarted())
    assert delays == [1.0, 2.0, 5.0, 15.0, 30.0, 60.0, 60.0, 60.0]
    clock.t += 119.5
    assert [a.delay_s for a in of(core.handle(C.WorkerExited(1)), C.RestartWorker)] == [60.0]
    core.handle(C.WorkerStarted())
    clock.t += 120.0
    assert [a.delay_s for a in of(core.handle(C.WorkerExited(1)), C.RestartWorker)] == [1.0]


def test_a_trainer_whose_inbound_falls_short_of_its_demand_asks_for_one_more_shard() -> None:
    """The exchange adds a rotating shard when the rollouts a trainer measures stay below its demand for
    SHORTFALL_WINDOW_S once a whole window is measured (a producer that announces and does not publish cannot
    starve it); fed enough, none."""
    for fed in (0, 64):
        core, clock, lid = _trainer_with_own_lineage()
        assert core.external_demand() > 0
        for _ in range(int(2 * exchange.SHORTFALL_WINDOW_S / C.ANNOUNCE_EVERY_S) + 2):  # measured, then short
            if fed:
                core.handle(C.RolloutsVerified("p", ((b"l" * 32, fed),)))
            core.handle(C.Tick())
            clock.t += C.ANNOUNCE_EVERY_S
        assert core.exchange.extra == (0 if fed else 1)


def test_a_trainers_announced_rate_is_supply_for_the_first_lineage_it_owns() -> None:
    """A producer serving nothing publishes for its own (first) lineage: its rate counts there, not for a
    lineage it lists after it."""
    core, clock, mine = _trainer_with_own_lineage()
    theirs = lineage_id(key(9).public, BASE, "theirs")
    core.handle(_producing(key(9), 1, owned=[demand(theirs, "theirs", 1), demand(mine, "mine", 0)], rate=3.0))
    core.handle(C.Tick())
    assert core.exchange.plan_.home == ()


def test_rollout_batches_sealed_within_one_millisecond_still_rise() -> None:
    """Receivers take a producer's batch only with a seq above the last (a reused one is a replay)."""
    clock = Clock()
    core = ClockedCore(
        C.CoreSettings(swarm=SWARM, roles=("trainer",)), key(7), clock, wall_ms=lambda: 1_700_000_000_000
    )
    seqs = []
    for _ in range(3):
        out = core.handle(W("rollouts", _group()))
        seqs += [
            wire.open_envelope(a.data, swarm=SWARM)[1].seq for a in of(out, C.Publish) if a.topic == C.Topic.ROLLOUTS
        ]
    assert len(seqs) == 3 and seqs[0] < seqs[1] < seqs[2]


def test_an_older_announce_replayed_does_not_replace_a_newer_one() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 5, [demand(lid, "lin", 7)]))
    assert core.handle(announce(trainer, 3, [demand(lid, "lin", 2)])) == []
    assert core.peers[trainer.peer_id].announce.seq == 5


def test_catch_up_asks_the_publisher_then_peers_heard_serving_the_lineage_lately() -> None:
    """Every fresh follower of the lineage is a source, whichever way its id sorts against the publisher's."""
    core, clock = make_core()
    trainer, silent = key(9), key(11)
    lower = next(key(i) for i in range(12, 200) if key(i).peer_id < trainer.peer_id)
    higher = next(key(i) for i in range(12, 200) if key(i).peer_id > trainer.peer_id)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(silent, 1, serving=lid, roles=("follower",)))
    clock.t += PT.PEER_EXPIRY_S + 1  # the first follower falls silent
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    for fresh in (lower, higher):
        core.handle(announce(fresh, 1, serving=lid, roles=("follower",)))
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    asked = []
    for peer in (trainer, lower, higher):
        asked += [a.peer for a in of(core.handle(C.CatalogFailed(peer.peer_id, lid, "gone")), C.FetchCatalog)]
    assert asked == [lower.peer_id, higher.peer_id]


def test_an_announced_throughput_past_the_wires_range_is_capped_at_it() -> None:
    core, clock = make_core()
    core.handle(W("perf", {"gen_tokens_per_s": 1e12, "rollout_latency_s": 1.0}))
    _, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.gen_tokens_per_s == 1e9


def test_a_trainers_announced_step_time_is_zero_until_measured_then_at_least_the_floor() -> None:
    """0 says "not measured yet" (followers do not pace to it); a measured interval below MIN_STEP_S is not a
    measurement the capacity rule can use, so the floor is announced instead."""
    core, clock, lid = _trainer_with_own_lineage()
    _, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.owned[0].step_time_s == 0.0
    core.handle(W("published", {"version": 1, "envelope": b""}))
    clock.t += 1e-4
    core.handle(W("published", {"version": 2, "envelope": b""}))
    clock.t += C.ANNOUNCE_EVERY_S
    _, a = wire.open_envelope(of(core.handle(C.Tick()), C.Publish)[0].data, swarm=SWARM)
    assert a.owned[0].step_time_s == C.MIN_STEP_S


def test_the_shard_count_follows_the_producers_heard_and_the_node_itself() -> None:
    """S doubles once every shard would hold twice PRODUCERS_PER_SHARD producers, this node counted: a trainer
    hearing three others is four producers, two shards; hearing two, one."""
    for others, rate, shards in ((2, 2.0, 1), (3, 2.0, 2), (3, 0.0, 1)):  # an announce of no publishing: no producer
        core, clock, lid = _trainer_with_own_lineage()
        for i in range(others):
            core.handle(
                _producing(key(20 + i), 1, owned=[demand(lineage_id(key(20 + i).public, BASE, "l"), "l", 1)], rate=rate)
            )
        core.handle(C.Tick())
        assert core.exchange.shards == shards


def test_an_accepted_transfer_is_forgotten_only_after_four_patiences() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=3)
    accepted = clock.t
    assert core.offer_manifest(manifest(trainer, "lin", 3, 4))
    clock.t = accepted + 4 * CM.IN_FLIGHT_PATIENCE_S
    core.handle(C.Tick())
    assert (lid, "patch", 3, 4) in core.in_flight
    clock.t += C.ANNOUNCE_EVERY_S
    core.handle(C.Tick())
    assert (lid, "patch", 3, 4) not in core.in_flight


def test_a_trainer_weighs_only_followers_heard_lately() -> None:
    """The capacity rule counts a follower's offer while its announces are fresh (PEER_EXPIRY_S): a claim
    no delivery backs is capped each time it is counted, and no more once the follower falls silent."""
    for start in (1000.0, 10.0):  # the virtual simulator's clock starts at 0
        core, clock, lid = _trainer_with_own_lineage()
        clock.t = start
        core.handle(announce(key(9), 1, serving=lid, roles=("follower",), gen_tps=1e6))
        core.handle(C.Tick())
        assert core.stats()["claims_capped"] == 1
        clock.t += PT.PEER_EXPIRY_S + 5
        core.handle(C.Tick())
        assert core.stats()["claims_capped"] == 1
    core, clock, lid = _trainer_with_own_lineage()  # a follower of another lineage is no offer to this one
    core.handle(announce(key(9), 1, serving=lineage_id(key(10).public, BASE, "x"), roles=("follower",), gen_tps=1e6))
    core.handle(C.Tick())
    assert core.stats()["claims_capped"] == 0


def test_a_trainer_joins_only_as_many_shards_as_cover_its_demand_in_batches() -> None:
    """Demand and supply meet in batches/s: a trainer needing 0.8 batches/s (6.4 rollouts/s in batches of 8)
    takes one shard offering 1 batch/s, not every shard that offers less than its rollouts/s."""
    core, clock, lid = _trainer_with_own_lineage()
    assert core.external_demand() / core.batch_rollouts == pytest.approx(0.8)
    for i, rate in ((20, 1.0), (22, 0.5), (23, 0.5)):  # shard 1: 1.0; shard 0: 0.5 + 0.5 (of two)
        core.handle(_producing(key(i), 1, owned=[demand(lineage_id(key(i).public, BASE, "l"), "l", 1)], rate=rate))
    core.handle(C.Tick())
    assert core.exchange.shards == 2 and len(core.exchange.plan_.subscribe) == 1


def test_the_rollouts_per_batch_estimate_moves_slowly_towards_what_arrives() -> None:
    """Supply is announced in batches/s and demand counted in rollouts: the mean batch size converts them, an
    average that a few odd batches barely move."""
    core, clock, lid = _trainer_with_own_lineage()
    assert core.batch_rollouts == 8.0  # group_size until measured
    core.handle(C.RolloutsVerified("p", ((b"l" * 32, 4),)))
    assert core.batch_rollouts == pytest.approx(0.95 * 8 + 0.05 * 4)
    for _ in range(200):
        core.handle(C.RolloutsVerified("p", ((b"l" * 32, 0),)))  # counted as one at least
    assert core.batch_rollouts == pytest.approx(1.0, abs=1e-3)


def test_a_hostile_codec_name_is_logged_and_charged_bounded() -> None:
    """A refusal quotes what the peer signed: the log line keeps at most 200 characters of it, the charge's
    reason 120 (the scoring table keeps reasons per peer)."""
    core, clock = make_core()
    trainer = key(9)
    follow_trainer(core, clock, trainer, head=3)
    m = manifest(trainer, "lin", 3, 4)
    hostile = wire.PatchManifest(**{f: getattr(m, f) for f in m.__struct_fields__} | {"codec": "\U000e0001" * 32})
    acts = core.handle(C.ManifestHeard(hostile))
    (log,) = [a for a in of(acts, C.Log) if a.msg == "manifest refused"]
    assert log.fields["why"].startswith("unknown codec") and len(log.fields["why"]) <= 200
    (pen,) = of(acts, C.Penalise)
    assert pen.reason.startswith("lineage: unknown codec") and len(pen.reason) <= 120


def test_the_reward_at_start_is_the_mean_of_the_first_five() -> None:
    from murmur.node.shell.views import reward_window

    core, _ = make_core()
    for r in (1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0):
        core.handle(W("gen", {"reward_mean": r, "version": 0}))
    assert reward_window(core) == (pytest.approx(0.8), 0.0)


def test_a_catch_up_plan_costs_only_what_it_fetches() -> None:
    """Held items and transfers on their way cost nothing to plan with: the plan's bytes are the fetched
    items' alone, and a held chain is preferred to a smaller download that replaces it."""
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(C.StoredItems(lid, tuple(StoredItem("patch", v, v + 1, 10) for v in range(4))))  # 0 -> 4 held
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    assert core.offer_manifest(manifest(trainer, "lin", 4, 5))  # 4 -> 5 on its way
    items = (StoredItem("patch", 5, 6, 100), StoredItem("anchor", 6, 6, 103))
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [("patch", 5, 6)]
    (log,) = [a for a in of(acts, C.Log) if a.msg == "catching up"]
    assert log.fields["bytes"] == 100 and log.fields["fetch"] == 1


def test_a_catalog_item_of_an_unknown_kind_is_never_requested() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(C.Tick())
    items = (StoredItem("shortcut", 0, 6, 1), StoredItem("anchor", 6, 6, 900))  # cheaper, of no kind we apply
    acts = core.handle(C.CatalogReceived(trainer.peer_id, lid, items))
    assert [(a.item.kind, a.item.base, a.item.target) for a in of(acts, C.RequestOffer)] == [("anchor", 6, 6)]


def test_a_transfer_of_another_lineage_is_not_counted_on_its_way() -> None:
    """A follower that moves to another lineage while a transfer of the first is still running plans the new
    one's catch-up without it (the same versions of two lineages are different items)."""
    core, clock = make_core()
    a, b = key(9), key(10)
    la, lb = lineage_id(a.public, BASE, "lin"), lineage_id(b.public, BASE, "lin")
    core.handle(announce(a, 1, [demand(la, "lin", 1)]))
    core.handle(C.Tick())
    assert core.serving == la
    assert core.offer_manifest(manifest(a, "lin", 0, 1))  # la's 0 -> 1 on its way
    core.handle(announce(b, 1, [demand(lb, "lin", 1, rollouts=10_000)]))  # far more short: the follower moves
    clock.t += C.ANNOUNCE_EVERY_S
    acts = core.handle(C.Tick())
    assert core.serving == lb and of(acts, C.FetchCatalog) == [C.FetchCatalog(b.peer_id, lb)]


def test_a_transfer_on_its_way_longer_than_the_patience_is_fetched_by_catch_up() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = follow_trainer(core, clock, trainer, head=4)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))
    assert core.offer_manifest(manifest(trainer, "lin", 3, 4))
    clock.t += C.CATCH_UP_EVERY_S
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []
    clock.t += CM.IN_FLIGHT_PATIENCE_S
    core.handle(announce(trainer, 2, [demand(lid, "lin", 4)]))  # the trainer is still there
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]


def test_a_worker_error_is_kept_for_the_status_and_logged_as_its_first_300_characters() -> None:
    core, clock = make_core()
    acts = core.handle(W("error", "x" * 5000))
    assert len(core.worker_error) == 4000
    (log,) = [a for a in of(acts, C.Log) if a.msg == "worker failed"]
    assert log.fields["error"] == "x" * 300


def test_a_failure_reported_about_another_lineage_does_not_move_catch_up_on() -> None:
    core, clock = make_core()
    trainer, peer = key(9), key(11)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(announce(peer, 1, serving=lid, roles=("follower",)))
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    for other in (bytes(32), b"\xff" * 32):  # ids either side of the lineage's
        assert core.handle(C.CatalogFailed(trainer.peer_id, other, "x")) == []
    acts = core.handle(C.CatalogFailed(trainer.peer_id, lid, "x"))
    assert of(acts, C.FetchCatalog) == [C.FetchCatalog(peer.peer_id, lid)]


def test_long_texts_from_peers_and_the_worker_reach_the_log_bounded() -> None:
    """A log line quotes what a catch-up source's failure said, what the worker reported and why a patch did not
    apply, each cut to its bound (200, 500 and 300 characters) however long the text that came in."""
    core, clock = make_core()
    trainer, peer = key(9), key(11)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(announce(peer, 1, serving=lid, roles=("follower",)))
    core.handle(C.Tick())
    huge = "y" * 100_000
    logs = of(core.handle(C.CatalogFailed(trainer.peer_id, lid, huge)), C.Log)
    logs += of(core.handle(W("log", huge)), C.Log)
    logs += of(core.handle(W("apply_failed", {"lineage": lid.hex(), "base": 0, "target": 1, "error": huge})), C.Log)
    got = {log.msg: max(len(v) for v in log.fields.values() if isinstance(v, str)) for log in logs}
    assert got == {"catch-up source failed": 200, "worker": 500, "patch apply failed": 300}
