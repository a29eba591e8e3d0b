"""The virtual simulator's reporting: the metric rows and counters a run records, and its summary.

`Recorder` keeps the rows (`docs/researcher.md` lists their kinds) and what the simulator counted while
carrying out the cores' actions; `summary` builds the run's summary dict from the nodes' final state;
`write` writes the report folder (`simulations/report.py`).
"""

from __future__ import annotations

import bisect
import os
import resource
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from murmur.simulations import curves
from murmur.simulations.report import MetricsWriter, write_report
from murmur.simulations.scenario import Scenario, dumps
from murmur.simulations.vnode import VNode

ALONE_POINTS = 20  # marks of virtual time at which the alone comparison is read
MODELLED = (
    "the network (rollouts: GossipSub meshes of degree 6 on the shard topics the cores "
    "join, forwarded once per mesh link, duplicates counted; announces and manifests: one hop; "
    "modelled links), the clock, compute time, learning (skill curve), patch transfer time; "
    "real: one node core per node (announces, roles and lineage choice, staleness admission, "
    "heads from messages, catch-up plans, rollout batching and sealing, the rollout exchange's "
    "shards), the exchange gate, signatures, verification pipeline, scoring, the worker's "
    "sampler, swarm broadcast core"
)


class Recorder:
    """A run's metric rows (written as they come when there is a report folder, which keeps them for the
    report: one copy) and its counters."""

    def __init__(self, out_dir: Path | None, fmt: str) -> None:
        self.metrics = MetricsWriter(out_dir, fmt) if out_dir else None
        self.rows: dict[str, list[dict[str, Any]]] = self.metrics.rows if self.metrics else {}
        self.rejections: Counter[str] = Counter()  # dropped batches, by reason
        self.core_logs: Counter[str] = Counter()  # the cores' Log actions, by message
        self.counts: Counter[str] = Counter()  # what the simulator carried out for the cores

    def row(self, kind: str, **fields: Any) -> None:
        if self.metrics:
            self.metrics.add(kind, **fields)
        else:
            self.rows.setdefault(kind, []).append(fields)


def core_summary(nodes: list[VNode], recorder: Recorder) -> dict[str, Any]:
    """What the nodes' cores decided and what the simulator carried out for them."""
    cores = [n.core for n in nodes if n.core is not None]
    followers = [n for n in nodes if n.role == "follower"]
    return {
        "actions": dict(sorted(recorder.counts.items())),
        "logs": dict(recorder.core_logs.most_common(24)),
        "followers_serving": sum(1 for n in followers if n.core is not None and n.core.serving is not None),
        "followers_admitted": sum(1 for n in followers if n.admitted),
        "followers": len(followers),
        "patches_applied": sum(c.stats()["applied"] for c in cores),
        "peers_evicted": sum(c.stats()["peers_evicted"] for c in cores),
        "lineages_evicted": sum(c.table.evicted for c in cores),
        "peers_max": max((len(c.peers) for c in cores), default=0),
        "lineages_max": max((len(c.lineages) for c in cores), default=0),
    }


def pods_summary(nodes: list[VNode], recorder: Recorder) -> dict[str, Any]:
    """The shape the roles took by the end: live trainers, how many lead a pod (at least one live follower's
    worker generates for its lineage), followers per pod, and the switches the auto nodes' cores made (and of
    them, the returns from a lineage whose modelled held-out reading was measurably below their own,
    `trials_refused`)."""
    live = [n for n in nodes if n.alive and n.core is not None]
    lineage_of = {n.lineage: n for n in live if n.role == "trainer"}
    pod: Counter[bytes] = Counter()
    unattached = 0
    for n in live:
        if n.role != "follower":
            continue
        lid = n.core.committed if n.core is not None else None
        if lid in lineage_of:
            pod[lid] += 1
        else:
            unattached += 1
    sizes = sorted(pod.values(), reverse=True)
    return {
        "auto_nodes": sum(1 for n in nodes if n.spec.role == "auto"),
        "trainers": len(lineage_of),
        "pods": len(sizes),
        "lone_trainers": len(lineage_of) - len(sizes),
        "followers_per_pod": round(sum(sizes) / len(sizes), 3) if sizes else 0.0,
        "followers_per_trainer": round(sum(sizes) / len(lineage_of), 3) if lineage_of else 0.0,
        "largest_pod": sizes[0] if sizes else 0,
        "followers_unattached": unattached,
        "role_switches": recorder.core_logs["role"],
        "trials_refused": recorder.core_logs["trial refused"],
    }


