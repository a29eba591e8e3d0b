"""Application-level peer scores with an injected clock (sans-IO).

Why our own: py-libp2p 0.8.1's default score parameters do nothing, its P4
sign is inverted, and a negative libp2p score mutes a peer silently. Here a
score is a float that decays toward 0 with a half-life (old sins fade,
old merit too), capped above so good behaviour cannot bank unlimited credit.
Below `graylist_threshold` a peer's messages are dropped before any expensive
work; proven forgery bans the peer until a deadline (blacklist).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Penalise:
    """The action every sans-IO machine returns for a peer's fault (the node core, the chunk swarm, the
    broadcast core); the driver applies it with `Scores.penalise`."""

    peer: str
    reason: str
    amount: float  # > 0: what the peer's score loses


MAX_REASONS = 16  # distinct rejection reasons kept per peer; the rest count as "other"


@dataclass
class ScoreParams:
    graylist_threshold: float = -50.0
    blacklist_s: float = 3600.0
    half_life_s: float = 600.0
    max_score: float = 20.0
    accept_reward: float = 0.5


@dataclass
class PeerRecord:
    score: float = 0.0
    updated: float = 0.0
    banned_until: float = 0.0
    rejections: dict[str, int] = field(default_factory=dict)
    accepted: int = 0
    charged: float = 0.0  # every penalty ever charged, summed: unlike the score, it neither decays nor heals


class PeerScores:
    def __init__(
        self,
        params: ScoreParams | None = None,
        on_change: Callable[[str, PeerRecord], None] | None = None,
        max_peers: int = 10_000,
    ) -> None:
        self.params = params or ScoreParams()
        self.on_change = on_change
        self.max_peers = max_peers
        self._peers: dict[str, PeerRecord] = {}

    def _rec(self, peer: str, now: float) -> PeerRecord:
        rec = self._peers.get(peer)
        if rec is None:
            if len(self._peers) >= self.max_peers:  # forget the most neutral peer
                victim = min(self._peers, key=lambda p: abs(self._peers[p].score) + self._peers[p].banned_until)
                del self._peers[victim]
            rec = self._peers[peer] = PeerRecord(updated=now)
        elif now > rec.updated:
            rec.score *= math.pow(0.5, (now - rec.updated) / self.params.half_life_s)
            rec.updated = now
        return rec

    def score(self, peer: str, now: float) -> float:
        return self._rec(peer, now).score if peer in self._peers else 0.0

    def record(self, peer: str) -> PeerRecord | None:
        return self._peers.get(peer)

    def is_blacklisted(self, peer: str, now: float) -> bool:
        rec = self._peers.get(peer)
        return rec is not None and rec.banned_until > now

    def is_graylisted(self, peer: str, now: float) -> bool:
        return peer in self._peers and self.score(peer, now) < self.params.graylist_threshold

    def penalise(self, peer: str, reason: str, amount: float, now: float, ban: bool = False) -> bool:
        """Lower `peer`'s score by `amount`; `ban` blacklists it. True when this call newly banned it."""
        rec = self._rec(peer, now)
        rec.score -= amount
        rec.charged += amount
        if reason not in rec.rejections and len(rec.rejections) >= MAX_REASONS:
            reason = "other"  # reasons can carry numbers the peer chose: its record stays bounded
        rec.rejections[reason] = rec.rejections.get(reason, 0) + 1
        newly = False
        if ban:
            newly = rec.banned_until <= now
            rec.banned_until = now + self.params.blacklist_s
        if self.on_change:
            self.on_change(peer, rec)
        return newly

    def reward(self, peer: str, now: float) -> None:
        rec = self._rec(peer, now)
        rec.accepted += 1
        rec.score = min(self.params.max_score, rec.score + self.params.accept_reward)

    def snapshot(self, now: float) -> dict[str, dict]:
        return {
            p: dict(
                score=round(self.score(p, now), 3),
                banned=self.is_blacklisted(p, now),
                accepted=r.accepted,
                rejections=dict(r.rejections),
                charged=round(r.charged, 3),
            )
            for p, r in list(self._peers.items())
        }
