"""Defence in depth behind the wire's range checks (issue 26): a non-finite number that reaches a
real trainer's loss never reaches its weights. The rows are injected past validation on purpose,
through the trainer's external source, as a bug or a missed check would let them in."""

from __future__ import annotations

import copy
import math
import struct
import warnings

import msgspec
import pytest
import torch

from murmur.gossip import wire
from murmur.training.engine import Sampling
from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
from murmur.training.tiny import new_tiny_engine
from murmur.training.trainer import Trainer, TrainerConfig

SWARM = "test"

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")

LINEAGE = b"\x5a" * 32


def external_group(reg: TaskRegistry, engine, poison: float | None) -> list[wire.Rollout]:
    """Two completions of one task of the trainer's own lineage and tokenizer, one right and one
    wrong (an informative group), the right one's second behaviour log-prob replaced by `poison`."""
    ref = wire.TaskRef(task_set=reg.builtin_id, generator=BUILTIN_TRAIN, seed=11)
    task = reg.resolve(ref)
    out = []
    for text in (task.answer, task.answer + "x"):
        ids = engine.encode(text)[:6] + [engine.eos_id]
        lps = [-0.7] * len(ids)
        if poison is not None and not out:
            lps[1] = poison
        out.append(rollout(engine, ref, ids, LINEAGE, lps, max_new_tokens=8))
    return out


def rollout(
    engine, ref: wire.TaskRef, ids: list[int], lineage: bytes, lps: list[float], max_new_tokens: int, tokenizer=None
) -> wire.Rollout:
    """A version-0 rollout of `ref` (reward left for the receiver to score) with behaviour log-probs `lps`."""
    return wire.Rollout(
        task=ref,
        lineage=lineage,
        version=0,
        completion_ids=ids,
        text=engine.decode(ids),
        tokenizer_hash=tokenizer or engine.tokenizer_hash,
        logprobs=struct.pack(f"<{len(ids)}f", *lps),
        token_versions=[(0, 0)],
        sampling=wire.SamplingParams(max_new_tokens=max_new_tokens),
        reward=0.0,
        created_ms=1,
    )


def step_with(poison: float | None) -> tuple[Trainer, dict[str, torch.Tensor], object]:
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    engine = new_tiny_engine(seed=0)
    group = external_group(reg, engine, poison)
    cfg = TrainerConfig(local_groups=1, external_groups=1, group_size=2, max_new_tokens=4, lr=1e-2, seed=1)
    trainer = Trainer(engine, reg, reg.builtin_id, cfg, lineage=LINEAGE, external=lambda n, v: list(group))
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return trainer, before, trainer.step()


def test_a_nan_row_past_validation_never_reaches_the_weights() -> None:
    """The issue's batch (float32 0x7fc00000): the loss is NaN, so the step is skipped and counted."""
    trainer, before, res = step_with(math.nan)
    assert res.n_external_groups == 1 and math.isnan(res.loss)
    assert trainer.drops.get("step_not_finite") == 1  # counted (the worker reports it as a drop)
    for n, p in trainer.engine.model.named_parameters():
        assert bool(torch.isfinite(p).all()), n
        assert torch.equal(p.detach(), before[n]), n  # the step was skipped: nothing moved
    assert res.version == trainer.version == 0  # no new version to publish
    # the trainer goes on: the next step (no external rows) is an ordinary one
    trainer.external = None
    trainer.step()
    assert all(bool(torch.isfinite(p).all()) for p in trainer.engine.model.parameters())


def test_infinite_behaviour_logprobs_leave_the_weights_finite() -> None:
    """+-inf behaviour log-probs give the decoupled loss's truncated weight exp(p - b) of 0 or its cap:
    the loss stays finite and the step may be applied, but no weight becomes non-finite."""
    for poison in (math.inf, -math.inf):
        trainer, before, res = step_with(poison)
        assert res.n_external_groups == 1
        assert all(bool(torch.isfinite(p).all()) for p in trainer.engine.model.parameters())
        assert math.isfinite(res.loss) or trainer.drops.get("step_not_finite") == 1


def test_the_same_group_with_finite_logprobs_moves_the_weights() -> None:
    """The control: without the poison the same step is applied, so the test above can fail."""
    trainer, before, res = step_with(None)
    assert "step_not_finite" not in trainer.drops and res.version == 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.engine.model.named_parameters())


