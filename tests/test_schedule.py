"""The shared prompt schedule (training/schedule.py) and its bad-input rules (issue 40).

The attacks first: a valid key's rollout claimed for a schedule round but answering another prompt is
refused and charged (provable from the task reference and the public schedule); a claimed round outside the
receiver's window is refused, uncharged (it rests on the receiver's clock); neither check costs more than a
set lookup per rollout, whatever round is claimed. Then what honest peers rely on: the schedule is one
function of (task set, round), the same on every node; a producer's scheduled prompts are accepted with
their claim, and the claim reaches the receiving trainer's rollout record.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.validation import PENALTIES, Pipeline, PipelineConfig, Reason
from murmur.simulations.bench.gossip import SWARM, TOKENIZER, registry, seal_rollouts
from murmur.training import schedule as S
from murmur.training.rollouts import from_wire
from murmur.training.tasksets import (
    BUILTIN_COORDINATOR,
    TaskRegistry,
    builtin_manifest,
    is_eval,
    sign_task_set,
    task_set_id,
    worked_manifest,
)
from murmur.training.verifiers import score
from tests.samples import Clock

ALICE = Identity.from_seed(b"\x01" * 32)
MALLORY = Identity.from_seed(b"\x02" * 32)
COORD = Identity.from_seed(b"\x0d" * 32)
LINEAGE = b"\x4c" * 32


@pytest.fixture(scope="module")
def reg() -> TaskRegistry:
    return registry()


@pytest.fixture(scope="module")
def worked_id(reg: TaskRegistry) -> bytes:
    """A second task set the registry holds (the worked-answer set, signed by a trusted coordinator)."""
    env = sign_task_set(COORD, worked_manifest(COORD.public), swarm=SWARM)
    reg.add(env, {COORD.public})
    return task_set_id(env, swarm=SWARM)


def pipe(reg: TaskRegistry, schedule: bool = True) -> tuple[Pipeline, Clock, S.ScheduleBook]:
    clock = Clock()
    book = S.ScheduleBook.of(reg)
    p = Pipeline(
        PipelineConfig(swarm=SWARM),
        clock=clock,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: None,
        task_set_trusted=reg.__contains__,
        schedule=book if schedule else None,
    )
    return p, clock, book


def answers(reg: TaskRegistry, ref: wire.TaskRef, round_no: int, n: int = 2) -> list[wire.Rollout]:
    """`n` completions of `ref`, the first right and the rest wrong, each honestly rewarded, claimed for
    `round_no`: a group any receiver learns from, valid in every way but (perhaps) its claim."""
    task = reg.resolve(ref)
    out = []
    for k in range(n):
        text = task.answer if k == 0 else "no idea"
        ids = [(ord(c) + 3) % 50_000 for c in text]
        out.append(
            wire.Rollout(
                task=ref,
                lineage=LINEAGE,
                version=0,
                completion_ids=ids,
                text=text,
                tokenizer_hash=TOKENIZER,
                logprobs=struct.pack(f"<{len(ids)}f", *([-0.5] * len(ids))),
                token_versions=[(0, 0)],
                sampling=wire.SamplingParams(max_new_tokens=64),
                reward=score(task, text),
                created_ms=wire.now_ms(),
                schedule_round=round_no,
            )
        )
    return out


def seal(ident: Identity, rollouts: list[wire.Rollout], seq: int, clock: Clock) -> bytes:
    return seal_rollouts(ident, rollouts, seq, SWARM, int(clock() * 1000))


def _key(ref: wire.TaskRef) -> tuple[bytes, str, int]:
    return (bytes(ref.task_set), ref.generator, ref.seed)


def now_round(clock: Clock) -> int:
    return S.round_at(int(clock() * 1000))


def unscheduled(reg: TaskRegistry, round_no: int, task_set: bytes | None = None) -> wire.TaskRef:
    """A valid training prompt of the set that is not one of round `round_no`'s."""
    tid = task_set or reg.builtin_id
    due = S.scheduled_prompts(tid, reg.get(tid), round_no)
    first = due[0]
    return next(
        wire.TaskRef(tid, first.generator, (first.seed + k) % 1_000_000)
        for k in range(1, 100)
        if wire.TaskRef(tid, first.generator, (first.seed + k) % 1_000_000) not in due
    )


# ------------------------------------------------------------ the attacks


