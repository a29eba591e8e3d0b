"""One simulated node's state (`VNode`), and the modelled model every simulated node starts from."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.gossip.intake import BatchIntake
from murmur.gossip.validation import Pipeline
from murmur.node.core.machine import NodeCore
from murmur.simulations.adversary import Adversary
from murmur.simulations.scenario import NodeSpec
from murmur.sync.items import StoredItem
from murmur.training.sampler import Sampler

TOKENIZER = hashlib.blake2b(b"murmur/sim-tokenizer", digest_size=32).digest()
BASE_MODEL = hashlib.blake2b(b"murmur/sim-base-model", digest_size=32).digest()  # every node's base model
LINEAGE_NAME = "sim"
MODEL_PATCHES = 8  # the modelled model state weighs this many patches (the core's manifest size check reads it)
TOKENS_PER_ROLLOUT = 8  # the modelled completions' max_new_tokens: what throughput is counted in


def identity_for(seed: int, index: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(f"murmur-sim/{seed}/{index}".encode(), digest_size=32).digest())


def item_bytes(patch_bytes: int, kind: str) -> int:
    """The size of a stored item of `kind`: a patch, or an anchor (the whole modelled model)."""
    return patch_bytes * (MODEL_PATCHES if kind == "anchor" else 1)


def stored_items(items: dict[tuple[str, int, int], bytes], patch_bytes: int) -> list[StoredItem]:
    """What a node's lineage store holds of one lineage (`VNode.store`), as the runtime lists it."""
    return [StoredItem(k, b, t, item_bytes(patch_bytes, k)) for (k, b, t) in items]


@dataclass
class Alone:
    """A trainer's compute-matched twin: I local groups a step, its own draws and its own clock."""

    skill: float
    rng: random.Random
    clock: float | None = None  # virtual time its steps have reached (None: the node has not stepped)
    until: float = 0.0  # the end of the node's last step: time the node was away is not the twin's either
    curve: list[tuple[float, float]] = field(default_factory=list)  # (t, skill) after each of its steps


@dataclass
class VNode:
    """One simulated node: its network process is a real `NodeCore` and its own pipeline; its worker is
    modelled (skill, held version, the worker's real `Sampler`)."""

    spec: NodeSpec
    ident: Identity
    peer_id: str
    lineage: bytes  # the lineage this node publishes when it trains (sync.ids.lineage_id of its key)
    skill: float
    iso_skill: float
    rng: random.Random
    alone: Alone | None = None  # trainers: the compute-matched twin
    # its gossip service's batch intake (pipeline, exchange gate, counters, shard count): every node's, set up by
    # simulations.virtual before it runs
    intake: BatchIntake = field(init=False)
    core: NodeCore | None = None  # None for adversaries (they send hostile bytes, they run no node)
    sampler: Sampler | None = None  # trainers: the worker's external-rollout sampler
    adversary: Adversary | None = None  # adversaries: what they send
    alive: bool = False
    inc: int = 0  # incarnation: events scheduled before a leave are ignored after it
    version: int = 0  # trainers: own lineage version
    steps: int = 0
    neighbours: list[int] = field(default_factory=list)  # rollout gossip
    ctrl: list[int] = field(default_factory=list)  # announces and manifests: neighbours + follow edges
    # the modelled worker
    following: bytes | None = None  # the lineage the core told it to follow (pipe.Follow)
    admitted: bool = False  # pipe.Admit: the core's staleness admission
    pace: float = 0.0  # pipe.Pace: rollouts/s cap (0 = none)
    held_lineage: bytes | None = None
    held: int = 0  # the version of held_lineage the worker holds (0: the base model)
    evaluated: tuple[bytes, int] | None = None  # the (lineage, version) of its last modelled held-out reading
    store: dict[bytes, dict[tuple[str, int, int], bytes]] = field(default_factory=dict)  # item -> manifest envelope
    transfers: dict[bytes, tuple[bytes, wire.PatchManifest, float]] = field(default_factory=dict)
    reward_sum: float = 0.0
    iso_sum: float = 0.0
    curve: list[tuple[float, float]] = field(default_factory=list)  # trainers: (t, skill) after each step
    consumed_ext: int = 0
    adv_accepted: int = 0
    patch_delay: float = 0.0
    shards: tuple[int, ...] = ()  # rollout shards subscribed
    duplicates: int = 0  # copies of a batch it already had
    # what its worker runs now: trainer | follower | adversary (an auto node starts as a trainer, and its
    # core may switch it: `Workers.restart`)
    role: str = ""

    def __post_init__(self) -> None:
        self.role = self.role or ("trainer" if self.spec.role == "auto" else self.spec.role)

    @property
    def pipeline(self) -> Pipeline:
        """Its gossip service's validation pipeline (scores outlive its cores, as a node's do)."""
        return self.intake.pipeline
