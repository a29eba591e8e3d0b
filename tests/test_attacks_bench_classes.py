"""What the issue-26 classes of `murmur bench attacks` put on the wire, checked without a live swarm.

Each class runs against a transport that keeps what it publishes (the live run is
tests/test_attacks_live.py); the messages are opened and checked to be the attack the class names:
valid signatures from the attacker's key (or, for a replay, the honest signer's), well-formed bodies,
honestly scored rewards.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from murmur.gossip import topics, wire
from murmur.gossip.identity import Identity
from murmur.gossip.validation import Pipeline, PipelineConfig, Reason
from murmur.simulations.bench import attacks
from murmur.sync.ids import lineage_id
from murmur.training import tokencheck
from murmur.training.schedule import ScheduleBook
from murmur.training.tasksets import TaskRegistry, builtin_manifest
from murmur.training.verifiers import score

SWARM = attacks.SWARM


class Recorder:
    """The publishing side of a transport: keeps every (topic, message) instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.sent.append((topic, data))


def _run(attack: Any, k: attacks.Knowledge, name: str) -> tuple[attacks.Attacker, list[tuple[str, Any, bytes]]]:
    t = Recorder()
    a = attacks.Attacker(t, attacks.attack_key(name), SWARM)
    trio.run(attack, a, k, [])
    opened = [(topic, *wire.open_envelope(data, swarm=SWARM), data) for topic, data in t.sent]
    return a, [(topic, body, data) for topic, _env, body, data in opened]


def _honest_knowledge() -> tuple[attacks.Knowledge, Identity]:
    """An honest trainer's traffic as the observer would have seen it: two announces (an old and a newer
    one), a manifest of its lineage and a batch of its rollouts."""
    honest = Identity.from_seed(b"\x11" * 32)
    h = attacks.Attacker(Recorder(), honest, SWARM)
    k = attacks.Knowledge(SWARM)
    k.take(attacks._announce(h, 1, gen_tokens_per_s=50.0))
    k.take(attacks._announce(h, 2, gen_tokens_per_s=500.0))
    lid = lineage_id(honest.public, b"\x00" * 32, "honest")
    k.take(attacks._manifest(h, lid, "honest", b"\x00" * 32, 3, 4))
    k.take(attacks._batch(h, [attacks._rollout_like(None, seed=1, version=4, lineage=lid)]))
    k.take(wire.seal(honest, wire.TASK_SET, builtin_manifest(honest.public), swarm=SWARM))
    return k, honest


def test_the_catalogue_holds_the_issue_26_classes() -> None:
    assert len(attacks.CATALOGUE) >= 32
    for name in (
        "claim_throughput",
        "lineage_by_announce",
        "long_completions",
        "large_batches",
        "held_frames",
        "idle_streams",
        "announce_replay",
        "taskset_takeover",
        "future_version",
        "poison_numbers",
        "payload_poison",
        "payload_unowned_lineage",
        "payload_foreign_tokenizer",
        "credit_farming",
        "supply_to_follower",
    ):
        assert name in attacks.CATALOGUE
    assert attacks.PROVABLE <= set(attacks.CATALOGUE)


def test_large_batches_are_full_honest_batches_within_the_envelope_limit() -> None:
    k, _ = _honest_knowledge()
    a, sent = _run(attacks.large_batches, k, "large_batches")
    batches = [(b, d) for _, b, d in sent if isinstance(b, wire.RolloutBatch)]
    assert batches and all(len(b.rollouts) == wire.MAX_ROLLOUTS_PER_BATCH for b, _ in batches)
    assert all(len(d) <= wire.MAX_ENVELOPE_BYTES for _, d in batches)
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    for b, _ in batches:
        assert bytes(b.producer) == a.ident.public
        assert all(r.reward == score(reg.resolve(r.task), r.text) for r in b.rollouts)
        assert all(not wire.rollout_number_fault(r) for r in b.rollouts)
    # the rate it announces covers what it sends (the ceiling is not what stops it)
    ann = [b for _, b, _ in sent if isinstance(b, wire.NodeAnnounce)]
    assert ann and ann[0].peer_id == a.ident.peer_id


def test_announce_replay_relays_an_honest_signers_older_announce_verbatim() -> None:
    k, honest = _honest_knowledge()
    old, new = k.first_announces[honest.peer_id][1], k.announces[honest.peer_id][1]
    assert old != new
    _, sent = _run(attacks.announce_replay, k, "announce_replay")
    assert (topics.announce(SWARM), old) in [(t, d) for t, _, d in sent]
    assert all(b.peer_id == honest.peer_id for _, b, _ in sent)  # every message is the honest signer's own