def test_a_valid_keys_rollout_claimed_for_a_round_but_another_prompt_is_refused_and_charged(reg) -> None:
    p, clock, book = pipe(reg)
    rnd = now_round(clock)
    due = book.prompts(reg.builtin_id, rnd)
    other = unscheduled(reg, rnd)
    # well-signed, rightly rewarded answers of a real task of a set the receiver trains on: only the claim lies
    lying = seal(MALLORY, answers(reg, due[0], rnd) + answers(reg, other, rnd), 1, clock)
    before = p.scores.score(MALLORY.peer_id, clock())
    v = p.check(lying, MALLORY.peer_id)
    assert v.reason is Reason.MISSCHEDULED and not v.accepted, v.detail
    assert f"seed {other.seed}" in v.detail
    assert PENALTIES[Reason.MISSCHEDULED][0] > 0
    assert before - p.scores.score(MALLORY.peer_id, clock()) == pytest.approx(PENALTIES[Reason.MISSCHEDULED][0])
    assert p.counts["misscheduled"] == 1 and p.per_peer[MALLORY.peer_id]["misscheduled"] == 1
    # a scheduled prompt claimed for a round it is not in (the next one, inside the window) is as false
    assert due[1] not in book.prompts(reg.builtin_id, rnd + 1)
    v = p.check(seal(MALLORY, answers(reg, due[1], rnd + 1), 2, clock), MALLORY.peer_id)
    assert v.reason is Reason.MISSCHEDULED, v.detail
    # a signed fault: the same bytes again are judged from the cache and charged again
    derived = book.derived
    v = p.check(lying, MALLORY.peer_id)
    assert v.reason is Reason.MISSCHEDULED and book.derived == derived
    # the same answers without the claim are accepted: only the claim was false
    assert p.check(seal(ALICE, answers(reg, other, 0), 1, clock), ALICE.peer_id).accepted


def test_a_claimed_round_outside_the_window_is_refused_uncharged_and_not_cached(reg) -> None:
    p, clock, book = pipe(reg)
    rnd = now_round(clock)
    sender = S.ScheduleBook.of(reg)  # the schedule is public: anyone derives any round's prompts
    seq = 0
    for far in (rnd - S.PAST_ROUNDS - 1, rnd + S.FUTURE_ROUNDS + 1, rnd + 10**6, 2**32 - 1):
        seq += 1
        derived = book.derived
        data = seal(MALLORY, answers(reg, sender.prompts(reg.builtin_id, far)[0], far), seq, clock)
        v = p.check(data, MALLORY.peer_id)
        assert v.reason is Reason.SCHEDULE_WINDOW and not v.accepted, (far, v.detail)
        assert book.derived == derived  # a round outside the window is never derived
    assert p.counts["schedule_window"] == 4
    assert p.scores.score(MALLORY.peer_id, clock()) == 0.0  # the window is this node's clock: nothing charged
    for edge in (rnd - S.PAST_ROUNDS, rnd + S.FUTURE_ROUNDS):  # the edges are inside
        seq += 1
        v = p.check(seal(ALICE, answers(reg, sender.prompts(reg.builtin_id, edge)[0], edge), seq, clock), ALICE.peer_id)
        assert v.accepted, (edge, v.detail)
    # not cached: a claim one round too far ahead is accepted once the receiver's clock reaches it
    early = seal(ALICE, answers(reg, sender.prompts(reg.builtin_id, rnd + 2)[1], rnd + 2), seq + 1, clock)
    assert p.check(early, ALICE.peer_id).reason is Reason.SCHEDULE_WINDOW
    clock.t += S.ROUND_MS / 1000
    assert p.check(early, ALICE.peer_id).accepted


def test_a_pipeline_without_the_schedule_accepts_no_claim(reg) -> None:
    p, clock, book = pipe(reg, schedule=False)
    rnd = now_round(clock)
    v = p.check(seal(ALICE, answers(reg, book.prompts(reg.builtin_id, rnd)[0], rnd), 1, clock), ALICE.peer_id)
    assert v.reason is Reason.SCHEDULE_WINDOW and p.scores.score(ALICE.peer_id, clock()) == 0.0


