"""The gossip service's order of checks for a rollout batch: the pipeline's cheap checks (size, rate,
decode, signature, ranges), then the exchange's gate (the newcomer budget shared per shard, the shard of
its lineages), then verification. Driven through `GossipService._validate_rollouts` on a settable clock."""

from __future__ import annotations

import trio

from murmur.gossip import exchange
from murmur.gossip.identity import Identity
from murmur.gossip.service import GossipService
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.simulations.bench.gossip import SWARM, make_batch, registry
from murmur.training.verifiers import score
from tests.samples import Clock

REG = registry()
HONEST = Identity.from_seed(b"\x51" * 32)
JUNK = Identity.from_seed(b"\x52" * 32)


def test_junk_refused_by_the_cheap_checks_does_not_spend_an_honest_newcomers_tokens() -> None:
    """A key that never announces sends 6 batches/s that the cheap checks refuse uncharged (signed long ago:
    `expired`); an honest newcomer's first 40 batches arrive during the flood's second 10 s. Were the
    shared newcomer token spent before decoding, the junk would drain the shard's bucket and drop about
    half of them; spent only on batches that passed the cheap checks, the junk takes none."""
    clock = Clock()
    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=clock,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=REG.__contains__,
    )
    service = GossipService(None, pipeline, SWARM)
    start = clock.t
    accepted, honest_seq, junk_seq = 0, 0, 0

    async def main() -> None:
        nonlocal accepted, honest_seq, junk_seq
        for tick in range(20 * 12):  # 20 s in steps of 1/12 s: junk every other step, the newcomer every third
            clock.t = start + tick / 12
            if tick % 2 == 0:
                junk_seq += 1
                old = int((clock.t - 2 * pipeline.config.replay_ttl_s) * 1000)
                data = make_batch(JUNK, REG, junk_seq, n=1, tokens=4, created_ms=old)
                assert not await service._validate_rollouts(0, JUNK.peer_id, JUNK.peer_id, data)
            if tick >= 10 * 12 and tick % 3 == 0:
                honest_seq += 1
                data = make_batch(HONEST, REG, honest_seq, n=2, tokens=8, created_ms=int(clock.t * 1000))
                accepted += await service._validate_rollouts(0, HONEST.peer_id, HONEST.peer_id, data)

    trio.run(main)
    assert honest_seq == 40 and accepted == 40, f"{accepted} of the newcomer's 40 first batches accepted"
    assert junk_seq == 120 and service.stats.dropped["expired"] == 120
    assert service.gate.counts["newcomer_budget"] == 0
    assert not service.gate.established(HONEST.peer_id, clock.t)  # it was a newcomer all along
    assert exchange.NEWCOMER_BURST < 120  # the junk alone would have emptied the shard's bucket


def test_only_a_peers_own_announce_sets_its_rate_and_ends_its_newcomer_time() -> None:
    """`BatchIntake.heard_announce`, which the live node and the simulator both call for every NodeAnnounce:
    the announce of HONEST signed by JUNK (a relay re-signing, or a forgery) changes neither HONEST's
    announced-rate bucket nor when it was first heard; HONEST's own announce sets both."""
    from murmur.gossip.intake import BatchIntake
    from tests.test_validation_rates import announce

    clock = Clock()
    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=clock,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=REG.__contains__,
    )
    intake = BatchIntake(pipeline)
    intake.heard_announce(JUNK.public, announce(HONEST, 50.0))
    assert pipeline.announced_rates.bucket(HONEST.peer_id) is None
    assert HONEST.peer_id not in intake.gate.first_heard
    intake.heard_announce(HONEST.public, announce(HONEST, 50.0))
    bucket = pipeline.announced_rates.bucket(HONEST.peer_id)
    assert bucket is not None and bucket.rate == pipeline.announced_rates.limits(50.0)[0]
    assert intake.gate.first_heard[HONEST.peer_id] == clock.t
    clock.t += exchange.ESTABLISHED_S
    assert intake.gate.established(HONEST.peer_id, clock.t)
