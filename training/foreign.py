"""The keys of the foreign-rollout corrections (HACPO's, TOPR's, rescue selection and the share cap), named
alike in `[training]` of the node config and in `TrainerConfig`, with HACPO's defaults and their ranges.

Torch-free: the node process builds the worker's trainer spec from these names, and only the worker
loads torch. What each key does is in docs/training.md ("Other models' rollouts").
"""

from __future__ import annotations

from typing import Final

HACPO_DELTA: Final = 0.2  # HACPO's stepwise clip: lower bound 1 - delta + k * step (its reference config's values)
HACPO_STEP: Final = 0.025
HACPO_ALPHA: Final = 1.0  # HACPO's exponential importance sampling power
CAPABILITY_CLIP: Final = 10.0  # HACPO's bound on a capability ratio (coefficient and baseline)

# steps an own group of a scheduled prompt may wait for peers' answers to it: each step waited makes its own
# samples one version staler, and the decoupled loss corrects only so far
MAX_FOREIGN_WAIT: Final = 4

FOREIGN_KEYS: Final = (
    "foreign_pool",
    "foreign_baseline",
    "foreign_ratio_clip",
    "foreign_clip_delta",
    "foreign_clip_step",
    "foreign_alpha",
    "foreign_capability",
    "foreign_capability_max",
    "foreign_topr",
    "foreign_rescue",
    "foreign_share_max",
    "foreign_wait",
    "foreign_split",
    "foreign_prompt_ref",
    "foreign_rows",
    "foreign_rows_rescue",
)

# the valid range of each numeric key (the node config's Meta bounds say the same; a test holds them equal)
FOREIGN_RANGES: Final[dict[str, tuple[float, float]]] = {
    "foreign_clip_delta": (0.0, 1.0),
    "foreign_clip_step": (0.0, 1.0),
    "foreign_alpha": (0.0, 8.0),
    "foreign_capability_max": (1.0 / CAPABILITY_CLIP, CAPABILITY_CLIP),
    "foreign_share_max": (0.0, 1.0),
    "foreign_wait": (0, MAX_FOREIGN_WAIT),
}
