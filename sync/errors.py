"""The errors of the sync layer: a patch or anchor that cannot be applied, stored or read back."""

from __future__ import annotations

from murmur.gossip.errors import MurmurError


class PatchError(MurmurError):
    """A patch cannot be applied: wrong base, corrupt or missing chunk, bad hash."""


class NonFiniteWeights(PatchError):
    """A state, patch or anchor would put a non-finite value (NaN, +-inf) into a weight. Raised by a
    follower for a patch whose signed, hash-checked content does so (the publisher's provable fault),
    and by a publisher that refuses to sign such a version."""
