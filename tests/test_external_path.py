"""The trainer's external path against a real tiny model: HACPO capabilities measured on one basis,
completions cut at their token cap masked out of the loss (never given an EOS that was not sampled),
and the overprovision a node runs is the one the benchmarks run."""

from __future__ import annotations

import warnings

import msgspec
import pytest
import torch

from murmur.gossip import wire
from murmur.training.losses import hacpo_coefficient
from murmur.training.rollouts import logprobs_to_bytes, to_wire
from murmur.training.sampler import Sampler, Signed
from murmur.training.tasksets import TaskRegistry
from murmur.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

OTHER = b"\x0b" * 32


def test_hacpo_capabilities_of_equal_skill_are_equal(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    """A source that is the learner itself (its own rollouts, one step later, under another lineage, through
    the sampler that drops uninformative groups) must get coefficient ~1: the learner's rate is measured on
    the same basis as the source's. Measured over all its rollouts it came out lower, and the source's rows
    were weighted up by HACPO's coefficient at equal skill."""
    sampler = Sampler(max_groups=64)
    sampler.observe_head(OTHER, 0)  # OTHER publishes (the node tells its worker once a manifest is accepted)

    def external(n: int, _min_version: int) -> list[Signed]:
        return sampler.take_rollouts(n)

    cfg = TrainerConfig(local_groups=4, external_groups=4, group_size=4, max_new_tokens=4, lr=0.0, seed=5)
    tr = Trainer(warm_engine, registry, registry.builtin_id, cfg, lineage=b"\x0a" * 32, external=external)
    ratios = []
    informative = 0
    for _ in range(30):
        res = tr.step()
        groups: dict[int, list] = {}
        for r in res.rollouts:
            groups.setdefault(r.ref.seed, []).append(r)
        informative += sum(len({x.reward for x in g}) > 1 for g in groups.values())
        sampler.add_rollouts([msgspec.structs.replace(to_wire(r), lineage=OTHER) for r in res.rollouts])
        if OTHER in tr.capability.rate:
            ratios.append(
                float(hacpo_coefficient(torch.tensor([tr.capability.get(OTHER)]), tr.capability.get(tr.lineage))[0])
            )
    assert informative >= 10 and len(ratios) >= 20  # the source was seen, through enough groups
    mean = sum(ratios) / len(ratios)
    assert 0.85 <= mean <= 1.15, mean


def _ref(registry: TaskRegistry, seed: int) -> wire.TaskRef:
    m = registry.get(registry.builtin_id)
    g = next(x for x in m.generators if not x.name.endswith("-eval"))
    return wire.TaskRef(registry.builtin_id, g.name, g.seed_start + seed)


def _rollout(engine, registry, ref: wire.TaskRef, text: str, eos: bool, cap: int) -> wire.Rollout:  # type: ignore[no-untyped-def]
    ids = engine.encode(text) + ([engine.eos_id] if eos else [])
    return wire.Rollout(
        task=ref,
        lineage=OTHER,
        version=0,
        completion_ids=ids,
        text=text,
        tokenizer_hash=engine.tokenizer_hash,
        logprobs=logprobs_to_bytes([-1.0] * len(ids)),
        token_versions=[(0, 0)],
        sampling=wire.SamplingParams(max_new_tokens=cap),
        reward=0.0,
        created_ms=1,
    )


@pytest.mark.parametrize("eos", [False, True])
def test_a_cut_external_completion_is_masked_not_given_an_eos(warm_engine, registry, eos: bool) -> None:  # type: ignore[no-untyped-def]
    """An informative external group of another lineage, same tokenizer. Cut at the producer's token cap
    (no EOS): the rows keep their rewards but train nothing, so the weights do not move; an EOS was
    appended to them before. With their sampled EOS (control) the same group does move the weights."""
    import copy

    eng = copy.deepcopy(warm_engine)
    ref = _ref(registry, 3)
    task = registry.resolve(ref)
    wrong = "9" * len(task.answer) if task.answer != "9" * len(task.answer) else "1" * len(task.answer)
    group = []
    for text in (task.answer, wrong):
        n = len(eng.encode(text)) + (1 if eos else 0)
        group.append(_rollout(eng, registry, ref, text, eos, cap=n if not eos else n + 4))

    # no own groups, so no reference log-prob of its own yet (0): HACPO's band would cut both rows and the
    # control could not move; the band has its own tests (tests/test_pooled.py)
    cfg = TrainerConfig(
        local_groups=0,
        external_groups=1,
        group_size=2,
        max_new_tokens=8,
        lr=1e-3,
        lr_warmup_steps=1,
        foreign_ratio_clip=False,
    )
    tr = Trainer(eng, registry, registry.builtin_id, cfg, lineage=b"\x0a" * 32, external=lambda n, v: list(group))
    before = [p.detach().clone() for p in eng.model.parameters()]
    res = tr.step()
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(before, eng.model.parameters()))
    assert res.n_external_groups == 1 and res.dropped_groups == 0  # informative: one right, one wrong
    if eos:
        assert moved and res.stats["truncated_masked"] == 0
    else:
        assert not moved and res.stats["truncated_masked"] == 2
        assert res.tokens == sum(len(r.completion_ids) for r in group)  # no EOS was added to the rows