def test_the_check_costs_a_lookup_per_rollout_whatever_rounds_are_claimed(reg) -> None:
    """A full batch whose every rollout claims another round derives only rounds inside the window (each once,
    then from the cache), however large the claimed numbers."""
    p, clock, book = pipe(reg)
    rnd = now_round(clock)
    sender = S.ScheduleBook.of(reg)
    window = range(rnd - S.PAST_ROUNDS, rnd + S.FUTURE_ROUNDS + 1)
    rows = [r for k in window for r in answers(reg, sender.prompts(reg.builtin_id, k)[0], k)]
    assert p.check(seal(ALICE, rows, 1, clock), ALICE.peer_id).accepted
    assert book.derived == len(window)
    rows = [r for k in window for r in answers(reg, sender.prompts(reg.builtin_id, k)[1], k)]
    assert p.check(seal(ALICE, rows, 2, clock), ALICE.peer_id).accepted
    assert book.derived == len(window)  # every round from the cache
    huge = [answers(reg, sender.prompts(reg.builtin_id, k)[0], k)[0] for k in range(2**32 - 64, 2**32)]
    assert p.check(seal(MALLORY, huge, 1, clock), MALLORY.peer_id).reason is Reason.SCHEDULE_WINDOW
    assert book.derived == len(window)


def test_a_claim_for_a_task_set_not_held_is_refused_uncharged(reg) -> None:
    """Without the set's manifest the claim cannot be judged: uncharged, as any unknown task set."""
    p, clock, _ = pipe(reg)
    p.task_set_trusted = None  # the claim is what meets the unknown set first
    rnd = now_round(clock)
    rows = answers(reg, S.ScheduleBook.of(reg).prompts(reg.builtin_id, rnd)[0], rnd)
    rows = [msgspec.structs.replace(r, task=msgspec.structs.replace(r.task, task_set=b"\xee" * 32)) for r in rows]
    v = p.check(seal(MALLORY, rows, 1, clock), MALLORY.peer_id)
    assert v.reason is Reason.UNKNOWN_TASK_SET and p.scores.score(MALLORY.peer_id, clock()) == 0.0


# ------------------------------------------------------------ honest peers


def test_an_honest_producers_scheduled_prompts_are_accepted_with_their_claim(reg) -> None:
    p, clock, _ = pipe(reg)
    draw = S.ScheduledDraw(S.ScheduleBook.of(reg), 1.0)
    wall = int(clock() * 1000)
    got = [draw.draw(reg.builtin_id, wall) for _ in range(S.PROMPTS_PER_ROUND)]
    assert all(g is not None for g in got)
    # the first prompts, and the round's last: one batch (a batch holds at most 256 rollouts)
    rows = [r for g in got[:16] + got[-16:] if g is not None for r in answers(reg, g[0], g[1])]
    v = p.check(seal(ALICE, rows, 1, clock), ALICE.peer_id)
    assert v.accepted and v.batch is not None, v.detail
    assert {r.schedule_round for r in v.batch.rollouts} == {now_round(clock)}
    # ... and the claim reaches the receiving trainer's record
    r = v.batch.rollouts[0]
    assert from_wire(r, reg.resolve(r.task), [1], TOKENIZER, lambda s: [1]).schedule_round == now_round(clock)
    assert draw.draw(reg.builtin_id, wall) is None  # the round's prompts are spent: free draws until the next


def test_the_schedule_is_one_function_of_task_set_and_round(reg, worked_id) -> None:
    """Two nodes with nothing shared but the signed set compute the same prompts; rounds and sets differ."""
    other = TaskRegistry("another-swarm")  # another node: its own registry, its own book
    other.add_builtin()
    a, b = S.ScheduleBook.of(reg), S.ScheduleBook.of(other)
    assert other.builtin_id == reg.builtin_id
    rnd = S.round_at(wire.now_ms())
    assert a.prompts(reg.builtin_id, rnd) == b.prompts(reg.builtin_id, rnd)
    assert len(a.prompts(reg.builtin_id, rnd)) == S.PROMPTS_PER_ROUND
    # the next round is another draw: prompts meet again only by chance (a generator's seed range is finite)
    both = {_key(r) for r in a.prompts(reg.builtin_id, rnd)} & {_key(r) for r in a.prompts(reg.builtin_id, rnd + 1)}
    assert len(both) < S.PROMPTS_PER_ROUND // 20
    worked = a.prompts(worked_id, rnd)
    assert worked and {r.task_set for r in worked} == {worked_id}
    assert {r.seed for r in worked} != {r.seed for r in a.prompts(reg.builtin_id, rnd)}
    # the same manifest under another id (a re-signed set) is another schedule
    assert S.scheduled_prompts(b"\x01" * 32, reg.get(reg.builtin_id), rnd) != a.prompts(reg.builtin_id, rnd)
    assert S.round_at(0) == 1 and S.round_at(S.ROUND_MS - 1) == 1 and S.round_at(S.ROUND_MS) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tid=st.binary(min_size=32, max_size=32),
    rnd=st.integers(1, 2**32 - 1),
    weights=st.lists(st.floats(1e-6, 1e6), min_size=3, max_size=3),
)
def test_every_scheduled_prompt_is_a_valid_training_prompt(tid: bytes, rnd: int, weights: list[float]) -> None:
    m = builtin_manifest(BUILTIN_COORDINATOR.public)
    trains = [g for g in m.generators if not is_eval(g)]
    m = msgspec.structs.replace(
        m,
        generators=[
            msgspec.structs.replace(g, weight=weights[trains.index(g)]) if g in trains else g for g in m.generators
        ],
    )
    book = S.ScheduleBook(lambda t: m if t == tid else None)
    refs = book.prompts(tid, rnd)
    assert refs == S.scheduled_prompts(tid, m, rnd) and len(refs) == S.PROMPTS_PER_ROUND
    specs = {g.name: g for g in m.generators}
    for ref in refs:
        g = specs[ref.generator]
        assert not is_eval(g) and g.seed_start <= ref.seed < g.seed_end and ref.task_set == tid
        assert book.scheduled(ref, rnd) is True
    probe = msgspec.structs.replace(refs[0], seed=(refs[0].seed + 1) % 1_000_000)
    assert book.scheduled(probe, rnd) is (probe in refs)
    assert book.scheduled(msgspec.structs.replace(refs[0], generator=refs[0].generator + "-eval"), rnd) is False
    assert book.scheduled(msgspec.structs.replace(refs[0], task_set=bytes(x ^ 1 for x in tid)), rnd) is None


