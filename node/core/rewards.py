"""What a node knows of a lineage's policy from work it verified itself (sans-IO): the mean reward of that
lineage's rollouts in informative groups, over its latest `WINDOW` of them. Rewards are the verifier's, as
the pipeline re-scored them, so no producer's word enters; a producer that sends only its best groups can
raise its own figure, which is why the figure only orders the lineages a node tries
(`node.core.roles.want_mode`) and never admits one: the weights on trial do (`roles.not_worse`)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable

from murmur.training.sampler import Group

WINDOW = 512  # rollouts per lineage: recent enough to follow a lineage that learns


def informative_rewards(groups: Iterable[Group]) -> dict[bytes, list[float]]:
    """Per lineage, the rewards of its rollouts in `groups` whose rewards differ (all-equal groups kept for a
    shared-schedule prompt say nothing a sender did not choose to send)."""
    out: dict[bytes, list[float]] = {}
    for g in groups:
        if g.uniform:
            continue
        out.setdefault(g.lineage, []).extend(float(r.reward) for r in g.rollouts)
    return out


class RewardBook:
    """Per lineage, its latest `window` verified rewards; at most `max_lineages` lineages, the one updated
    longest ago forgotten first."""

    def __init__(self, max_lineages: int, window: int = WINDOW) -> None:
        self.max_lineages = max(1, max_lineages)
        self.window = max(1, window)
        self.rows: OrderedDict[bytes, deque[float]] = OrderedDict()

    def add(self, lineage: bytes, rewards: Iterable[float]) -> None:
        row = self.rows.pop(lineage, None) or deque(maxlen=self.window)
        row.extend(r for r in rewards if math.isfinite(r) and 0.0 <= r <= 1.0)
        self.rows[lineage] = row
        while len(self.rows) > self.max_lineages:
            self.rows.popitem(last=False)

    def add_groups(self, groups: Iterable[Group]) -> None:
        for lineage, rewards in informative_rewards(groups).items():
            self.add(lineage, rewards)

    def mean(self, lineage: bytes) -> float | None:
        """The lineage's mean verified reward, None before any."""
        row = self.rows.get(lineage)
        return sum(row) / len(row) if row else None
