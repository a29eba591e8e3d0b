"""The rollout exchange on real py-libp2p hosts: shard topics joined and left, the gate, multi-topic messages."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from murmur.gossip import exchange, topics
from murmur.gossip.host import open_transport
from murmur.gossip.transport import PublishError
from murmur.simulations.bench.gossip import SWARM, make_batch
from tests.test_gossip_swarm import REG, full_mesh, ids, node


def lineage_where(pred) -> bytes:
    for i in range(10_000):
        lid = hashlib.blake2b(b"L%d" % i, digest_size=32).digest()
        if pred(lid):
            return lid
    raise AssertionError("no lineage found")


ON_1 = lineage_where(lambda lid: exchange.shard_of(lid, 2) == 1)  # shard 1 of 2
NOT_ON_1 = lineage_where(lambda lid: not exchange.on_shard(lid, 1, 2))


async def until(pred, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.05)


def test_shards_are_joined_and_left_and_a_batch_off_its_shard_is_dropped(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = [await stack.enter_async_context(node(i, tmp_path)) for i in ids(2, base=40)]
            await full_mesh([a, b])
            t1 = topics.rollouts(SWARM, 1)
            for n in (a, b):
                await n.service.set_shards(2, (0, 1))
            await until(lambda: a.ident.peer_id in b.transport.topic_peers(t1))
            await b.service.publish_rollouts(make_batch(b.ident, REG, 1, n=2, tokens=8, lineage=ON_1), 1)
            await until(lambda: a.service.stats.counts["verified_batches"] == 1)
            await b.service.publish_rollouts(make_batch(b.ident, REG, 2, n=2, tokens=8, lineage=NOT_ON_1), 1)
            await until(lambda: a.service.stats.dropped["wrong_shard"] == 1)
            assert a.service.stats.counts["verified_batches"] == 1
            assert a.pipeline.scores.score(b.ident.peer_id, a.pipeline.clock()) >= 0  # not charged: views differ
            # a leaves shard 1: b has nobody to send shard 1 to, and a receives nothing more
            await a.service.set_shards(2, (0,))
            assert a.service.subscribed_shards == (0,)
            await until(lambda: a.ident.peer_id not in b.transport.topic_peers(t1))
            received = a.service.stats.counts["received_batches"]
            with pytest.raises(PublishError):
                await b.service.publish_rollouts(make_batch(b.ident, REG, 3, n=2, tokens=8, lineage=ON_1), 1)
            # shard 0 still flows (a marker that what was sent before has arrived)
            await b.service.publish_rollouts(make_batch(b.ident, REG, 4, n=2, tokens=8, lineage=NOT_ON_1), 0)
            await until(lambda: a.service.stats.counts["verified_batches"] == 2)
            assert a.service.stats.counts["received_batches"] == received + 1
            for n in (a, b):
                await n.service.transport.disconnect(a.ident.peer_id if n is b else b.ident.peer_id)

    trio.run(main)


def test_a_message_on_several_topics_is_refused_and_charged_to_its_originator(tmp_path: Path) -> None:
    """One signed pubsub message naming every shard would reach every shard's subscribers."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            (a,) = [await stack.enter_async_context(node(i, tmp_path)) for i in ids(1, base=50)]
            mal_id = ids(1, base=60)[0]
            mal = await stack.enter_async_context(open_transport(mal_id))
            await a.service.set_shards(1, (0, 1))
            await mal.connect(a.transport.listen_addrs()[0])
            both = [topics.rollouts(SWARM, 0), topics.rollouts(SWARM, 1)]
            for t in both:
                await mal.subscribe(t)
            await until(lambda: all(a.ident.peer_id in mal.topic_peers(t) for t in both))
            data = make_batch(mal_id, REG, 1, n=2, tokens=8, lineage=ON_1)  # valid on shard 0 and 1 alike
            await mal.pubsub.publish(both, data)
            await until(lambda: a.service.stats.dropped["multi_topic"] >= 1)
            assert a.service.stats.counts["verified_batches"] == 0
            assert a.pipeline.scores.score(mal_id.peer_id, a.pipeline.clock()) < 0
            # the same batch on one topic is fine: the refusal was for the topic list, not the content
            await mal.pubsub.publish(both[0], make_batch(mal_id, REG, 2, n=2, tokens=8, lineage=ON_1))
            await until(lambda: a.service.stats.counts["verified_batches"] == 1)

    trio.run(main)
