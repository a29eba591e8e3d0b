"""`murmur bench swarm`: does swarm sampling beat training alone, and does it survive an adversary?

N murmur-tiny nodes (the scenario's 4, or `--nodes N`), each a real
`training.trainer.Trainer` (the node's own code path), same base checkpoint,
same seeds, same task set, same number of optimizer steps, in three runs
(settings: `simulations/scenarios/bench_swarm.toml`):

  (a) isolated: every node generates 8 local prompt groups per step, shares nothing;
  (b) swarm:    4 local groups + 4 verified external groups per step (SAPO's 4/4);
  (c) swarm with one adversarial node: every step it sends garbage bytes,
      validly signed rollouts whose task does not resolve, its real rollouts
      with forged rewards, and its real rollouts with a corrupted signature.

Same per-node compute per step: 8 groups of rollouts enter each update (the
swarm generates only 4 of them). Zero-advantage groups are dropped by the
trainer in every run (the loss is normalised as the scenario's
`trainer.loss_norm` says, the node's `[training] loss_norm`); a swarm node's
external groups come from its own `training.sampler.Sampler`, the node
worker's sampler: informative groups only (SAPO's filtering), a uniform draw,
within the staleness bound against the heads its peers announce.

Why one process, round-robin: N torch processes on two shared cores
would measure scheduler noise, not learning. Each round steps node 0..N-1 in
turn; each step's local rollouts are sealed in a `RolloutBatch` with the
node's real ed25519 key and handed to every other node's own
`gossip.validation.Pipeline` (signature, replay, task regeneration, reward
recomputation, staleness) with its own task registry, exactly what a
receiving node runs. Only accepted groups reach a trainer. The
multi-process path is `murmur simulate`.

Cumulative reward of a run: per node, the sum over steps of the mean reward
of that step's own (locally generated) rollouts, i.e. how good its current
policy is on fresh tasks; then averaged over the honest nodes, so runs with
N - 1 and N honest nodes compare. `gain_adversarial` compares (c)'s honest nodes
with the same nodes in (a): a node's identity and seed make its own isolated
reward differ a lot (17.2 to 29.9 within seed 2), so a base that included the
adversary's slot would measure which node was picked, not the adversary.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from murmur.gossip import wire
from murmur.gossip.errors import ConfigError
from murmur.gossip.identity import Identity
from murmur.gossip.tomlfile import convert_strict, parse_toml
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.training.sampler import Sampler
from murmur.training.schedule import ScheduleBook
from murmur.training.tasksets import TaskSetToml, manifest_from_toml, sign_task_set

SWARM = "murmur-bench-swarm"
COORDINATOR = Identity.from_seed(hashlib.blake2b(b"murmur-bench-swarm/task-set-coordinator", digest_size=32).digest())


# ------------------------------------------------------------ scenario


class TrainerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lr: float = 3e-4
    lr_warmup_steps: int = 5
    group_size: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    max_staleness: int = 4
    loss_norm: str = "informative"


class Mix(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    local_groups: int
    external_groups: int


class AdversarySection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    node: int = 3
    garbage: bool = True
    bad_task: bool = True
    forged_reward: bool = True
    bad_signature: bool = True


class BenchScenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "bench-swarm"
    nodes: int = 4
    rounds: int = 200
    model_warmup_steps: int = 60
    inbox_groups: int = 64
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    isolated: Mix = msgspec.field(default_factory=lambda: Mix(local_groups=8, external_groups=0))
    swarm: Mix = msgspec.field(default_factory=lambda: Mix(local_groups=4, external_groups=4))
    adversary: AdversarySection = msgspec.field(default_factory=AdversarySection)
    task_set: TaskSetToml


MAX_NODES = 64


def load_scenario(path: str | Path | None = None, nodes: int = 0) -> tuple[BenchScenario, str]:
    """The benchmark scenario (default: the packaged `scenarios/bench_swarm.toml`) and its text.

    `nodes` > 0 replaces the scenario's node count (`--nodes`); the adversary keeps its slot, or takes
    the last one when the swarm is smaller than that."""
    if path is None:
        text, origin = (
            resources.files("murmur.simulations").joinpath("scenarios", "bench_swarm.toml").read_text("utf-8"),
            "scenario:bench_swarm",
        )
    else:
        try:
            text, origin = Path(path).read_text("utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read: {e}") from None
    sc = convert_strict(parse_toml(text, origin), BenchScenario, origin)
    if nodes:
        if not 2 <= nodes <= MAX_NODES:
            raise ConfigError(f"nodes must be in 2..{MAX_NODES}, not {nodes}")
        sc = msgspec.structs.replace(
            sc, nodes=nodes, adversary=msgspec.structs.replace(sc.adversary, node=min(sc.adversary.node, nodes - 1))
        )
    if sc.nodes > MAX_NODES:
        raise ConfigError(f"{origin}: at most {MAX_NODES} nodes")
    if sc.nodes < 2 or not 0 <= sc.adversary.node < sc.nodes:
        raise ConfigError(f"{origin}: need nodes >= 2 and 0 <= adversary.node < nodes")
    for mix in (sc.isolated, sc.swarm):
        if mix.local_groups < 1 or mix.external_groups < 0:
            raise ConfigError(f"{origin}: local_groups must be >= 1 and external_groups >= 0")
    from murmur.training.trainer import LOSS_NORMS  # torch only when a scenario is loaded

    if sc.trainer.loss_norm not in LOSS_NORMS:
        raise ConfigError(f"{origin}: trainer.loss_norm {sc.trainer.loss_norm!r}: use one of {', '.join(LOSS_NORMS)}")
    if sc.trainer.group_size * max(sc.isolated.local_groups, sc.swarm.local_groups) > wire.MAX_ROLLOUTS_PER_BATCH * 16:
        raise ConfigError(f"{origin}: too many rollouts per step")
    return sc, text


def bench_task_set(sc: BenchScenario) -> bytes:
    """The scenario's task set, signed by the benchmark's (public, fixed) coordinator key.

    created_ms is fixed so the task-set id, and with it every task reference, is the same in every run."""
    t = msgspec.structs.replace(sc.task_set, created_ms=1)
    return sign_task_set(COORDINATOR, manifest_from_toml(t, f"bench scenario task set {t.name!r}"), swarm=SWARM)


# ------------------------------------------------------------ nodes


@dataclass
class _Node:
    index: int
    ident: Identity
    lineage: bytes
    trainer: Any
    pipeline: Pipeline
    sampler: Sampler
    seq: int = 0
    rewards: list[float] = field(default_factory=list)
    by_gen: list[dict[str, tuple[float, int]]] = field(default_factory=list)  # per step: generator -> (sum, n)
    used_groups: int = 0  # informative groups that entered updates (local + external)
    ext_used: int = 0
    idle_steps: int = 0  # steps without any informative group: no update
    accepted_from_adversary: int = 0


def _ident(seed: int, i: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(f"murmur-bench-swarm/{seed}/{i}".encode(), digest_size=32).digest())


class _Sealer(Protocol):
    ident: Identity
    seq: int


S = TypeVar("S", bound=msgspec.Struct)


def _seal(node: _Sealer, rollouts: list[wire.Rollout]) -> list[bytes]:
    out = []
    for k in range(0, len(rollouts), wire.MAX_ROLLOUTS_PER_BATCH):
        node.seq += 1
        batch = wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=SWARM,
            producer=node.ident.public,
            seq=node.seq,
            created_ms=wire.now_ms(),
            rollouts=rollouts[k : k + wire.MAX_ROLLOUTS_PER_BATCH],
        )
        out.append(wire.seal(node.ident, wire.ROLLOUT_BATCH, batch, swarm=SWARM))
    return out


def _with(r: S, **changes: Any) -> S:
    return msgspec.structs.replace(r, **changes)


def _adversarial_payloads(
    node: _Node, rollouts: list[wire.Rollout], adv: AdversarySection, rng: random.Random
) -> list[bytes]:
    """Everything the adversary sends in one step, cheapest-to-reject first."""
    out: list[bytes] = []
    if adv.garbage:
        out.append(rng.randbytes(256))
    if adv.bad_task:  # a seed far outside every generator's range: the task cannot be regenerated
        out += _seal(node, [_with(r, task=_with(r.task, seed=2**62 + i)) for i, r in enumerate(rollouts[:8])])
    if adv.forged_reward:
        out += _seal(node, [_with(r, reward=1.0 - r.reward) for r in rollouts])
    if adv.bad_signature:
        bad = bytearray(_seal(node, rollouts)[0])
        bad[-7] ^= 0x55  # inside the signature
        out.append(bytes(bad))
    return out


def trainer_config(sc: BenchScenario, mix: Mix, seed: int, index: int) -> Any:
    """Node `index`'s `TrainerConfig`: the scenario's trainer section; everything else (overprovision
    among it) at the defaults a node's worker runs."""
    from murmur.training.trainer import TrainerConfig

    t = sc.trainer
    return TrainerConfig(
        local_groups=mix.local_groups,
        external_groups=mix.external_groups,
        group_size=t.group_size,
        lr=t.lr,
        lr_warmup_steps=t.lr_warmup_steps,
        max_new_tokens=t.max_new_tokens,
        temperature=t.temperature,
        max_staleness=t.max_staleness,
        loss_norm=t.loss_norm,
        seed=seed * 100 + index,
    )


