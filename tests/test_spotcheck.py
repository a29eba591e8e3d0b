"""Spot checks of behaviour log-probs (issue 26): which received rollouts a node can check (it holds
their exact weights), that every producer faces the stated chance however much it sends, and that
the fraction is measured per producer and reaches the node's status."""

from __future__ import annotations

import msgspec

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.node.core import machine as C
from murmur.training.spotcheck import SPOT_PER_ROUND, SPOT_RATE, SpotSampler, checkable
from tests.samples import rollout
from tests.test_core import W, make_core

LIN, TOK = b"\x02" * 32, b"\x03" * 32  # tests.samples.rollout's lineage and tokenizer (version 3)
BIG, SMALL = b"\xb1" * 32, b"\x5e" * 32


def batch(producer: bytes, rollouts: list[wire.Rollout]) -> wire.RolloutBatch:
    return wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm="t", producer=producer, seq=1, created_ms=1, rollouts=rollouts
    )


def test_only_rollouts_of_the_held_weights_are_checkable() -> None:
    r = rollout()
    assert checkable(r, LIN, 3, TOK)
    assert not checkable(r, LIN, 4, TOK)  # another version: we do not hold its weights
    assert not checkable(r, b"\x09" * 32, 3, TOK)  # another lineage
    assert not checkable(r, LIN, 3, b"\x04" * 32)  # another tokenizer: its ids mean nothing to us
    assert not checkable(msgspec.structs.replace(r, token_versions=[(0, 3), (4, 4)]), LIN, 3, TOK)  # partial
    assert not checkable(msgspec.structs.replace(r, completion_ids=[], logprobs=b""), LIN, 3, TOK)


def test_every_producer_faces_the_stated_fraction_however_much_it_sends() -> None:
    """A producer that floods cannot dilute the checks of another: draws are uniform over all
    eligible rollouts of a round, and the per-producer counters measure the fraction."""
    s = SpotSampler(SPOT_RATE, SPOT_PER_ROUND, seed=5)
    r = rollout()
    for _ in range(2000):
        rounds = [(BIG, batch(BIG, [r] * 3)), (SMALL, batch(SMALL, [r]))]
        eligible, chosen = s.pick(rounds, LIN, 3, TOK)
        assert eligible == 4 and len(chosen) <= SPOT_PER_ROUND
    big, small = s.producers[BIG], s.producers[SMALL]
    assert (big.eligible, small.eligible) == (6000, 2000)
    for rec in (big, small):
        assert abs(rec.fraction - SPOT_RATE) < 0.03, rec  # 0.25 stated; ~0.01 sampling error here
    # the per-round cap binds when a round holds many: the fraction falls, and the counter shows it
    s2 = SpotSampler(SPOT_RATE, SPOT_PER_ROUND, seed=6)
    for _ in range(50):
        s2.pick([(BIG, batch(BIG, [r] * 64))], LIN, 3, TOK)
    assert s2.producers[BIG].checked == 50 * SPOT_PER_ROUND and s2.producers[BIG].fraction < SPOT_RATE


def test_a_drawn_rollout_the_worker_cannot_use_is_not_counted() -> None:
    s = SpotSampler(1.0, 10, seed=1)
    eligible, chosen = s.pick(
        [(BIG, batch(BIG, [rollout(seed=1), rollout(seed=2)]))], LIN, 3, TOK, usable=lambda r: r.task.seed == 1
    )
    assert eligible == 1 and [c[1].task.seed for c in chosen] == [1]
    assert (s.producers[BIG].eligible, s.producers[BIG].checked) == (1, 1)


def test_spot_rounds_and_failures_reach_the_status_counters() -> None:
    core, _ = make_core()
    core.handle(W("spot_round", {"eligible": 12}))
    bad = Identity.from_seed(b"\x66" * 32)
    acts = core.handle(W("spot", {"ok": False, "producer": bad.public.hex(), "diff": 0.9}))
    assert core.stats()["spot_eligible"] == 12 and core.stats()["spot_checked"] == 1
    assert [(p.peer, p.reason) for p in acts if isinstance(p, C.Penalise)] == [(bad.peer_id, "spot_check_failed")]