@settings(max_examples=50, deadline=None)
@given(share=st.floats(0.0, 1.0), draws=st.integers(1, 200))
def test_a_producer_draws_its_share_from_the_schedule_in_order(share: float, draws: int) -> None:
    m = builtin_manifest(BUILTIN_COORDINATOR.public)
    tid = b"\x07" * 32
    draw = S.ScheduledDraw(S.ScheduleBook(lambda t: m if t == tid else None), share)
    wall = 5 * S.ROUND_MS
    got = [draw.draw(tid, wall + k) for k in range(draws)]
    taken = [g for g in got if g is not None]
    want = min(S.PROMPTS_PER_ROUND, int(draws * share + 1e-6))
    assert abs(len(taken) - want) <= 1
    assert [g[0] for g in taken] == list(S.scheduled_prompts(tid, m, S.round_at(wall))[: len(taken)])
    assert all(g[1] == S.round_at(wall) for g in taken)


def test_a_new_round_starts_at_its_first_prompt_and_a_bad_share_is_refused() -> None:
    m = builtin_manifest(BUILTIN_COORDINATOR.public)
    tid = b"\x07" * 32
    draw = S.ScheduledDraw(S.ScheduleBook(lambda t: m if t == tid else None), 0.5)
    wall = 9 * S.ROUND_MS
    assert [draw.draw(tid, wall) for _ in range(4)][1::2] == [
        (p, S.round_at(wall)) for p in S.scheduled_prompts(tid, m, S.round_at(wall))[:2]
    ]
    nxt = [draw.draw(tid, wall + S.ROUND_MS) for _ in range(2)]
    assert nxt == [None, (S.scheduled_prompts(tid, m, S.round_at(wall) + 1)[0], S.round_at(wall) + 1)]
    assert draw.draw(b"\x08" * 32, wall) is None and draw.draw(b"\x08" * 32, wall) is None  # a set not held
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            S.ScheduledDraw(draw.book, bad)


def test_a_producer_never_signs_a_claim_receivers_would_refuse_for_its_round() -> None:
    """A prompt drawn long before it is published goes out unclaimed (receivers would refuse the whole batch
    for its round); one drawn recently keeps its claim."""
    from murmur.node.core.events import Publish
    from murmur.node.core.sealing import RolloutSealer

    reg = registry()
    wall = wire.now_ms()
    rnd = S.round_at(wall)
    assert S.publishable(rnd, wall) == rnd and S.publishable(rnd - S.PAST_ROUNDS + S.PUBLISH_MARGIN_ROUNDS, wall)
    assert S.publishable(rnd - S.PAST_ROUNDS + S.PUBLISH_MARGIN_ROUNDS - 1, wall) == 0
    assert S.publishable(rnd + 1, wall) == 0 and S.publishable(0, wall) == 0
    book = S.ScheduleBook.of(reg)
    old = rnd - S.PAST_ROUNDS
    rows = answers(reg, book.prompts(reg.builtin_id, rnd)[0], rnd) + answers(
        reg, book.prompts(reg.builtin_id, old)[0], old
    )
    sealer = RolloutSealer(SWARM, ALICE)
    out: list = []
    sealer.seal([wire.encode(r) for r in rows], 0.0, wall, lambda lid: 0, out)
    batch = wire.open_envelope(next(a for a in out if isinstance(a, Publish)).data, swarm=SWARM)[1]
    assert [r.schedule_round for r in batch.rollouts] == [rnd, rnd, 0, 0]
    assert sealer.unscheduled == 2