def exchange_summary(sc: Scenario, nodes: list[VNode], end: float, unix_now: float, shard_count: int) -> dict[str, Any]:
    """Per-node load of the rollout exchange over `end` virtual seconds: what each trainer (a consumer)
    received, verified and used per virtual second, and from how many producers; followers' inbound apart."""
    span = max(1e-9, end)
    g = sc.training.group_size

    def per_s(xs: list[float]) -> dict[str, float]:
        return {"mean": round(sum(xs) / len(xs), 3), "max": round(max(xs), 3)} if xs else {"mean": 0.0, "max": 0.0}

    out: dict[str, Any] = {}
    for role in ("trainer", "follower"):
        ns = [n for n in nodes if n.role == role and n.core is not None]
        if not ns:
            continue
        rec = [n.intake.stats.counts["received_rollouts"] / span for n in ns]
        ver = [n.intake.stats.counts["verified_rollouts"] / span for n in ns]
        used = sum(n.consumed_ext * g for n in ns)
        verified = sum(n.intake.stats.counts["verified_rollouts"] for n in ns)
        cs = [n.core.stats() for n in ns if n.core is not None]
        out[role] = {
            "nodes": len(ns),
            # totals over the nodes (a restarted node's core counts from its restart)
            "rollouts": {
                "produced": sum(c["rollouts_produced"] for c in cs),
                "published": sum(c["rollouts_published"] for c in cs),
                "uninformative": sum(c["rollouts_uninformative"] for c in cs),
                "withheld": sum(c["rollouts_withheld"] for c in cs),
                "unsent": sum(c["rollouts_sealed"] - c["rollouts_published"] for c in cs),
                "received": sum(n.intake.stats.counts["received_rollouts"] for n in ns),
                "verified": verified,
                "used": used,
            },
            "groups": {k: sum(c[f"groups_{k}"] for c in cs) for k in ("generated", "sent", "trained")},
            "inbound_rollouts_per_s": per_s(rec),
            "verified_rollouts_per_s": per_s(ver),
            "duplicates_per_s": per_s([n.duplicates / span for n in ns]),
            "used_over_verified": round(used / verified, 3) if verified else None,
            "distinct_producers": per_s([float(n.intake.stats.distinct_producers(unix_now)) for n in ns]),
            "shards_subscribed": per_s([float(len(n.shards)) for n in ns]),
        }
    out["shard_count"] = shard_count
    dropped: Counter[str] = Counter()
    for n in nodes:
        dropped.update(n.intake.stats.dropped)
    out["dropped"] = dict(dropped.most_common(16))
    return out


def alone_summary(trainers: list[VNode], end: float, skill_at: dict[bytes, list[float]]) -> dict[str, Any] | None:
    """The trainers' mean skill and their alone twins' at `ALONE_POINTS` equal marks of virtual time up to
    `end`, and the time-to-target speedup of the swarm over alone (`simulations.curves`)."""
    if not trainers or end <= 0:
        return None
    xs = [end * k / ALONE_POINTS for k in range(ALONE_POINTS + 1)]

    def mean_at(curves: list[tuple[list[float], list[float], float]], t: float) -> float:
        total = 0.0
        for times, values, start in curves:
            k = bisect.bisect_right(times, t)
            total += values[k - 1] if k else start
        return total / len(curves)

    def prepared(pairs: list[tuple[float, float]], start: float) -> tuple[list[float], list[float], float]:
        return [t for t, _ in pairs], [v for _, v in pairs], start

    swarm = [prepared(n.curve, skill_at[n.lineage][0]) for n in trainers]
    alone = [prepared(n.alone.curve if n.alone else [], skill_at[n.lineage][0]) for n in trainers]
    sw = [mean_at(swarm, t) for t in xs]
    al = [mean_at(alone, t) for t in xs]
    speedup, reached, _, _ = curves.speedup(xs, al, sw)
    return {
        "marks_s": [round(x, 2) for x in xs],
        "skill": [round(v, 4) for v in sw],
        "alone_skill": [round(v, 4) for v in al],
        "speedup": round(speedup, 4),
        "reached": reached,
        "final_skill_delta": round(sw[-1] - al[-1], 4),
    }