def test_a_trainer_worker_spot_checks_its_own_lineage_and_names_fabrication(tmp_path) -> None:
    """A trainer that is not a validator re-scores followers' rollouts of the version it holds with the
    published weights, and reports a fabricated behaviour log-prob (charged by the node, above)."""
    import multiprocessing
    import struct

    from murmur.node import pipe
    from murmur.node.worker.main import Worker
    from murmur.training.engine import Sampling
    from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
    from murmur.training.tiny import new_tiny_engine

    reg = TaskRegistry("t")
    reg.add_builtin()
    engine = new_tiny_engine(seed=2)
    lineage, version = b"\x4d" * 32, 6
    ref = wire.TaskRef(task_set=reg.builtin_id, generator=BUILTIN_TRAIN, seed=4)
    prompt = engine.encode(reg.resolve(ref).prompt)
    ids, lps, _ = engine.sample([prompt], Sampling(temperature=1.0, max_new_tokens=6))[0]
    honest = wire.Rollout(
        task=ref,
        lineage=lineage,
        version=version,
        completion_ids=ids,
        text=engine.decode(ids),
        tokenizer_hash=engine.tokenizer_hash,
        logprobs=struct.pack(f"<{len(ids)}f", *lps),
        token_versions=[(0, version)],
        sampling=wire.SamplingParams(max_new_tokens=6),
        reward=0.0,
        created_ms=1,
    )
    # the attacker's payload: likely tokens claimed at log-prob 0 (certain), so the trainer's
    # behaviour weight exp(p - b) shrinks and nothing flags its tokens as off-policy
    forged = msgspec.structs.replace(honest, logprobs=struct.pack(f"<{len(ids)}f", *([0.0] * len(ids))))
    mine, theirs = multiprocessing.Pipe()
    w = Worker(theirs, {"home": str(tmp_path), "swarm": "t", "roles": ["trainer"], "seed": 0, "spot_rate": 1.0})
    w.checker, w.registry = engine, reg
    w.inbox.spot.extend([(BIG, batch(BIG, [honest])), (SMALL, batch(SMALL, [forged]))])
    w._spot_checks(lineage, version)
    msgs = []
    while mine.poll(0):
        msgs.append(pipe.decode(mine.recv_bytes()))
    assert [m.eligible for m in msgs if isinstance(m, pipe.SpotRound)] == [2]
    verdicts = {bytes.fromhex(m.producer): m.ok for m in msgs if isinstance(m, pipe.Spot)}
    assert verdicts == {BIG: True, SMALL: False}
    assert w.spot.producers[SMALL].failed == 1 and w.spot.producers[BIG].failed == 0


def test_an_unproven_producer_is_checked_first_and_always_until_it_has_passed() -> None:
    """Attack (issue 43, trust before any check): a fresh key's fabricated log-probs were trained on for
    hundreds of rows before a sampled check found them. An unproven producer's eligible rollouts are drawn
    first, every time, within the round's cap, until it has passed TRUST_AFTER checks; then the stated rate."""
    from murmur.training.spotcheck import TRUST_AFTER

    s = SpotSampler(SPOT_RATE, SPOT_PER_ROUND, seed=3)
    r = rollout()
    _, chosen = s.pick([(BIG, batch(BIG, [r] * 20))], LIN, 3, TOK)
    assert len(chosen) == SPOT_PER_ROUND >= TRUST_AFTER  # unproven: rate 1 up to the round's cap
    assert s.producers[BIG].proven
    new = b"\x4e" * 32
    rounds = 0
    while s.producers.get(new) is None or s.producers[new].checked < TRUST_AFTER:
        rounds += 1
        assert rounds <= 20
        _, chosen = s.pick([(BIG, batch(BIG, [r] * 20)), (new, batch(new, [r]))], LIN, 3, TOK)
        assert new in {p for p, _ in chosen}  # its one rollout beside 20 of a proven producer's, every round
    assert rounds == TRUST_AFTER and s.producers[new].proven
    s.failed(new)
    assert not s.producers[new].proven  # a failure makes it unproven again
