"""The virtual-time swarm runs the node's multi-patch broadcast core (`sync.transfers.BroadcastCore`) per node."""

from __future__ import annotations

from murmur.simulations.vsim import SimLink, VirtualSwarm
from murmur.sync.swarm import SwarmSession
from murmur.sync.transfers import BroadcastCore

C, B = 64 * 2**10, 2**20
M = 12  # chunks per patch


def test_two_patches_complete_share_the_links_and_a_corrupt_sender_is_banned_in_both() -> None:
    sw = VirtualSwarm(12, [C] * M, link=SimLink(up_bps=B), seed=4, patches=2)
    sw.make_corrupt(5)
    r = sw.run(until_s=120)
    assert r["completed"] == 12 and r["all_hashes_match"]  # every chunk of both patches, verified
    pids = [p for p, _, _ in sw.patches]
    assert len(set(pids)) == 2
    for nd in sw.nodes:
        assert type(nd.core) is BroadcastCore and set(nd.core.transfers) == set(pids)
        assert all(type(tr.session) is SwarmSession for tr in nd.core.transfers.values())
        # every byte a node uploaded was paid for from its one token bucket, across both patches
        assert nd.core.bucket.total == nd.bytes_out
    banners = [nd for nd in sw.nodes if 5 in nd.banned]
    assert banners, "someone must have received and caught a corrupt chunk"
    for nd in banners:  # the ban is node-wide: both patches' sessions dropped the corrupt sender
        assert all(5 in nd.core.transfers[p].session.banned for p in pids)
        assert nd.penalties[5] > 0
    # round-robin across patches: the second patch is not queued behind the first. Alone, one patch takes
    # about 70% of the time two take here, so the first would be done everywhere by then; shared, they end together.
    honest = [nd for nd in sw.nodes[1:] if nd.id != 5]
    first = max(nd.done[pids[0]] for nd in honest)
    second = max(nd.done[pids[1]] for nd in honest)
    assert first > 0.9 * second
    assert all(sw.nodes[0].core.transfers[p].session.bytes_out > 0 for p in pids)


def test_without_manifest_gossip_nodes_ask_peers_for_both_manifests() -> None:
    sw = VirtualSwarm(
        8, [C] * 4, link=SimLink(up_bps=B), seed=1, patches=2, patch_interval_s=0.5, gossip_manifests=False
    )
    r = sw.run(until_s=60)
    assert r["completed"] == 8 and r["all_hashes_match"]
    asked = [nd.core.frames_by_type.get("ManifestRequest", 0) for nd in sw.nodes]
    answered = [nd.core.frames_by_type.get("Manifest", 0) for nd in sw.nodes[1:]]
    assert sum(asked) >= 2 and all(a >= 2 for a in answered)  # each follower got both manifests from a peer
