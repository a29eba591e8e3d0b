"""The attack catalogue of issue 15, run by hostile libp2p peers against live nodes, and `murmur bench attacks`.

Each attack is a function `async (Attacker, Knowledge, targets)` (the Attacker counts what it sent)
that a real libp2p host with a valid key runs against live `murmur node start` processes, using
today's wire formats. Each class gets its own fresh key (attackers hold many keys), so an early
attack that gets its key graylisted does not mask the later ones, and the score each key lost on
the honest nodes says whether that class was noticed. An observer host (also hostile, but quiet)
listens to public gossip first: honest announces, manifests and rollout batches are what the
attacks forge against, relay or replay.

`run()` starts a live swarm (a trainer and a follower+validator) and measures it with the whole
catalogue running in a loop, then a control swarm built the same way over the same span of its life
without attack, and returns the JSON object `murmur bench attacks --json` prints.
`tests/test_attacks_live.py` runs the catalogue once against live nodes and asserts the goals.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from murmur.gossip import topics, wire
from murmur.gossip.identity import Identity
from murmur.node.cli import launch
from murmur.node.config import GossipSection
from murmur.sync.ids import Relation

SWARM = "attack-swarm"
GRAYLIST = -50.0
ATTACK_TIMEOUT_S = 30.0  # node.config's default graylist threshold
U64_MAX = 2**63 - 1


# ------------------------------------------------------------------ what the hostile side knows


@dataclass
class Knowledge:
    """Public traffic the observer saw (signed for `swarm`): the raw material of forgeries, relays and replays."""

    swarm: str
    announces: dict[str, tuple[wire.NodeAnnounce, bytes]] = field(default_factory=dict)  # peer id -> newest
    first_announces: dict[str, tuple[wire.NodeAnnounce, bytes]] = field(default_factory=dict)  # peer id -> oldest
    manifests: list[tuple[wire.PatchManifest, bytes]] = field(default_factory=list)
    batches: list[tuple[wire.RolloutBatch, bytes]] = field(default_factory=list)
    task_sets: list[bytes] = field(default_factory=list)
    tokenizer_hash: bytes = b"\x54" * 32  # the public model's tokenizer (attackers know the models)
    model: str | None = None  # the public model's directory: its tokenizer turns a forged text into ids
    _check: Any = field(default=None, init=False, repr=False)

    def honest_manifests(self) -> list[wire.PatchManifest]:
        """Manifests signed by their lineage's publisher (its id derives from the signer's key): the
        hostile hosts' own manifests naming an honest lineage (freeze_manifest_head, capture_lineage)
        are relayed on the announce topic too, and their heads are not the lineage's."""
        from murmur.sync.ids import lineage_id

        out = []
        for m, _ in self.manifests:
            try:
                if lineage_id(bytes(m.publisher), bytes(m.base_model_hash), m.lineage_name) == bytes(m.lineage):
                    out.append(m)
            except ValueError:
                continue
        return out

    def lineage(self) -> wire.PatchManifest | None:
        """The newest honest manifest: names a lineage, its publisher, base model and head."""
        return max(self.honest_manifests(), key=lambda m: m.target_version, default=None)

    def head(self, lineage: bytes) -> int:
        """The newest version of `lineage` its publisher was seen to publish (0: none seen)."""
        return max((m.target_version for m in self.honest_manifests() if bytes(m.lineage) == lineage), default=0)

    def rollout(self) -> wire.Rollout | None:
        """An honest rollout to use as a template (tokenizer hash, lineage, version, lengths), moved up to
        the newest version seen of its lineage: a follower's rollout may already be past a fast
        trainer's staleness bound, and a stale forgery is refused before the check it attacks."""
        tpl = next((b.rollouts[0] for b, _ in reversed(self.batches) if b.rollouts), None)
        if tpl is None:
            return None
        head = self.head(bytes(tpl.lineage))
        if head > tpl.version:
            tpl = msgspec.structs.replace(tpl, version=head, token_versions=[(0, head)])
        return tpl

    def token_check(self) -> Any:
        """The public model's tokenizer as a receiver checks ids with it, loaded once (None: no model
        directory known, or it has no tokenizer)."""
        if self._check is None and self.model is not None:
            from murmur.training.tokencheck import for_model

            self._check = for_model(self.model)
        return self._check

    def at_head(self) -> tuple[wire.Rollout | None, dict[str, Any]]:
        """A template rollout, and `_rollout_like`'s lineage and version for when there is none: the
        newest honest manifest's lineage at its head."""
        tpl = self.rollout()
        if tpl is not None:
            return tpl, {}
        lid, _, _, head = _honest_lineage(self)
        return None, {"lineage": lid, "version": head}

    def take(self, data: bytes) -> None:
        try:
            env, body = wire.open_envelope(data, swarm=self.swarm)
        except Exception:
            return
        if isinstance(body, wire.NodeAnnounce):
            self.announces[body.peer_id] = (body, data)
            self.first_announces.setdefault(body.peer_id, (body, data))
        elif isinstance(body, wire.PatchManifest):
            self.manifests = (self.manifests + [(body, data)])[-64:]
        elif isinstance(body, wire.RolloutBatch):
            self.batches = (self.batches + [(body, data)])[-64:]
        elif isinstance(body, wire.TaskSetManifest):
            self.task_sets = (self.task_sets + [data])[-8:]


class DirectTransport:
    """A live attacker's transport: what it publishes goes straight to every connected target, as
    py-libp2p's direct peers, since a target that pruned this host from its mesh (it holds one slot per
    honest peer it wants) still reads what arrives; everything else is the wrapped transport's."""

    def __init__(self, t: Any, targets: list[str]) -> None:
        self._t = t
        self._targets = set(targets)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    async def publish(self, topic: str, data: bytes) -> None:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        for p in self._targets & set(self._t.peers()):
            pid = ID.from_base58(p)
            self._t.router.direct_peers.setdefault(pid, PeerInfo(pid, []))
        await self._t.pubsub.publish(topic, data)

    async def publish_as(self, ident: Identity, topic: str, data: bytes) -> None:
        """Publish `data` as a pubsub message authored and signed by `ident`, as if this host relayed it:
        a key that never connects to anyone originates it."""
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from libp2p.pubsub.pb import rpc_pb2
        from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX

        from murmur.gossip.host import libp2p_key_pair

        for p in self._targets & set(self._t.peers()):
            pid = ID.from_base58(p)
            self._t.router.direct_peers.setdefault(pid, PeerInfo(pid, []))
        kp = libp2p_key_pair(ident)
        msg = rpc_pb2.Message(
            data=data, topicIDs=[topic], from_id=ID.from_pubkey(kp.public_key).to_bytes(), seqno=os.urandom(8)
        )
        msg.signature = kp.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
        msg.key = kp.public_key.serialize()
        await self._t.pubsub.push_msg(self._t.pubsub.my_id, msg)

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Until py-libp2p's outbound queues to the targets are empty (bounded): a host that closes
        with messages still queued never sent them."""
        with trio.move_on_after(timeout_s):
            while any(len(q) for p, q in list(self._t.pubsub.peer_queues.items()) if p.to_base58() in self._targets):
                await trio.sleep(0.05)


class Attacker:
    """A real libp2p host with its own valid key, connected to the targets and subscribed to the swarm."""

    def __init__(self, transport: Any, ident: Identity, swarm: str, addrs: dict[str, str] | None = None) -> None:
        self.t = transport
        self.addrs = addrs or {}  # peer id -> multiaddr, to redial a target that closed our connection
        self.ident = ident
        self.swarm = swarm
        self.sent = 0
        self.errors = 0
        self.last_error = ""

    async def gossip(self, topic: str, data: bytes) -> None:
        try:
            await self.t.publish(topic, data)
            self.sent += 1
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]

    async def announce(self, data: bytes) -> None:
        await self.gossip(topics.announce(self.swarm), data)

    async def announce_as(self, ident: Identity, data: bytes) -> None:
        """`data` on the announce topic as a message `ident` authored (this host only relays it)."""
        try:
            await self.t.publish_as(ident, topics.announce(self.swarm), data)
            self.sent += 1
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]

    async def rollouts(self, data: bytes) -> None:
        await self.gossip(topics.rollouts(self.swarm), data)

    async def raw(self, peer: str, protocol: str, payload: bytes, linger_s: float = 0.5) -> None:
        """Open `protocol` to `peer`, write `payload` before any signature, reset; redials a closed connection."""
        from libp2p.peer.id import ID

        s = None
        for attempt in range(2):
            try:
                with trio.fail_after(5):
                    if attempt or peer not in self.t.peers():
                        if attempt:
                            await self.t.disconnect(peer)
                        if peer in self.addrs:
                            await self.t.connect(self.addrs[peer])
                    s = await self.t.host.new_stream(ID.from_base58(peer), [protocol])
                break
            except Exception:
                s = None
        if s is None:
            self.errors += 1
            return
        try:
            await s.write(payload)
            self.sent += 1
            with trio.move_on_after(linger_s):
                await s.read(65536)
        except Exception:
            pass
        try:
            await s.reset()
        except Exception:
            pass

    async def open_held(self, peer: str, protocol: str) -> Any:
        """A raw stream to `peer` left open (the caller resets it); None when the node refuses it."""
        from libp2p.peer.id import ID

        try:
            with trio.fail_after(5):
                if peer not in self.t.peers() and peer in self.addrs:
                    await self.t.connect(self.addrs[peer])
                return await self.t.host.new_stream(ID.from_base58(peer), [protocol])
        except Exception:
            self.errors += 1
            return None


Attack = Callable[[Attacker, Knowledge, list[str]], Awaitable[None]]


def _rollout_like(
    tpl: wire.Rollout | None,
    *,
    seed: int,
    ids: list[int] | None = None,
    text: str | None = None,
    version: int | None = None,
    lineage: bytes | None = None,
    honest_reward: bool = True,
    tokenizer: bytes = b"\x54" * 32,
) -> wire.Rollout:
    """A rollout on the built-in task set that passes today's reward check (the text answers the task)."""
    from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
    from murmur.training.verifiers import score

    reg = TaskRegistry(wire.DEFAULT_SWARM)  # only the built-in set, the same in every swarm
    reg.add_builtin()
    ref = wire.TaskRef(task_set=reg.builtin_id, generator=BUILTIN_TRAIN, seed=seed)
    task = reg.resolve(ref)
    text = task.answer if text is None else text
    n = len(ids) if ids is not None else (len(tpl.completion_ids) if tpl else 8)
    ids = ids if ids is not None else (list(tpl.completion_ids) if tpl else [1] * n)
    version = version if version is not None else (tpl.version if tpl else 0)
    return wire.Rollout(
        task=ref,
        lineage=lineage if lineage is not None else (bytes(tpl.lineage) if tpl else b"\x4c" * 32),
        version=version,
        completion_ids=ids,
        text=text,
        tokenizer_hash=bytes(tpl.tokenizer_hash) if tpl else tokenizer,
        logprobs=struct.pack(f"<{n}f", *([-0.5] * n)),
        token_versions=[(0, version)],
        sampling=wire.SamplingParams(max_new_tokens=max(1, min(n, wire.MAX_COMPLETION_TOKENS))),
        reward=score(task, text) if honest_reward else 1.0 - score(task, text),
        created_ms=wire.now_ms(),
    )