def summary(
    sc: Scenario,
    nodes: list[VNode],
    recorder: Recorder,
    *,
    end: float,
    events: int,
    wall_s: float,
    cpu_s: float,
    build_s: float,
    setup_s: float,
    broadcasts: list[dict[str, Any]],
    skill_at: dict[bytes, list[float]],
    exchange: dict[str, Any],
) -> dict[str, Any]:
    """The run's summary (`docs/researcher.md` lists its keys); `end`: the virtual seconds it ran."""
    trainers = [n for n in nodes if n.sampler is not None]  # every node that trained (some may follow now)
    swarm = sum(n.reward_sum for n in trainers)
    iso = sum(n.iso_sum for n in trainers)
    return {
        "title": f"Murmur virtual simulation: {sc.name}",
        "mode": "virtual",
        "scenario": sc.name,
        "seed": sc.seed,
        "nodes": len(nodes),
        "virtual_s": end,
        "wall_s": round(wall_s, 2),
        "cpu_s": round(cpu_s, 2),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "build_s": round(build_s, 2),
        "setup_s": round(setup_s, 2),  # start-up broadcasts through the swarm core
        "peak_rss_mb": peak_rss_mb(),
        "events": events,
        "steps": sum(n.steps for n in nodes),
        "swarm_cumulative_reward": round(swarm, 3),
        "isolated_cumulative_reward": round(iso, 3),
        "gain_swarm": round(swarm / iso - 1, 4) if iso > 0 else None,
        "final_skill_mean": round(sum(n.skill for n in trainers) / max(1, len(trainers)), 4),
        "final_isolated_skill_mean": round(sum(n.iso_skill for n in trainers) / max(1, len(trainers)), 4),
        "alone": alone_summary(trainers, end, skill_at),
        "external_groups_consumed": sum(n.consumed_ext for n in trainers),
        "sampler": {
            k: sum(n.sampler.counts[k] for n in trainers if n.sampler is not None)
            for k in (trainers[0].sampler.counts if trainers and trainers[0].sampler else {})
        },
        "adversarial_accepted": sum(
            n.adv_accepted for n in nodes if n.spec.behaviour in ("forged_reward", "invalid_signature")
        ),
        "rejections": dict(recorder.rejections),
        "broadcasts": broadcasts,
        "graylist_threshold": sc.gossip.graylist_threshold,
        "cores": core_summary(nodes, recorder),
        "pods": pods_summary(nodes, recorder),
        "exchange": exchange,
        "modelled": MODELLED,
    }


def record_bytes(recorder: Recorder, nodes: list[VNode], bytes_up: list[int], bytes_down: list[int]) -> None:
    """One `bytes` row per node: what its link carried over the run."""
    for n in nodes:
        recorder.row(
            "bytes",
            node=n.spec.index,
            group=n.spec.group,
            bytes_up=bytes_up[n.spec.index],
            bytes_down=bytes_down[n.spec.index],
        )


def write(out_dir: Path, recorder: Recorder, summary: dict[str, Any], sc: Scenario) -> None:
    """The report folder: metrics, summary, scenario, page and plots."""
    if recorder.metrics is not None:
        recorder.metrics.close()
    write_report(
        out_dir,
        recorder.rows,
        summary,
        dumps(sc),
        title=summary["title"],
        notes="Virtual time. " + summary["modelled"] + ".",
        threshold=sc.gossip.graylist_threshold,
        plots=sc.report.plots,
    )


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1)
