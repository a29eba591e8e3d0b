"""GossipSub topic names: one set per swarm, versioned so a format change gets new topics."""

from __future__ import annotations

from gossip.errors import ConfigError

TOPIC_VERSION = 1


def _check(swarm: str) -> str:
    if not swarm or "/" in swarm or len(swarm) > 128:
        raise ConfigError(f"swarm name {swarm!r} must be 1-128 characters without '/'")
    return swarm


def rollouts(swarm: str) -> str:
    """Signed RolloutBatch envelopes."""
    return f"/murmur/{_check(swarm)}/rollouts/{TOPIC_VERSION}"


def announce(swarm: str) -> str:
    """Signed TaskSetManifest, PatchManifest and NodeAnnounce envelopes (and big-payload adverts)."""
    return f"/murmur/{_check(swarm)}/announce/{TOPIC_VERSION}"
