"""PODS down-sampling: a trainer updates on the most informative subset of the groups it has (sans-IO, pure).

PODS (Xu et al., "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement Learning",
arXiv 2504.13818) generates n rollouts and updates on m < n of them, chosen by max-variance down-sampling:
the subset whose rewards have the largest variance. In the paper the rule works inside one prompt's group
(n completions, keep m; the best subset is the k highest and m - k lowest rewards for some k, which for
0/1 rewards means as many right as wrong answers as the group allows).

Murmur applies the same criterion one level up, to whole groups, and that is the only rule implemented
here: of the n informative groups a step has (its own and the swarm's, each a task's completions with
their GRPO advantages), the trainer updates on the m whose reward variance is largest
(`training.select_groups`; 0 = all). Choosing the m largest variances maximises the summed variance of
the groups kept, the paper's objective summed over groups; for 0/1 rewards a group's variance is p(1 - p)
with p its share of right answers, so the groups closest to half right come first. Whole groups are kept
because a pod's followers generate whole groups: what down-sampling saves is the trainer's cost per group
generated, and a group's advantages stay those of all its completions (the paper's rollout-level rule,
which recomputes them over the subset, is not implemented).

Ties keep arrival order (a step lists its own groups first, then the swarm's), so the choice is
deterministic; the groups kept are returned in arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_SELECT_GROUPS = 1024


def reward_variance(rewards: Sequence[float]) -> float:
    """Population variance of one group's rewards (0 for fewer than two)."""
    if len(rewards) < 2:
        return 0.0
    mean = sum(rewards) / len(rewards)
    return sum((r - mean) ** 2 for r in rewards) / len(rewards)


def max_variance_groups(groups: Sequence[Sequence[float]], m: int) -> list[int]:
    """Indices (ascending) of the `m` groups whose reward variance is largest, ties to the earlier group;
    every index when `m` is 0 or at least the number of groups."""
    if m < 0:
        raise ValueError("m must be >= 0 (0: keep every group)")
    if m == 0 or m >= len(groups):
        return list(range(len(groups)))
    var = [reward_variance(g) for g in groups]
    ranked = sorted(range(len(groups)), key=lambda i: -var[i])  # stable: ties stay in arrival order
    return sorted(ranked[:m])
