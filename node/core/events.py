"""The events a node core takes and the actions it returns (see `node.core.machine`): plain frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from murmur.gossip import exchange, wire
from murmur.gossip.identity import peer_id_from_public
from murmur.gossip.scoring import Penalise  # one penalty action for every machine
from murmur.node import pipe
from murmur.node.core.rewards import informative_rewards
from murmur.sync.ids import Relation
from murmur.sync.items import StoredItem
from murmur.training import sampler

# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class ListenAddrs:
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AnnounceHeard:
    signer: bytes  # the envelope's verified signer
    body: wire.NodeAnnounce
    data: bytes  # the envelope, to persist for discovery


@dataclass(frozen=True, slots=True)
class ManifestHeard:
    body: wire.PatchManifest  # wire checked publisher == envelope signer


@dataclass(frozen=True, slots=True)
class PeerGone:
    peer_id: str


@dataclass(frozen=True, slots=True)
class FromWorker:
    msg: pipe.FromWorker  # decoded and checked once, by node.pipe


@dataclass(frozen=True, slots=True)
class WorkerExited:
    code: int | None


@dataclass(frozen=True, slots=True)
class StoredItems:
    lineage: bytes
    items: tuple[StoredItem, ...]


@dataclass(frozen=True, slots=True)
class ManifestOffered:
    """The broadcast heard a signed manifest and asks whether to fetch it: the core answers `Accept` (and
    counts the transfer as in flight from now) or `Decline`, in the same `handle` call."""

    manifest: wire.PatchManifest


@dataclass(frozen=True, slots=True)
class TransferDone:
    pid: bytes
    manifest: wire.PatchManifest


@dataclass(frozen=True, slots=True)
class PatchStored:
    manifest: wire.PatchManifest
    bytes_in: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CatalogReceived:
    peer: str
    lineage: bytes
    items: tuple[StoredItem, ...]


@dataclass(frozen=True, slots=True)
class CatalogFailed:
    peer: str
    lineage: bytes
    error: str


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """The runtime started a (new) worker process."""


@dataclass(frozen=True, slots=True)
class LineageKnown:
    """A lineage the node's store holds from an earlier run (loaded before the first tick)."""

    lineage: bytes
    name: str
    relation: Relation
    publisher: bytes
    base: bytes
    held: int


@dataclass(frozen=True, slots=True)
class RolloutsPublished:
    """A `Publish(Topic.ROLLOUTS)` went out: its rollouts count as published (a failed publish is not fed)."""

    count: int


@dataclass(frozen=True, slots=True)
class OfferFailed:
    """A `RequestOffer` that did not bring a manifest (dial, stream, decode or not held): the core asks the next
    source at once instead of waiting out its catch-up patience."""

    peer: str
    lineage: bytes
    error: str


@dataclass(frozen=True, slots=True)
class RolloutsVerified:
    """A rollout batch this node's pipeline accepted: who produced how many rollouts for which lineage (the
    exchange's inbound meter), and how many of them a trainer could learn from: rollouts in informative
    groups (the sampler's own rule), per lineage and tokenizer (what a follower's claimed throughput is
    credited against, `node.core.credit`)."""

    producer: str  # peer id of the batch's signer
    lineages: tuple[tuple[bytes, int], ...]  # (lineage, rollouts)
    usable: tuple[tuple[bytes, bytes, int], ...] = ()  # (lineage, tokenizer hash, rollouts in informative groups)
    # (lineage, the verified rewards of its rollouts in informative groups): what `node.core.rewards` keeps
    rewards: tuple[tuple[bytes, tuple[float, ...]], ...] = ()

    @classmethod
    def of(cls, batch: wire.RolloutBatch) -> RolloutsVerified:
        n: dict[bytes, int] = {}
        for r in batch.rollouts:
            lid = bytes(r.lineage)
            n[lid] = n.get(lid, 0) + 1
        u: dict[tuple[bytes, bytes], int] = {}
        groups = sampler.split(batch.rollouts)[0]
        for g in groups:
            if g.uniform:  # kept only to join a receiver's own group of its task: not work a trainer uses as sent
                continue
            for r in g.rollouts:
                k = (g.lineage, bytes(r.tokenizer_hash))
                u[k] = u.get(k, 0) + 1
        return cls(
            peer_id_from_public(bytes(batch.producer)),
            tuple(n.items()),
            tuple((lid, tok, c) for (lid, tok), c in u.items()),
            tuple((lid, tuple(rs)) for lid, rs in informative_rewards(groups).items()),
        )


