"""The policy-engine interface shared by the transformers and vLLM engines.

An engine samples completions with per-token behaviour log-probs, re-scores
token sequences, and takes in-place weight updates from the sync package
(`take_version`: the elements a patch changed, or a whole state), so the
trainer, rollout workers and validators need not know which backend runs
underneath. `open_engine` is the one place that picks the backend.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import msgspec

from murmur.gossip.errors import MurmurError

ENGINES: Final = ("transformers", "vllm")
MODE_TRANSFORMERS: Final = "transformers"
MODE_SPARSE: Final = "vllm (sparse in place)"
MODE_DENSE: Final = "vllm (dense reload)"


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
    eos_id: int
    mode: str  # MODE_TRANSFORMERS | MODE_SPARSE | MODE_DENSE

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def sample(
        self, prefixes: list[list[int]], sampling: Sampling, max_new: int | None = None
    ) -> list[tuple[list[int], list[float], bool]]:
        """Continue each token prefix by up to `max_new` tokens: (new ids, log-probs, hit EOS)."""
        ...

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions for each prompt (groups, in prompt order)."""
        ...

    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every completion token of each (prompt_ids, completion_ids)."""
        ...

    def apply_patch(self, updates: list[SparseUpdate]) -> None: ...

    def load_state(self, tensors: dict[str, Any]) -> None: ...

    def take_version(self, state: Mapping[str, Any], changed: Mapping[str, Any] | None) -> None:
        """Make the weights equal `state` (the published bf16 tensors of one version), given the flat
        indices each tensor changed since the engine's current version (None: load all of it)."""
        ...


def generate_groups(engine: Engine, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
    """`n` completions per prompt through the engine's `sample`, in one batch: what `Engine.generate` does
    for every backend."""
    enc = [engine.encode(p) for p in prompts]
    res = engine.sample([e for e in enc for _ in range(n)], sampling)
    groups: list[list[Completion]] = []
    for gi, e in enumerate(enc):
        g = []
        for k in range(n):
            ids, lps, fin = res[gi * n + k]
            g.append(Completion(prompt_ids=e, ids=ids, text=engine.decode(ids), logprobs=lps, finished=fin))
        groups.append(g)
    return groups


def open_engine(
    kind: str,
    model_path: str | Path,
    reference: Any,
    *,
    role: str = "follower",
    memory_budget_mb: int = 1024,
    seed: int = 0,
    threads: int = 1,
) -> Engine:
    """The generation engine a node asked for. `reference` is the transformers engine already loaded
    from `model_path` (the trainer's master, the source of the base state): it is returned as is for
    "transformers". "vllm" raises MurmurError with the reason when vLLM cannot run here: never a
    silent fallback to transformers."""
    if kind == "transformers":
        return reference
    if kind != "vllm":
        raise MurmurError(f"unknown engine {kind!r}: use one of {', '.join(ENGINES)}")
    from murmur.training.engine_vllm import VLLMEngine

    return VLLMEngine(
        model_path,
        tokenizer=reference.tokenizer,
        role=role,
        memory_budget_mb=memory_budget_mb,
        seed=seed,
        threads=threads,
    )


def tokenizer_hash_from_json(tokenizer_json: str) -> bytes:
    """blake2b-256 of the tokenizer's canonical JSON (sorted keys, no whitespace)."""
    canon = json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canon.encode(), digest_size=32).digest()