def test_taskset_takeover_names_every_seen_set_at_a_higher_version_under_our_key() -> None:
    k, honest = _honest_knowledge()
    a, sent = _run(attacks.taskset_takeover, k, "taskset_takeover")
    taken = [b for _, b, _ in sent if isinstance(b, wire.TaskSetManifest)]
    name = builtin_manifest().name
    assert taken and all(bytes(m.coordinator) == a.ident.public for m in taken)
    assert any(m.name == name and m.version > builtin_manifest().version for m in taken)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from murmur.training.tiny import ensure_tiny

    return ensure_tiny(tmp_path_factory.mktemp("model"), warmup_steps=0)


def test_payload_poison_sends_honestly_scored_groups_half_carrying_the_payload(tiny: Path) -> None:
    from murmur.training.tokenizer import load_tokenizer

    k, _ = _honest_knowledge()
    k.model = str(tiny)
    k.tokenizer_hash = attacks.model_tokenizer_hash(tiny) or k.tokenizer_hash
    _, sent = _run(attacks.payload_poison, k, "payload_poison")
    rs = [r for _, b, _ in sent if isinstance(b, wire.RolloutBatch) for r in b.rollouts]
    assert rs
    tok = load_tokenizer(tiny)
    check = tokencheck.for_model(str(tiny))
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    head = k.lineage().target_version
    carrying = [r for r in rs if r.text.startswith(attacks.PAYLOAD)]
    assert len(carrying) * 2 == len(rs)
    for r in rs:
        assert list(r.completion_ids) == list(tok(r.text, add_special_tokens=False)["input_ids"])
        assert r.reward == score(reg.resolve(r.task), r.text)  # honestly scored: not forged_reward
        assert r.version <= head and not wire.rollout_number_fault(r)
        assert (
            bytes(r.tokenizer_hash) == check.hash and check(r) is None
        )  # ids and text agree: its only fault is the claimed log-probs
    assert all(r.reward == 1.0 for r in carrying)  # the payload rides on correct answers


def test_the_template_rollout_moves_up_to_its_lineages_newest_version() -> None:
    """A forgery built on a follower's lagging rollout would be refused as stale before the check it
    attacks (a fast trainer moves several versions a second): the template takes the newest version
    its lineage's publisher was seen to publish, and no other lineage's, nor a hostile manifest's that
    names the lineage (those are relayed too, and a forgery at their head is refused as future)."""
    honest = Identity.from_seed(b"\x11" * 32)
    h = attacks.Attacker(Recorder(), honest, SWARM)
    k = attacks.Knowledge(SWARM)
    lid = lineage_id(honest.public, b"\x00" * 32, "honest")
    k.take(attacks._batch(h, [attacks._rollout_like(None, seed=1, version=4, lineage=lid)]))
    assert k.rollout().version == 4
    other = lineage_id(honest.public, b"\x00" * 32, "other")
    k.take(attacks._manifest(h, other, "other", b"\x00" * 32, 40, 41))
    assert k.rollout().version == 4
    k.take(attacks._manifest(h, lid, "honest", b"\x00" * 32, 11, 12))
    r = k.rollout()
    assert (r.version, list(r.token_versions), bytes(r.lineage)) == (12, [(0, 12)], lid)
    k.take(attacks._manifest(h, lid, "honest", b"\x00" * 32, 4, 5))  # an older manifest changes nothing
    assert k.rollout().version == 12
    mallory = attacks.Attacker(Recorder(), attacks.attack_key("freeze_manifest_head"), SWARM)
    k.take(attacks._manifest(mallory, lid, "honest", b"\x00" * 32, attacks.U64_MAX - 1, attacks.U64_MAX))
    assert k.rollout().version == 12 and k.head(lid) == 12


def _observed_trainer() -> tuple[attacks.Knowledge, Any, TaskRegistry, bytes]:
    """What an observer saw of an honest trainer: its manifest (head 12), a lagging rollout with the
    murmur-tiny tokenizer's ids, and a hostile manifest at a huge head; with the tokenizer check and the
    built-in task registry a receiver uses."""
    check = tokencheck.for_model("murmur-tiny")
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    honest = Identity.from_seed(b"\x11" * 32)
    h = attacks.Attacker(Recorder(), honest, SWARM)
    lid = lineage_id(honest.public, b"\x00" * 32, "honest")
    k = attacks.Knowledge(SWARM, model="murmur-tiny", tokenizer_hash=check.hash)
    k.take(attacks._manifest(h, lid, "honest", b"\x00" * 32, 11, 12))
    tpl = attacks._rollout_like(None, seed=1, version=7, lineage=lid)  # a follower's, five versions behind
    ids = attacks._encode(check, tpl.text)
    k.take(
        attacks._batch(
            h,
            [msgspec.structs.replace(tpl, completion_ids=ids, tokenizer_hash=check.hash, logprobs=bytes(4 * len(ids)))],
        )
    )
    mallory = attacks.Attacker(Recorder(), attacks.attack_key("freeze_manifest_head"), SWARM)
    k.take(attacks._manifest(mallory, lid, "honest", b"\x00" * 32, attacks.U64_MAX - 1, attacks.U64_MAX))
    return k, check, reg, lid


