"""The external-rollout sampler (training/sampler.py): intake, staleness, the take rule, bounds; plain calls."""

from __future__ import annotations

import msgspec
import pytest

from murmur.gossip import wire
from murmur.training import sampler as sampling
from murmur.training.sampler import Sampler, split
from tests import samples

LIN_A, LIN_B = b"\x0a" * 32, b"\x0b" * 32


def group(
    seed: int, rewards: tuple[float, ...] = (1.0, 0.0), lineage: bytes = LIN_A, version: int = 3, generator: str = "add"
) -> list[wire.Rollout]:
    r = samples.rollout(seed=seed)
    return [
        msgspec.structs.replace(
            r, lineage=lineage, version=version, reward=x, task=msgspec.structs.replace(r.task, generator=generator)
        )
        for x in rewards
    ]


def sampler(**kw: object) -> Sampler:
    """A trainer's sampler whose own lineage is LIN_A and which knows LIN_B publishes (heads at 0)."""
    s = Sampler(**{"own": LIN_A, **kw})  # type: ignore[arg-type]  # the keywords are Sampler's own
    s.observe_head(LIN_A, 0)
    s.observe_head(LIN_B, 0)
    return s


def seeds(groups: list[sampling.Group]) -> list[int]:
    return [g.key[2] for g in groups]


def test_split_keeps_informative_groups_per_task_and_lineage() -> None:
    batch = (
        group(1)
        + group(2, (1.0, 1.0, 1.0))
        + group(3, (0.0,))
        + group(4, lineage=LIN_A)
        + group(4, lineage=LIN_B)
        + group(5, generator="sub")
    )
    got, dropped = split(batch)
    assert dropped == {"too_small": 1, "uninformative": 1}
    assert [(g.key[1], g.key[2], g.lineage) for g in got] == [
        ("add", 1, LIN_A),
        ("add", 4, LIN_A),
        ("add", 4, LIN_B),
        ("sub", 5, LIN_A),
    ]
    assert all(len(g.rollouts) == 2 for g in got)
    mixed, _ = split(group(6, version=7)[:1] + group(6, version=5)[1:])
    assert mixed[0].version == 5  # a group is as old as its oldest rollout


def test_take_each_group_once_in_arrival_order() -> None:
    s = sampler(max_groups=16)
    for k in range(6):
        assert s.add_rollouts(group(k)) == 1
    first = seeds(s.take(4))
    assert first == sorted(first) and len(set(first)) == 4  # arrival order
    rest = seeds(s.take(4))
    assert sorted(first + rest) == list(range(6))  # what is left; nothing is handed out twice
    assert s.take(4) == [] and len(s) == 0
    assert s.counts["taken"] == 6 and s.counts["added"] == 6
    assert s.take(0) == []


def test_take_is_a_uniform_seeded_draw_not_the_newest() -> None:
    """Newest-first made every trainer of a round-robin swarm learn from the same few predecessors: each
    fresh group must be as likely to be drawn as any other, reproducibly for a seed."""
    hits = [0] * 8
    for trial in range(400):
        s = sampler(seed=trial)
        for k in range(8):
            s.add_rollouts(group(k))
        for k in seeds(s.take(2)):
            hits[k] += 1
    assert sum(hits) == 800
    assert min(hits) >= 70 and max(hits) <= 130  # 100 each expected; newest-first gave [0]*6 + [400, 400]

    def draw(seed: int) -> list[int]:
        s = sampler(seed=seed)
        for k in range(8):
            s.add_rollouts(group(k))
        return seeds(s.take(3))

    assert draw(5) == draw(5)
    assert len({tuple(draw(x)) for x in range(10)}) > 1


def test_uninformative_groups_never_reach_the_trainer() -> None:
    s = sampler()
    s.add_rollouts(group(1, (0.0, 0.0)) + group(2, (1.0, 1.0)) + group(3, (0.0,)))
    assert len(s) == 0 and s.take(4) == []
    assert s.counts["uninformative"] == 2 and s.counts["too_small"] == 1


