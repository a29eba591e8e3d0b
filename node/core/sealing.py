"""Rollout sealing (sans-IO, part of `node.core.machine`): our worker's rollouts as signed, recorded, published batches.

A rollout that receivers would refuse as a forgery (a number out of range, log-prob bytes that do not
match its tokens) is never signed: it is counted (`unpublishable`) and logged. The rest are grouped by
lineage (a batch goes to its lineage's shard, so it holds one lineage), cut into batches of at most
`BATCH_MAX_ROLLOUTS`, each signed once and recorded before it is published. Only the groups a receiver's
sampler would keep go out (`training.sampler.split`: two or more rollouts of one task whose rewards differ;
the rest are `uninformative`), and a trainer's first pass its publish budget (`allow`,
`gossip.exchange.Outbox`): a group no one asked for stays local, never signed (`withheld`). Groups are
counted too: `groups_generated` (every task's completions our worker made) and `groups_sent` (those signed). Batch seqs follow the wall
clock in microseconds, so they still rise after a restart (a reused seq is a replay to receivers).
The batches published per second are metered: the rate our announce states.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError
from murmur.gossip.identity import Identity
from murmur.gossip.ratelimit import RateMeter
from murmur.node.core.events import Action, Log, Publish, RecordRollouts, Topic
from murmur.training.sampler import Group, split
from murmur.training.schedule import publishable

BATCH_MAX_ROLLOUTS = wire.MAX_ROLLOUTS_PER_BATCH


class RolloutSealer:
    def __init__(self, swarm: str, identity: Identity) -> None:
        self.swarm = swarm
        self.ident = identity
        self.rollout_seq = 0
        self.publish_meter = RateMeter()  # rollout batches/s we publish, stated in our announce
        self.unpublishable = 0
        self.produced = 0  # rollouts our worker made that could be signed
        self.uninformative = 0  # ... of them kept local: groups no receiver can learn from
        self.withheld = 0  # ... of them kept local: over the publish budget
        self.sealed = 0  # ... of them signed into batches to publish
        self.unscheduled = 0  # ... of them whose schedule round was about to leave receivers' windows: sent unclaimed
        self.groups_generated = 0  # groups (one task's completions) our worker made that could be signed
        self.groups_sent = 0  # ... of them signed into batches to publish (informative, within the budget)

    def seal(
        self,
        encoded: list[bytes],
        now: float,
        wall_ms: int,
        shard_of: Callable[[bytes], int],
        out: list[Action],
        allow: Callable[[bytes, int], bool] | None = None,
    ) -> list[Group]:
        """Our worker's encoded rollouts: a `RecordRollouts` then a `Publish` to `shard_of(lineage)` per batch;
        `wall_ms` (unix milliseconds) stamps the batches' `created_ms`, which receivers' freshness checks read.
        `allow(lineage, n)`: whether a group of n rollouts (one task's) goes out; None: all do. Returns the
        groups a receiver would keep, sent or not."""
        from murmur.gossip.validation import rollout_id

        rollouts = []
        for b in encoded:
            try:
                r = wire.decode_struct(b, wire.Rollout, wire.KIND_LIMITS[wire.ROLLOUT_BATCH])
            except DecodeError as e:
                out.append(Log("worker rollout undecodable", {"error": str(e)[:200]}))
                continue
            # what receivers refuse as a forgery is never signed (an engine's missing log-prob is NaN)
            bad = (
                wire.rollout_number_fault(r)
                if len(r.logprobs) == 4 * len(r.completion_ids)
                else "log-prob bytes do not match the tokens"
            )
            if bad:
                self.unpublishable += 1
                out.append(Log("worker rollout not published", {"error": bad[:200]}))
                continue
            if r.schedule_round and publishable(r.schedule_round, wall_ms) != r.schedule_round:
                # receivers would refuse the whole batch for a round outside their window: the task is as valid as
                # ever, so it goes out unclaimed
                r = msgspec.structs.replace(r, schedule_round=0)
                self.unscheduled += 1
            rollouts.append(r)
        self.produced += len(rollouts)
        # every receiver's sampler keeps only groups whose rewards differ (GRPO learns nothing from the others),
        # and all-equal ones of scheduled prompts to pool with its own: the rest would be verified for nothing
        groups, dropped = split(rollouts)
        kept = [r for g in groups for r in g.rollouts]
        self.uninformative += len(rollouts) - len(kept)
        self.groups_generated += len(groups) + sum(dropped.values())
        sent = [g for g in groups if allow is None or allow(g.lineage, len(g.rollouts))]
        self.groups_sent += len(sent)
        rollouts = [r for g in sent for r in g.rollouts]
        self.withheld += len(kept) - len(rollouts)
        by_lineage: dict[bytes, list[wire.Rollout]] = {}
        for r in rollouts:
            by_lineage.setdefault(bytes(r.lineage), []).append(r)
        parts = [
            (lid, rs[i : i + BATCH_MAX_ROLLOUTS])
            for lid, rs in by_lineage.items()
            for i in range(0, len(rs), BATCH_MAX_ROLLOUTS)
        ]
        for lid, part in parts:
            self.rollout_seq = max(self.rollout_seq + 1, int(wall_ms) * 1000)
            batch = wire.RolloutBatch(
                v=wire.FORMAT_VERSION,
                swarm=self.swarm,
                producer=self.ident.public,
                seq=self.rollout_seq,
                created_ms=wall_ms,
                rollouts=part,
            )
            data = wire.seal(self.ident, wire.ROLLOUT_BATCH, batch, swarm=self.swarm)
            out.append(
                RecordRollouts(
                    tuple(
                        dict(
                            rollout_id=rollout_id(r),
                            direction="produced",
                            status="produced",
                            producer=self.ident.public,
                            lineage=bytes(r.lineage),
                            version=r.version,
                            task_set=bytes(r.task.task_set),
                            generator=r.task.generator,
                            task_seed=r.task.seed,
                            reward=r.reward,
                            tokens=len(r.completion_ids),
                            payload=data if j == 0 else None,
                        )
                        for j, r in enumerate(part)
                    )
                )
            )
            self.publish_meter.tick(now)
            self.sealed += len(part)
            out.append(Publish(Topic.ROLLOUTS, data, len(part), shard_of(lid)))
        return groups

    def rate(self, now: float) -> float:
        """Rollout batches/s published lately."""
        return self.publish_meter.rate(now)