def _attack_batches(name: str, k: attacks.Knowledge) -> tuple[attacks.Attacker, list[bytes]]:
    t = Recorder()
    a = attacks.Attacker(t, attacks.attack_key(name), SWARM)
    trio.run(attacks.CATALOGUE[name], a, k, [], clock=trio.testing.MockClock(autojump_threshold=0))
    return a, [d for topic, d in t.sent if topic == topics.rollouts(SWARM)]


def _trainer_pipeline(check: Any, reg: TaskRegistry, lid: bytes) -> Pipeline:
    """The trainer's own pipeline: token check, built-in verifier, its lineage's published head (13)."""
    return Pipeline(
        PipelineConfig(swarm=SWARM, max_completion_tokens=16),
        clock=time.time,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda lin: 13 if bytes(lin) == lid else None,
        own_lineage=lambda lin: bytes(lin) == lid,
        check_tokens=check,
        task_set_trusted=reg.__contains__,
        schedule=ScheduleBook.of(reg),
    )


@pytest.mark.parametrize("name", sorted(attacks.FAULTS))
def test_each_forging_class_is_refused_for_the_fault_it_commits(name: str) -> None:
    """Each rollout-forging class, built from what an observer saw of an honest trainer, meets the
    trainer's own pipeline and is charged for the fault it is named after, not refused earlier for
    another reason (stale, future, ids outside the vocabulary), whichever of its batches arrives first."""
    k, check, reg, lid = _observed_trainer()
    a, batches = _attack_batches(name, k)
    assert batches
    for data in batches:  # each batch, met first (a banned key's later batches are refused unread)
        p = _trainer_pipeline(check, reg, lid)
        v = p.check(data, a.ident.peer_id)
        assert v.reason.value == attacks.FAULTS[name], (v.reason, v.detail)
        assert p.scores.score(a.ident.peer_id, time.time()) < 0


@pytest.mark.parametrize("name", ["starve_verifier", "large_batches"])
def test_the_verification_work_classes_send_batches_verified_in_full(name: str) -> None:
    """The classes that attack verification's cost send full batches nothing refuses cheaply: through the
    trainer's own pipeline every batch passes the token check and the verifier and is accepted, or meets
    the key's rate limit, so only the rate limit and the CPU budget stand between them and a node's cores."""
    k, check, reg, lid = _observed_trainer()
    a, batches = _attack_batches(name, k)
    assert len(batches) >= 4
    p = _trainer_pipeline(check, reg, lid)
    accepted = 0
    for data in batches:
        v = p.check(data, a.ident.peer_id)
        assert v.reason in (Reason.ACCEPTED, Reason.RATE_LIMITED), (v.reason, v.detail)
        if v.reason is Reason.ACCEPTED:
            accepted += 1
            assert len(v.batch.rollouts) == wire.MAX_ROLLOUTS_PER_BATCH
            assert len({(r.task.generator, r.task.seed) for r in v.batch.rollouts}) == wire.MAX_ROLLOUTS_PER_BATCH
    assert accepted >= min(len(batches), p.config.burst)  # an unannounced key's burst, or the announced rate's