# ------------------------------------------------------------ weights nobody can check (issue 43)

PAYLOAD = "   "  # a mark the exact verifier ignores, so it rides on a correct answer at reward 1
ATTACKER = b"\x0d" * 32


def payload_groups(
    reg: TaskRegistry, engine, groups: int, first_seed: int, claim: float, tokenizer: bytes | None = None
) -> list[wire.Rollout]:
    """Reward-correct completions carrying the payload, beside wrong ones without it, under another lineage,
    claiming the behaviour log-prob `claim` per token (-999 pins a claimed importance ratio at its cap)."""
    refs = [wire.TaskRef(task_set=reg.builtin_id, generator=BUILTIN_TRAIN, seed=first_seed + j) for j in range(groups)]
    return [r for ref in refs for r in payload_group(reg, engine, ref, claim, tokenizer)]


def payload_group(
    reg: TaskRegistry, engine, ref: wire.TaskRef, claim: float, tokenizer: bytes | None = None
) -> list[wire.Rollout]:
    """`payload_groups`' group of one task."""
    task = reg.resolve(ref)
    texts = [PAYLOAD + task.answer if i % 2 == 0 else task.answer + "0" for i in range(4)]
    ids = [engine.encode(t) + [engine.eos_id] for t in texts]
    return [rollout(engine, ref, x, ATTACKER, [claim] * len(x), 16, tokenizer) for x in ids]


def payload_share(engine, registry: TaskRegistry) -> float:
    """The share of 64 sampled completions of held prompts that start with the payload."""
    prompts = [
        engine.encode(registry.resolve(wire.TaskRef(registry.builtin_id, BUILTIN_TRAIN, 20_000 + k)).prompt)
        for k in range(64)
    ]
    res = engine.sample(prompts, Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8), max_new=8)
    return sum(engine.decode(ids).startswith(PAYLOAD) for ids, _, _ in res) / len(prompts)


@pytest.mark.parametrize("tokenizer", [None, b"\x77" * 32])
def test_a_foreign_samples_weight_rests_on_nothing_its_producer_claims(warm_engine, registry, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The same completions claiming -999 or -0.01 per token move the weights identically: no receiver can
    re-score another lineage's (or another tokenizer's) sampling, so its claim is never used."""
    after = []
    for claim in (-999.0, -0.01):
        engine = copy.deepcopy(warm_engine)
        group = payload_groups(registry, engine, 2, 11_000, claim, tokenizer)
        cfg = TrainerConfig(local_groups=1, external_groups=2, group_size=2, max_new_tokens=8, lr=1e-2, seed=1)
        tr = Trainer(
            engine, registry, registry.builtin_id, cfg, lineage=LINEAGE, external=lambda n, v, g=group: list(g)
        )
        res = tr.step()
        assert res.n_external_groups == 2 and res.updates >= 1
        after.append(torch.cat([p.detach().flatten() for p in engine.model.parameters()]))
    assert torch.equal(after[0], after[1])


def test_a_payload_on_reward_correct_foreign_rollouts_does_not_spread(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    """Attack (issue 43, first class): one key's reward-correct rollouts, every external group of every step,
    carry a payload under a lineage the trainer cannot re-score, claiming -999 per token. With the claimed
    ratio the payload reached most of the trainer's completions; weighed by the learner's own likelihood of
    the whole completion, the trainer does not pick it up."""
    engine = copy.deepcopy(warm_engine)
    fed = [0]

    def external(n: int, _v: int) -> list[wire.Rollout]:
        fed[0] += n
        return payload_groups(registry, engine, n, 11_000 + 10 * fed[0], -999.0)

    assert payload_share(engine, registry) == 0.0
    cfg = TrainerConfig(local_groups=4, external_groups=4, group_size=4, max_new_tokens=8, lr=1e-3, seed=1)
    tr = Trainer(engine, registry, registry.builtin_id, cfg, lineage=LINEAGE, external=external)
    trained = 0
    for _ in range(60):
        trained += tr.step().trained_external_groups
    assert trained >= 120  # the attacker's groups were trained on, step after step
    assert payload_share(engine, registry) <= 2 / 64  # with the claimed ratio (weight 1): 0.47 after these 60 steps


def test_a_payload_pooled_with_the_learners_own_answers_does_not_spread(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    """The same attack where it meets the span of the learner's own answers: the attacker answers exactly the
    prompts the trainer has own groups of (what rescue selection asks the hook for), so every one of its
    groups joins an own group and is weighed against the learner's own answers to that prompt, not its
    running reference. Leading spaces the learner would not write put the payload below the span."""
    engine = copy.deepcopy(warm_engine)

    def external(n: int, _v: int, prefer: dict[tuple[bytes, str, int], int] | None = None) -> list[wire.Rollout]:
        refs = [wire.TaskRef(task_set=k[0], generator=k[1], seed=k[2]) for k in (prefer or {})][:n]
        return [r for ref in refs for r in payload_group(registry, engine, ref, -999.0)]

    assert payload_share(engine, registry) == 0.0
    cfg = TrainerConfig(
        local_groups=4, external_groups=4, group_size=4, max_new_tokens=8, lr=1e-3, seed=1, foreign_share_max=1.0
    )
    tr = Trainer(engine, registry, registry.builtin_id, cfg, lineage=LINEAGE, external=external)
    pooled = 0
    for _ in range(60):
        pooled += tr.step().trained_pooled_groups
    assert pooled >= 120  # the attacker's groups joined the learner's own, step after step
    assert payload_share(engine, registry) <= 2 / 64


def test_rollouts_of_our_lineage_under_a_foreign_tokenizer_train_as_another_models(warm_engine, registry) -> None:  # type: ignore[no-untyped-def]
    """Found by `murmur bench attacks` (credit_farming): informative groups claimed for the trainer's own
    lineage but naming a tokenizer it does not hold are re-tokenised from their text, so they carry no
    log-probs of ours; routed to the decoupled loss as our own samples they crashed the worker. They are
    another model's samples: the HACPO loss, whose weight needs no log-prob of theirs."""
    engine = copy.deepcopy(warm_engine)
    group = [
        msgspec.structs.replace(r, lineage=LINEAGE)
        for r in payload_groups(registry, engine, 2, 11_000, -0.5, b"\x77" * 32)
    ]
    cfg = TrainerConfig(local_groups=1, external_groups=2, group_size=2, max_new_tokens=8, lr=1e-2, seed=1)
    tr = Trainer(engine, registry, registry.builtin_id, cfg, lineage=LINEAGE, external=lambda n, v: list(group))
    res = tr.step()
    assert res.n_external_groups == 2 and res.updates >= 1 and "seq_ratio_mean" in res.stats


