"""What the node core knows, as the status views (`node.status`) that the control socket, dashboard and metrics show."""

from __future__ import annotations

from gossip.identity import peer_id_from_public
from node.core import NodeCore
from node.status import LineageView, PeerView


def peer_views(core: NodeCore, now: float) -> list[PeerView]:
    out = []
    for pid, p in sorted(core.peers.items()):
        a = p.announce
        out.append(PeerView(peer_id=pid, roles=list(a.roles), hardware=a.hardware, gen_tokens_per_s=a.gen_tokens_per_s,
                            rollout_latency_s=a.rollout_latency_s, serving=bytes(a.serving).hex(),
                            last_seen_s=now - p.seen))
    return out


def lineage_views(core: NodeCore) -> list[LineageView]:
    out = []
    for lin in core.lineages.values():
        relation = lin.relation
        act = lin.activation
        out.append(LineageView(lineage=lin.lineage.hex(), name=lin.name, relation=relation,
                               publisher=peer_id_from_public(lin.publisher) if len(lin.publisher) == 32 else "",
                               head=lin.head, held=lin.held,
                               lag=max(0, lin.head - lin.held) if relation != "seen" else 0,
                               need_rollouts_per_s=act.need if act else 0.0,
                               supply_rollouts_per_s=act.supply if act else 0.0,
                               active=list(act.active) if act else [], standby=list(act.standby) if act else [],
                               rejected=dict(act.rejected) if act else {},
                               admission=lin.admission, admission_note=lin.admission_note))
    return out


def reward_window(core: NodeCore, k: int = 5) -> tuple[float | None, float | None]:
    """(mean of the first k rewards, mean of the last k)."""
    first = core.reward_first[:k]
    recent = list(core.rewards)[-k:]
    return (sum(first) / len(first) if first else None, sum(recent) / len(recent) if recent else None)