def test_staleness_against_reported_heads() -> None:
    s = Sampler(max_staleness=4, own=LIN_A)
    s.add_rollouts(group(1, version=3) + group(2, version=5, lineage=LIN_B))
    s.add_rollouts(group(3, version=6))
    s.observe_head(LIN_A, 8)  # LIN_A's publisher announced version 8: version 3 is 5 behind
    s.observe_head(LIN_A, 2)  # an older announcement never lowers the head
    assert s.head(LIN_A) == 8 and s.head(LIN_B) is None
    got = s.take(4)
    assert seeds(got) == [3]  # LIN_B has no reported head: no one publishes it, so it is not trained on
    assert s.counts["stale"] == 1 and s.counts["unowned"] == 1 and len(s) == 0
    s.add_rollouts(group(5, version=3) + group(6, version=8))
    s.take(1)
    assert s.counts["stale"] == 2 and len(s) == 0  # a stale group goes even when a fresh one fills the take
    s.add_rollouts(group(4, version=4))
    assert seeds(s.take(1)) == [4]  # exactly max_staleness behind is still usable


def test_a_claimed_version_does_not_age_other_groups_out() -> None:
    """Attack: a peer claims a far-future version for an honest lineage, hoping to make its groups stale."""
    s = Sampler(max_staleness=4, own=LIN_A)
    s.observe_head(LIN_A, 3)
    s.add_rollouts(group(1, version=3))
    s.add_rollouts(group(2, version=2**40))  # verified (the reward is real), but its publisher never signed it
    assert s.head(LIN_A) == 3
    assert seeds(s.take(4)) == [1, 2] and s.counts["stale"] == 0


def test_pool_is_bounded_oldest_evicted_and_heads_table_too() -> None:
    s = sampler(max_groups=3)
    for k in range(5):
        s.add_rollouts(group(k))
    assert len(s) == 3 and s.counts["evicted"] == 2
    assert seeds(s.take(10)) == [2, 3, 4]  # the oldest went when the pool was full
    for k in range(sampling.MAX_HEADS + 10):
        s.observe_head(k.to_bytes(32, "big"), k)
    assert len(s._heads) == sampling.MAX_HEADS
    assert s.head((0).to_bytes(32, "big")) is None  # least recently reported forgotten first
    with pytest.raises(ValueError):
        sampler(max_groups=0)
    with pytest.raises(ValueError):
        sampler(max_staleness=-1)


def test_groups_are_shareable_between_receivers() -> None:
    """The simulator splits a message once and hands the same Groups to every receiver: none can change one."""
    groups, _ = split(group(1) + group(2))
    with pytest.raises(AttributeError):
        groups[0].version = 0  # type: ignore[misc]
    a, b = sampler(), sampler()
    a.add(groups)
    b.add(groups)
    assert len(a.take(1)) == 1 and len(a) == 1
    assert seeds(b.take(4)) == [1, 2]  # a's take did not touch b's pool


def test_take_rollouts_is_the_trainer_hook_shape() -> None:
    s = sampler()
    s.add_rollouts(group(1) + group(2, (0.0, 1.0, 1.0)))
    s.add_rollouts(group(3), producer=b"\x07" * 32)
    out = s.take_rollouts(4, 0)
    assert [(x.rollout.task.seed, x.rollout.reward) for x in out][:5] == [
        (1, 1.0),
        (1, 0.0),
        (2, 0.0),
        (2, 1.0),
        (2, 1.0),
    ]
    # each rollout comes with the key that signed its batch (b"": added without one)
    assert {(x.rollout.task.seed, x.producer) for x in out} == {(1, b""), (2, b""), (3, b"\x07" * 32)}


def test_the_worker_and_the_swarm_benchmark_share_this_sampler() -> None:
    from murmur.node.worker import main as worker
    from murmur.simulations.bench import swarm as bench_swarm

    assert worker.Sampler is Sampler and bench_swarm.Sampler is Sampler