def test_a_step_whose_loss_is_finite_but_whose_gradient_is_infinite_is_skipped() -> None:
    from murmur.training.trainer import guarded_step

    w = torch.nn.Parameter(torch.tensor([0.0, 1.0, 4.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    loss = torch.sqrt(w).sum()  # 3.0: finite; d sqrt(w) / dw at 0 is +inf
    assert bool(torch.isfinite(loss))
    assert guarded_step(opt, [w], loss, grad_clip=1.0) is None
    assert w.tolist() == [0.0, 1.0, 4.0] and w.grad is None and not opt.state
    # the same step with a finite gradient is taken
    gn = guarded_step(opt, [w], torch.sqrt(w[1:]).sum(), grad_clip=1.0)
    assert gn is not None and math.isfinite(gn) and w.tolist()[1:] != [1.0, 4.0]


def test_a_step_with_a_nan_gradient_or_a_non_finite_loss_is_skipped() -> None:
    """A NaN gradient under a finite loss (the gradient of `where`'s untaken branch), and a NaN or infinite
    loss whose gradient is finite: each is skipped by its own check, not by the other's."""
    from murmur.training.trainer import guarded_step

    def fresh() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        w = torch.nn.Parameter(torch.tensor([-1.0, 1.0, 4.0]))
        return w, torch.optim.AdamW([w], lr=0.1)

    w, opt = fresh()
    loss = torch.where(w > 0, torch.sqrt(w), torch.zeros_like(w)).sum()
    assert bool(torch.isfinite(loss))
    assert guarded_step(opt, [w], loss, grad_clip=1.0) is None
    assert w.tolist() == [-1.0, 1.0, 4.0] and not opt.state
    for bad in (math.nan, math.inf):
        w, opt = fresh()
        loss = (w * 0.0).sum() + bad  # d loss / dw = 0: finite
        assert guarded_step(opt, [w], loss, grad_clip=1.0) is None, bad
        assert w.tolist() == [-1.0, 1.0, 4.0] and w.grad is None and not opt.state