def test_a_foreign_tokenizer_completion_shorter_than_its_cap_finished() -> None:
    from murmur.training.rollouts import from_wire
    from murmur.training.tasks import Task

    task = Task(prompt="p", answer="1", verifier="exact")
    ref = wire.TaskRef(bytes(32), "g", 1)

    def w(n: int, cap: int) -> wire.Rollout:
        return wire.Rollout(
            task=ref,
            lineage=OTHER,
            version=0,
            completion_ids=[7] * n,
            text="12",
            tokenizer_hash=b"\x05" * 32,
            logprobs=logprobs_to_bytes([-0.5] * n),
            token_versions=[(0, 0)],
            sampling=wire.SamplingParams(max_new_tokens=cap),
            reward=0.0,
            created_ms=1,
        )

    def enc(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert from_wire(w(3, 8), task, [1], b"\x06" * 32, enc, 2).finished
    assert not from_wire(w(8, 8), task, [1], b"\x06" * 32, enc, 2).finished  # reached the cap: cut
    same = msgspec.structs.replace(w(3, 8), tokenizer_hash=b"\x06" * 32, completion_ids=[7, 7, 2])
    assert from_wire(same, task, [1], b"\x06" * 32, enc, 2).finished  # our tokenizer: its EOS shows
    assert not from_wire(
        msgspec.structs.replace(same, completion_ids=[7, 7, 7]), task, [1], b"\x06" * 32, enc, 2
    ).finished


def test_nodes_and_benchmarks_overprovision_alike(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from murmur.gossip.identity import Identity
    from murmur.node.config import Config
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec
    from murmur.simulations.bench import swarm as bench_swarm

    spec = worker_spec(Config(), tmp_path, Identity.generate(), ["trainer"], RunOptions())
    node = TrainerConfig(**spec["trainer"])
    sc, _ = bench_swarm.load_scenario()
    bench = bench_swarm.trainer_config(sc, sc.swarm, seed=0, index=0)
    assert bench.overprovision == node.overprovision == 1.0


def test_the_nodes_training_keys_reach_its_trainer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from murmur.gossip.identity import Identity
    from murmur.node.config import Config, TrainingSection
    from murmur.node.shell.runtime import RunOptions
    from murmur.node.shell.workerlink import worker_spec

    cfg = Config(training=TrainingSection(loss_norm="constant", minibatch_groups=6))
    got = TrainerConfig(**worker_spec(cfg, tmp_path, Identity.generate(), ["trainer"], RunOptions())["trainer"])
    assert (got.loss_norm, got.minibatch_groups) == ("constant", 6)
    assert got == TrainerConfig.from_config(cfg)  # the worker's path and the in-process one agree
    default = TrainerConfig(
        **worker_spec(Config(), tmp_path, Identity.generate(), ["trainer"], RunOptions())["trainer"]
    )
    assert default.minibatch_groups == Config().training.minibatch_groups > 0  # swarm data adds updates


def test_with_a_fixed_minibatch_swarm_groups_add_updates_and_never_displace_local_ones(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    import copy

    peer = Trainer(
        copy.deepcopy(warm_engine),
        registry,
        registry.builtin_id,
        TrainerConfig(local_groups=4, group_size=4, max_new_tokens=4, lr=0.0, seed=9),
        lineage=OTHER,
    )
    sampler = Sampler(max_groups=64, seed=1)
    sampler.observe_head(OTHER, 0)

    def external(n: int, _v: int) -> list[Signed]:
        for _ in range(2):
            sampler.add_rollouts([to_wire(r) for r in peer.step().rollouts])
        return sampler.take_rollouts(n)

    m = 2
    cfg = TrainerConfig(
        local_groups=2, external_groups=6, group_size=4, max_new_tokens=4, lr=1e-4, seed=4, minibatch_groups=m
    )
    tr = Trainer(
        copy.deepcopy(warm_engine), registry, registry.builtin_id, cfg, lineage=b"\x0a" * 32, external=external
    )
    local_informative = updates = trained = trained_ext = 0
    for _ in range(6):
        res = tr.step()
        local_informative += sum(len({r.reward for r in g}) > 1 for g in _groups(res.rollouts))
        updates += res.updates
        trained += res.trained_groups
        trained_ext += res.trained_external_groups
        assert res.trained_groups == m * res.updates and res.backlog_groups < m  # every update exactly m groups
        assert res.stats["updates"] == res.updates
    waiting_local = sum(not p.external for p in tr.backlog)
    assert trained - trained_ext + waiting_local == local_informative  # every local informative group trains
    assert trained_ext > 0 and updates > local_informative // m  # the swarm's groups added updates
    assert tr.version <= tr.step_no  # one version per step that updated, however many updates it made


def _groups(rollouts: list) -> list[list]:  # type: ignore[type-arg]
    by: dict[int, list] = {}
    for r in rollouts:
        by.setdefault(r.ref.seed, []).append(r)
    return list(by.values())


def test_minibatch_groups_is_checked() -> None:
    from murmur.gossip.errors import ConfigError

    with pytest.raises(ConfigError, match="minibatch_groups"):
        TrainerConfig(minibatch_groups=-1)