def test_the_worker_refuses_an_external_batch_the_network_process_would_refuse(tmp_path) -> None:
    """The network process verifies a batch's signature before sending it to the worker (gossip/validation.py,
    the authoritative check: `wire.verify_envelope`); the worker opens it in full again, as defence in depth:
    a batch whose signature the first refuses is refused by the second and nothing of it is taken."""
    from murmur.gossip.errors import DecodeError
    from murmur.gossip.identity import Identity
    from murmur.node.worker import main as worker

    w = worker.Worker(None, {"home": str(tmp_path), "swarm": "t"})
    ident = Identity.generate()
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm="t", producer=ident.public, seq=1, created_ms=1, rollouts=group(1, lineage=LIN_B)
    )
    data = wire.seal(ident, wire.ROLLOUT_BATCH, batch, swarm="t")
    forged = bytearray(data)
    forged[-5] ^= 0xFF  # in the signature
    with pytest.raises(DecodeError, match="signature"):
        wire.verify_envelope(wire.decode_envelope(bytes(forged), wire.ROLLOUT_BATCH, swarm="t"))
    assert not worker.take_external(w.inbox, bytes(forged))
    assert not w.inbox.spot and not w.inbox.accepted and w.inbox.sampler.counts["added"] == 0
    assert worker.take_external(w.inbox, data)
    assert len(w.inbox.spot) == 1 and w.inbox.sampler.counts["added"] == 1


def test_worker_feeds_verified_batches_to_the_sampler_and_the_trainer_takes_them(tmp_path) -> None:
    """The worker's real reader thread on a real pipe; the trainer hook then takes from the same sampler."""
    import multiprocessing
    import threading
    import time

    from murmur.gossip.identity import Identity
    from murmur.node import pipe
    from murmur.node.worker import main as worker

    net, end = multiprocessing.Pipe()
    w = worker.Worker(end, {"home": str(tmp_path), "swarm": "t", "trainer": {"max_staleness": 4}})
    reader = threading.Thread(target=worker._reader, args=(end, w.inbox), daemon=True)
    reader.start()
    ident = Identity.generate()
    own = b"\x0c" * 32
    rollouts = group(1, lineage=own, version=1) + group(2, lineage=LIN_B) + group(3, (0.0, 0.0))
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm="t", producer=ident.public, seq=1, created_ms=1, rollouts=rollouts
    )
    net.send_bytes(pipe.encode_struct(pipe.External(wire.seal(ident, wire.ROLLOUT_BATCH, batch, swarm="t"))))
    net.send_bytes(pipe.encode_struct(pipe.External(b"not an envelope")))
    net.send_bytes(b"not a pipe message")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with w.inbox.lock:
            if w.inbox.sampler.counts["added"] + w.inbox.sampler.counts["uninformative"] >= 3:
                break
        time.sleep(0.01)
    w._observe_own_head(own, 9)  # our own lineage moved on: its version-1 group is beyond the bound
    net.send_bytes(pipe.encode_struct(pipe.Head(LIN_B.hex(), 3)))  # LIN_B publishes: its head reaches the sampler
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and w.inbox.sampler.head(LIN_B) is None:
        time.sleep(0.01)
    got = [x.rollout for x in w._external(4, 5)]
    assert {(r.task.seed, bytes(r.lineage)) for r in got} == {(2, LIN_B)}
    assert w.inbox.sampler.counts == {
        "added": 2,
        "too_small": 0,
        "uninformative": 1,
        "evicted": 0,
        "stale": 1,
        "over_budget": 0,
        "unowned": 0,
        "taken": 1,
        "producer_share": 0,
        "producer_failed": 0,
    }
    net.send_bytes(pipe.encode_struct(pipe.Stop()))
    reader.join(5)
    assert not reader.is_alive()


