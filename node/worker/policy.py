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

from murmur.training.engine import Engine
from murmur.training.engine_hf import HFEngine

PUBLISHED_DTYPE = torch.bfloat16
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def to_published(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 copy of the floating tensors (others copied unchanged): the state a version hashes."""
    return {
        n: (t.detach().to(PUBLISHED_DTYPE) if t.dtype in _FLOATS else t.detach().clone()).contiguous()
        for n, t in state.items()
    }


class MasterEngine(HFEngine):
    """Trains the fp32 master (`model`) but samples from the published bf16 weights (`gen_engine`).

    The trainer loop calls `sample` for rollouts and `token_logprobs` for the
    loss: rollouts come from the version peers can hold (so they can be
    gossiped and spot-checked), gradients flow through the master. `gen_engine` is a
    transformers copy by default, or any engine passed in (a vLLM engine: the
    split of an fp32 torch learner and a vLLM sampler).
    """

    def __init__(
        self, master: HFEngine, published: Mapping[str, torch.Tensor], seed: int = 0, gen: Engine | None = None
    ) -> None:
        super().__init__(master.model, master.tokenizer, master.memory_budget_mb, seed)
        if gen is None:
            copy_ = HFEngine(copy.deepcopy(master.model), master.tokenizer, master.memory_budget_mb, seed)
            copy_.model.requires_grad_(False)
            gen = copy_
        self.gen_engine = gen  # not `gen`: HFEngine's sampling RNG has that name
        self.mode = gen.mode
        self._held: dict[str, torch.Tensor] | None = None
        self.set_published(published)

    def set_published(self, published: Mapping[str, torch.Tensor]) -> None:
        """Bring the sampler to a new published version: only the elements whose bf16 bits changed."""
        changed = None
        if self._held is not None and set(self._held) == set(published):
            changed = {}
            for n, t in published.items():
                a, b = self._held[n].view(-1), t.view(-1)
                if a.dtype.is_floating_point and a.element_size() == 2:
                    a, b = a.view(torch.int16), b.view(torch.int16)
                idx = (a != b).nonzero().view(-1)
                if idx.numel():
                    changed[n] = idx
        self.gen_engine.take_version(published, changed)
        self._held = {n: t.detach().clone() for n, t in published.items()}

    def sample(
        self, prefixes: list[list[int]], sampling: Any, max_new: int | None = None
    ) -> list[tuple[list[int], list[float], bool]]:
        return self.gen_engine.sample(prefixes, sampling, max_new)
