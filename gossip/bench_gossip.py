"""Gossip benchmark, and the honest/adversarial message factories its tests share.

`run(nodes=8)` starts `nodes` real py-libp2p hosts as separate processes
(one honest publisher each, plus one adversary) on 127.0.0.1, in a full mesh,
publishes paced signed rollout batches and measures delivery and latency
(publish -> accepted at the last honest node), then measures the verification
pipeline alone on one core. See docs/gossip.md for why processes and the pacing.
"""

from __future__ import annotations

import os
import random
import struct
import time
from typing import Any

from gossip import wire
from node.identity import Identity

SWARM = "bench"
LINEAGE = b"\x4c" * 32
TOKENIZER = b"\x54" * 32


def registry() -> Any:
    from training.tasksets import TaskRegistry

    reg = TaskRegistry()
    reg.add_builtin()
    return reg


def make_rollout(reg: Any, seed: int, tokens: int = 256, version: int = 0, lineage: bytes = LINEAGE,
                 forge: bool = False, task_set: bytes | None = None, generator: str = "add") -> wire.Rollout:
    """A rollout on the built-in task set whose claimed reward is the true one (unless `forge`)."""
    from training.verifiers import score

    ref = wire.TaskRef(task_set=task_set if task_set is not None else reg.builtin_id, generator=generator, seed=seed)
    try:
        task = reg.resolve(ref)
        text = task.answer if seed % 2 == 0 else "no idea"
        reward = score(task, text)
    except Exception:
        text, reward = "0", 0.0
    if forge:
        reward = 1.0 - reward
    return wire.Rollout(
        task=ref, lineage=lineage, version=version, completion_ids=[(seed + i) % 50_000 for i in range(tokens)],
        text=text, tokenizer_hash=TOKENIZER, logprobs=struct.pack(f"<{tokens}f", *([-0.25] * tokens)),
        token_versions=[(0, version)], sampling=wire.SamplingParams(max_new_tokens=max(1, tokens)),
        reward=reward, created_ms=wire.now_ms())


def make_batch(ident: Identity, reg: Any, seq: int, n: int = 4, tokens: int = 64, swarm: str = SWARM,
               version: int = 0, created_ms: int | None = None, **kw: Any) -> bytes:
    seeds = [(seq * 1009 + i * 7) % 1_000_000 for i in range(n)]
    batch = wire.RolloutBatch(v=1, swarm=swarm, producer=ident.public, seq=seq,
                              created_ms=wire.now_ms() if created_ms is None else created_ms,
                              rollouts=[make_rollout(reg, s, tokens, version, **kw) for s in seeds])
    return wire.seal(ident, wire.ROLLOUT_BATCH, batch)


def resign_with(signer: Identity, claimed: Identity, data: bytes) -> bytes:
    """The same body, claiming `claimed` as signer but signed by `signer`: a bad signature."""
    env = wire.decode_envelope(data)
    sig = signer.sign(wire.signing_domain(env.kind) + env.body)
    return wire.encode(wire.Envelope(env.v, env.kind, env.body, claimed.public, sig))


# ------------------------------------------------------------ pipeline throughput


def verify_throughput(seconds: float = 2.0, tokens: int = 256, batch: int = 16) -> dict[str, float]:
    """Rollouts/s through the whole pipeline (signature + task regeneration + reward) on this core."""
    from gossip.validation import Pipeline, PipelineConfig
    from training.verifiers import score

    reg = registry()
    ident = Identity.from_seed(b"\x77" * 32)
    msgs = [make_batch(ident, reg, seq, n=batch, tokens=tokens) for seq in range(1, 201)]
    cfg = PipelineConfig(swarm=SWARM, rate_per_s=1e9, burst=10**9)
    n = 0
    t0 = time.perf_counter()
    rounds = 0
    while time.perf_counter() - t0 < seconds:
        # a fresh pipeline per round: nothing is a duplicate, and the task cache starts cold
        p = Pipeline(cfg, clock=time.time, resolve_task=reg.resolve, reward=score, head_version=lambda _: None)
        for m in msgs:
            v = p.check(m, ident.peer_id)
            if not v.accepted:
                raise RuntimeError(f"benchmark batch rejected: {v.reason} {v.detail}")
            n += batch
        rounds += 1
    dt = time.perf_counter() - t0
    return dict(verify_per_s_core=n / dt, verify_batches_per_s_core=n / batch / dt)


def run(nodes: int = 8, batches_per_node: int = 20, rate_per_node: float = 2.0, rollouts_per_batch: int = 4,
        tokens: int = 64, adversarial: bool = True, timeout_s: float = 120.0) -> dict[str, Any]:
    """Multi-process gossip benchmark; returns delivery, latency, adversarial and pipeline figures."""
    from gossip.bench_swarm import run_swarm

    out = run_swarm(nodes=nodes, batches_per_node=batches_per_node, rate_per_node=rate_per_node,
                    rollouts_per_batch=rollouts_per_batch, tokens=tokens, adversarial=adversarial,
                    timeout_s=timeout_s)
    out.update(verify_throughput())
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run()))