def test_rollout_budget_holds_whatever_group_sizes_peers_send() -> None:
    """Attack: a peer sends batches of one 64-completion group each to fill a trainer's memory."""
    s = sampler(max_groups=1000, max_rollouts=100)
    for k in range(10):
        s.add_rollouts(group(k, rewards=(1.0, 0.0) * 32))
        assert s._rollouts <= 100
    assert len(s) == 1 and s.counts["evicted"] == 9
    s.add_rollouts(group(20) + group(21, (0.0, 1.0, 1.0)))
    assert s._rollouts == 64 + 5
    took = s.take(1)[0]
    assert s._rollouts == 64 + 5 - len(took.rollouts) == sum(len(g.rollouts) for g in s._pool)
    with pytest.raises(ValueError):
        sampler(max_rollouts=1)


def test_a_steps_external_work_is_bounded_in_tokens_not_only_groups() -> None:
    """Attack (issue 26): groups of 64 long completions make one external group cost a trainer many honest
    groups' work. `take` stays within a token budget: a group larger than the whole budget is dropped and
    counted, one that does not fit this step waits for the next."""
    s = sampler()
    s.add_rollouts(group(1) + group(2))  # 2 rollouts x 8 tokens each
    s.add_rollouts(group(9, rewards=(1.0, 0.0) * 32))  # 64 x 8 = 512 tokens, the newest
    picked = s.take(4, max_tokens=4 * 2 * 8)
    assert seeds(picked) == [1, 2] and s.counts["over_budget"] == 1 and len(s) == 0
    s.add_rollouts(group(3) + group(4) + group(5))
    first = seeds(s.take(4, max_tokens=2 * 2 * 8))  # room for two of the three
    assert len(first) == 2 and len(s) == 1
    assert sorted(first + seeds(s.take(4, max_tokens=32))) == [3, 4, 5]
    assert s.take_rollouts(4, 0, max_tokens=32) == [] and s.counts["over_budget"] == 1


def test_the_worker_bounds_a_steps_external_tokens_by_its_own_shape(tmp_path) -> None:
    """The trainer hook takes at most J groups' worth of its own group size and max_new_tokens."""
    from murmur.node.worker import main as worker

    end = object()
    w = worker.Worker(
        end,
        {"home": str(tmp_path), "swarm": "t", "trainer": {"max_staleness": 4, "group_size": 2, "max_new_tokens": 8}},
    )
    w.inbox.sampler.add_rollouts(group(1) + group(2) + group(9, rewards=(1.0, 0.0) * 32) + group(3))
    w._observe_own_head(LIN_A, 0)
    got = [x.rollout for x in w._external(4, 0)]
    assert {r.task.seed for r in got} == {1, 2, 3} and len(got) == 6
    assert w.inbox.sampler.counts["over_budget"] == 1


def test_the_configurable_bounds_accept_their_extremes() -> None:
    """max_groups up to MAX_GROUPS_LIMIT, a rollout budget of one two-rollout group, no staleness allowed."""
    assert sampler(max_groups=sampling.MAX_GROUPS_LIMIT).max_groups == 1 << 20
    one = sampler(max_groups=1)
    one.add_rollouts(group(1) + group(2))
    assert seeds(one.take(4)) == [2]
    with pytest.raises(ValueError):
        sampler(max_groups=sampling.MAX_GROUPS_LIMIT + 1)
    tight = sampler(max_rollouts=2)
    tight.add_rollouts(group(1) + group(2))
    assert seeds(tight.take(4)) == [2] and tight.counts["evicted"] == 1
    fresh_only = sampler(max_staleness=0)
    fresh_only.add_rollouts(group(1, version=3) + group(2, version=4))
    fresh_only.observe_head(LIN_A, 4)
    assert seeds(fresh_only.take(4)) == [2] and fresh_only.counts["stale"] == 1


