"""The policy-engine interface shared by the transformers and vLLM engines.

An engine samples completions with per-token behaviour log-probs, re-scores
token sequences, and takes in-place weight updates from the sync package
(`apply_patch` for sparse element updates, `load_state` for dense tensors),
so the trainer, rollout workers and validators need not know which backend
runs underneath.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass
class Completion:
    """One sampled continuation. `logprobs[i]` is the behaviour log-prob of `ids[i]`
    under the sampling distribution (logits / temperature, before top-p)."""

    prompt_ids: list[int]
    ids: list[int]
    text: str
    logprobs: list[float]
    finished: bool  # ended with EOS (False: hit the token limit or was cut for a partial rollout)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SparseUpdate:
    """New values for some elements of one tensor (flat indices into the tensor)."""

    name: str
    indices: Any  # int64/int32 1-D tensor or array
    values: Any  # 1-D tensor or array, any float dtype; cast to the parameter dtype


@runtime_checkable
class Engine(Protocol):
    tokenizer_hash: bytes

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions for each prompt (groups, in prompt order)."""
        ...

    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every completion token of each (prompt_ids, completion_ids)."""
        ...

    def apply_patch(self, updates: list[SparseUpdate]) -> None:
        ...

    def load_state(self, tensors: dict[str, Any]) -> None:
        ...


def tokenizer_hash_from_json(tokenizer_json: str) -> bytes:
    """blake2b-256 of the tokenizer's canonical JSON (sorted keys, no whitespace)."""
    canon = json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canon.encode(), digest_size=32).digest()