def test_the_nodes_worker_draws_its_configured_share(reg, tmp_path) -> None:
    from murmur.node.config import Config, TrainingSection
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec
    from murmur.node.worker.main import Worker

    spec = worker_spec(
        Config(training=TrainingSection(schedule_share=0.25)), tmp_path, ALICE, ["trainer"], RunOptions()
    )
    draw = Worker._scheduled_draw(SimpleNamespace(spec=spec, registry=reg))  # the two fields it reads
    assert isinstance(draw, S.ScheduledDraw) and draw.share == 0.25
    spec = worker_spec(Config(), tmp_path, ALICE, ["trainer"], RunOptions())
    assert Worker._scheduled_draw(SimpleNamespace(spec=spec, registry=reg)) is None


def test_a_trainer_draws_its_share_from_the_schedule_and_a_receiver_accepts_the_claims(reg) -> None:
    from murmur.training.rollouts import to_wire
    from murmur.training.tiny import new_tiny_engine
    from murmur.training.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(local_groups=4, group_size=2, max_new_tokens=4, lr=0.0, external_groups=0)
    tr = Trainer(new_tiny_engine(seed=1), reg, reg.builtin_id, cfg)
    book = S.ScheduleBook.of(reg)
    tr.schedule = S.ScheduledDraw(book, 0.5)
    res = tr.step()
    scheduled = [r for r in res.rollouts if r.schedule_round]
    assert len({_key(r.ref) for r in scheduled}) == 2  # half of the step's four prompts
    assert all(book.scheduled(r.ref, r.schedule_round) for r in scheduled)
    assert all(r.schedule_round == 0 for r in res.rollouts if r not in scheduled)
    rows = [to_wire(r) for r in res.rollouts]
    assert [w.schedule_round for w in rows] == [r.schedule_round for r in res.rollouts]
    p, clock, _ = pipe(reg)
    v = p.check(seal(ALICE, rows, 1, clock), ALICE.peer_id)
    assert v.accepted, v.detail
    plain = Trainer(new_tiny_engine(seed=1), reg, reg.builtin_id, cfg)  # no schedule given: nothing claimed
    assert not any(r.schedule_round for r in plain.step().rollouts)


def test_in_the_virtual_swarm_honest_claims_pass_and_every_misscheduled_rollout_is_refused() -> None:
    """The virtual simulator's nodes (real cores, sealers and pipelines) draw half their prompts from the
    schedule; an adversary sends correct work under false claims."""
    from murmur.simulations import scenario as SC
    from murmur.simulations.virtual import VirtualSim

    sim = VirtualSim(
        SC.loads("""
name = "schedule"
seed = 3
duration_s = 30.0
[[group]]
count = 4
[[adversary]]
behaviour = "misscheduled"
rate_per_s = 2.0
[training]
step_s = 1.0
schedule_share = 0.5
[sync]
broadcasts = 0
""")
    )
    honest = [n for n in sim.nodes if n.spec.role != "adversary"]
    claimed: list[int] = []
    for n in honest:

        def commit(p, inner=n.pipeline.commit):  # type: ignore[no-untyped-def]  # wraps the bound method
            v = inner(p)
            if v.accepted and v.batch is not None:
                claimed.extend(r.schedule_round for r in v.batch.rollouts if r.schedule_round)
            return v

        n.pipeline.commit = commit  # type: ignore[method-assign]  # a test's tap on what was accepted
    s = sim.run()
    assert s["adversarial_accepted"] == 0
    assert s["rejections"].get("misscheduled", 0) > 0, s["rejections"]
    assert claimed  # honest producers' scheduled rollouts were accepted with their claims
    ids = {n.peer_id for n in honest}
    for n in honest:  # no honest batch refused for its claim, nor charged for anything
        for peer, c in n.pipeline.per_peer.items():
            if peer in ids:
                assert not (c.get("misscheduled") or c.get("schedule_window")), (peer, c)
                assert all(PENALTIES[Reason(k)][0] == 0 for k in c), (peer, c)