def test_the_default_pool_holds_256_groups_up_to_4_versions_behind() -> None:
    s = sampler()
    for k in range(257):
        s.add_rollouts(group(k, version=k % 2))
    assert len(s) == 256 and s.counts["evicted"] == 1
    s.observe_head(LIN_A, 5)  # version 1 is 4 behind: usable; version 0 is 5 behind: stale
    assert seeds(s.take(300)) == list(range(1, 257, 2)) and s.counts["stale"] == 128


def test_taking_no_groups_leaves_the_pool_as_it_is() -> None:
    s = sampler(max_staleness=0)
    s.add_rollouts(group(1, version=0) + group(2, version=1))
    s.observe_head(LIN_A, 1)
    assert s.take(0) == [] and s.take(-1) == [] and s.take_rollouts(-3) == []
    assert len(s) == 2 and s.counts["stale"] == 0 and s.counts["taken"] == 0


def test_a_token_budget_takes_exactly_the_groups_asked_for_and_a_group_that_fills_it() -> None:
    s = sampler(max_groups=1000)
    for k in range(400):
        s.add_rollouts(group(k))
    assert len(s.take(300, max_tokens=10**6)) == 300 and len(s) == 100
    assert len(s.take(1, max_tokens=2 * 8)) == 1 and s.counts["over_budget"] == 0  # 2 rollouts x 8 tokens


def test_groups_of_a_lineage_no_one_publishes_are_never_taken() -> None:
    """Attack (issue 43): reward-correct rollouts under a made-up lineage. No publisher signs its
    versions, so no head is ever reported and its groups would never age out: they are dropped, counted,
    and the trainer learns from none of them, however long they wait."""
    s = Sampler(own=LIN_A)
    s.observe_head(LIN_A, 0)
    made_up = b"\x0d" * 32
    for k in range(6):
        s.add_rollouts(group(k, lineage=made_up), producer=b"p")
    s.add_rollouts(group(9))
    assert seeds(s.take(4)) == [9]
    assert s.counts["unowned"] == 6 and len(s) == 0
    s.observe_head(made_up, 0)  # once its publisher is proven and publishes, its groups count like any
    s.add_rollouts(group(10, lineage=made_up), producer=b"p")
    assert seeds(s.take(4)) == [10]


def test_one_producer_fills_at_most_half_of_a_steps_groups_of_other_lineages() -> None:
    """Attack (issue 43): one key floods the pool with groups of another lineage, whose weights no receiver
    can re-score, to own every external group of a step. It gets `producer_cap(J)` of them; the rest waits
    (counted) while other producers' and the trainer's own lineage's groups fill the step."""
    assert [sampling.producer_cap(j) for j in (1, 2, 3, 4, 8)] == [1, 1, 1, 2, 4]
    s = sampler(seed=3)
    for k in range(20):
        s.add_rollouts(group(k, lineage=LIN_B), producer=b"flood")
    s.add_rollouts(group(50, lineage=LIN_B), producer=b"honest")
    s.add_rollouts(group(60), producer=b"follower")  # our own lineage: checkable, never capped
    for _ in range(3):
        got = s.take(4)
        by = [g.producer for g in got]
        assert by.count(b"flood") <= 2
    assert s.counts["producer_share"] > 0
    own = sampler()
    for k in range(8):
        own.add_rollouts(group(k), producer=b"follower")  # a pod's one follower may fill every slot
    assert len(own.take(4)) == 4 and own.counts["producer_share"] == 0


def test_a_producer_that_failed_a_check_leaves_nothing_in_the_pool() -> None:
    """A failed log-prob check drops every group that producer pooled: what the check found in one rollout
    is as likely in its others, and they were never checked."""
    s = sampler()
    for k in range(4):
        s.add_rollouts(group(k), producer=b"liar")
    s.add_rollouts(group(9), producer=b"honest")
    assert s.drop_producer(b"liar") == 4 and s.counts["producer_failed"] == 4
    assert seeds(s.take(8)) == [9] and s._rollouts == 0
    assert s.drop_producer(b"nobody") == 0
