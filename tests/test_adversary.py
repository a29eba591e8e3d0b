"""What an adversary sends (`simulations/adversary.py`): the one builder of hostile batches, used by the
emulator's adversary processes and the virtual simulator's adversaries. Each behaviour's bytes are a real
envelope, bad in the one way the behaviour names."""

from __future__ import annotations

import pytest

from murmur.gossip import wire
from murmur.gossip.errors import SignatureError
from murmur.gossip.identity import Identity
from murmur.simulations.adversary import SENDERS, Adversary, for_process
from murmur.training.tasksets import TaskRegistry
from murmur.training.verifiers import score

SWARM = "adv-test"
IDENT = Identity.from_seed(bytes(range(32)))


def opened(data: bytes) -> wire.RolloutBatch:
    env = wire.decode_envelope(data, wire.ROLLOUT_BATCH, swarm=SWARM)
    wire.verify_envelope(env)
    body = wire.decode_body(env)
    assert isinstance(body, wire.RolloutBatch) and body.producer == IDENT.public
    return body


def test_a_forged_batch_is_validly_signed_wrong_answers_claiming_full_reward() -> None:
    adv = for_process(IDENT, SWARM, seed=1)
    [(data, lineage)] = adv.payloads("forged_reward")
    batch = opened(data)
    assert lineage == adv.lineage and all(r.lineage == lineage for r in batch.rollouts)
    registry = TaskRegistry(SWARM)
    registry.add_builtin()
    for r in batch.rollouts:
        assert r.reward == 1.0 and score(registry.resolve(r.task), r.text) == 0.0


def test_an_invalid_signature_is_one_flipped_byte_of_an_honest_batch() -> None:
    [(data, _)] = for_process(IDENT, SWARM, seed=1).payloads("invalid_signature")
    env = wire.decode_envelope(data, wire.ROLLOUT_BATCH, swarm=SWARM)
    with pytest.raises(SignatureError):
        wire.verify_envelope(env)
    fixed = bytearray(data)
    fixed[-5] ^= 0xFF
    opened(bytes(fixed))


def test_a_replayer_resends_its_first_batch_and_equivocates_under_its_seq() -> None:
    adv = for_process(IDENT, SWARM, seed=1)
    [(first, _)] = adv.payloads("replay")
    for _ in range(2):
        again, other = [d for d, _ in adv.payloads("replay")]
        assert again == first and other != first
        assert opened(other).seq == opened(first).seq and opened(other).rollouts != opened(first).rollouts


def test_stale_spam_names_the_victims_lineage_and_omissions_send_nothing() -> None:
    victim = b"v" * 32
    adv = for_process(IDENT, SWARM, seed=1, victim_lineage=victim)
    [(data, lineage)] = adv.payloads("stale_spam")
    assert lineage == victim and {(r.lineage, r.version) for r in opened(data).rollouts} == {(victim, 0)}
    assert adv.payloads("corrupt_chunks") == adv.payloads("free_ride") == []
    assert set(SENDERS) == {"forged_reward", "invalid_signature", "replay", "stale_spam", "misscheduled"}


def test_the_draws_and_clock_are_the_callers() -> None:
    """The virtual simulator gives its adversaries its worker model's draws and the virtual clock."""
    calls: list[tuple[bytes, bool]] = []
    template = for_process(IDENT, SWARM, seed=2).draw

    def draw(lineage: bytes, wrong: bool) -> list[wire.Rollout]:
        calls.append((lineage, wrong))
        return template(lineage, wrong)

    adv = Adversary(IDENT, SWARM, b"o" * 32, lambda: 1234, draw, lambda: b"v" * 32)
    sent = [adv.payloads(b) for b in ("forged_reward", "invalid_signature", "stale_spam")]
    assert calls == [(b"o" * 32, True), (b"o" * 32, False), (b"v" * 32, False)]
    assert opened(sent[0][0][0]).created_ms == opened(sent[2][0][0]).created_ms == 1234
    assert [opened(s[0][0]).seq for s in (sent[0], sent[2])] == [1, 3]  # one sequence over its batches


def test_a_misscheduled_batch_is_correct_work_claiming_a_round_its_task_is_not_in() -> None:
    """Everything about it is honest but its claim: receivers refuse it as `misscheduled`, and charge it."""
    import time

    import msgspec

    from murmur.gossip.validation import Pipeline, PipelineConfig, Reason
    from murmur.training.schedule import ScheduleBook, in_window, round_at

    registry = TaskRegistry(SWARM)
    registry.add_builtin()
    book = ScheduleBook.of(registry)
    adv = for_process(IDENT, SWARM, seed=1)
    [(data, lineage)] = adv.payloads("misscheduled")
    batch = opened(data)
    assert lineage == adv.lineage
    for r in batch.rollouts:
        assert r.reward == score(registry.resolve(r.task), r.text)
        assert in_window(r.schedule_round, wire.now_ms()) and book.scheduled(r.task, r.schedule_round) is False
    p = Pipeline(
        PipelineConfig(swarm=SWARM),
        clock=time.time,
        resolve_task=registry.resolve,
        reward=score,
        head_version=lambda _: None,
        task_set_trusted=registry.__contains__,
        schedule=book,
    )
    v = p.check(data, IDENT.peer_id)
    assert v.reason is Reason.MISSCHEDULED and p.scores.score(IDENT.peer_id, time.time()) < 0
    # a draw that happens to be one of the current round's prompts is claimed for an earlier round it is not in
    now = round_at(1_000 * 60_000)
    due = book.prompts(registry.builtin_id, now)[0]
    rows = [msgspec.structs.replace(r, task=due) for r in batch.rollouts]
    late = Adversary(IDENT, SWARM, b"o" * 32, lambda: 1_000 * 60_000, lambda lin, wrong: rows, lambda: b"v" * 32, book)
    assert late.misround(due) == now - 1 and book.scheduled(due, now - 1) is False
