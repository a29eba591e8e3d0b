"""Defence in depth behind the wire's range checks (issue 26): a non-finite number that reaches a
real trainer's loss never reaches its weights. The rows are injected past validation on purpose,
through the trainer's external source, as a bug or a missed check would let them in."""

from __future__ import annotations

import math
import struct
import warnings

import torch

from gossip import wire
from training.tasksets import BUILTIN_TRAIN, TaskRegistry
from training.tiny import new_tiny_engine
from training.trainer import Trainer, TrainerConfig

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
        out.append(wire.Rollout(task=ref, lineage=LINEAGE, version=0, completion_ids=ids,
                                text=engine.decode(ids), tokenizer_hash=engine.tokenizer_hash,
                                logprobs=struct.pack(f"<{len(ids)}f", *lps), token_versions=[(0, 0)],
                                sampling=wire.SamplingParams(max_new_tokens=8), reward=0.0, created_ms=1))
    return out


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


def test_a_step_whose_loss_is_finite_but_whose_gradient_is_infinite_is_skipped() -> None:
    from training.trainer import guarded_step

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
    from training.trainer import guarded_step

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
