"""Real py-libp2p nodes on 127.0.0.1 in one trio loop: delivery, adversary, restart, discovery."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from murmur.gossip import wire
from murmur.gossip.discovery import Discovery
from murmur.gossip.host import Libp2pTransport, open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.service import GossipService
from murmur.gossip.validation import Pipeline, PipelineConfig, Reason
from murmur.node.store import Store
from murmur.simulations.bench.gossip import SWARM, make_batch, registry, resign_with
from murmur.training.verifiers import score

REG = registry()
HEADS: dict[bytes, int] = {}


@dataclass
class Node:
    ident: Identity
    transport: Libp2pTransport
    pipeline: Pipeline
    service: GossipService
    store: Store
    discovery: Discovery


@asynccontextmanager
async def node(
    ident: Identity,
    home: Path,
    bootstrap: list[str] = (),
    dht: bool = False,
    listen: str | None = None,
    rate: float = 50.0,
    burst: int = 100,
):
    store = Store(home / f"{ident.peer_id[-8:]}.db")
    cfg = PipelineConfig(swarm=SWARM, rate_per_s=rate, burst=burst, max_staleness=4)
    pipeline = Pipeline(
        cfg,
        clock=time.time,
        resolve_task=REG.resolve,
        reward=score,
        head_version=HEADS.get,
        task_set_trusted=REG.__contains__,
    )
    try:
        async with open_transport(ident, [listen] if listen else None) as t, trio.open_nursery() as nursery:
            service = GossipService(t, pipeline, SWARM, store)
            await nursery.start(service.run)
            disc = Discovery(t, list(bootstrap), store, dht=dht, interval_s=0.2)
            await nursery.start(disc.run)
            yield Node(ident, t, pipeline, service, store, disc)
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def full_mesh(nodes: list[Node], timeout: float = 10.0) -> None:
    for i, a in enumerate(nodes):
        for b in nodes[:i]:
            await a.transport.connect(b.transport.listen_addrs()[0])
    topic = nodes[0].service.rollout_topic
    with trio.fail_after(timeout):
        while not all(len(n.transport.topic_peers(topic)) >= len(nodes) - 1 for n in nodes):
            await trio.sleep(0.05)


def accepted(n: Node) -> int:
    """Rollouts the node's ledger records as received and accepted."""
    return n.store.ledger_counts().get("accepted", 0)


def ids(n: int, base: int = 10) -> list[Identity]:
    return [Identity.from_seed(bytes([base + i]) * 32) for i in range(n)]


def test_five_nodes_every_batch_reaches_every_node_once(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(node(i, tmp_path)) for i in ids(5)]
            await full_mesh(nodes)
            sent = 0
            for seq in range(1, 4):
                for n in nodes:
                    await n.service.publish_rollouts(make_batch(n.ident, REG, seq, n=4, tokens=32))
                    sent += 1
            for n in nodes:  # every node receives every batch but its own
                await n.service.wait_for(lambda n=n: n.service.accepted_batches >= 12, timeout=30)
            # no batch may arrive twice: wait until every router's message cache has let go of the batches;
            # from then on no IHAVE can name them and no IWANT be answered with them
            topic = nodes[0].service.rollout_topic
            with trio.fail_after(30):
                while any(topic in m.topicIDs for n in nodes for m in n.transport.router.mcache.msgs.values()):
                    await trio.sleep(0.1)
            for n in nodes:
                assert n.service.accepted_batches == 12
                assert n.store.ledger_counts().get("accepted") == 12 * 4
                assert n.pipeline.counts[Reason.ACCEPTED.value] == 12

    trio.run(main)


