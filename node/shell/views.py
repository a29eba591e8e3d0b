"""What the node core knows, as the status views (`node.status`) that the control socket, dashboard and metrics show."""

from __future__ import annotations

from typing import Any

from murmur.gossip.identity import peer_id_from_public
from murmur.node.core.machine import NodeCore
from murmur.node.shell import hardware
from murmur.node.status import ExchangeView, LineageView, NodeStatus, PeerView, ReachView
from murmur.sync.ids import Relation


def peer_views(core: NodeCore, now: float) -> list[PeerView]:
    out = []
    for pid, p in sorted(core.peers.items()):
        a = p.announce
        out.append(
            PeerView(
                peer_id=pid,
                roles=list(a.roles),
                hardware=a.hardware,
                gen_tokens_per_s=a.gen_tokens_per_s,
                rollout_latency_s=a.rollout_latency_s,
                serving=bytes(a.serving).hex(),
                last_seen_s=now - p.seen,
            )
        )
    return out


def lineage_views(core: NodeCore) -> list[LineageView]:
    out = []
    for lin in core.lineages.values():
        relation = lin.relation
        act = lin.activation
        out.append(
            LineageView(
                lineage=lin.lineage.hex(),
                name=lin.name,
                relation=relation,
                publisher=peer_id_from_public(lin.publisher) if len(lin.publisher) == 32 else "",
                head=lin.head,
                held=lin.held,
                lag=max(0, lin.head - lin.held) if relation != Relation.SEEN else 0,
                need_rollouts_per_s=act.need if act else 0.0,
                supply_rollouts_per_s=act.supply if act else 0.0,
                active=list(act.active) if act else [],
                standby=list(act.standby) if act else [],
                rejected=dict(act.rejected) if act else {},
                admission=lin.admission or "",
                admission_note=lin.admission_note,
                on_trial=lin.lineage == core.on_trial,
            )
        )
    return out


def reward_window(core: NodeCore, k: int = 5) -> tuple[float | None, float | None]:
    """(mean of the first k rewards, mean of the last k)."""
    first = core.reward_first[:k]
    recent = list(core.rewards)[-k:]
    return (sum(first) / len(first) if first else None, sum(recent) / len(recent) if recent else None)


def heldout_fields(core: NodeCore) -> dict[str, Any]:
    """The status's held-out accuracy of the weights the node holds: a trainer's measurements every
    `node.worker.main.EVAL_EVERY_STEPS` steps, a follower's of the versions it held (`follower_eval_due`)."""
    held = [a for _, a in core.heldout]
    return {
        "heldout_trend": [round(a, 4) for a in held],
        "heldout_start": held[0] if held else None,
        "heldout_now": held[-1] if held else None,
    }


def node_status(node: Any, loop_now: float | None = None) -> NodeStatus:
    """The status of a running `node.shell.runtime.Node`: its core's views plus what only the shell knows."""
    c, led, now = node.core, node.ledger, node.clock()
    counts = c.stats()
    rejected = {k.split(":", 1)[1]: v for k, v in led.items() if k.startswith("rejected:")}
    if node.service is not None:
        for reason in ("graylisted", "blacklisted", "rate_limited", "over_announced_rate"):
            n = node.service.pipeline.counts.get(reason, 0)
            if n:
                rejected[reason] = rejected.get(reason, 0) + n
    if counts["spot_failed"]:
        rejected["spot_check_failed"] = counts["spot_failed"]
    accepted = led.get("accepted", 0)
    start, now_r = reward_window(c)
    gave = list(c.swarm_gave)
    per_step = [sum(x[k] for x in gave) / len(gave) if gave else 0.0 for k in range(3)]
    pids = [node.worker.pid] if node.worker and node.worker.pid else []
    live = (
        sum(tr.session.bytes_in for tr in list(node.bcast.transfers.values()) if not tr.session.complete)
        if node.bcast is not None
        else 0
    )
    return NodeStatus(
        peer_id=node.ident.peer_id,
        swarm=node.cfg.node.swarm,
        roles=list(c.roles),
        hardware=node.hw_class,
        roles_reason=c.role_reason or node.roles_reason,
        roles_chosen=c.pods is not None,
        role_switches=counts["role_switches"],
        trials_refused=counts["trials_refused"],
        listen=node.transport.listen_addrs() if node.transport else [],
        state=node.state,
        uptime_s=now - node.started,
        worker=c.worker_state.value,
        worker_error=c.worker_error[:2000],
        engine=c.engine,
        worker_restarts=counts["worker_restarts"],
        worker_pid=pids[0] if pids else 0,
        peers=peer_views(c, now),
        lineages=lineage_views(c),
        serving=c.serving.hex() if c.serving else "",
        serving_reason=c.serving_reason,
        following=c.committed.hex() if c.committed else "",
        steps=c.steps,
        versions_published=counts["published"],
        versions_applied=counts["applied"],
        rollouts_produced=led.get("produced", 0),
        rollouts_published=counts["rollouts_published"],
        rollouts_received=accepted + sum(v for k2, v in led.items() if k2.startswith("rejected")),
        rollouts_accepted=accepted,
        rollouts_used=counts["used"],
        rejected=rejected,
        used_over_verified=round(counts["used"] / accepted, 4) if accepted else None,
        external_groups_per_step=round(per_step[0], 3),
        external_lineages_per_step=round(per_step[1], 3),
        updates_per_step=round(per_step[2], 3),
        **heldout_fields(c),
        spot_eligible=counts["spot_eligible"],
        spot_checked=counts["spot_checked"],
        spot_failed=counts["spot_failed"],
        reward_trend=list(c.rewards),
        reward_start=start,
        reward_now=now_r,
        gen_tokens_per_s=c.gen_tps,
        rollout_latency_s=c.latency,
        bytes_up=int(node.bcast.counters["bytes_up"]) if node.bcast is not None else 0,
        bytes_down=counts["bytes_down"] + live,
        memory_rss_mb=hardware.rss_bytes(pids) / 2**20,
        memory_budget_mb=node.cfg.node.memory_budget_mb,
        metrics_port=node.metrics.port if node.metrics else 0,
        dropped=node.drops.view(
            node.worker.dropped if node.worker else 0,
            {
                "rollout_unpublishable": counts["rollouts_unpublishable"],
                "patch_not_finite": counts["patches_not_finite"],
                "lineage_left": counts["lineages_left"],
            },
        ),
        disk=node.disk.views(now),
        loop_stall_max_ms=round(node.stall.max_ms, 1),
        loop_stall_recent_ms=round(node.stall.recent_ms(loop_now), 1) if loop_now is not None else 0.0,
        gc_pause_max_ms=round(node.gc_timer.max_ms[2], 1),
        stream_faults=dict(node.transport.faults.counts) if node.transport is not None else {},
        stream_limits=_stream_limits(node.transport),
        **(peer_records(node.service.pipeline) if node.service is not None else {}),
        reach=node.reach.view() if node.reach is not None else ReachView(),
        exchange=exchange_view(node.service, c) if node.service is not None else ExchangeView(),
    )


