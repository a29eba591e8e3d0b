"""Rollout verification runs in at most VERIFY_THREADS threads, under the service's own limiter: a flood of
batches waiting on the verifier never holds the threads of trio's default limiter (ledger writes, the worker
link). Driven through GossipService's own validator with a verifier that holds each batch until released."""

from __future__ import annotations

import threading
import time

import trio

from murmur.gossip.identity import Identity
from murmur.gossip.service import VERIFY_THREADS, GossipService
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.simulations.bench.gossip import SWARM, make_batch, registry
from murmur.training.verifiers import score

REG = registry()
BATCHES = VERIFY_THREADS + 4


def test_verification_threads_are_capped_and_leave_the_default_limiter_alone() -> None:
    producer = Identity.from_seed(b"\x31" * 32)
    lock, release = threading.Lock(), threading.Event()
    inside = [0, 0]  # now, most at once

    def held_reward_batch(items):  # type: ignore[no-untyped-def]
        with lock:
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
        release.wait(60)
        with lock:
            inside[0] -= 1
        return [score(task, text) for task, text in items]

    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, rate_per_s=50.0, burst=100, max_staleness=4),
        clock=time.time,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=REG.__contains__,
        reward_batch=held_reward_batch,
    )
    service = GossipService(None, pipeline, SWARM)
    verdicts: list[bool] = []

    async def one(seq: int) -> None:
        p = producer.peer_id
        verdicts.append(await service._validate_rollouts(0, p, p, make_batch(producer, REG, seq, n=2, tokens=8)))

    async def main() -> None:
        default = trio.to_thread.current_default_thread_limiter()
        free = default.available_tokens
        async with trio.open_nursery() as n:
            for seq in range(1, BATCHES + 1):
                n.start_soon(one, seq)
            with trio.fail_after(30):  # every batch admitted: VERIFY_THREADS verifying, the rest queued
                while not (
                    inside[0] == VERIFY_THREADS
                    and service._verify_limiter.statistics().tasks_waiting == BATCHES - VERIFY_THREADS
                ):
                    await trio.sleep(0.01)
            assert default.available_tokens == free
            release.set()
        assert inside[1] == VERIFY_THREADS
        assert verdicts == [True] * BATCHES

    trio.run(main)