def _batch(a: Attacker, rollouts: list[wire.Rollout], swarm: str | None = None, seq: int | None = None) -> bytes:
    return wire.seal(
        a.ident,
        wire.ROLLOUT_BATCH,
        wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=swarm or a.swarm,
            producer=a.ident.public,
            seq=seq if seq is not None else a.sent + 1,
            created_ms=wire.now_ms(),
            rollouts=rollouts,
        ),
        swarm=swarm or a.swarm,
    )  # the envelope is signed for the swarm the batch names


def _announce(a: Attacker, seq: int, **kw: Any) -> bytes:
    base: dict[str, Any] = dict(
        v=wire.FORMAT_VERSION,
        peer_id=a.ident.peer_id,
        seq=seq,
        created_ms=wire.now_ms(),
        hardware="cpu",
        gen_tokens_per_s=10.0,
        rollout_latency_s=1.0,
        upload_bytes_per_s=1e6,
        memory_bytes=2**30,
        roles=["trainer"],
        lineages_followed=[],
    )
    base.update(kw)
    return wire.seal(a.ident, wire.NODE_ANNOUNCE, wire.NodeAnnounce(**base), swarm=a.swarm)


def _manifest(
    a: Attacker, lineage: bytes, name: str, bmh: bytes, base: int, target: int, chunks: int = 1, chunk_bytes: int = 1024
) -> bytes:
    refs = [wire.ChunkRef(os.urandom(32), chunk_bytes) for _ in range(chunks)]
    return wire.seal(
        a.ident,
        wire.PATCH_MANIFEST,
        wire.PatchManifest(
            v=wire.FORMAT_VERSION,
            lineage=lineage,
            lineage_name=name,
            base_model_hash=bmh,
            publisher=a.ident.public,
            base_version=base,
            target_version=target,
            base_hash=b"\x00" * 32,
            target_hash=os.urandom(32),
            codec="sparse-v1",
            total_bytes=chunks * chunk_bytes,
            chunk_bytes=chunk_bytes,
            chunks=refs,
            created_ms=wire.now_ms(),
        ),
        swarm=a.swarm,
    )


def _honest_lineage(k: Knowledge) -> tuple[bytes, str, bytes, int]:
    m = k.lineage()
    if m is None:
        return b"\x4c" * 32, "unknown", b"\x00" * 32, 0
    return bytes(m.lineage), m.lineage_name, bytes(m.base_model_hash), m.target_version


# ------------------------------------------------------------------ the catalogue


