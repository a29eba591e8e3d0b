"""`murmur bench swarm`: does swarm sampling beat training alone, and does it survive an adversary?

Four murmur-tiny trainers, same base checkpoint, same seeds, same task set
(the built-in one), same number of optimizer steps, in three runs:

  (a) isolated: every node trains on 8 local groups per step, shares nothing;
  (b) swarm:    4 local + 4 external groups per step (SAPO's 4/4);
  (c) swarm with node 3 adversarial: it trains like the others but every
      batch it sends has forged rewards, and it also sends batches with
      invalid signatures.

Why one process, round-robin: four torch processes on two shared cores
would measure scheduler noise, not learning. Each round steps node 0..3 in
turn (identical per-node compute); each step's local rollouts are sealed in a
`RolloutBatch` with the node's real ed25519 key and handed to every other
node's own `gossip.validation.Pipeline` (signature, replay, task regeneration,
reward recomputation, staleness), exactly what a receiving node runs. Only
accepted rollouts enter a node's inbox; its trainer takes up to J groups from
it per step, informative groups (rewards not all equal) first, newest first,
within the staleness bound. The multi-process path is `murmur simulate`.

Cumulative reward of a run: per node, the sum over steps of the mean reward
of that step's own (local) rollouts, i.e. how good its current policy is on
fresh tasks; then averaged over the (honest) nodes, so runs with 3 and 4
honest nodes compare.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossip import wire
from gossip.validation import Pipeline, PipelineConfig
from node.identity import Identity

SWARM = "murmur-bench-swarm"
NODES = 4
ADVERSARY = 3


@dataclass
class _Node:
    index: int
    ident: Identity
    lineage: bytes
    trainer: Any
    pipeline: Pipeline
    inbox: list[tuple[int, list[wire.Rollout], bool]] = field(default_factory=list)  # (version, group, informative)
    seq: int = 0
    rewards: list[float] = field(default_factory=list)
    accepted_from_adversary: int = 0


def _ident(seed: int, i: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(f"murmur-bench-swarm/{seed}/{i}".encode(), digest_size=32).digest())


def _seal(node: _Node, rollouts: list[wire.Rollout]) -> list[bytes]:
    out = []
    for k in range(0, len(rollouts), wire.MAX_ROLLOUTS_PER_BATCH):
        node.seq += 1
        batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=SWARM, producer=node.ident.public, seq=node.seq,
                                  created_ms=wire.now_ms(), rollouts=rollouts[k:k + wire.MAX_ROLLOUTS_PER_BATCH])
        out.append(wire.seal(node.ident, wire.ROLLOUT_BATCH, batch))
    return out


def _forge(rollouts: list[wire.Rollout]) -> list[wire.Rollout]:
    """Claim the opposite reward on every rollout: wrong answers 'correct', right ones 'wrong'."""
    return [wire.Rollout(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "reward": 1.0 - r.reward})
            for r in rollouts]


def run_one(mode: str, rounds: int, seed: int, model_dir: Path, *, lr: float, group_size: int,
            max_new_tokens: int, on_round: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """mode: isolated | swarm | adversarial."""
    import torch  # noqa: PLC0415

    from training.engine_hf import HFEngine, set_threads  # noqa: PLC0415
    from training.rollouts import to_wire  # noqa: PLC0415
    from training.tasksets import TaskRegistry  # noqa: PLC0415
    from training.trainer import Trainer, TrainerConfig  # noqa: PLC0415
    from training.verifiers import score  # noqa: PLC0415

    set_threads(1)
    torch.manual_seed(seed)
    registry = TaskRegistry()
    registry.add_builtin()
    isolated = mode == "isolated"
    nodes: list[_Node] = []
    heads: dict[bytes, int] = {}
    for i in range(NODES):
        ident = _ident(seed, i)
        lineage = hashlib.blake2b(b"lineage" + ident.public, digest_size=32).digest()
        engine = HFEngine.from_path(model_dir, device="cpu", seed=seed * 100 + i)
        cfg = TrainerConfig(local_groups=8 if isolated else 4, external_groups=0 if isolated else 4,
                            group_size=group_size, lr=lr, max_new_tokens=max_new_tokens, seed=seed * 100 + i)
        node = _Node(i, ident, lineage, None, Pipeline(  # type: ignore[arg-type]
            PipelineConfig(swarm=SWARM, max_staleness=cfg.max_staleness, rate_per_s=1000.0, burst=1000),
            clock=time.time, resolve_task=registry.resolve, reward=score,
            head_version=lambda lin: heads.get(bytes(lin))))
        node.trainer = Trainer(engine, registry, registry.builtin_id, cfg, lineage=lineage,
                               external=None if isolated else _source(node, heads, cfg.max_staleness))
        heads[lineage] = 0
        nodes.append(node)
    bad_sent = 0
    t0 = time.monotonic()
    for rnd in range(rounds):
        for node in nodes:
            res = node.trainer.step()
            heads[node.lineage] = node.trainer.version
            node.rewards.append(res.reward_mean)
            if isolated:
                continue
            rollouts = [to_wire(r) for r in res.rollouts]
            if not rollouts:
                continue
            adversary = mode == "adversarial" and node.index == ADVERSARY
            if adversary:
                payloads = _seal(node, _forge(rollouts))
                bad = bytearray(_seal(node, rollouts)[0])
                bad[-7] ^= 0x55  # inside the signature
                payloads.append(bytes(bad))
                bad_sent += len(payloads)
            else:
                payloads = _seal(node, rollouts)
            for other in nodes:
                if other is node:
                    continue
                for data in payloads:
                    v = other.pipeline.check(data, node.ident.peer_id)
                    if not v.accepted or v.batch is None:
                        continue
                    if adversary:
                        other.accepted_from_adversary += 1
                    _file(other, v.batch)
        if on_round is not None:
            on_round(mode, rnd + 1)
    honest = [n for n in nodes if not (mode == "adversarial" and n.index == ADVERSARY)]
    per_node = [sum(n.rewards) for n in honest]
    rejections: dict[str, int] = {}
    for n in honest:
        for k, c in n.pipeline.counts.items():
            rejections[k] = rejections.get(k, 0) + c
    return {
        "cumulative_reward": sum(per_node) / len(per_node),
        "per_node": [round(x, 3) for x in per_node],
        "final_reward": sum(sum(n.rewards[-10:]) / max(1, len(n.rewards[-10:])) for n in honest) / len(honest),
        "curve": [round(sum(n.rewards[r] for n in honest) / len(honest), 4) for r in range(rounds)],
        "accepted_from_adversary": sum(n.accepted_from_adversary for n in honest),
        "adversary_messages": bad_sent,
        "verdicts": rejections,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _file(node: _Node, batch: wire.RolloutBatch) -> None:
    groups: dict[tuple[str, int], list[wire.Rollout]] = {}
    for r in batch.rollouts:
        groups.setdefault((r.task.generator, r.task.seed), []).append(r)
    for g in groups.values():
        if len(g) >= 2:
            rw = [r.reward for r in g]
            node.inbox.append((g[0].version, g, max(rw) != min(rw)))
    del node.inbox[:-64]  # bounded: the newest 64 groups


def _source(node: _Node, heads: dict[bytes, int], max_staleness: int) -> Callable[[int, int], list[wire.Rollout]]:
    def take(groups: int, _min_version: int) -> list[wire.Rollout]:
        fresh = [e for e in node.inbox if heads.get(bytes(e[1][0].lineage), e[0]) - e[0] <= max_staleness]
        fresh.sort(key=lambda e: (not e[2], -e[0]))
        picked = fresh[:groups]
        ids = {id(e) for e in picked}
        node.inbox = [e for e in node.inbox if id(e) not in ids and e in fresh]
        return [r for e in picked for r in e[1]]
    return take


def run(rounds: int = 120, seed: int = 0, warmup_steps: int = 30, lr: float = 1e-3, group_size: int = 8,
        max_new_tokens: int = 4, home: str | None = None,
        on_round: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run (a) isolated, (b) swarm, (c) swarm with one adversary; return the comparison."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from training.tiny import ensure_tiny  # noqa: PLC0415

    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    t0 = time.monotonic()
    base = Path(home) if home else Path(tempfile.gettempdir()) / "murmur-bench-swarm"
    model_dir = ensure_tiny(base / f"w{warmup_steps}", seed=seed, warmup_steps=warmup_steps)
    kw = dict(lr=lr, group_size=group_size, max_new_tokens=max_new_tokens, on_round=on_round)
    iso = run_one("isolated", rounds, seed, model_dir, **kw)
    sw = run_one("swarm", rounds, seed, model_dir, **kw)
    adv = run_one("adversarial", rounds, seed, model_dir, **kw)
    i, s, a = iso["cumulative_reward"], sw["cumulative_reward"], adv["cumulative_reward"]
    return {
        "rounds": rounds,
        "seed": seed,
        "nodes": NODES,
        "model": f"murmur-tiny (warm-up {warmup_steps} steps)",
        "lr": lr,
        "group_size": group_size,
        "isolated_cumulative_reward": round(i, 3),
        "swarm_cumulative_reward": round(s, 3),
        "adversarial_cumulative_reward": round(a, 3),
        "gain_swarm": round(s / i - 1, 4) if i > 0 else None,
        "gain_adversarial": round(a / i - 1, 4) if i > 0 else None,
        "adversarial_accepted": adv["accepted_from_adversary"],
        "adversary_messages": adv["adversary_messages"],
        "isolated_final_reward": round(iso["final_reward"], 4),
        "swarm_final_reward": round(sw["final_reward"], 4),
        "adversarial_final_reward": round(adv["final_reward"], 4),
        "swarm_verdicts": sw["verdicts"],
        "adversarial_verdicts": adv["verdicts"],
        "curves": {"isolated": iso["curve"], "swarm": sw["curve"], "adversarial": adv["curve"]},
        "run_wall_s": {"isolated": iso["wall_s"], "swarm": sw["wall_s"], "adversarial": adv["wall_s"]},
        "wall_s": round(time.monotonic() - t0, 1),
        "method": "4 nodes round-robin in one process (same per-node compute); rollouts sealed with real "
                  "ed25519 keys and checked by each receiver's gossip.validation.Pipeline",
    }


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    r = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    print(json.dumps(run(rounds=r, on_round=lambda m, k: print(m, k, file=sys.stderr) if k % 20 == 0 else None)))
