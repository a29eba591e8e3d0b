"""A coordinator's task set reaches another node over gossip: real `node.shell.runtime.Node`s attached to in-process
libp2p transports (their own gossip service and task-set handler). The node that trusts the coordinator
adds the set to its registry and its store; one that does not refuses it and counts the refusal."""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio

from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.node.config import Config, TrustSection
from murmur.node.shell.runtime import Node, RunOptions
from murmur.training.tasksets import TaskSetToml, manifest_from_toml, sign_task_set, task_set_id

SWARM = Config().node.swarm  # the swarm of the nodes below (the default config's)


def _signed_set(coordinator: Identity) -> bytes:
    t = msgspec.convert(
        {
            "name": "gossiped",
            "verifier": "exact",
            "created_ms": 1,
            "generators": [
                {"name": "first", "generator": "digits", "seed_end": 10**6, "config": {"length": 3, "ops": "first"}},
                {
                    "name": "first-eval",
                    "generator": "digits",
                    "seed_end": 10**6,
                    "config": {"length": 3, "ops": "last"},
                },
            ],
        },
        TaskSetToml,
    )
    return sign_task_set(coordinator, manifest_from_toml(t, "gossiped"), swarm=SWARM)


def test_a_task_set_reaches_a_trusting_node_over_gossip(tmp_path: Path) -> None:
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (71, 72, 73)]
    coord, trusting, other = ids
    env = _signed_set(coord)
    tid = task_set_id(env, swarm=SWARM)
    nodes = [
        Node(Config(), tmp_path / "coordinator", coord, RunOptions()),
        Node(
            Config(trust=TrustSection(coordinators=[coord.public.hex()])), tmp_path / "trusting", trusting, RunOptions()
        ),
        Node(Config(), tmp_path / "other", other, RunOptions()),
    ]
    nodes[0].store.add_task_set(tid, "gossiped", 1, coord.public, env)  # as `murmur tasks publish` stores it

    async def main() -> None:
        async with open_transport(coord) as a, open_transport(trusting) as b, open_transport(other) as c:
            async with trio.open_nursery() as n:
                for node, t in zip(nodes, (a, b, c)):
                    await node.attach(t)
                    await n.start(node.service.run)
                for t in (b, c):
                    await t.connect(a.listen_addrs()[0])
                topic = nodes[0].service.announce_topic
                with trio.fail_after(20):
                    while not (a.router.mesh.get(topic) and len(a.router.mesh[topic]) == 2):
                        await trio.sleep(0.05)
                await nodes[0].tasks.announce_own(nodes[0].service)
                assert tid in nodes[0].tasks.sent
                with trio.fail_after(20):
                    while tid not in nodes[1].registry or not nodes[2].drops.counts.get("task_set_refused"):
                        await trio.sleep(0.05)
                n.cancel_scope.cancel()

    try:
        trio.run(main)
        stored = {bytes(ts["task_set_id"]): ts for ts in nodes[1].store.task_sets()}
        assert tid in stored and bytes(stored[tid]["envelope"]) == env
        assert nodes[1].registry.get(tid).name == "gossiped"
        assert tid not in nodes[2].registry and tid not in {
            bytes(ts["task_set_id"]) for ts in nodes[2].store.task_sets()
        }
    finally:
        for node in nodes:
            if node.verifiers is not None:
                node.verifiers.close()
            node.store.close()