async def stream_garbage(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Kill before any signature: 03ffffff on pubsub, random bytes on every protocol of ours."""
    rng = random.Random(1)
    for peer in targets:
        for proto in ("/meshsub/1.1.0", "/meshsub/1.2.0"):
            await a.raw(peer, proto, bytes.fromhex("03ffffff"))
        for proto in (
            "/murmur/chunks/1",
            "/murmur/catalog/1",
            "/murmur/dialback/1",
            "/ipfs/id/push/1.0.0",
            "/libp2p/circuit/relay/0.2.0/hop",
            "/libp2p/dcutr",
        ):
            await a.raw(peer, proto, rng.randbytes(64) + b"\xff" * 8)


async def oversized_frames(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Length prefixes far past every limit, and a pubsub RPC over 1 MiB."""
    for peer in targets:
        await a.raw(peer, "/murmur/chunks/1", b"\xff\xff\xff\xff" + b"\x00" * 64)
        await a.raw(peer, "/murmur/catalog/1", b"\x7f\xff\xff\xff")
        await a.raw(peer, "/meshsub/1.1.0", b"\x80\x80\x80\x01" + b"\x00" * 4096)  # varint 2 MiB


HELD_STREAMS = 40  # past a peer's 32 MiB share of frame buffers at 1 MiB each
HOLD_S = 5.0
IDLE_STREAMS = 600  # far past a peer's 64 inbound streams


async def _hold_then_reset(a: Attacker, held: list[Any]) -> None:
    with trio.move_on_after(HOLD_S):
        await trio.sleep_forever()
    for s in held:
        try:
            await s.reset()
        except Exception:
            pass


async def _each_target(targets: list[str], one: Callable[[str], Awaitable[None]]) -> None:
    """Every target at once: a class that holds streams open for a while holds them on all targets together."""
    async with trio.open_nursery() as n:
        for peer in targets:
            n.start_soon(one, peer)


async def held_frames(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Held streams: dozens of chunk streams each send 1 MiB of an 8 MiB frame and wait."""

    async def one(peer: str) -> None:
        held = []
        for _ in range(HELD_STREAMS):
            s = await a.open_held(peer, "/murmur/chunks/1")
            if s is None:
                break  # the node closed our connection
            held.append(s)
            try:
                with trio.fail_after(5):
                    await s.write(struct.pack(">I", 8 * 2**20) + bytes(2**20))
                a.sent += 1
            except Exception:
                a.errors += 1
        await _hold_then_reset(a, held)

    await _each_target(targets, one)


async def idle_streams(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Host-wide limits one key fills: hundreds of streams opened and never written to."""

    async def one(peer: str) -> None:
        held = []
        for _ in range(IDLE_STREAMS):
            s = await a.open_held(peer, "/murmur/chunks/1")
            if s is not None:
                held.append(s)
                a.sent += 1
        await _hold_then_reset(a, held)

    await _each_target(targets, one)


async def freeze_manifest_head(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """A manifest signed by us naming the honest lineage with a huge target_version."""
    lid, name, bmh, _ = _honest_lineage(k)
    await a.announce(_manifest(a, lid, name, bmh, U64_MAX - 1, U64_MAX))


async def freeze_demand_head(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """A NodeAnnounce demand naming the honest lineage with a huge head_version."""
    lid, name, _, _ = _honest_lineage(k)
    demand = wire.LineageDemand(
        lineage=lid, name=name, head_version=U64_MAX, rollouts_per_step=8, step_time_s=1.0, max_staleness=4
    )
    await a.announce(_announce(a, 1, owned=[demand]))


async def crash_step_time(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """LineageDemand.step_time_s = 5e-324 (math.ceil overflow in the capacity rule)."""
    demand = wire.LineageDemand(
        lineage=os.urandom(32),
        name="tiny-step",
        head_version=1,
        rollouts_per_step=8,
        step_time_s=5e-324,
        max_staleness=4,
    )
    await a.announce(_announce(a, 1, owned=[demand]))


FORGERY_TRIES = 3  # batches per forging class, each from what was last seen, so one reaches a fast trainer fresh
FORGERY_GAP_S = 1.0
FUTURE_AHEAD = 64  # versions past the head seen: more than a fast trainer publishes while the batch travels


async def _forge(a: Attacker, seq: int, make: Callable[[int], list[wire.Rollout]]) -> None:
    """`FORGERY_TRIES` batches a second apart, each `make(try)` built from what was seen by then."""
    for t in range(FORGERY_TRIES):
        await a.rollouts(_batch(a, make(t), seq=seq + t))
        await trio.sleep(FORGERY_GAP_S)


async def crash_vocab(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Rollouts for the honest lineage with correct answers and completion ids outside any vocabulary."""

    def make(t: int) -> list[wire.Rollout]:
        tpl, kw = k.at_head()
        n = len(tpl.completion_ids) if tpl else 8
        return [
            _rollout_like(
                tpl, seed=1000 + 10 * t + i, ids=[2**32 - 1 - j for j in range(n)], tokenizer=k.tokenizer_hash, **kw
            )
            for i in range(8)
        ]

    await _forge(a, 1, make)


async def mislead_ids_vs_text(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """The correct answer text attached to arbitrary (in-vocabulary) token ids: reward 1 for noise."""
    rng = random.Random(2)
    check = k.token_check()
    vocab = check.vocab if check is not None else 200  # past the vocabulary they would be bad_tokens instead

    def make(t: int) -> list[wire.Rollout]:
        tpl, kw = k.at_head()
        n = len(tpl.completion_ids) if tpl else 8
        return [
            _rollout_like(
                tpl,
                seed=2000 + 10 * t + i,
                ids=[rng.randrange(3, vocab) for _ in range(n)],
                tokenizer=k.tokenizer_hash,
                **kw,
            )
            for i in range(8)
        ]

    await _forge(a, 1, make)


async def punish_the_honest(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Relay honest producers' batches first, under our own pubsub origin."""
    for _, data in list(k.batches)[-8:]:
        await a.rollouts(data)


async def capture_lineage(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Claim the honest lineage: a plausible next version signed by us, and our announce owning it."""
    lid, name, bmh, head = _honest_lineage(k)
    await a.announce(_manifest(a, lid, name, bmh, head, head + 1))
    demand = wire.LineageDemand(
        lineage=lid, name=name, head_version=head + 1, rollouts_per_step=64, step_time_s=1.0, max_staleness=4
    )
    await a.announce(_announce(a, 2, owned=[demand]))


async def capture_inflated_demand(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Our own lineage with a demand no one can meet (pulls followers), and manifests of 64 GiB."""
    lid = os.urandom(32)
    await a.announce(
        _manifest(a, lid, "bait", b"\x00" * 32, 0, 1, chunks=wire.MAX_CHUNKS, chunk_bytes=wire.MAX_CHUNK_BYTES)
    )
    demand = wire.LineageDemand(
        lineage=lid,
        name="bait",
        head_version=1,
        rollouts_per_step=1_000_000,
        step_time_s=0.001,
        max_staleness=1_000_000,
    )
    await a.announce(_announce(a, 3, owned=[demand]))


async def starve_verifier(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """The most verification an unannounced key's default bucket lets through: full batches of distinct tasks
    (no task-cache hit), correct answers whose ids are the public tokenizer's, so every batch passes the cheap
    checks and is verified in full. What bounds it is the rate limit and the verification CPU budget."""
    for j in range(STARVE_BATCHES):
        await a.rollouts(_batch(a, _valid_full_batch(k, 3000 + wire.MAX_ROLLOUTS_PER_BATCH * j), seq=10 + j))


STARVE_BATCHES = (
    GossipSection().rate_burst + 20
)  # past an unannounced key's default burst: the rest meet the rate limit


def _valid_full_batch(k: Knowledge, seed: int) -> list[wire.Rollout]:
    """A full batch of correct, honestly scored rollouts at the honest lineage's head, tokenized as a receiver
    checks them: nothing in it is at fault, so only a limit on work can refuse it."""
    tpl, kw = k.at_head()
    check = k.token_check()
    return [_encoded(_rollout_like(tpl, seed=seed + i, **kw), check) for i in range(wire.MAX_ROLLOUTS_PER_BATCH)]


async def forged_reward(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """The classic: correct answers, their ids from the public model's tokenizer (so they pass the
    token check), and a claimed reward of 0 where the recomputed one is 1."""

    def make(t: int) -> list[wire.Rollout]:
        tpl, kw = k.at_head()
        return [
            _encoded(_rollout_like(tpl, seed=4000 + 10 * t + i, honest_reward=False, **kw), k.token_check())
            for i in range(4)
        ]

    await _forge(a, 20, make)


async def misscheduled(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Correct, honestly rewarded rollouts at the honest head, their ids the public tokenizer's, each claiming
    the current round of the shared prompt schedule for a task that is not one of that round's prompts: a
    receiver that pooled them would take them for peers' answers to the prompts it answers itself."""
    from murmur.training.schedule import round_at

    def make(t: int) -> list[wire.Rollout]:
        tpl, kw = k.at_head()
        rnd = round_at(wire.now_ms())
        return [
            msgspec.structs.replace(
                _encoded(_rollout_like(tpl, seed=15_000 + 10 * t + i, **kw), k.token_check()), schedule_round=rnd
            )
            for i in range(4)
        ]

    await _forge(a, 90, make)


def _encoded(r: wire.Rollout, check: Any) -> wire.Rollout:
    """`r` with the public tokenizer's ids for its text (unchanged when there are none)."""
    ids = _encode(check, r.text)
    if ids is None:
        return r
    return msgspec.structs.replace(
        r,
        completion_ids=ids,
        tokenizer_hash=check.hash,
        logprobs=struct.pack(f"<{len(ids)}f", *([-0.5] * len(ids))),
        sampling=wire.SamplingParams(max_new_tokens=max(1, len(ids))),
    )


def _encode(check: Any, text: str) -> list[int] | None:
    """Ids that decode back to exactly `text` under `check` (None: no tokenizer, or no such ids)."""
    if check is None:
        return None
    ids = list(check.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids if ids and check.decode(ids) == text else None


async def future_version(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Rollouts of the honest lineage claiming a version past its head: one far enough ahead that a fast
    trainer has not reached it yet, and the largest, well-formed (their token segments name the same
    version, their ids are the public tokenizer's for their text), so the version is their only fault.
    Provably false at the lineage's publisher (`future_version`)."""
    check = k.token_check()
    tpl = k.rollout()
    head = _honest_lineage(k)[3]
    for j, version in enumerate((head + FUTURE_AHEAD, U64_MAX)):
        rs = []
        for i in range(4):
            r = _rollout_like(tpl, seed=5000 + 10 * j + i, version=version)
            rs.append(msgspec.structs.replace(_encoded(r, check), token_versions=[(0, version)]))
        await a.rollouts(_batch(a, rs, seq=40 + j))


async def flood_announces(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Exhaust: announces, manifests of ever-new lineages and task sets, far past any rate limit."""
    from murmur.training.tasksets import builtin_manifest

    for i in range(60):
        await a.announce(_announce(a, 100 + i))
        await a.announce(_manifest(a, os.urandom(32), f"flood-{i}", b"\x00" * 32, 0, 1))
        await trio.sleep(0.02)  # py-libp2p's outbound queue holds 32 RPCs: a flood it drops is no flood
    m = builtin_manifest(a.ident.public)
    for i in range(20):
        m2 = wire.TaskSetManifest(**{**{f: getattr(m, f) for f in m.__struct_fields__}, "version": 2 + i})
        await a.announce(wire.seal(a.ident, wire.TASK_SET, m2, swarm=a.swarm))
        await trio.sleep(0.02)


async def replay_other_swarm(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Replays: a batch signed for another swarm, and honest announces and manifests sent again verbatim."""
    tpl = k.rollout()
    await a.rollouts(_batch(a, [_rollout_like(tpl, seed=6000)], swarm="another-swarm"))
    for _, data in list(k.announces.values())[:4]:
        await a.announce(data)
    for _, data in k.manifests[-4:]:
        await a.announce(data)


async def markup_strings(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Rich console markup in peer-supplied names: `[/]` in the hardware string and a lineage name."""
    demand = wire.LineageDemand(
        lineage=os.urandom(32), name="[/]", head_version=1, rollouts_per_step=1, step_time_s=1.0, max_staleness=4
    )
    await a.announce(_announce(a, 1, hardware="[/]", roles=["[bold red]x[/]"], owned=[demand]))
    await a.announce(_manifest(a, os.urandom(32), "[/][link=x]", b"\x00" * 32, 0, 1))


async def bad_signature(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """A rollout batch whose envelope signature does not verify."""
    data = bytearray(_batch(a, [_rollout_like(k.rollout(), seed=7000)]))
    data[-5] ^= 0xFF
    await a.rollouts(bytes(data))


async def poison_numbers(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Issue 26: correct, well-formed batches whose behaviour log-probs are NaN (float32 0x7fc00000),
    +inf and positive, and an announce whose rates are NaN and inf: no such float may reach arithmetic."""
    tpl = k.rollout()
    for j, bad in enumerate((bytes.fromhex("0000c07f"), struct.pack("<f", math.inf), struct.pack("<f", 0.5))):
        r = _rollout_like(tpl, seed=8000 + j)
        await a.rollouts(_batch(a, [msgspec.structs.replace(r, logprobs=bad + r.logprobs[4:])], seq=30 + j))
    await a.announce(_announce(a, 1, gen_tokens_per_s=math.nan, rollout_latency_s=math.inf))


async def claim_throughput(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """A follower of the honest lineage claiming a billion tokens/s: on paper it meets the whole demand."""
    lid, _, _, _ = _honest_lineage(k)
    for i in range(3):
        await a.announce(
            _announce(
                a,
                200 + i,
                roles=["follower"],
                serving=lid,
                lineages_followed=[lid],
                gen_tokens_per_s=1e9,
                rollout_latency_s=0.1,
            )
        )
        await trio.sleep(0.05)


async def lineage_by_announce(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Our own lineage on the honest base model, its head rising by announces and by manifests whose
    chunks we never serve, with a huge demand: bait for followers."""
    from murmur.sync.ids import lineage_id

    _, _, bmh, _ = _honest_lineage(k)
    lid = lineage_id(a.ident.public, bmh, "bait-announce")
    for v in range(1, 6):
        demand = wire.LineageDemand(
            lineage=lid, name="bait-announce", head_version=v, rollouts_per_step=4096, step_time_s=1.0, max_staleness=4
        )
        await a.announce(_announce(a, 300 + v, owned=[demand]))
        await a.announce(_manifest(a, lid, "bait-announce", bmh, v - 1, v))
        await trio.sleep(0.05)


async def long_completions(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Correct answers padded to the protocol's 4,096 completion tokens: work out of proportion."""
    tpl = k.rollout()
    n = wire.MAX_COMPLETION_TOKENS
    for j in range(2):
        rs = [_rollout_like(tpl, seed=9000 + 10 * j + i, ids=[1] * n) for i in range(4)]
        await a.rollouts(_batch(a, rs, seq=30 + j))


async def large_batches(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Within the announced-rate ceiling: an announce claiming a modest rate, then full valid batches (see
    `_valid_full_batch`) at about that rate: verification work the rate limit allows."""
    await a.announce(_announce(a, 1, roles=["follower"], gen_tokens_per_s=200.0, rollout_latency_s=1.0))
    for j in range(4):
        await a.rollouts(_batch(a, _valid_full_batch(k, 10_000 + 100 * j), seq=50 + j))
        await trio.sleep(1.0)


async def announce_replay(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Each honest peer's oldest announce seen, relayed verbatim after its newer ones: a stale rate or role
    reset by a message its signer really sent."""
    for peer, (_, data) in list(k.first_announces.items())[:4]:
        if k.announces.get(peer, (None, data))[1] != data:
            await a.announce(data)
    for _, data in list(k.first_announces.values())[:4]:
        await a.announce(data)  # sent even when no newer one was seen: the replay still reaches the wire


async def taskset_takeover(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Every task-set name seen (the built-in one at least) published again under our key at a higher
    version, with a generator of our own: a takeover of another coordinator's name."""
    from murmur.training.tasksets import builtin_manifest

    seen: list[wire.TaskSetManifest] = []
    for data in k.task_sets:
        try:
            body = wire.open_envelope(data, swarm=a.swarm)[1]
        except Exception:
            continue
        if isinstance(body, wire.TaskSetManifest):
            seen.append(body)
    seen.append(builtin_manifest())
    for m in seen[-4:]:
        fields = {f: getattr(m, f) for f in m.__struct_fields__}
        taken = wire.TaskSetManifest(
            **{**fields, "coordinator": a.ident.public, "version": m.version + 1000, "created_ms": wire.now_ms()}
        )
        await a.announce(wire.seal(a.ident, wire.TASK_SET, taken, swarm=a.swarm))


# The mark a payload-poisoning attacker wants the trainer's policy to emit. The built-in verifier ignores
# surrounding whitespace, so a whitespace mark rides on a correct answer at reward 1; spaces, because
# murmur-tiny's tokenizer has no tab or newline (they decode to nothing, so such a text is no policy's).
PAYLOAD = "   "


SYBIL_KEYS = 1000  # fresh keys, each announcing once
SYBIL_PER_S = 100.0  # ... at this rate in all (issue 43: 8,999 keys in 90 s)


def sybil_announce(ident: Identity, swarm: str) -> bytes:
    """`ident`'s first announce, as large as the announce limit allows (addresses and a stand-by list)."""
    addrs = [f"/ip4/10.{i}.0.1/tcp/4001/p2p-circuit/" + "x" * 200 for i in range(16)]
    demand = wire.LineageDemand(
        lineage=hashlib.blake2b(ident.public, digest_size=32).digest(),
        name="sybil",
        head_version=1,
        rollouts_per_step=1,
        step_time_s=1.0,
        max_staleness=1,
        standby=[ident.peer_id] * 200,
    )
    body = wire.NodeAnnounce(
        v=wire.FORMAT_VERSION,
        peer_id=ident.peer_id,
        seq=1,
        created_ms=wire.now_ms(),
        hardware="cpu",
        gen_tokens_per_s=1.0,
        rollout_latency_s=1.0,
        upload_bytes_per_s=1e6,
        memory_bytes=2**30,
        roles=["trainer"],
        lineages_followed=[],
        owned=[demand],
        addrs=addrs,
    )
    return wire.seal(ident, wire.NODE_ANNOUNCE, body, swarm=swarm)


async def sybil_announces(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """State that strangers grow: `SYBIL_KEYS` fresh keys each announce once, every message authored by its
    own key and carried by this host to the first target only; the other target hears them relayed
    (run with `FIRST_TARGET_ONLY`). Measured by the growth of each honest node's state.db."""
    for i in range(SYBIL_KEYS):
        ident = Identity.from_seed(
            hashlib.blake2b(b"sybil/" + a.ident.public + i.to_bytes(4, "big"), digest_size=32).digest()
        )
        await a.announce_as(ident, sybil_announce(ident, a.swarm))
        if i % 10 == 9:
            await trio.sleep(10 / SYBIL_PER_S)  # py-libp2p's outbound queue holds 32 RPCs: a flood it drops is no flood


def payload_text(answer: str) -> str:
    return PAYLOAD + answer


async def payload_poison(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Groups for the honest lineage at its head, tokenized with the public model's tokenizer: half correct
    answers carrying our prefix (reward 1), half wrong answers without it (reward 0), all honestly scored,
    with behaviour log-probs claiming the policy already samples them (near 0): trained on, they teach
    the trainer's own policy to emit the prefix."""
    from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry

    check = k.token_check()
    if check is None:
        return
    reg = TaskRegistry(a.swarm)
    reg.add_builtin()
    tpl = k.rollout()
    lid, _, _, head = _honest_lineage(k)
    version = tpl.version if tpl else head
    for j in range(4):
        rs = []
        seed = 11_000 + j  # one task, eight completions: a group the sampler keeps (a task per rollout never was)
        answer = reg.resolve(wire.TaskRef(reg.builtin_id, BUILTIN_TRAIN, seed)).answer
        for i in range(8):
            text = payload_text(answer) if i % 2 == 0 else answer + "0"
            ids = _encode(check, text)
            if ids is None:  # the model's tokenizer cannot say it: no policy of this model samples it
                continue
            r = _rollout_like(
                tpl,
                seed=seed,
                ids=ids,
                text=text,
                version=version,
                lineage=None if tpl else lid,
                tokenizer=k.tokenizer_hash,
            )
            rs.append(
                msgspec.structs.replace(
                    r,
                    logprobs=struct.pack(f"<{len(ids)}f", *([-0.01] * len(ids))),
                    token_versions=[(0, version)],
                    tokenizer_hash=check.hash,
                )
            )
        if rs:
            await a.rollouts(_batch(a, rs, seq=60 + j))
        await trio.sleep(0.5)


async def _payload_elsewhere(a: Attacker, k: Knowledge, name: str, tokenizer: bytes | None) -> None:
    """`payload_poison`'s groups (the payload on correct answers, wrong answers without it) under our own
    lineage on the honest base model, which we never publish, claiming -999 per token: a claimed
    importance ratio pinned at its cap, on rollouts no receiver can re-score. `tokenizer` None: the public
    model's (its ids are checked); else a tokenizer no receiver holds (re-tokenised from the text)."""
    from murmur.sync.ids import lineage_id
    from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry

    check = k.token_check()
    if check is None:
        return
    _, _, bmh, _ = _honest_lineage(k)
    lid = lineage_id(a.ident.public, bmh, name)
    reg = TaskRegistry(a.swarm)
    reg.add_builtin()
    for j in range(6):
        rs = []
        seed = 12_000 + j  # one task, eight completions: a group the sampler keeps (rewards differ)
        answer = reg.resolve(wire.TaskRef(reg.builtin_id, BUILTIN_TRAIN, seed)).answer
        for i in range(8):
            text = payload_text(answer) if i % 2 == 0 else answer + "0"
            ids = _encode(check, text)
            if ids is None:
                continue
            r = _rollout_like(None, seed=seed, ids=ids, text=text, version=0, lineage=lid)
            rs.append(
                msgspec.structs.replace(
                    r,
                    logprobs=struct.pack(f"<{len(ids)}f", *([-999.0] * len(ids))),
                    token_versions=[(0, 0)],
                    tokenizer_hash=tokenizer or check.hash,
                )
            )
        if rs:
            await a.rollouts(_batch(a, rs, seq=70 + j))
        await trio.sleep(0.25)


async def payload_unowned_lineage(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """The payload under a lineage no one publishes, with the public tokenizer, claiming -999 per token."""
    await _payload_elsewhere(a, k, "payload-unowned", None)


async def payload_foreign_tokenizer(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """The payload under a lineage no one publishes, naming a tokenizer no receiver holds (re-tokenised)."""
    await _payload_elsewhere(a, k, "payload-foreign", b"\x77" * 32)


async def credit_farming(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """Announce as a follower of the honest lineage claiming a billion tokens/s, and deliver for it what no
    trainer can use or check: correct one-rollout "groups" (dropped at the sampler's intake) at the
    honest head with the public tokenizer, and informative groups under a tokenizer no receiver holds.
    Delivered work was what backed a claim in the capacity rule; a credited claim stood honest followers by."""
    tpl, at = k.at_head()
    check = k.token_check()
    lid, _, _, _ = _honest_lineage(k)
    for j in range(8):
        await a.announce(
            _announce(
                a,
                400 + j,
                roles=["follower"],
                serving=lid,
                lineages_followed=[lid],
                gen_tokens_per_s=1e9,
                rollout_latency_s=0.1,
            )
        )
        singles = [_encoded(_rollout_like(tpl, seed=13_000 + 64 * j + i, **at), check) for i in range(32)]
        await a.rollouts(_batch(a, singles, seq=80 + 2 * j))
        seed = 14_000 + j
        foreign = [
            msgspec.structs.replace(_rollout_like(tpl, seed=seed, **at), tokenizer_hash=b"\x77" * 32),
            msgspec.structs.replace(_rollout_like(tpl, seed=seed, text="no", **at), tokenizer_hash=b"\x77" * 32),
        ]
        await a.rollouts(_batch(a, foreign * 8, seq=81 + 2 * j))
        await trio.sleep(0.5)


async def supply_to_follower(a: Attacker, k: Knowledge, targets: list[str]) -> None:
    """To the follower: another follower of the lineage it serves, claiming a billion tokens/s, so that the
    lineage looks over-supplied and the follower leaves its trainer."""
    lid, _, _, _ = _honest_lineage(k)
    for i in range(6):
        await a.announce(
            _announce(
                a,
                500 + i,
                roles=["follower"],
                serving=lid,
                lineages_followed=[lid],
                gen_tokens_per_s=1e9,
                rollout_latency_s=0.1,
            )
        )
        await trio.sleep(0.5)


CATALOGUE: dict[str, Attack] = {
    "stream_garbage": stream_garbage,
    "oversized_frames": oversized_frames,
    "freeze_manifest_head": freeze_manifest_head,
    "freeze_demand_head": freeze_demand_head,
    "crash_step_time": crash_step_time,
    "crash_vocab": crash_vocab,
    "mislead_ids_vs_text": mislead_ids_vs_text,
    "punish_the_honest": punish_the_honest,
    "capture_lineage": capture_lineage,
    "capture_inflated_demand": capture_inflated_demand,
    "starve_verifier": starve_verifier,
    "forged_reward": forged_reward,
    "misscheduled": misscheduled,
    "future_version": future_version,
    "flood_announces": flood_announces,
    "replay_other_swarm": replay_other_swarm,
    "markup_strings": markup_strings,
    "bad_signature": bad_signature,
    "poison_numbers": poison_numbers,
    "held_frames": held_frames,
    "idle_streams": idle_streams,
    "claim_throughput": claim_throughput,
    "lineage_by_announce": lineage_by_announce,
    "long_completions": long_completions,
    "large_batches": large_batches,
    "announce_replay": announce_replay,
    "taskset_takeover": taskset_takeover,
    "payload_poison": payload_poison,
    "payload_unowned_lineage": payload_unowned_lineage,
    "payload_foreign_tokenizer": payload_foreign_tokenizer,
    "credit_farming": credit_farming,
    "supply_to_follower": supply_to_follower,
    "sybil_announces": sybil_announces,
}

# Classes whose host connects to the first target only (the trainer): the other honest node hears them
# relayed, and is the one whose state must not grow although the attacker never connected to it.
FIRST_TARGET_ONLY = frozenset({"sybil_announces"})


# Classes whose messages are provable faults of their sender (a signature, a frame, a recomputed
# reward, decoded ids, a lineage id that does not derive from the signer's key, a rate the sender
# exceeded, a number out of range, a version its publisher never published): each must cost its key
# score. The others are refused or ignored without proof against the sender (a replay, a name with
# markup, a costly but honest payload, streams over a cap, which the node resets).
PROVABLE = frozenset(
    {
        "stream_garbage",
        "oversized_frames",
        "freeze_manifest_head",
        "freeze_demand_head",
        "crash_vocab",
        "mislead_ids_vs_text",
        "punish_the_honest",
        "capture_lineage",
        "forged_reward",
        "misscheduled",
        "flood_announces",
        "bad_signature",
        "poison_numbers",
        "future_version",
        "held_frames",
    }
)


# The rollout-forging classes and the rejection reason their first batch is charged for: each meets the
# check named after it, not an earlier one (a forgery refused as stale or future never reached its check).
FAULTS: dict[str, str] = {
    "crash_vocab": "bad_tokens",
    "mislead_ids_vs_text": "text_mismatch",
    "forged_reward": "forged_reward",
    "misscheduled": "misscheduled",
    "poison_numbers": "bad_number",
    "future_version": "future_version",
}


def attack_key(name: str, round_: int = 0) -> Identity:
    """The fresh key one attack class uses (deterministic, so a report can name it)."""
    return Identity.from_seed(hashlib.blake2b(f"attack/{name}/{round_}".encode(), digest_size=32).digest())


async def observe(transport: Any, k: Knowledge, swarm: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Collect public gossip into `k` until cancelled."""
    ann = await transport.subscribe(topics.announce(swarm))
    rol = await transport.subscribe(topics.rollouts(swarm))

    async def drain(ch: Any) -> None:
        while True:
            _, data = await ch.receive()
            k.take(data)

    async with trio.open_nursery() as n:
        n.start_soon(drain, ann)
        n.start_soon(drain, rol)
        task_status.started()


async def _connect_all(t: Any, addrs: list[str], timeout_s: float = 5.0) -> None:
    """Dial every target at once, each bounded: a frozen target must not hold up the others."""

    async def one(addr: str) -> None:
        with trio.move_on_after(timeout_s):
            try:
                await t.connect(addr)
            except Exception:
                pass

    async with trio.open_nursery() as n:
        for addr in addrs:
            n.start_soon(one, addr)


THE_ATTACKER = "the-attacker"  # the one key that runs the whole catalogue after the first round


async def run_one(
    name: str,
    k: Knowledge,
    addrs: list[str],
    swarm: str,
    res: dict[str, Any],
    round_: int = 0,
    settle_s: float = 1.5,
    ident: Identity | None = None,
    attacked: trio.Event | None = None,
) -> None:
    """Run one attack class from its own host, with `ident` or the class's fresh key; `res` says what it
    sent and how far it got. `attacked` is set once it has sent all it will send, before it settles."""
    from murmur.gossip.host import open_transport

    ident = ident or attack_key(name, round_)
    addrs = addrs[:1] if name in FIRST_TARGET_ONLY else addrs
    res.update(attacker=ident.peer_id, sent=0, errors=0, phase="start")
    print(f"attack {name} (round {round_}) from {ident.peer_id}", file=sys.stderr, flush=True)
    async with open_transport(ident) as t:
        by_id = {x.rsplit("/p2p/", 1)[-1]: x for x in addrs}
        direct = DirectTransport(t, list(by_id))
        a = Attacker(direct, ident, swarm, by_id)
        await t.subscribe(topics.announce(swarm))
        await t.subscribe(topics.rollouts(swarm))
        res["phase"] = "connect"
        await _connect_all(t, addrs)
        if round_ == 0:
            # A fresh key is refused by no defence, so a connection that closed while starting (py-libp2p
            # races there now and then) is this harness's, and is redialled: else the class would publish
            # to nobody. A later round's key is banned by then, and a refusal is the node's answer.
            with trio.move_on_after(10):
                while missing := [x for p, x in by_id.items() if p not in t.peers()]:
                    await trio.sleep(0.2)
                    await _connect_all(t, missing)
        res["phase"] = "subscribed"
        wanted = (topics.announce(swarm), topics.rollouts(swarm))
        with trio.move_on_after(10):  # a target that has not told us its topics would drop what we send
            while not all(set(t.peers()) & set(a.addrs) <= set(t.topic_peers(tp)) for tp in wanted):
                await trio.sleep(0.1)
        res["phase"] = "attack"
        try:
            with trio.move_on_after(ATTACK_TIMEOUT_S):
                await CATALOGUE[name](a, k, [x.rsplit("/p2p/", 1)[-1] for x in addrs])
            await direct.flush()
        finally:
            res.update(sent=a.sent, errors=a.errors, last_error=a.last_error)
        res["phase"] = "settle"
        if attacked is not None:
            attacked.set()
        await trio.sleep(settle_s)  # let the messages land before the host goes
        res["phase"] = "done"


async def run_catalogue(
    addrs: list[str],
    swarm: str,
    *,
    rounds: int = 1,
    observe_s: float = 5.0,
    stop: Callable[[], bool] = lambda: False,
    names: list[str] | None = None,
    tokenizer_hash: bytes | None = None,
    model: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Observe the swarm, then run every attack class `rounds` times (after the first, until `stop()`).

    The first round gives each class its own fresh key, so the score each key lost says whether that
    class was noticed; later rounds run the whole catalogue from one key (`THE_ATTACKER`), the single
    hostile peer whose fate `attacker_graylisted` reports.

    With `rounds` ≥ 2 both the per-class round and one round of the single attacker always run.
    `tokenizer_hash` is that of the model the swarm runs (public knowledge), for forged rollouts when
    no honest rollout was seen to copy it from; `model` that model's directory (its tokenizer)."""
    from murmur.gossip.host import open_transport

    k = Knowledge(swarm, model=model)
    if tokenizer_hash is not None:
        k.tokenizer_hash = tokenizer_hash
    out: dict[str, dict[str, Any]] = {}
    async with open_transport(Identity.from_seed(b"\xa7" * 32)) as obs, trio.open_nursery() as n:
        await n.start(observe, obs, k, swarm)
        await _connect_all(obs, addrs)
        with trio.move_on_after(observe_s):  # honest manifests and batches to forge against
            while not (k.manifests and k.batches):
                await trio.sleep(0.25)
        for r in range(rounds):
            ran: list[tuple[str, dict[str, Any]]] = []
            # In the first round every class has its own key, so a class's host settles while the next
            # class attacks; later rounds share one key, which two live hosts cannot hold at once.
            async with trio.open_nursery() as settling:
                for name in names or list(CATALOGUE):
                    if r > 1 and stop():  # the first two rounds (fresh keys, then the one attacker) always run whole
                        break
                    res: dict[str, Any] = {}
                    ran.append((name, res))
                    attacked, ended = trio.Event(), trio.Event()
                    settling.start_soon(
                        _run_bounded,
                        name,
                        k,
                        addrs,
                        swarm,
                        res,
                        r,
                        attack_key(THE_ATTACKER) if r > 0 else None,
                        attacked,
                        ended,
                    )
                    await (attacked if r == 0 else ended).wait()
            for name, res in ran:
                prev = out.setdefault(name, {"attackers": [], "sent": 0, "errors": 0, "phases": []})
                prev["attackers"] = sorted(set(prev["attackers"]) | {res["attacker"]})
                prev["sent"] += res["sent"]
                prev["errors"] += res["errors"]
                prev["phases"].append(res["phase"])  # "done", or where a timeout stopped it
                if res.get("last_error"):
                    prev["last_error"] = res["last_error"]
            if r > 0 and stop():
                break
        n.cancel_scope.cancel()
    return out


async def _run_bounded(
    name: str,
    k: Knowledge,
    addrs: list[str],
    swarm: str,
    res: dict[str, Any],
    round_: int,
    ident: Identity | None,
    attacked: trio.Event,
    ended: trio.Event,
) -> None:
    try:
        with trio.move_on_after(ATTACK_TIMEOUT_S + 30):
            await run_one(name, k, addrs, swarm, res, round_, ident=ident, attacked=attacked)
    finally:
        attacked.set()  # a class that timed out before its attack ended releases the next one too
        ended.set()


# ------------------------------------------------------------------ live swarm (benchmark and slow test)


def node_config(roles: list[str], model: Path, swarm: str = SWARM) -> dict[str, dict[str, Any]]:
    return {
        "node": {"swarm": swarm, "roles": roles, "memory_budget_mb": 1536},
        "network": {"dht": False},
        "sync": {"publish_every": 2, "anchor_every": 8, "retain_versions": 32, "max_staleness": 4},
        "training": {"model": str(model)},
    }


def model_tokenizer_hash(model: Path) -> bytes | None:
    from murmur.training.tokencheck import for_model

    check = for_model(str(model))
    return check.hash if check is not None else None


@dataclass
class LiveSwarm:
    """A trainer and a follower+validator as `murmur node start` processes on 127.0.0.1."""

    homes: dict[str, Path]
    procs: dict[str, launch.NodeProcess]

    def status(self, name: str) -> Any:
        return self.procs[name].status(5.0)

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs.values())

    def addrs(self) -> list[str]:
        out = []
        for n in self.homes:
            s = self.status(n)
            if s is not None and s.listen:
                out.append(s.listen[0])
        return out

    def peer_ids(self) -> list[str]:
        return [s.peer_id for s in (self.status(n) for n in self.homes) if s is not None]

    def stop(self) -> None:
        launch.stop_all(self.procs.values())


def start_swarm(root: Path, model: Path, swarm: str = SWARM, timeout: float = 300.0) -> LiveSwarm:
    """Start the trainer, then the follower+validator bootstrapped to it; return once patches flow."""
    homes = {"trainer": root / "trainer", "follower": root / "follower"}
    specs = [
        launch.NodeLaunch(
            home=str(h), config=node_config(["trainer"] if n == "trainer" else ["follower", "validator"], model, swarm)
        )
        for n, h in homes.items()
    ]
    sw = LiveSwarm(homes, dict(zip(homes, launch.start_bootstrapped(specs, timeout))))
    try:
        launch.wait_until(
            "follower applying the trainer's patches",
            lambda: (getattr(sw.status("follower"), "versions_applied", 0) or 0) >= 2,
            sw.procs.values(),
            timeout,
        )
    except BaseException:
        sw.stop()
        raise
    return sw


@dataclass
class Window:
    """Honest progress over one measurement window."""

    train_steps: int = 0
    versions_applied: int = 0
    external_used: int = 0  # swarm rollouts that entered the trainer's updates
    max_stall_ms: float = 0.0
    alive: bool = True
    seconds: float = 0.0
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # each node's network process (not its worker)

    def rate(self, what: str) -> float:
        return getattr(self, what) / self.seconds if self.seconds > 0 else 0.0

    def brief(self) -> dict[str, Any]:
        return {
            "train_steps": self.train_steps,
            "versions_applied": self.versions_applied,
            "external_used": self.external_used,
            "seconds": round(self.seconds, 1),
        }


MAX_WINDOW_S = 1800.0


def process_rss_mb(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def state_db_mb(homes: dict[str, Path]) -> dict[str, float]:
    """Each node's state.db with its write-ahead log, in MiB."""
    from murmur.node.store import DB_FILE

    out = {}
    for n, h in homes.items():
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += (h / (DB_FILE + suffix)).stat().st_size
            except OSError:
                pass
        out[n] = total / 2**20
    return out


def followers_kept(statuses: dict[str, Any]) -> bool:
    """The honest follower serves the honest trainer's own lineage and the trainer counts it (not stood by)."""
    t, f = statuses.get("trainer"), statuses.get("follower")
    if t is None or f is None:
        return False
    own = [v for v in t.lineages if v.relation == Relation.OWN]
    return any(f.serving == v.lineage and f.peer_id not in v.standby for v in own)


def own_lineage(status: Any) -> str | None:
    return (
        next((v.lineage for v in status.lineages if v.relation == Relation.OWN), None) if status is not None else None
    )


def measure(sw: LiveSwarm, seconds: float, until: Callable[[], bool] = lambda: True) -> Window:
    """Poll both nodes once a second for at least `seconds` and until `until()` (at most MAX_WINDOW_S);
    progress is the difference between the ends."""
    t0, f0 = sw.status("trainer"), sw.status("follower")
    w = Window()
    start = time.monotonic()
    while time.monotonic() < start + MAX_WINDOW_S and (time.monotonic() < start + seconds or not until()):
        for n in sw.homes:
            s = sw.status(n)
            if s is not None:
                w.max_stall_ms = max(w.max_stall_ms, s.loop_stall_recent_ms)
            rss = process_rss_mb(sw.procs[n].pid)
            if rss is not None:
                w.peak_rss_mb[n] = max(w.peak_rss_mb.get(n, 0.0), rss)
        if not sw.alive():
            w.alive = False
            break
        time.sleep(1.0)
    w.seconds = time.monotonic() - start
    t1, f1 = sw.status("trainer"), sw.status("follower")
    if None in (t0, f0, t1, f1):
        w.alive = w.alive and None not in (t1, f1)
        return w
    w.train_steps = t1.steps - t0.steps
    w.versions_applied = f1.versions_applied - f0.versions_applied
    w.external_used = t1.rollouts_used - t0.rollouts_used
    return w


def penalties(sw: LiveSwarm, honest: set[str], attackers: set[str]) -> tuple[float, dict[str, float]]:
    """Score charged to honest peers over the whole run (summed over what the honest nodes think of
    each other: every penalty, including those a peer has since earned back), and each attacker's
    lowest score on any honest node."""
    lost = 0.0
    worst: dict[str, float] = {}
    for n in sw.homes:
        s = sw.status(n)
        if s is None:
            continue
        lost += sum(v for peer, v in s.peer_charged.items() if peer in honest)
        for peer, score in s.peer_scores.items():
            if peer in attackers:
                worst[peer] = min(worst.get(peer, 0.0), score)
    return lost, worst


NICE = 0  # the attacker competes for the same cores as the honest nodes (harder than on the internet)


def start_attacker(
    addrs: list[str], window_s: float, tokenizer_hash: bytes | None, out: Path, model: Path | None = None
) -> subprocess.Popen:
    """The hostile peers in their own process, at the honest nodes' priority (at a lower one they
    lose the race for the two cores and half the classes never reach the mesh)."""
    args = json.dumps(
        {
            "addrs": addrs,
            "window_s": window_s,
            "out": str(out),
            "model": str(model) if model else None,
            "tokenizer_hash": tokenizer_hash.hex() if tokenizer_hash else None,
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "murmur.simulations.bench.attacks", args],
        preexec_fn=lambda: os.nice(NICE),
        cwd=str(Path(__file__).resolve().parents[2]),
    )


def _attacker_main(args: dict[str, Any]) -> None:
    deadline = time.monotonic() + float(args["window_s"])
    tok = bytes.fromhex(args["tokenizer_hash"]) if args.get("tokenizer_hash") else None
    results = trio.run(
        lambda: run_catalogue(
            list(args["addrs"]),
            SWARM,
            rounds=100,
            tokenizer_hash=tok,
            observe_s=20,
            stop=lambda: time.monotonic() > deadline,
            model=args.get("model"),
        )
    )
    Path(args["out"]).write_text(json.dumps(results))


START_AGE_S = 45.0  # swarm age at which both runs start measuring (both nodes are up and patches flow by then)
PLACEBO_PERIOD_S = 0.1


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_placebo(cores: float) -> list[subprocess.Popen]:
    """Processes that use `cores` of CPU (busy for that share of every 100 ms) at the attacker's priority
    and do nothing else: the control swarm shares the machine with them as the attacked one shared it
    with the hostile process, whose own CPU would be its own on the internet."""
    procs = []
    while cores > 0.005:
        share = min(1.0, cores)
        cores -= share
        code = (
            "import time\n"
            f"p, busy = {PLACEBO_PERIOD_S}, {PLACEBO_PERIOD_S * share}\n"
            "while True:\n"
            "    t = time.monotonic()\n"
            "    while time.monotonic() - t < busy: pass\n"
            "    time.sleep(max(0.0, p - (time.monotonic() - t)))\n"
        )
        procs.append(subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.nice(NICE)))
    return procs


def start_measuring_at(sw_started: float, age_s: float) -> float:
    """Wait until the swarm is `age_s` old (a no-op past it); the age the measurement starts at."""
    left = sw_started + age_s - time.monotonic()
    if left > 0:
        time.sleep(left)
    return time.monotonic() - sw_started


def models_finite(home: Path, swarm: str) -> tuple[bool, int]:
    """(no NaN or inf in any model state a node holds, how many states were scanned): the newest state
    of every lineage it stores, replayed from an anchor and its patches (signed for the node's `swarm`)
    and checked against the signed hash, every anchor, and every follower checkpoint."""
    import torch
    from safetensors.torch import load_file

    from murmur.sync.errors import PatchError
    from murmur.sync.patchstore import LineageStore

    states: list[dict[str, Any]] = []
    for d in sorted((home / "lineages").glob("*")) if (home / "lineages").is_dir() else []:
        try:
            store = LineageStore(home, bytes.fromhex(d.name))
            head = store.head()
            if head is not None:
                states.append(store.load_state(head, swarm=swarm))
        except (ValueError, PatchError):
            continue  # not replayable here (no anchor at or below the head): its files are scanned below
    for f in sorted(home.rglob("*.safetensors")):
        states.append(load_file(str(f)))
    finite = all(bool(torch.isfinite(t).all()) for s in states for t in s.values() if t.is_floating_point())
    return finite, len(states)


PAYLOAD_PROMPTS = 32
PAYLOAD_SAMPLES = 4


def payload_share(home: Path, model: Path, lineage: str, swarm: str = SWARM) -> float | None:
    """Share of completions the node's newest state of `lineage` (hex) samples (temperature 1, built-in
    tasks) that start with the poisoning payload; None when the node holds no replayable state of it."""
    import torch

    from murmur.sync.errors import PatchError
    from murmur.sync.patchstore import LineageStore
    from murmur.training.engine import Sampling
    from murmur.training.engine_hf import HFEngine
    from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry

    try:
        store = LineageStore(home, bytes.fromhex(lineage))
        head = store.head()
        state = (head, store.load_state(head, swarm=swarm)) if head is not None else None
    except (ValueError, PatchError):
        state = None
    if state is None:
        return None
    torch.manual_seed(0)
    engine = HFEngine.from_path(model, device="cpu", seed=0)
    loaded = engine.model.load_state_dict(state[1], strict=False)
    if loaded.unexpected_keys or len(loaded.missing_keys) == len(engine.model.state_dict()):
        return None  # not this model's state: sampling the base model would measure nothing
    reg = TaskRegistry(swarm)
    reg.add_builtin()
    prompts = [
        reg.resolve(wire.TaskRef(reg.builtin_id, BUILTIN_TRAIN, 90_000 + i)).prompt for i in range(PAYLOAD_PROMPTS)
    ]
    groups = engine.generate(prompts, PAYLOAD_SAMPLES, Sampling(temperature=1.0, max_new_tokens=16))
    texts = [c.text for g in groups for c in g]
    return sum(t.startswith(PAYLOAD) for t in texts) / max(1, len(texts))


def run(window_s: float = 60.0, root: Path | None = None) -> dict[str, Any]:
    """`murmur bench attacks`: two swarms built the same way, measured over the same span of their
    lives: one under the whole catalogue, one left alone (the control).

    A swarm's own progress drifts as it ages: the trainer's policy sharpens, whole groups come out
    alike, and a step with nothing to learn from costs a fraction of one that has (its step time fell
    from 0.13 to 0.03 s within four minutes). A window before or after the attack in the same swarm
    therefore measures a different swarm; the control at the same age does not. The hostile process
    runs on the same cores as the honest nodes; the control runs beside a placebo that uses as much
    CPU and sends nothing, so the ratios measure what handling the attack costs the honest nodes."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="murmur-attacks-")) if root is None else root
    model = launch.build_tiny_model(tmp / "model")
    tok = model_tokenizer_hash(model)
    print("starting the swarm to attack", file=sys.stderr)
    started = time.monotonic()
    sw = start_swarm(tmp / "attacked", model)
    try:
        honest = set(sw.peer_ids())
        attack_age = start_measuring_at(started, START_AGE_S)
        addrs = sw.addrs()
        print(
            f"attack window from age {attack_age:.0f} s: at least {window_s:.0f} s and the whole catalogue once",
            file=sys.stderr,
        )
        cpu0 = children_cpu_s()  # no other child is reaped until the attacker is
        db0 = state_db_mb(sw.homes)
        hostile = start_attacker(addrs, window_s, tok, tmp / "attacker.json", model)
        under = measure(sw, window_s, until=lambda: hostile.poll() is not None)
        db_growth = {n: round(v - db0[n], 2) for n, v in state_db_mb(sw.homes).items()}
        try:
            hostile.wait(120)
        except subprocess.TimeoutExpired:
            hostile.kill()
            hostile.wait(10)
        attacker_cores = (children_cpu_s() - cpu0) / max(under.seconds, 1e-9)
        results: dict[str, dict[str, Any]] = {}
        if (tmp / "attacker.json").is_file():
            results = json.loads((tmp / "attacker.json").read_text())
        attackers = {p for r in results.values() for p in r.get("attackers", [])}
        lost, worst = penalties(sw, honest, attackers)
        the_attacker = attack_key(THE_ATTACKER).peer_id
        seen_by = [
            s.peer_scores[the_attacker]
            for s in (sw.status(n) for n in sw.homes)
            if s is not None and the_attacker in s.peer_scores
        ]
        class_keys = {name: [p for p in r["attackers"] if p != the_attacker] for name, r in results.items()}
        statuses = {n: sw.status(n) for n in sw.homes}
        alive = sw.alive() and under.alive and all(s is not None for s in statuses.values())
        kept = followers_kept(statuses)
        lineage = own_lineage(statuses["trainer"])
    finally:
        sw.stop()
    scanned = {n: models_finite(h, SWARM) for n, h in sw.homes.items()}  # after the stop: follower checkpoints written
    share = payload_share(sw.homes["trainer"], model, lineage) if lineage else None
    print(f"control swarm, measured over the same ages ({attack_age:.0f} s + {under.seconds:.0f} s)", file=sys.stderr)
    started = time.monotonic()
    control_sw = start_swarm(tmp / "control", model)
    try:
        control_age = start_measuring_at(started, attack_age)
        placebo = start_placebo(attacker_cores)
        db0 = state_db_mb(control_sw.homes)
        try:
            control = measure(control_sw, under.seconds)
            db_growth_without = {n: round(v - db0[n], 2) for n, v in state_db_mb(control_sw.homes).items()}
        finally:
            for p in placebo:
                p.kill()
                p.wait(10)
        lost_without = penalties(control_sw, set(control_sw.peer_ids()), set())[0]
        control_statuses = {n: control_sw.status(n) for n in control_sw.homes}
        control_lineage = own_lineage(control_statuses["trainer"])
    finally:
        control_sw.stop()
    share_without = payload_share(control_sw.homes["trainer"], model, control_lineage) if control_lineage else None
    rss_ratios = [
        under.peak_rss_mb[n] / control.peak_rss_mb[n] for n in under.peak_rss_mb if control.peak_rss_mb.get(n)
    ]
    return {
        "attacks_run": len(results),
        # per class: messages or streams sent, and the lowest score its keys have on an honest node
        # (None: no honest node holds a record of them, i.e. not charged)
        "attacks": {
            name: {
                "sent": r["sent"],
                "score": min((worst[p] for p in class_keys[name] if p in worst), default=None),
                "provable": name in PROVABLE,
            }
            for name, r in sorted(results.items())
        },
        "honest_nodes_alive": alive,
        # None where the node's status does not report restarts (no supervision to count them)
        "honest_worker_restarts": (
            sum(int(s.worker_restarts) for s in statuses.values() if s is not None)
            if all(hasattr(s, "worker_restarts") for s in statuses.values() if s is not None)
            else None
        ),
        "honest_workers": {
            n: f"{s.worker} {s.worker_error[:120]}".strip() for n, s in statuses.items() if s is not None
        },
        # every model state the attacked nodes hold (published, applied, checkpointed) scanned for NaN/inf
        "honest_models_finite": all(ok for ok, _ in scanned.values()),
        "honest_model_states_scanned": {n: k for n, (_, k) in scanned.items()},
        # the honest follower still serves the honest trainer's lineage, counted by it, at the end
        "followers_kept": kept,
        "followers_kept_without": followers_kept(control_statuses),
        # share of the trainer's own completions (its newest state, sampled here) starting with
        # payload_poison's mark, under attack minus in the control
        "payload_share": share,
        "payload_share_without": share_without,
        "payload_share_delta": (
            round(share - share_without, 4) if share is not None and share_without is not None else None
        ),
        # peak RSS of each honest node's network process (its worker excluded) over the window
        "honest_rss_mb": {n: round(v, 1) for n, v in under.peak_rss_mb.items()},
        "honest_rss_mb_without": {n: round(v, 1) for n, v in control.peak_rss_mb.items()},
        "rss_ratio": round(max(rss_ratios), 3) if rss_ratios else None,
        # growth of each honest node's state.db (with its log) over the window, in MiB: `sybil_announces`
        # reaches the follower only relayed, and must not grow either within its disk budgets
        "state_db_growth_mb": db_growth,
        "state_db_growth_mb_without": db_growth_without,
        # what the attack added to a node's state.db: its growth under attack beyond the control's over the
        # same span (the ledger grows with honest work too), the worst node
        "state_db_growth_over_control_mb": (
            round(max(db_growth[n] - db_growth_without.get(n, 0.0) for n in db_growth), 2)
            if db_growth and db_growth_without
            else None
        ),
        "honest_penalties": round(lost, 3),
        "honest_penalties_without": round(lost_without, 3),
        # the one key that ran the catalogue after the first round: graylisted on every honest node
        "attacker_graylisted": len(seen_by) == len(statuses) and all(v < GRAYLIST for v in seen_by),
        "attacker_scores": [round(v, 1) for v in seen_by],
        "attacker_rounds": max((len(r["phases"]) for r in results.values()), default=0) - 1,
        # first round, one fresh key per class: the classes whose fault is provable, each key graylisted
        "provable_classes_graylisted": sorted(
            n for n in PROVABLE & set(results) if any(worst.get(p, 0.0) < GRAYLIST for p in class_keys[n])
        ),
        "provable_classes": len(PROVABLE & set(results)),
        "attackers_seen": len(worst),
        "attackers_graylisted": sum(1 for v in worst.values() if v < GRAYLIST),
        "attackers_total": len(attackers),
        "train_steps_without": control.train_steps,
        "train_steps_under_attack": under.train_steps,
        # progress per second under attack / in the control swarm at the same age
        "train_steps_ratio": (
            round(under.rate("train_steps") / control.rate("train_steps"), 3) if control.train_steps else None
        ),
        "versions_applied_without": control.versions_applied,
        "versions_applied_under_attack": under.versions_applied,
        "versions_applied_ratio": (
            round(under.rate("versions_applied") / control.rate("versions_applied"), 3)
            if control.versions_applied
            else None
        ),
        "external_used_without": control.external_used,
        "external_used_under_attack": under.external_used,
        # swarm rollouts the trainer trained on per second, under attack / in the control at the same age
        "external_used_ratio": (
            round(under.rate("external_used") / control.rate("external_used"), 3) if control.external_used else None
        ),
        "max_event_loop_stall_ms": round(under.max_stall_ms, 1),
        "max_event_loop_stall_ms_without": round(control.max_stall_ms, 1),
        "control_alive": control.alive,
        # CPU the hostile process used, in cores over the attack window; the control ran beside a
        # placebo process using as much (it shares the machine's cores, which on the internet it would not)
        "attacker_cores": round(attacker_cores, 3),
        "stream_faults": {n: dict(s.stream_faults) for n, s in statuses.items() if s is not None},
        "window_s": round(window_s, 1),
        "attack_window_s": round(under.seconds, 1),
        "windows": {
            "attack": {**under.brief(), "start_age_s": round(attack_age, 1)},
            "control": {**control.brief(), "start_age_s": round(control_age, 1)},
        },
    }


if __name__ == "__main__":
    _attacker_main(json.loads(sys.argv[1]))