def test_adversary_is_rejected_and_graylisted_while_honest_delivery_goes_on(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            honest = [await stack.enter_async_context(node(i, tmp_path, rate=1.0, burst=3)) for i in ids(4)]
            mallory_id = Identity.from_seed(b"\x66" * 32)
            other = Identity.from_seed(b"\x67" * 32)
            mal = await stack.enter_async_context(open_transport(mallory_id))
            await mal.subscribe(honest[0].service.rollout_topic)
            await full_mesh(honest)
            for h in honest:
                await mal.connect(h.transport.listen_addrs()[0])
            topic = honest[0].service.rollout_topic
            with trio.fail_after(10):
                while not all(mal.peer_id in h.transport.topic_peers(topic) for h in honest):
                    await trio.sleep(0.05)

            def mal_queued() -> int:
                return max((len(q) for q in mal.pubsub.peer_queues.values()), default=0)

            async def raw(data: bytes) -> None:  # bypasses our size checks, as an attacker would
                with trio.fail_after(10):  # py-libp2p drops silently past 32 queued RPCs: keep below
                    while mal_queued() > 8:
                        await trio.sleep(0.005)
                await mal._top_up_mesh(topic)
                await mal.pubsub.publish(topic, data)

            honest_sent = 0

            async def honest_traffic() -> None:
                nonlocal honest_sent
                for seq in range(1, 5):  # honest nodes stay under the 1/s limit
                    for h in honest:
                        await h.service.publish_rollouts(make_batch(h.ident, REG, seq, n=2, tokens=16))
                        honest_sent += 1
                    await trio.sleep(1.2)

            flood = [make_batch(mallory_id, REG, 1000 + i, n=1, tokens=8) for i in range(40)]
            alice_batch = make_batch(honest[0].ident, REG, 999, n=1, tokens=8)
            bad = {
                "garbage": b"\x00\xffnot a message" * 10,
                "oversized": b"\x01" * (600 * 1024),
                "stale": make_batch(mallory_id, REG, 1, version=1, lineage=b"\x5a" * 32),
                "unknown_task_set": make_batch(mallory_id, REG, 2, task_set=b"\xee" * 32),
                "replay_of_honest": alice_batch,
                "signed_by_another_key": make_batch(other, REG, 3),
                "forged_reward": make_batch(mallory_id, REG, 4, forge=True),
                "bad_signature": resign_with(mallory_id, honest[1].ident, make_batch(honest[1].ident, REG, 998)),
            }
            HEADS[b"\x5a" * 32] = 10  # that lineage's head: version 1 is stale (bound 4)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(honest_traffic)
                for data in bad.values():  # paced under the rate limit, so each is inspected
                    await raw(data)
                    await trio.sleep(1.05)
                t0 = trio.current_time()
                for data in flood:  # valid messages as fast as receivers take them (~10x the 1/s limit)
                    await raw(data)
                    await trio.sleep(0.01)
            flood_ids = {wire.content_id(d) for d in flood}
            bad_ids = {wire.content_id(d) for d in bad.values()}
            threshold = honest[0].pipeline.config.score.graylist_threshold
            with trio.move_on_after(60) as waited:  # all mallory sent is processed; every honest node graylists it
                while mal_queued() or not all(
                    h.pipeline.scores.score(mallory_id.peer_id, time.time()) < threshold for h in honest
                ):
                    await trio.sleep(0.05)
            assert not waited.cancelled_caught, (
                mal_queued(),
                [h.pipeline.per_peer.get(mallory_id.peer_id) for h in honest],
            )
            elapsed = trio.current_time() - t0  # receivers refill buckets over their processing time
            for h in honest:
                await h.service.wait_for(lambda h=h: h.service.accepted_batches >= 12, timeout=30)
            for h in honest:
                accepted = {
                    bytes(r[0]) for r in h.store.query("SELECT rollout_id FROM rollouts WHERE status='accepted'")
                }
                accepted_msgs = set(h.pipeline.seen._d)  # msg ids with ACCEPTED or a reason
                ok_msgs = {k for k, (_, v) in h.pipeline.seen._d.items() if v is Reason.ACCEPTED}
                assert not (ok_msgs & bad_ids), "an honest node accepted a bad message"
                assert len(ok_msgs & flood_ids) <= 3 + 1.0 * elapsed + 1, "rate limit not enforced"
                assert len(ok_msgs & flood_ids) < len(flood) / 2
                assert h.pipeline.counts[Reason.RATE_LIMITED.value] + h.pipeline.counts[Reason.GRAYLISTED.value] > 0
                s = h.pipeline.scores.score(mallory_id.peer_id, time.time())
                assert s < h.pipeline.config.score.graylist_threshold, (s, h.pipeline.per_peer.get(mallory_id.peer_id))
                if h.pipeline.scores.is_blacklisted(mallory_id.peer_id, time.time()):  # banned => disconnected
                    assert mallory_id.peer_id not in h.transport.peers()
                # honest delivery went on: every honest batch of the other 3 nodes arrived
                assert h.service.accepted_batches - len(ok_msgs & flood_ids) == 12
                assert accepted and accepted_msgs
            HEADS.clear()

    trio.run(main)


def test_restarted_node_rejoins_and_receives_again(tmp_path: Path) -> None:
    async def main() -> None:
        a_id, b_id, c_id = ids(3, base=40)
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(node(a_id, tmp_path))
            boot = a.transport.listen_addrs()
            b = await stack.enter_async_context(node(b_id, tmp_path, bootstrap=boot))
            topic = a.service.rollout_topic

            async def subscribed(x: Node, n: int) -> None:
                with trio.fail_after(15):
                    while len(x.transport.topic_peers(topic)) < n:
                        await trio.sleep(0.05)

            async with node(c_id, tmp_path, bootstrap=boot) as c:
                await subscribed(a, 2)
                await subscribed(c, 1)
                await a.service.publish_rollouts(make_batch(a_id, REG, 1, n=2, tokens=8))
                await c.service.wait_for(lambda: accepted(c) == 2, timeout=15)
            with trio.fail_after(10):  # c is gone, and a notices
                while c_id.peer_id in a.transport.peers():
                    await trio.sleep(0.05)
            async with node(c_id, tmp_path, bootstrap=boot) as c2:
                assert accepted(c2) == 2  # the ledger (signed batches kept) survives the restart
                await subscribed(a, 2)
                await a.service.publish_rollouts(make_batch(a_id, REG, 2, n=2, tokens=8))
                await b.service.publish_rollouts(make_batch(b_id, REG, 1, n=2, tokens=8))
                await c2.service.wait_for(lambda: accepted(c2) == 6, timeout=15)
                assert c2.pipeline.counts[Reason.ACCEPTED.value] == 2
            assert b.pipeline.counts[Reason.ACCEPTED.value] == 2

    trio.run(main)


def test_dht_discovers_peers_beyond_bootstrap(tmp_path: Path) -> None:
    async def main() -> None:
        a_id, b_id, c_id = ids(3, base=60)
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(node(a_id, tmp_path, dht=True))
            boot = a.transport.listen_addrs()
            await stack.enter_async_context(node(b_id, tmp_path, bootstrap=boot, dht=True))
            with trio.fail_after(10):
                while b_id.peer_id not in a.transport.peers():
                    await trio.sleep(0.05)
            c = await stack.enter_async_context(node(c_id, tmp_path, bootstrap=boot, dht=True))
            with trio.fail_after(30):  # c only knows a; it must find b through a's routing table
                while b_id.peer_id not in c.transport.peers():
                    await trio.sleep(0.1)
            with trio.fail_after(10):  # and records it in its peer table on its next round
                while not any(p["peer_id"] == b_id.peer_id and p["addrs"] for p in c.store.peers()):
                    await trio.sleep(0.1)

    trio.run(main)


def test_batches_accepted_before_a_restart_are_duplicates_after_it(tmp_path: Path) -> None:
    """Peers replay recent messages to a node that (re)joins: a batch it accepted before the restart
    must not be accepted (and trained on) a second time."""
    producer, receiver = ids(2, base=60)
    data = make_batch(producer, REG, 1, n=2, tokens=8)

    async def main() -> None:
        async with node(receiver, tmp_path) as r:
            assert r.pipeline.check(data, producer.peer_id).accepted
            r.store.record_rollouts(
                [
                    dict(
                        rollout_id=b"r%d" % i,
                        direction="received",
                        status="accepted",
                        producer=producer.public,
                        payload=data if i == 0 else None,
                    )
                    for i in range(2)
                ]
            )
        async with node(receiver, tmp_path) as r2:
            assert r2.pipeline.check(data, producer.peer_id).reason is Reason.DUPLICATE

    trio.run(main)
