"""The virtual simulator's start-up patch broadcasts: one `sync.transfers.BroadcastCore` per node (the live
node's broadcast logic) through `simulations.vsim.VirtualSwarm`, over the scenario's links.

Each followed publisher broadcasts a patch of the scenario's size to its followers, which gives every
follower its patch delay (the main run's modelled transfer time); then `sync.broadcasts` measured
broadcasts from the trainers in turn to a random sample of receivers (adversaries that act on the
broadcast plane always among them) are reported.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from murmur.simulations.scenario import Scenario
from murmur.simulations.vnode import VNode
from murmur.simulations.vsim import SimLink, VirtualSwarm
from murmur.simulations.wan import broadcast_lower_bound


def broadcast(
    sc: Scenario, nodes: list[VNode], rng: random.Random, origin: int, receivers: list[int]
) -> dict[str, Any]:
    """One patch from `origin` to `receivers` (node indices); `VirtualSwarm.run`'s result, plus each
    receiver's completion time, the bans, each node's bytes out and the lower bound."""
    sy = sc.sync
    sizes = [sy.chunk_bytes] * (sy.patch_bytes // sy.chunk_bytes)
    if sy.patch_bytes % sy.chunk_bytes:
        sizes.append(sy.patch_bytes % sy.chunk_bytes)
    ids = [origin] + receivers
    links = {}
    for k, i in enumerate(ids):
        s = nodes[i].spec
        up = s.upload_bytes_per_s if s.behaviour != "free_ride" else 1.0  # a free-rider uploads nothing
        links[k] = SimLink(up_bps=up, down_bps=s.download_bytes_per_s, latency_s=s.latency_ms / 1000.0, loss=s.loss)
    vs = VirtualSwarm(
        len(receivers),
        sizes,
        links=links,
        degree=min(sc.gossip.degree, len(receivers)),
        seed=rng.randrange(2**32),
        swarm=sc.swarm,
    )
    for k, i in enumerate(ids):
        if nodes[i].spec.behaviour == "corrupt_chunks":
            vs.make_corrupt(k)
    res = vs.run(until_s=max(600.0, 50 * sy.patch_bytes / min(links[0].up_bps, 1e12)))
    res["times"] = {ids[k]: vs.nodes[k].completed_at for k in range(1, len(ids))}
    res["bans"] = sum(len(nd.banned) for nd in vs.nodes)
    res["bytes_out"] = {ids[k]: vs.nodes[k].bytes_out for k in range(len(ids))}
    rtt = 2 * nodes[origin].spec.latency_ms / 1000.0
    res["lower_bound_s"] = broadcast_lower_bound(sy.patch_bytes, len(receivers), links[0].up_bps, len(sizes), rtt)
    return res


def setup_broadcasts(
    sc: Scenario, nodes: list[VNode], rng: random.Random, row: Callable[..., None], bytes_up: list[int]
) -> list[dict[str, Any]]:
    """Sets each follower's `patch_delay`; returns the measured broadcasts' summaries, adds their `broadcast`
    rows and counts their upload in `bytes_up`."""
    out = []
    # followers: one broadcast per followed lineage gives each follower its patch delay
    leads = sorted({n.spec.follow for n in nodes if n.spec.role == "follower" and n.spec.follow is not None})
    for lead in leads:
        fol = [n.spec.index for n in nodes if n.spec.role == "follower" and n.spec.follow == lead]
        res = broadcast(sc, nodes, rng, lead, fol)
        for i, t in res["times"].items():
            nodes[i].patch_delay = t if t is not None else sc.duration_s
    # measured swarm-wide broadcasts, sample of receivers (adversaries included)
    every = [n.spec.index for n in nodes]
    trainers = [n.spec.index for n in nodes if n.spec.role in ("trainer", "auto")]
    for b in range(sc.sync.broadcasts):
        origin = trainers[b % len(trainers)]
        pool = [i for i in every if i != origin]
        rng.shuffle(pool)
        adv = [i for i in pool if nodes[i].spec.behaviour in ("corrupt_chunks", "free_ride")]
        recv = (adv + [i for i in pool if i not in adv])[: sc.sync.broadcast_nodes]
        if not recv:
            continue
        res = broadcast(sc, nodes, rng, origin, sorted(recv))
        for i, t in res["times"].items():
            row(
                "broadcast",
                n=b,
                receiver=i,
                completion_s=t if t is not None else math.inf,
                lower_bound_s=res["lower_bound_s"],
                bytes=sc.sync.patch_bytes,
            )
        out.append(
            {
                "n": b,
                "receivers": len(recv),
                "p50_s": res["completion_s_p50"],
                "max_s": res["completion_s_max"],
                "lower_bound_s": res["lower_bound_s"],
                "bans": res["bans"],
                "hashes_ok": res["all_hashes_match"],
            }
        )
        for i, bo in res["bytes_out"].items():
            bytes_up[i] += bo
    # a node whose core may turn it into a follower fetches patches as a measured swarm-wide broadcast did
    measured = max((b["max_s"] for b in out if b["max_s"] is not None and math.isfinite(b["max_s"])), default=0.0)
    for n in nodes:
        if n.spec.role == "auto" and not n.patch_delay:
            n.patch_delay = measured
    return out
