"""A node's intake of rollout batches, sans-IO: the one rule that decides what happens to a batch copy that
reaches a subscriber of its shard, between GossipSub's dedup and delivery.

Steps: a validator that does not train first keeps only its sample (`exchange.Sample`); the pipeline's
cheap checks (`Pipeline.admit`: decode, signature, ranges, rate, replay); the exchange's gate
(`exchange.ShardGate`: newcomer budget per shard, then the shard of its lineages); verification
(`Pipeline.verify`, CPU-only: the caller runs it where it likes); the verdict (`commit`). `stats` counts what
was received, verified and dropped, and why.

`gossip.service.GossipService` runs it inside py-libp2p's topic validator (verification in a worker thread);
the virtual-time simulator (`simulations/vruntime.py`) runs the same object on the virtual clock.

    step = intake.admit(shard, forwarder, origin, data)
    if isinstance(step, Pending):
        pipeline.verify(step)                 # or in a thread; `pipeline.abandon(step)` if that is cancelled
        step = intake.commit(step, cpu_s)     # a Verdict
    # step: Dropped (refused before the pipeline's verdict) or Verdict, already counted in `stats`
"""

from __future__ import annotations

from dataclasses import dataclass

from murmur.gossip import exchange, wire
from murmur.gossip.identity import peer_id_from_public
from murmur.gossip.validation import Pending, Pipeline, Verdict

UNSAMPLED = "unsampled"


@dataclass(frozen=True, slots=True)
class Dropped:
    """A batch refused before the pipeline's verdict: outside a validator's sample (`UNSAMPLED`), or refused by
    the exchange's gate (its reason: newcomer budget, wrong shard)."""

    reason: str


class BatchIntake:
    """One node's rollout-batch intake: its pipeline, its exchange gate and counters, the shard count it
    believes, and a non-training validator's sample."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.stats = exchange.Stats()
        self.gate = exchange.ShardGate()
        self.shards = 1  # the shard count this node believes (its exchange plan's)
        # a validator that does not train verifies a sample of each producer's batches (exchange.Sample)
        self.sample: exchange.Sample | None = None

    def admit(self, shard: int, forwarder: str, origin: str, data: bytes) -> Pending | Verdict | Dropped:
        """A copy of a batch reached us on `shard` from `forwarder`: a Pending to verify, a Verdict already
        reached (counted), or Dropped (counted)."""
        now = self.pipeline.clock()
        if self.sample is not None and not self.sample.check(origin, data, now):
            self.stats.unsampled()  # not in the sample: dropped unverified, not counted as received work
            return Dropped(UNSAMPLED)
        self.stats.received()
        step = self.pipeline.admit(data, origin, forwarder)
        if step.batch is not None:
            self.stats.counts["received_rollouts"] += len(step.batch.rollouts)
        if isinstance(step, Verdict):
            self._count(step)
            return step
        # The shared newcomer token goes only to a batch that passed the cheap checks: junk refused
        # there (uncharged or not) never spends what an honest newcomer's first batches need.
        why = self.gate.screen(
            origin, [bytes(r.lineage) for r in step.batch.rollouts], shard, self.shards, self.pipeline.clock()
        )
        if (
            why is not None
        ):  # fresh keys over their shared budget, or our count of shards and the publisher's differ: uncharged
            self.pipeline.abandon(step)
            self.stats.drop(why)
            return Dropped(why)
        return step

    def heard_announce(self, signer: bytes, body: wire.NodeAnnounce) -> None:
        """A NodeAnnounce whose envelope `signer` signed reached us: when the signer announces itself, the
        rate it states bounds what we accept from it (`Pipeline.announced`) and it stops being a newcomer
        once established (`ShardGate.announced`); an announce of another peer, relayed or forged, does
        neither."""
        if peer_id_from_public(signer) == body.peer_id:
            self.pipeline.announced(body.peer_id, body)
            self.gate.announced(body.peer_id, self.pipeline.clock())

    def commit(self, step: Pending, cpu_s: float) -> Verdict:
        """`step` was verified (`Pipeline.verify`), which cost `cpu_s` CPU-seconds (0: not measured): the
        verdict, counted."""
        self.pipeline.spent(step, cpu_s)
        v = self.pipeline.commit(step)
        self._count(v)
        return v

    def _count(self, v: Verdict) -> None:
        if v.accepted and v.batch is not None:
            self.stats.verified(
                bytes(v.batch.producer),
                [(bytes(r.task.task_set), bytes(r.lineage)) for r in v.batch.rollouts],
                len(v.batch.rollouts),
                self.pipeline.clock(),
            )
        else:
            self.stats.drop(v.reason.value)