def test_a_first_round_class_redials_a_target_whose_connection_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-libp2p now and then closes a new connection while it starts. A first-round class (a fresh key,
    which no defence refuses) redials, so it attacks its target instead of publishing to nobody (its
    `sent` would count either way)."""
    from murmur.gossip.host import open_transport

    real, calls = attacks._connect_all, []

    async def first_fails(t: Any, addrs: list[str], timeout_s: float = 5.0) -> None:
        calls.append(list(addrs))
        if len(calls) > 1:
            await real(t, addrs, timeout_s)

    monkeypatch.setattr(attacks, "_connect_all", first_fails)

    async def main() -> None:
        async with open_transport(Identity.from_seed(b"\x21" * 32)) as target:
            announces = await target.subscribe(topics.announce(SWARM))
            await target.subscribe(topics.rollouts(SWARM))
            addr = f"{target.listen_addrs()[0].split('/p2p/')[0]}/p2p/{target.peer_id}"
            res: dict[str, Any] = {}
            with trio.fail_after(60):
                await attacks.run_one("crash_step_time", attacks.Knowledge(SWARM), [addr], SWARM, res, settle_s=0.1)
                _, data = await announces.receive()
            _, body = wire.open_envelope(data, swarm=SWARM)
            assert body.peer_id == attacks.attack_key("crash_step_time").peer_id
            assert len(calls) >= 2 and res["phase"] == "done" and res["sent"] == 1

    trio.run(main)


@pytest.mark.parametrize("name", ["payload_unowned_lineage", "payload_foreign_tokenizer", "credit_farming"])
def test_the_unusable_work_classes_are_accepted_by_validation_and_earn_nothing_downstream(name: str) -> None:
    """Issue 43's classes send valid, honestly scored batches: validation accepts them (the attack is not
    refused before the rule it targets), and what a trainer learns or credits from them is nothing: the
    payload classes name a lineage no one publishes (the sampler drops it as unowned), credit farming's
    rollouts are one-rollout groups or under a tokenizer no receiver holds (no creditable rollout)."""
    from murmur.node.core.events import RolloutsVerified
    from murmur.training.sampler import Sampler

    k, check, reg, lid = _observed_trainer()
    a, batches = _attack_batches(name, k)
    assert batches
    p = _trainer_pipeline(check, reg, lid)
    s = Sampler(own=lid)
    s.observe_head(lid, 13)
    for data in batches:
        v = p.check(data, a.ident.peer_id)
        assert v.reason in (Reason.ACCEPTED, Reason.RATE_LIMITED), (v.reason, v.detail)
        if v.reason is Reason.ACCEPTED:
            assert not [u for u in RolloutsVerified.of(v.batch).usable if u[0] == lid and u[1] == check.hash]
            s.add_rollouts(v.batch.rollouts, bytes(v.batch.producer))
    if name.startswith("payload"):  # informative groups, every one dropped for its lineage
        assert s.counts["added"] > 0 and s.take(64) == [] and s.counts["unowned"] == s.counts["added"]
        sent = [r for data in batches for r in wire.open_envelope(data, swarm=SWARM)[1].rollouts]
        assert all(r.reward == float(r.text.startswith(attacks.PAYLOAD)) for r in sent)


def test_sybil_announces_are_authored_each_by_a_fresh_key_and_meet_the_new_key_rate() -> None:
    """The live class for state that strangers grow: every announce is signed, as envelope and as pubsub
    message author, by a key of its own, near the announce size limit; relayed through one host to a
    receiver, at most the node-wide new-key burst and rate of them pass (the in-process version)."""
    from murmur.gossip.identity import peer_id_from_public
    from murmur.gossip.ratelimit import NEW_KEYS_BURST, NEW_KEYS_PER_S
    from murmur.gossip.service import GossipService

    class AuthoredRecorder(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.authors: list[str] = []

        async def publish_as(self, ident: Identity, topic: str, data: bytes) -> None:
            self.sent.append((topic, data))
            self.authors.append(ident.peer_id)

    t = AuthoredRecorder()
    a = attacks.Attacker(t, attacks.attack_key("sybil_announces"), SWARM)
    trio.run(
        attacks.sybil_announces, a, attacks.Knowledge(SWARM), [], clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert a.sent == len(t.sent) == attacks.SYBIL_KEYS and "sybil_announces" in attacks.FIRST_TARGET_ONLY
    signers = []
    for (topic, data), author in zip(t.sent, t.authors):
        env, body = wire.open_envelope(data, swarm=SWARM)
        assert topic == topics.announce(SWARM) and isinstance(body, wire.NodeAnnounce)
        assert peer_id_from_public(env.signer) == body.peer_id == author
        assert 12 * 1024 < len(data) <= wire.KIND_LIMITS[wire.NODE_ANNOUNCE]
        signers.append(author)
    assert len(set(signers)) == attacks.SYBIL_KEYS and a.ident.peer_id not in signers
    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=time.time,
        resolve_task=None,
        reward=score,
        head_version=lambda lineage: 0,
    )
    service = GossipService(None, pipeline, SWARM)

    async def relayed() -> tuple[int, float]:
        t0 = time.monotonic()
        n = sum([await service._validate_announce(a.ident.peer_id, o, d) for (_, d), o in zip(t.sent, signers)])
        return n, time.monotonic() - t0

    admitted, elapsed = trio.run(relayed)
    assert admitted <= NEW_KEYS_BURST + NEW_KEYS_PER_S * elapsed
    assert service.stats.dropped["announce_new_key_rate"] == attacks.SYBIL_KEYS - admitted
