"""The thin trio layer that wires the libp2p host and the verification pipeline.

Rollout batches move on shard topics: `set_shards` joins and leaves them as the
node's exchange plan (`gossip.exchange`) says, and `publish_rollouts` sends a
batch to the shard of its lineage. What happens to each batch copy is
`gossip.intake.BatchIntake`'s rule (sans-IO, shared with the virtual-time
simulator): a validator that does not train first keeps only its sample
(`sample`, `gossip.exchange.Sample`); between the pipeline's cheap checks
(decode, signature, ranges) and verification each batch passes the exchange's
gate (newcomer budget per shard, then the shard of its lineages); `stats`
counts what was received, verified and dropped, and why.

Rollout batches are verified inside a py-libp2p topic validator, so a batch
that fails is neither delivered nor forwarded: the cheap stages run on the
event loop, task regeneration and reward recomputation in a worker thread
(`trio.to_thread.run_sync`), so the loop never stalls on CPU work. Accepted
batches go to the ledger (signed bytes kept) and to `on_accept` (the node hands
them to its trainer's sampler, `training/sampler.py`); rejections past
the cheap gate are recorded with their reason. A peer proven to forge is
blacklisted in pubsub and disconnected (py-libp2p does not disconnect it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from murmur.gossip import exchange, topics, wire
from murmur.gossip.errors import DecodeError
from murmur.gossip.identity import peer_id_from_public
from murmur.gossip.intake import BatchIntake, Dropped
from murmur.gossip.ratelimit import NEW_KEYS_BURST, NEW_KEYS_PER_S, NewKeys, TokenBuckets
from murmur.gossip.transport import PublishError
from murmur.gossip.validation import Pending, Pipeline, Reason, Verdict, rollout_id

log = logging.getLogger("murmur.gossip.service")

# Cheap-gate rejections are not written to the ledger: a flood must not become disk writes.
_UNRECORDED = {Reason.GRAYLISTED, Reason.BLACKLISTED, Reason.RATE_LIMITED, Reason.OVER_ANNOUNCED_RATE, Reason.DUPLICATE}
VERIFY_THREADS = 2  # threads waiting on the verifier pool at once
MULTI_TOPIC_PENALTY = 10.0  # like a malformed message: an honest node publishes each message to one topic
MAX_ANNOUNCE_VERDICTS = 8192  # announce-topic messages whose verdict is remembered for their copies
ANNOUNCE_KINDS = (wire.TASK_SET, wire.PATCH_MANIFEST, wire.NODE_ANNOUNCE)

AnnounceHandler = Callable[[str, Any, bytes], Awaitable[None]]  # (originator, body, envelope bytes)


class GossipService:
    def __init__(
        self,
        transport: Any,
        pipeline: Pipeline,
        swarm: str,
        store: Any | None = None,
        announce_rate_per_s: float = 10.0,
        announce_burst: int = 40,
        new_keys_per_s: float = NEW_KEYS_PER_S,
        new_keys_burst: float = NEW_KEYS_BURST,
    ) -> None:
        if swarm != pipeline.config.swarm:
            raise ValueError(f"gossip service for swarm {swarm!r} given a pipeline for {pipeline.config.swarm!r}")
        self.transport = transport
        self.pipeline = pipeline
        self.swarm = swarm
        self.store = store
        self.rollout_topic = topics.rollouts(swarm, 0)  # the only shard while the swarm has one
        # what decides each batch copy (sans-IO): its `stats`, `gate`, `shards` and `sample` are this service's
        self.intake = BatchIntake(pipeline)
        self._shard_scopes: dict[int, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self.announce_topic = topics.announce(swarm)
        self._handlers: dict[str, list[AnnounceHandler]] = {}
        self._announce_buckets = TokenBuckets(announce_rate_per_s, announce_burst)
        self.new_keys = NewKeys(new_keys_per_s, new_keys_burst)  # relayed announces of keys not heard before
        self._announce_verdicts: OrderedDict[bytes, bool] = OrderedDict()  # (origin, message) digest -> verdict
        # Verification threads have their own limiter, so a flood waiting on the verifier pool
        # never holds the tokens of trio's default one (ledger writes, the worker link).
        self._verify_limiter = trio.CapacityLimiter(VERIFY_THREADS)
        self._changed = trio.Event()
        self.accepted_batches = 0
        self.on_accept: Callable[[Verdict], None] | None = None  # e.g. latency probes
        # CPU the calling thread's verifier-pool calls used so far (the node injects its pool's meter)
        self.child_cpu: Callable[[], float] = lambda: 0.0

    # ------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe, install validators, and drain the topics until cancelled.

        Batches accepted before a restart are remembered first (from the ledger's signed payloads),
        so peers' replays of them after the restart are duplicates, not a second acceptance."""
        if self.store is not None:
            limit = self.pipeline.config.replay_entries
            for data in await trio.to_thread.run_sync(self.store.accepted_payloads, limit):
                self.pipeline.remember(bytes(data))
        self.transport.set_validator(self.announce_topic, self._validate_announce)
        if hasattr(self.transport, "on_multi_topic"):
            self.transport.on_multi_topic = self._multi_topic
        announces = await self.transport.subscribe(self.announce_topic)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.set_shards(*exchange.first_subscription())
            nursery.start_soon(self._drain_announces, announces)
            task_status.started()

    async def set_shards(self, shards: int, subscribe: tuple[int, ...]) -> None:
        """Join the rollout shards `subscribe` (and leave the others) of a swarm of `shards` shards."""
        if self._nursery is None:
            raise RuntimeError("set_shards before run()")
        self.shards = max(1, int(shards))
        want = set(subscribe)
        for j in [j for j in self._shard_scopes if j not in want]:
            self._shard_scopes.pop(j).cancel()
            await self.transport.unsubscribe(topics.rollouts(self.swarm, j))
        for j in sorted(want - set(self._shard_scopes)):
            topic = topics.rollouts(self.swarm, j)
            self.transport.set_validator(topic, functools.partial(self._validate_rollouts, j))
            channel = await self.transport.subscribe(topic)
            scope = self._shard_scopes[j] = trio.CancelScope()
            self._nursery.start_soon(self._drain_rollouts, channel, scope)

    @property
    def subscribed_shards(self) -> tuple[int, ...]:
        return tuple(sorted(self._shard_scopes))

    @property
    def stats(self) -> exchange.Stats:
        return self.intake.stats

    @property
    def gate(self) -> exchange.ShardGate:
        return self.intake.gate

    @property
    def shards(self) -> int:
        return self.intake.shards

    @shards.setter
    def shards(self, value: int) -> None:
        self.intake.shards = value

    @property
    def sample(self) -> exchange.Sample | None:
        return self.intake.sample

    @sample.setter
    def sample(self, value: exchange.Sample | None) -> None:
        self.intake.sample = value

    def on_announce(self, kind: str, handler: AnnounceHandler) -> None:
        if kind not in ANNOUNCE_KINDS:
            raise ValueError(f"{kind!r} is not an announce kind ({', '.join(ANNOUNCE_KINDS)})")
        self._handlers.setdefault(kind, []).append(handler)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until `predicate()` holds, re-checked after every accepted batch; TooSlowError on timeout."""
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    # ------------------------------------------------------------ publish
    async def publish_rollouts(self, data: bytes, shard: int = 0) -> None:
        """Publish our own signed RolloutBatch to rollout shard `shard`; PublishError when it cannot go out."""
        env = wire.decode_envelope(data, wire.ROLLOUT_BATCH, swarm=self.swarm)
        if env.signer != self.transport.identity.public:
            raise PublishError("a node publishes only rollout batches it produced and signed itself")
        self.pipeline.mark_own(data)
        await self.transport.publish(topics.rollouts(self.swarm, shard), data)

    async def publish_announce(self, data: bytes) -> None:
        wire.decode_envelope(data, swarm=self.swarm)
        await self.transport.publish(self.announce_topic, data)

    # ------------------------------------------------------------ rollouts
    async def _validate_rollouts(self, shard: int, forwarder: str, origin: str, data: bytes) -> bool:
        step = self.intake.admit(shard, forwarder, origin, data)
        if isinstance(step, Dropped):
            return False
        if isinstance(step, Pending):
            try:
                cpu_s = await trio.to_thread.run_sync(
                    verify_timed, self.pipeline.verify, step, self.child_cpu, limiter=self._verify_limiter
                )
            except BaseException:
                self.pipeline.abandon(step)
                raise
            step = self.intake.commit(step, cpu_s)
        await self._settle(step, forwarder)
        return step.accepted

    async def _settle(self, v: Verdict, forwarder: str) -> None:
        if v.accepted and v.batch is not None:
            self.accepted_batches += 1
            if self.store is not None:
                await trio.to_thread.run_sync(self.store.record_rollouts, _accepted_entries(v.batch, v.data, forwarder))
            if self.on_accept is not None:
                self.on_accept(v)
            self._changed.set()
            self._changed = trio.Event()
            return
        if self.store is not None and v.reason not in _UNRECORDED:
            entry = dict(
                rollout_id=v.msg_id or wire.content_id(v.data[:4096]),
                direction="received",
                status="rejected",
                reason=v.reason.value,
                from_peer=v.origin,
                producer=bytes(v.batch.producer) if v.batch is not None else None,
            )
            await trio.to_thread.run_sync(self.store.record_rollouts, [entry])
        if v.newly_banned:
            log.warning("banning %s: %s (%s)", v.origin, v.reason.value, v.detail)
            try:
                self.transport.blacklist(v.origin)
            except Exception as e:  # not connected, or already gone
                log.debug("blacklist %s: %s", v.origin, e)
            await self.transport.disconnect(v.origin)
            if self.store is not None:
                rec = self.pipeline.scores.record(v.origin)
                until = int(rec.banned_until * 1000) if rec is not None else 0
                await trio.to_thread.run_sync(
                    self.store.set_peer_score,
                    v.origin,
                    self.pipeline.scores.score(v.origin, self.pipeline.clock()),
                    until,
                )

    async def _drain_rollouts(self, channel: Any, scope: trio.CancelScope) -> None:
        # Delivery already happened in the validator; draining keeps py-libp2p's 32-slot buffer empty.
        with scope:
            while True:
                await channel.receive()

    def _multi_topic(self, origin: str) -> None:
        """A message naming several topics: its originator signed that list (a provable fault)."""
        self.stats.drop("multi_topic")
        if origin:
            self.pipeline.scores.penalise(origin, "multi_topic", MULTI_TOPIC_PENALTY, self.pipeline.clock())

    # ------------------------------------------------------------ announces
    async def _validate_announce(self, forwarder: str, origin: str, data: bytes) -> bool:
        now = time.monotonic()
        if self.pipeline.scores.is_blacklisted(origin, self.pipeline.clock()):
            return False
        # Every mesh peer relays a message, and py-libp2p validates concurrent copies before it marks
        # one seen: a copy of a message already judged keeps that verdict and spends no token.
        key = hashlib.blake2b(origin.encode() + b"\0" + data, digest_size=16).digest()
        verdict = self._announce_verdicts.get(key)
        if verdict is None:
            verdict = self._judge_announce(forwarder, origin, data, now)
            self._announce_verdicts[key] = verdict
            while len(self._announce_verdicts) > MAX_ANNOUNCE_VERDICTS:
                self._announce_verdicts.popitem(last=False)
        return verdict

    def _judge_announce(self, forwarder: str, origin: str, data: bytes, now: float) -> bool:
        if not self._announce_buckets.take(origin, now):
            self.stats.drop("announce_rate_limited")
            # Over the rate is the originator's provable fault only on a copy it sent us itself: a
            # relayed copy may be another peer's replay of messages it sent long ago.
            if forwarder == origin:
                self.pipeline.scores.penalise(origin, "announce_rate_limited", 1.0, self.pipeline.clock())
            return False
        try:
            env, _ = wire.open_envelope(data, swarm=self.swarm)
        except wire.WrongSwarm:  # signed for another swarm: replayed here
            self.pipeline.scores.penalise(origin, "announce_wrong_swarm", 5.0, self.pipeline.clock())
            return False
        except DecodeError:
            self.pipeline.scores.penalise(origin, "announce_invalid", 10.0, self.pipeline.clock())
            return False
        if env.kind not in ANNOUNCE_KINDS:
            return False
        # Keys are free and each one's first announce passes its own bucket: keys not heard before share
        # one node-wide rate, so a flood of fresh keys neither grows this node's peer state nor is relayed on.
        # The key is the envelope's signer (whose state it would grow), whichever pubsub author carried it.
        signer = peer_id_from_public(env.signer)
        if not self.new_keys.admit(signer, now, direct=forwarder == origin == signer):
            self.stats.drop("announce_new_key_rate")
            return False
        return True

    async def _drain_announces(self, channel: Any) -> None:
        while True:
            origin, data = await channel.receive()
            try:
                env, body = wire.open_envelope(data, swarm=self.swarm)
            except DecodeError:
                continue
            for handler in self._handlers.get(env.kind, ()):
                try:
                    await handler(origin, body, data)
                except Exception:
                    log.exception("announce handler for %s failed", env.kind)


def verify_timed(verify: Callable[[Pending], Any], step: Pending, child_cpu: Callable[[], float]) -> float:
    """Run `verify` in this thread; return the CPU-seconds it cost: this thread's own
    (`time.thread_time`) plus what the verifier processes it called spent (`child_cpu`)."""
    t0, c0 = time.thread_time(), child_cpu()
    verify(step)
    return (time.thread_time() - t0) + (child_cpu() - c0)


def _accepted_entries(batch: wire.RolloutBatch, data: bytes, forwarder: str) -> list[dict[str, Any]]:
    """Ledger rows of an accepted batch, its signed bytes on the first row."""
    return [
        dict(
            rollout_id=rollout_id(r),
            direction="received",
            status="accepted",
            producer=bytes(batch.producer),
            from_peer=forwarder,
            lineage=bytes(r.lineage),
            version=r.version,
            task_set=bytes(r.task.task_set),
            generator=r.task.generator,
            task_seed=r.task.seed,
            reward=r.reward,
            tokens=len(r.completion_ids),
            payload=data if i == 0 else None,
        )
        for i, r in enumerate(batch.rollouts)
    ]