@dataclass(frozen=True, slots=True)
class SwarmHeard:
    """What the announce topic says swarm-wide, summed: the producers other than this node that announce a
    publishing rate, and the rollout batches/s announced per lineage, this node's own last announce included
    (the core takes its own out). The peer table sums the announces a node is fed as `AnnounceHeard`; a driver
    that delivers fewer announces than the live topic carries sums the topic itself and feeds the sums here
    (the virtual simulator, whose announces travel one hop, before each `Tick`). The core plans the rollout
    exchange from the last sums fed while they are no older than `node.core.peertable.PEER_EXPIRY_S`, as it
    counts a peer's announce, and from its peer table otherwise. `supply` is read when the core plans."""

    producers: int
    supply: exchange.Supply


Event = (
    Tick
    | ListenAddrs
    | AnnounceHeard
    | ManifestHeard
    | ManifestOffered
    | PeerGone
    | FromWorker
    | WorkerExited
    | WorkerStarted
    | LineageKnown
    | StoredItems
    | TransferDone
    | PatchStored
    | CatalogReceived
    | CatalogFailed
    | OfferFailed
    | RolloutsVerified
    | RolloutsPublished
    | SwarmHeard
)


# ---------------------------------------------------------------- actions


class Topic(StrEnum):
    """Where a `Publish` goes: the announce topic, or a rollout shard topic (`Publish.shard`)."""

    ANNOUNCE = "announce"
    ROLLOUTS = "rollouts"


@dataclass(frozen=True, slots=True)
class Publish:
    topic: Topic
    data: bytes
    count: int = 0  # rollouts in a rollout batch
    shard: int = 0  # rollouts: the shard topic (gossip.exchange.shard_of its lineage)


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Join exactly these rollout shards (gossip.exchange plan) of a swarm of `shards` shards."""

    shards: int
    subscribe: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ToWorker:
    msg: pipe.ToWorker


@dataclass(frozen=True, slots=True)
class RestartWorker:
    delay_s: float
    roles: tuple[str, ...] = ()  # the roles the new worker runs with (empty: the node's roles as they are)


@dataclass(frozen=True, slots=True)
class RecordRollouts:
    entries: tuple[dict[str, Any], ...]  # node.store.record_rollouts rows


@dataclass(frozen=True, slots=True)
class SeedVersion:
    envelope: bytes  # our worker's new version: seed it on the broadcast


@dataclass(frozen=True, slots=True)
class StorePatch:
    pid: bytes  # the completed transfer to store in the lineage store


@dataclass(frozen=True, slots=True)
class DropItem:
    lineage: bytes
    base: int
    target: int


@dataclass(frozen=True, slots=True)
class LoadStored:
    lineage: bytes


@dataclass(frozen=True, slots=True)
class FetchCatalog:
    peer: str
    lineage: bytes


@dataclass(frozen=True, slots=True)
class RequestOffer:
    peer: str
    lineage: bytes
    item: StoredItem


@dataclass(frozen=True, slots=True)
class SeePeer:
    peer_id: str
    public: bytes
    addrs: tuple[str, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class Accept:
    """Fetch the offered manifest's patch (the answer to `ManifestOffered`)."""


@dataclass(frozen=True, slots=True)
class Decline:
    """Do not fetch the offered manifest's patch."""


@dataclass(frozen=True, slots=True)
class ResendTaskSets:
    """A new peer appeared: the runtime sends our own task sets again (they are not re-gossiped otherwise)."""


@dataclass(frozen=True, slots=True)
class Log:
    msg: str
    fields: dict[str, Any] = field(default_factory=dict)


Action = (
    Publish
    | Subscribe
    | ToWorker
    | RestartWorker
    | RecordRollouts
    | SeedVersion
    | StorePatch
    | DropItem
    | LoadStored
    | FetchCatalog
    | RequestOffer
    | Penalise
    | SeePeer
    | ResendTaskSets
    | Accept
    | Decline
    | Log
)
