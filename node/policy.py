"""The published policy is bf16: what a lineage versions, what every node generates with.

A version's state hash is over its bf16 bytes (DESIGN.md), so a patch lists
only the elements whose bf16 value changed: a trainer keeps an fp32 master
for the optimizer (pure bf16 training stalls, notes/ml-on-cpu.md) and
publishes its bf16 copy, whose elements move only when the master crosses a
rounding boundary. Generation everywhere (followers, and the trainer's own
rollouts, as vLLM + fp32-master setups do) runs on the published bf16 values
upcast to fp32 for CPU compute: the values are exactly the bf16 ones, so a
validator holding version v recomputes the same log-probs the producer
claimed.

Imported only in the worker process (torch).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from training.engine_hf import HFEngine

PUBLISHED_DTYPE = torch.bfloat16
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def to_published(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 copy of the floating tensors (others copied unchanged): the state a version hashes."""
    return {n: (t.detach().to(PUBLISHED_DTYPE) if t.dtype in _FLOATS else t.detach().clone()).contiguous()
            for n, t in state.items()}


@torch.no_grad()
def mirror(model_state: Mapping[str, torch.Tensor], published: Mapping[str, torch.Tensor],
           changed: Mapping[str, torch.Tensor]) -> None:
    """Copy the elements a patch changed from the bf16 state into the fp32 compute model (exact upcast)."""
    for name, idx in changed.items():
        dst = model_state[name].view(-1)
        dst[idx] = published[name].view(-1)[idx].to(dst.dtype)


class MasterEngine(HFEngine):
    """Trains the fp32 master (`model`) but samples from the published bf16 weights (`gen`).

    The trainer loop calls `sample` for rollouts and `token_logprobs` for the
    loss: rollouts come from the version peers can hold (so they can be
    gossiped and spot-checked), gradients flow through the master.
    """

    def __init__(self, master: HFEngine, published: Mapping[str, torch.Tensor], seed: int = 0) -> None:
        super().__init__(master.model, master.tokenizer, master.memory_budget_mb, seed)
        self.gen = HFEngine(copy.deepcopy(master.model), master.tokenizer, master.memory_budget_mb, seed)
        self.gen.model.requires_grad_(False)
        self.set_published(published)

    def set_published(self, published: Mapping[str, torch.Tensor]) -> None:
        self.gen.load_state(dict(published))

    def sample(self, prefixes: list[list[int]], sampling: Any, max_new: int | None = None
               ) -> list[tuple[list[int], list[float], bool]]:
        return self.gen.sample(prefixes, sampling, max_new)
