"""GossipSub topic names: one set per swarm, versioned so a format change gets new topics.

Rollouts move on shard topics (`gossip.exchange` decides which a node joins and publishes to)."""

from __future__ import annotations

from murmur.gossip.errors import ConfigError

TOPIC_VERSION = 1
ROLLOUTS_VERSION = 2  # 2: sharded


def _check(swarm: str) -> str:
    if not swarm or "/" in swarm or len(swarm) > 128:
        raise ConfigError(f"swarm name {swarm!r} must be 1-128 characters without '/'")
    return swarm


def rollouts(swarm: str, shard: int = 0) -> str:
    """Signed RolloutBatch envelopes of one shard (a swarm of fewer than 16 producers has one: shard 0)."""
    if not 0 <= shard < 1 << 20:
        raise ConfigError(f"shard {shard} out of range")
    return f"/murmur/{_check(swarm)}/rollouts/{ROLLOUTS_VERSION}/{shard}"


def rollout_shard(swarm: str, topic: str) -> int | None:
    """The shard index of a rollouts topic of `swarm`, or None when `topic` is not one."""
    prefix = f"/murmur/{_check(swarm)}/rollouts/{ROLLOUTS_VERSION}/"
    tail = topic[len(prefix) :] if topic.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and len(tail) <= 7 else None


def announce(swarm: str) -> str:
    """Signed TaskSetManifest, PatchManifest and NodeAnnounce envelopes (and big-payload adverts)."""
    return f"/murmur/{_check(swarm)}/announce/{TOPIC_VERSION}"
