"""The virtual simulator's network model (`simulations/vnet.py`) on tiny swarms: who a batch reaches, how
often, and what the shard meshes and the connection graph look like."""

from __future__ import annotations

import heapq
import random
from collections import Counter

from murmur.gossip.intake import BatchIntake
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.simulations import scenario as S
from murmur.simulations.vevents import AnnounceArrives, BatchArrives, EventQueue
from murmur.simulations.vnet import MESH_D, MESH_D_HIGH, Network
from murmur.simulations.vnode import VNode, identity_for

DATA = b"a batch" * 100


def swarm(text: str, seed: int = 0) -> tuple[Network, list[VNode], EventQueue]:
    sc = S.loads(text)
    nodes = []
    for s in S.expand(sc):
        ident = identity_for(sc.seed, s.index)
        nodes.append(VNode(s, ident, ident.peer_id, bytes([s.index]) * 32, 0.5, 0.5, random.Random(s.index)))
    queue = EventQueue()
    net = Network(sc, nodes, queue, random.Random(seed), Counter(), None, memo_horizon_s=5.0)
    for n in nodes:
        n.alive = True
        # the shard count it believes lives in its intake; no batch is validated here
        n.intake = BatchIntake(
            Pipeline(
                PipelineConfig(swarm=sc.swarm),
                clock=queue.unix,
                resolve_task=None,  # type: ignore[arg-type]
                reward=None,
                head_version=lambda lineage: None,
            )
        )  # type: ignore[arg-type]
    return net, nodes, queue


def nodes_text(count: int, degree: int = 8) -> str:
    return f"""
duration_s = 10.0
[[group]]
count = {count}
latency_ms = 10.0
[gossip]
degree = {degree}
"""


def deliver_all(net: Network, nodes: list[VNode], queue: EventQueue) -> list[BatchArrives]:
    """Run the arrivals as the runtime does for a batch every receiver accepts: the first copy is passed on."""
    firsts = []
    while queue.heap:
        t, _, ev = heapq.heappop(queue.heap)
        queue.now = t
        d = nodes[ev.node]
        if net.first_copy(d, ev.data):
            firsts.append(ev)
            net.pass_on(d, ev.fwd, ev.origin, ev.data, ev.shard)
    return firsts


def test_a_batch_reaches_every_subscriber_once_and_each_other_copy_is_a_duplicate() -> None:
    net, nodes, queue = swarm(nodes_text(4))
    for n in nodes:
        net.subscribe(n, 1, (0,))
    assert all(net.mesh[0][n.spec.index] == {k for k in range(4) if k != n.spec.index} for n in nodes)  # 3 < D
    assert net.publish(nodes[0], DATA, 0)
    assert len(queue.heap) == 3  # to each mesh peer of the publisher
    firsts = deliver_all(net, nodes, queue)
    assert sorted(ev.node for ev in firsts) == [1, 2, 3] and all(ev.origin == 0 for ev in firsts)
    # 3 sends by the publisher, 2 by each receiver (its mesh less the sender and the publisher): 9 copies on
    # the wire, 3 of them first copies, 6 duplicates (dropped by message id, their bytes still carried)
    assert sum(net.links.bytes_up) == sum(net.links.bytes_down) == 9 * len(DATA)
    assert net.links.bytes_up[0] == 3 * len(DATA)
    assert sum(n.duplicates for n in nodes) == 6 and nodes[0].duplicates == 0


def test_publishing_without_a_mesh_is_fanout_and_with_no_subscriber_goes_nowhere() -> None:
    net, nodes, queue = swarm(nodes_text(12))
    for n in nodes[1:]:
        net.subscribe(n, 1, (0,))
    assert net.publish(nodes[0], DATA, 0)  # node 0 is not subscribed: D random subscribers
    assert len(queue.heap) == MESH_D and {ev.node for _, _, ev in queue.heap} <= set(range(1, 12))
    firsts = deliver_all(net, nodes, queue)
    assert sorted(ev.node for ev in firsts) == list(range(1, 12))  # the meshes carry it to every subscriber
    assert not net.publish(nodes[0], DATA, 1) and net.counts["publish_no_subscriber"] == 1
    assert not queue.heap


def test_a_batch_goes_to_live_mesh_peers_only_each_copy_stamped_with_its_incarnation() -> None:
    net, nodes, queue = swarm(nodes_text(3))
    for n in nodes:
        net.subscribe(n, 1, (0,))
    nodes[2].alive = False
    net.publish(nodes[0], DATA, 0)
    assert [ev.node for _, _, ev in queue.heap] == [1]
    assert queue.heap[0][2].inc == nodes[1].inc  # the runtime drops it if node 1 has rejoined since


def test_meshes_stay_symmetric_bounded_and_lose_a_leaving_node() -> None:
    net, nodes, _ = swarm(nodes_text(40))
    for n in nodes:
        net.subscribe(n, 2, (0, 1) if n.spec.index % 2 else (0,))
    for shard, mesh in net.mesh.items():
        for i, peers in mesh.items():
            assert peers and len(peers) <= MESH_D_HIGH and i not in peers
            assert all(i in mesh[k] for k in peers), (shard, i)  # GRAFT is both ways
            assert peers <= net.subs[shard]
    leaving = nodes[7]
    net.subscribe(leaving, 2, ())  # PRUNE: its connections close
    assert leaving.shards == () and all(7 not in s for s in net.subs.values())
    assert all(7 not in peers for mesh in net.mesh.values() for peers in mesh.values())
    assert all(7 not in mesh for mesh in net.mesh.values())
    assert net.shards_seen == 2


def test_the_graph_is_connected_symmetric_and_joins_followers_to_their_publisher() -> None:
    net, nodes, _ = swarm(nodes_text(30, degree=3) + '[[group]]\ncount = 2\nrole = "follower"\nfollow = 5\n')
    net.connect()
    for n in nodes:
        assert len(n.neighbours) >= 2 and all(n.spec.index in nodes[j].neighbours for j in n.neighbours)
        assert set(n.neighbours) <= set(n.ctrl)
    assert {30, 31} <= set(nodes[5].ctrl) and all(5 in nodes[f].ctrl for f in (30, 31))
    seen, todo = {0}, [0]
    while todo:
        for j in nodes[todo.pop()].neighbours:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    assert seen == set(range(32))


def test_one_hop_messages_go_to_the_live_targets_over_their_links() -> None:
    net, nodes, queue = swarm(nodes_text(4))
    nodes[3].alive = False
    net.send(nodes[0], [1, 2, 3], AnnounceArrives, DATA)
    arrivals = sorted((t, ev.node) for t, _, ev in queue.heap)
    assert [i for _, i in arrivals] == [1, 2]
    assert all(t >= net.latency(0, i) for t, i in arrivals)
    assert net.links.bytes_up[0] == 2 * len(DATA)