def run_one(
    mode: str,
    rounds: int,
    seed: int,
    model_dir: Path,
    sc: BenchScenario,
    on_round: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """mode: isolated | swarm | adversarial."""
    import torch

    from murmur.training.engine_hf import HFEngine, set_threads
    from murmur.training.rollouts import to_wire
    from murmur.training.tasksets import TaskRegistry, task_set_id
    from murmur.training.trainer import Trainer
    from murmur.training.verifiers import score

    if mode not in ("isolated", "swarm", "adversarial"):
        raise ValueError(f"unknown mode {mode!r}")
    set_threads(1)
    torch.manual_seed(seed)
    envelope = bench_task_set(sc)
    ts_id = task_set_id(envelope, swarm=SWARM)
    isolated = mode == "isolated"
    mix = sc.isolated if isolated else sc.swarm
    adv_index = sc.adversary.node if mode == "adversarial" else -1
    t = sc.trainer
    nodes: list[_Node] = []
    heads: dict[bytes, int] = {}
    for i in range(sc.nodes):
        ident = _ident(seed, i)
        lineage = hashlib.blake2b(b"lineage" + ident.public, digest_size=32).digest()
        registry = TaskRegistry(SWARM)  # every node verifies against its own registry
        registry.add(envelope, {COORDINATOR.public})
        engine = HFEngine.from_path(model_dir, device="cpu", seed=seed * 100 + i)
        cfg = trainer_config(sc, mix, seed, i)
        pipeline = Pipeline(
            PipelineConfig(swarm=SWARM, max_staleness=t.max_staleness, rate_per_s=1000.0, burst=1000),
            clock=time.time,
            resolve_task=registry.resolve,
            reward=score,
            head_version=lambda lin: heads.get(bytes(lin)),
            task_set_trusted=registry.__contains__,
            schedule=ScheduleBook.of(registry),
        )
        node = _Node(
            i,
            ident,
            lineage,
            None,
            pipeline,
            Sampler(sc.inbox_groups, t.max_staleness, seed=seed * 100 + i, own=lineage),
        )
        ext = None if isolated or mix.external_groups == 0 else node.sampler.take_rollouts
        node.trainer = Trainer(engine, registry, ts_id, cfg, lineage=lineage, external=ext)
        heads[lineage] = 0
        nodes.append(node)
    rng = random.Random(seed)
    adversary_messages = 0
    t0, c0 = time.monotonic(), time.process_time()
    for rnd in range(rounds):
        for node in nodes:
            v0 = node.trainer.version
            res = node.trainer.step()
            heads[node.lineage] = node.trainer.version
            for other in nodes:  # the head a node announces in its signed manifest
                other.sampler.observe_head(node.lineage, node.trainer.version)
            node.rewards.append(res.reward_mean)
            gen: dict[str, tuple[float, int]] = {}
            for r in res.rollouts:
                s_, n_ = gen.get(r.ref.generator, (0.0, 0))
                gen[r.ref.generator] = (s_ + r.reward, n_ + 1)
            node.by_gen.append(gen)
            used = res.n_local_groups + res.n_external_groups - res.dropped_groups
            node.used_groups += used
            node.ext_used += res.n_external_groups
            node.idle_steps += node.trainer.version == v0
            if isolated or not res.rollouts:
                continue
            rollouts = [to_wire(r) for r in res.rollouts]
            adversary = node.index == adv_index
            if adversary:
                payloads = _adversarial_payloads(node, rollouts, sc.adversary, rng)
                adversary_messages += len(payloads)
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
                    other.sampler.add_rollouts(v.batch.rollouts, bytes(v.batch.producer))
        if on_round is not None:
            on_round(mode, rnd + 1)
    honest = [n for n in nodes if n.index != adv_index]
    per_node = [sum(n.rewards) for n in honest]
    verdicts: dict[str, int] = {}
    sampler: dict[str, int] = {}
    for n in honest:
        for k, c in n.pipeline.counts.items():
            verdicts[k] = verdicts.get(k, 0) + c
        for k, c in n.sampler.counts.items():
            sampler[k] = sampler.get(k, 0) + c
    h = len(honest)
    blocks = max(1, rounds // 5)
    curve = [sum(n.rewards[r] for n in honest) / h for r in range(rounds)]

    def by_generator(lo: int, hi: int) -> dict[str, float]:
        tot: dict[str, tuple[float, int]] = {}
        for n in honest:
            for step in n.by_gen[lo:hi]:
                for g, (s_, n_) in step.items():
                    a, b = tot.get(g, (0.0, 0))
                    tot[g] = (a + s_, b + n_)
        return {g: round(a / b, 4) for g, (a, b) in sorted(tot.items()) if b}

    edge = max(1, min(20, rounds // 5))
    return {
        "cumulative_reward": sum(per_node) / h,
        "reward_by_generator": {"start": by_generator(0, edge), "end": by_generator(rounds - edge, rounds)},
        "per_node": per_node,
        "start_reward": sum(curve[:10]) / len(curve[:10]),
        "final_reward": sum(curve[-10:]) / len(curve[-10:]),
        "block_means": [
            round(sum(curve[k : k + blocks]) / len(curve[k : k + blocks]), 4) for k in range(0, rounds, blocks)
        ],
        "curve": [round(x, 4) for x in curve],
        "informative_groups_per_step": round(sum(n.used_groups for n in honest) / (h * rounds), 3),
        "external_groups_per_step": round(sum(n.ext_used for n in honest) / (h * rounds), 3),
        "idle_steps": sum(n.idle_steps for n in honest),
        "accepted_from_adversary": sum(n.accepted_from_adversary for n in honest),
        "adversary_messages": adversary_messages,
        "verdicts": verdicts,
        "sampler": sampler,
        "wall_s": round(time.monotonic() - t0, 1),
        "cpu_s": round(time.process_time() - c0, 1),
    }


def run(
    rounds: int = 0,
    seed: int = 0,
    home: str | None = None,
    scenario: str | None = None,
    on_round: Callable[[str, int], None] | None = None,
    nodes: int = 0,
) -> dict[str, Any]:
    """Run (a) isolated, (b) swarm, (c) swarm with one adversary; return the comparison.

    rounds 0 = the scenario's `rounds`; nodes 0 = the scenario's `nodes`. `scenario`: a TOML path
    (default: the packaged one)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from murmur.training.tiny import ensure_tiny

    sc, text = load_scenario(scenario, nodes)
    rounds = rounds or sc.rounds
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    load_start = os.getloadavg()
    t0, c0 = time.monotonic(), time.process_time()
    base = Path(home) if home else Path(tempfile.gettempdir()) / "murmur-bench-swarm"
    model_dir = ensure_tiny(base, seed=seed, warmup_steps=sc.model_warmup_steps)
    model_s = time.monotonic() - t0
    runs = {m: run_one(m, rounds, seed, model_dir, sc, on_round) for m in ("isolated", "swarm", "adversarial")}
    iso, sw, adv = runs["isolated"], runs["swarm"], runs["adversarial"]
    i, s, a = iso["cumulative_reward"], sw["cumulative_reward"], adv["cumulative_reward"]
    # (c)'s honest nodes against the same nodes isolated (module docstring)
    same = [r for k, r in enumerate(iso["per_node"]) if k != sc.adversary.node]
    i_same = sum(same) / len(same)
    return {
        "rounds": rounds,
        "seed": seed,
        "nodes": sc.nodes,
        "adversary_node": sc.adversary.node,
        "scenario": scenario or "simulations/scenarios/bench_swarm.toml",
        "scenario_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "model": f"murmur-tiny (supervised warm-up {sc.model_warmup_steps} steps)",
        "task_set": f"{sc.task_set.name}: "
        + ", ".join(f"{g.name}={g.generator}{g.config} x{g.weight}" for g in sc.task_set.generators),
        "trainer": msgspec.to_builtins(sc.trainer),
        "mix": {
            "isolated": [sc.isolated.local_groups, sc.isolated.external_groups],
            "swarm": [sc.swarm.local_groups, sc.swarm.external_groups],
        },
        "isolated_cumulative_reward": round(i, 3),
        "swarm_cumulative_reward": round(s, 3),
        "adversarial_cumulative_reward": round(a, 3),
        "isolated_cumulative_reward_honest_nodes": round(i_same, 3),
        "gain_swarm": round(s / i - 1, 4) if i > 0 else None,
        "gain_adversarial": round(a / i_same - 1, 4) if i_same > 0 else None,
        "adversarial_accepted": adv["accepted_from_adversary"],
        "adversary_messages": adv["adversary_messages"],
        "per_node_cumulative": {m: [round(x, 3) for x in r["per_node"]] for m, r in runs.items()},
        "start_reward": {m: round(r["start_reward"], 4) for m, r in runs.items()},
        "final_reward": {m: round(r["final_reward"], 4) for m, r in runs.items()},
        "block_means": {m: r["block_means"] for m, r in runs.items()},
        "reward_by_generator": {m: r["reward_by_generator"] for m, r in runs.items()},
        "informative_groups_per_step": {m: r["informative_groups_per_step"] for m, r in runs.items()},
        "external_groups_per_step": {m: r["external_groups_per_step"] for m, r in runs.items()},
        "idle_steps": {m: r["idle_steps"] for m, r in runs.items()},
        "swarm_verdicts": sw["verdicts"],
        "sampler": {m: r["sampler"] for m, r in runs.items()},
        "adversarial_verdicts": adv["verdicts"],
        "curves": {m: r["curve"] for m, r in runs.items()},
        "model_s": round(model_s, 1),
        "run_wall_s": {m: r["wall_s"] for m, r in runs.items()},
        "run_cpu_s": {m: r["cpu_s"] for m, r in runs.items()},
        "wall_s": round(time.monotonic() - t0, 1),
        "cpu_s": round(time.process_time() - c0, 1),
        "load_avg_start": [round(x, 1) for x in load_start],
        "load_avg_end": [round(x, 1) for x in os.getloadavg()],
        "method": f"{sc.nodes} real Trainer instances round-robin in one process (same per-node compute and seeds); "
        "rollouts sealed with real ed25519 keys and checked by each receiver's own "
        "gossip.validation.Pipeline and task registry",
    }


def _run_seed(args: tuple[int, int, str | None, str | None, int]) -> dict[str, Any]:
    rounds, seed, home, scenario, nodes = args
    return run(rounds=rounds, seed=seed, home=home, scenario=scenario, nodes=nodes)


def run_seeds(
    seeds: int,
    rounds: int = 0,
    seed: int = 0,
    home: str | None = None,
    scenario: str | None = None,
    workers: int = 0,
    nodes: int = 0,
) -> dict[str, Any]:
    """`seeds` consecutive seeds from `seed`, each `run` in its own process (`workers` at a time, 0 = one
    per core), and their means: one seed's gain moves by ±0.2 with the warm-up alone (0.14 to 0.52 on
    seeds 0-3), so a claim needs several. Per-seed results are bit-identical to `run` with that seed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if seeds < 1:
        raise ValueError("seeds must be >= 1")
    load_scenario(scenario, nodes)  # a bad file fails here, once, not in every worker
    t0 = time.monotonic()
    todo = [(rounds, seed + k, home, scenario, nodes) for k in range(seeds)]
    n = workers or min(seeds, os.cpu_count() or 1)
    # spawn: each worker imports torch after run() has pinned it to one thread
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn")) as pool:
        per = list(pool.map(_run_seed, todo))
    keys = (
        "isolated_cumulative_reward",
        "swarm_cumulative_reward",
        "adversarial_cumulative_reward",
        "isolated_cumulative_reward_honest_nodes",
    )

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    sums = {k: sum(r[k] for r in per) for k in keys}
    gains = {g: [r[g] for r in per if r[g] is not None] for g in ("gain_swarm", "gain_adversarial")}
    iso, iso_h = sums["isolated_cumulative_reward"], sums["isolated_cumulative_reward_honest_nodes"]
    return {
        "rounds": per[0]["rounds"],
        "nodes": per[0]["nodes"],
        "seeds": [r["seed"] for r in per],
        "scenario": per[0]["scenario"],
        "scenario_sha256": per[0]["scenario_sha256"],
        **{k: round(v / seeds, 3) for k, v in sums.items()},
        "gain_swarm": round(mean(gains["gain_swarm"]), 4) if gains["gain_swarm"] else None,
        "gain_adversarial": round(mean(gains["gain_adversarial"]), 4) if gains["gain_adversarial"] else None,
        "gain_swarm_pooled": round(sums["swarm_cumulative_reward"] / iso - 1, 4) if iso > 0 else None,
        "gain_adversarial_pooled": round(sums["adversarial_cumulative_reward"] / iso_h - 1, 4) if iso_h > 0 else None,
        "adversarial_accepted": sum(r["adversarial_accepted"] for r in per),
        "per_seed": [
            {
                k: r[k]
                for k in (
                    "seed",
                    "gain_swarm",
                    "gain_adversarial",
                    "adversarial_accepted",
                    *keys,
                    "informative_groups_per_step",
                    "idle_steps",
                    "wall_s",
                )
            }
            for r in per
        ],
        "workers": n,
        "wall_s": round(time.monotonic() - t0, 1),
        "method": per[0]["method"] + "; one process per seed; gains: mean of the per-seed gains "
        "(pooled: ratio of the summed cumulative rewards)",
    }


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    r = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(
        json.dumps(
            run(
                rounds=r,
                seed=s,
                on_round=lambda m, k: print(m, k, round(time.monotonic()), file=sys.stderr) if k % 10 == 0 else None,
            )
        )
    )
