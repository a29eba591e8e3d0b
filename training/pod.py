"""A pod's trainer yields its own generation to its followers (`[training] pod_yield`).

A trainer with followers (a pod) still generating all `local_groups` of its own groups a step spends about the
generation share g of its CPU on rollouts its followers could have made, so the pod stays below its ceiling
1 / (1 - g). With `pod_yield` the trainer counts the informative groups of its own lineage that the swarm
delivered (its followers'; nothing another lineage sends counts) and generates that many fewer of its own: one
delivered informative group stands for 1 / p own groups, p being the measured informative share of its own
groups, since its followers send only informative groups and it keeps only its informative ones. The groups it
no longer generates are room for as many more external groups, so a step's batch keeps its size and its
training CPU goes to its followers' rollouts.

Bounded both ways: the trainer always generates at least `local_groups` / `MIN_OWN_DIVISOR` (at least one) of
its own groups, which keep its success rate, its log-prob reference and its published rollouts measured; and
the counts are running means over a few steps, so a pod whose followers stop delivering returns to generating
all its groups within a few steps. Sans-IO: counts in, a number out; the trainer feeds it each step.
"""

from __future__ import annotations

import math
from typing import Final

MIN_OWN_DIVISOR: Final = 8  # the trainer keeps generating at least local_groups / 8 of its own groups
DECAY: Final = 0.5  # weight of the past in the running means: a change counts in full within a few steps
PRIOR_INFORMATIVE: Final = 0.5  # the informative share assumed before the trainer measured one
MIN_INFORMATIVE: Final = 0.1  # one delivered group never stands for more than 1 / 0.1 own groups


class PodYield:
    """How many own groups a pod's trainer generates next step (`quota`), from what its followers delivered."""

    def __init__(self, local_groups: int) -> None:
        self.local_groups = max(1, local_groups)
        self.delivered = 0.0  # running mean: informative own-lineage groups from the swarm per step
        self.informative = PRIOR_INFORMATIVE  # running mean: informative share of the trainer's own groups

    @property
    def floor(self) -> int:
        return max(1, math.ceil(self.local_groups / MIN_OWN_DIVISOR))

    def observe(self, delivered: int, own_groups: int, own_informative: int) -> None:
        """One step: `delivered` informative groups of this lineage came from the swarm; of the `own_groups`
        the trainer generated, `own_informative` were informative (a step with none leaves the share)."""
        self.delivered = DECAY * self.delivered + (1.0 - DECAY) * max(0, delivered)
        if own_groups > 0:
            share = min(max(own_informative / own_groups, 0.0), 1.0)
            self.informative = DECAY * self.informative + (1.0 - DECAY) * share

    def quota(self) -> int:
        """Own groups to generate next step: `local_groups` less those the deliveries stand for, never below
        the floor."""
        stands_for = self.delivered / max(self.informative, MIN_INFORMATIVE)
        return max(self.floor, self.local_groups - math.floor(stands_for))