def exchange_view(service: Any, core: NodeCore) -> ExchangeView:
    st, now = service.stats, service.pipeline.clock()
    counts = core.stats()
    used = counts["used"]
    verified = st.counts["verified_rollouts"]
    rates = st.rates(now)
    sample = service.sample
    return ExchangeView(
        shards=service.shards,
        subscribed=list(service.subscribed_shards),
        produced_rollouts=counts["rollouts_produced"],
        published_rollouts=counts["rollouts_published"],
        withheld_rollouts=counts["rollouts_withheld"],
        uninformative_rollouts=counts["rollouts_uninformative"],
        unsent_rollouts=max(0, counts["rollouts_sealed"] - counts["rollouts_published"]),
        groups_generated=counts["groups_generated"],
        groups_sent=counts["groups_sent"],
        groups_trained=counts["groups_trained"],
        publish_budget_per_s=round(core.outbox.rate, 3) if core.outbox is not None else None,
        unsampled_batches=st.counts["unsampled_batches"],
        sample_fraction=sample.fraction if sample is not None else None,
        sample_floor_per_min=sample.floor_per_min if sample is not None else None,
        sample_rate=round(sample.rate(), 4) if sample is not None else None,
        received_batches=st.counts["received_batches"],
        received_rollouts=st.counts["received_rollouts"],
        verified_batches=st.counts["verified_batches"],
        verified_rollouts=verified,
        used_rollouts=used,
        dropped=dict(st.dropped),
        rates=rates,
        used_over_verified=round(used / verified, 3) if verified else 0.0,
        distinct_producers=st.distinct_producers(now),
        task_sets={k: dict(v) for k, v in st.task_sets.items()},
        lineages_by_task_set=st.lineages_by_set(now),
    )


def status_fields(s: NodeStatus) -> dict[str, Any]:
    """The periodic `status` log line of a node without a dashboard."""
    own = next((x for x in s.lineages if x.relation == Relation.OWN), None) if "trainer" in s.roles else None
    fol = next((x for x in s.lineages if x.lineage == s.serving), None)
    held = own or fol
    return dict(
        peers=len(s.peers),
        roles=s.roles,
        worker=s.worker,
        steps=s.steps,
        version=held.held if held else None,
        lag=fol.lag if fol else None,
        serving=s.serving[:16],
        reward=s.reward_now,
        produced=s.rollouts_produced,
        accepted=s.rollouts_accepted,
        rejected=s.rejected,
        bytes_up=s.bytes_up,
        bytes_down=s.bytes_down,
        rss_mb=round(s.memory_rss_mb),
        worker_restarts=s.worker_restarts,
    )


MAX_SCORES_SHOWN = 256  # peer scores in the status reply (it has a size limit)


def peer_records(pipeline: Any) -> dict[str, Any]:
    """`peer_scores` (current scores), `peer_charged` (penalties charged so far, for the same peers: a
    charge a peer has since earned back still shows there) and `peer_faults` (what each charged peer was
    charged for, by reason and count), from one snapshot of the score table."""
    shown = list(pipeline.scores.snapshot(pipeline.clock()).items())[:MAX_SCORES_SHOWN]
    return {
        "peer_scores": {peer: round(v["score"], 3) for peer, v in shown},
        "peer_charged": {peer: v["charged"] for peer, v in shown if v["charged"]},
        "peer_faults": {peer: v["rejections"] for peer, v in shown if v["charged"]},
    }


def _stream_limits(transport: Any) -> dict[str, int]:
    budget = getattr(transport, "budget", None)
    if budget is None:
        return {}
    return {
        **budget.counters,
        "inbound_streams": budget.node_streams,
        "unproven_streams": budget.pool_streams,
        "buffered_bytes": budget.node_buffered,
    }
