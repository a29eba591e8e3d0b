"""The worker's own defences against verified-but-hostile rollouts, on a real tiny model in-process:
spot checks flag forged behaviour log-probs, and token ids are re-checked against the worker's engine
before a spot check feeds them to the model and before the trainer takes them from the sampler."""

from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

from murmur.gossip import wire
from murmur.node import pipe
from murmur.node.worker.main import Worker
from murmur.training.rollouts import logprobs_to_bytes
from murmur.training.tasksets import TaskRegistry
from murmur.training.tiny import new_tiny_engine

SWARM = "test"

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

LINEAGE = b"\x0c" * 32
PRODUCER = b"\x0d" * 32


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return new_tiny_engine(seed=0)


@pytest.fixture
def worker(tmp_path: Path, engine):  # type: ignore[no-untyped-def]
    ours, theirs = multiprocessing.Pipe()
    w = Worker(ours, {"home": str(tmp_path), "swarm": SWARM, "roles": ["validator"], "spot_rate": 1.0})
    w.engine = w.checker = engine
    w.registry = TaskRegistry(SWARM)
    w.registry.add_builtin()
    yield w, theirs
    ours.close()
    theirs.close()


def _ref(reg: TaskRegistry, seed: int) -> wire.TaskRef:
    g = next(x for x in reg.get(reg.builtin_id).generators if not x.name.endswith("-eval"))
    return wire.TaskRef(reg.builtin_id, g.name, g.seed_start + seed)


def _rollout(
    engine,
    reg: TaskRegistry,
    seed: int,
    text: str,
    logprobs: list[float] | None = None,  # type: ignore[no-untyped-def]
    ids: list[int] | None = None,
    reward: float = 0.0,
) -> wire.Rollout:
    ref = _ref(reg, seed)
    ids = engine.encode(text) + [engine.eos_id] if ids is None else ids
    if logprobs is None:  # honest: what the model gives these ids after the task's prompt
        logprobs = engine.logprobs([(engine.encode(reg.resolve(ref).prompt), ids)], 1.0)[0]
    return wire.Rollout(
        task=ref,
        lineage=LINEAGE,
        version=3,
        completion_ids=ids,
        text=text,
        tokenizer_hash=engine.tokenizer_hash,
        logprobs=logprobs_to_bytes(logprobs),
        token_versions=[(0, 3)],
        sampling=wire.SamplingParams(max_new_tokens=8),
        reward=reward,
        created_ms=wire.now_ms(),
    )


def _batch(rollouts: list[wire.Rollout]) -> wire.RolloutBatch:
    return wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm=SWARM, producer=PRODUCER, seq=1, created_ms=wire.now_ms(), rollouts=rollouts
    )


def _spots(conn) -> list[pipe.Spot]:  # type: ignore[no-untyped-def]
    out = []
    while conn.poll(0):
        m = pipe.decode(conn.recv_bytes())
        if isinstance(m, pipe.Spot):
            out.append(m)
    return out


def test_spot_check_fails_forged_logprobs_and_passes_honest_ones(worker, engine) -> None:  # type: ignore[no-untyped-def]
    w, conn = worker
    honest = _rollout(engine, w.registry, 1, "12")
    forged = _rollout(engine, w.registry, 2, "34", logprobs=[-0.01] * 3)  # "almost certain": not what the model says
    w.inbox.spot.append((PRODUCER, _batch([honest, forged])))
    w._spot_checks(LINEAGE, 3)
    spots = _spots(conn)
    assert [s.ok for s in spots] == [True, False], spots
    assert spots[0].diff < 1e-3 < 0.05 < spots[1].diff and spots[1].producer == PRODUCER.hex()


def test_spot_check_never_feeds_the_model_ids_outside_its_vocabulary(worker, engine) -> None:  # type: ignore[no-untyped-def]
    w, conn = worker
    bad = _rollout(engine, w.registry, 1, "12", logprobs=[-1.0, -1.0], ids=[engine.vocab + 5, engine.eos_id])
    mismatched = _rollout(engine, w.registry, 2, "12", logprobs=[-1.0] * 3, ids=engine.encode("99") + [engine.eos_id])
    w.inbox.spot.append((PRODUCER, _batch([bad, mismatched])))
    w._spot_checks(LINEAGE, 3)  # an id past the embedding would raise IndexError in the model call
    assert _spots(conn) == []  # neither was checked, so neither producer is charged for a check it never got


def test_trainer_takes_only_rollouts_whose_ids_are_the_verified_text(worker, engine) -> None:  # type: ignore[no-untyped-def]
    w, _ = worker
    group = [
        _rollout(engine, w.registry, 5, t, logprobs=[-1.0] * 3, reward=r)
        for t, r in (("10", 1.0), ("11", 0.0), ("12", 0.0))
    ]
    # verified text "10" (reward 1), ids of something else: the trainer would learn from ids nobody checked
    group.append(
        _rollout(
            engine, w.registry, 5, "10", logprobs=[-1.0] * 3, ids=engine.encode("77") + [engine.eos_id], reward=1.0
        )
    )
    group.append(_rollout(engine, w.registry, 5, "13", logprobs=[-1.0, -1.0], ids=[engine.vocab, engine.eos_id]))
    assert w.inbox.sampler.add_rollouts(group) == 1
    w._observe_own_head(LINEAGE, 0)
    taken = [x.rollout for x in w._external(4, 0)]
    assert sorted(r.text for r in taken) == ["10", "11", "12"]
    assert all(r.completion_ids[0] < engine.vocab for r in taken)
