"""vLLM policy engine (optional; GPU nodes). Imported lazily: nothing here loads vllm at import time.

Written against vLLM 0.33's weight-update API (see docs/training.md):
- sparse, in place, on GPU: the `sparse_nccl` weight-transfer backend takes
  `SparseWeightPatch(name, indices int32 flat, values bf16, full_shape)` in
  Hugging Face checkpoint names; we drive it from a colocated node through a
  worker extension (`worker_extension_cls`) whose method calls the inference
  side `load_checkpoint_weight_patches` (it maps fused q/k/v and tensor-
  parallel shards; indices must be unique, float dtypes only, no rollback).
  The trainer-side sequence is `init_weight_transfer_engine`,
  `start_weight_update`, `update_weights` (repeatable, chunked),
  `finish_weight_update(weight_version=...)`.
- dense fallback (any build, incl. the community CPU build where linear
  weights are repacked after load so sparse patches cannot apply):
  `model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`
  with every part of a fused module sent together, and a tied output head
  re-sent with its embedding.
vLLM pins its own torch/transformers, so it lives in the `gpu` extra or its own
environment; this module must import cleanly without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gossip.errors import MurmurError
from training.engine import Completion, Sampling, SparseUpdate, tokenizer_hash_from_json


def vllm_available() -> tuple[bool, str]:
    """(importable, reason when not)."""
    try:
        import vllm  # noqa: F401, PLC0415
    except Exception as e:  # ImportError, or a CUDA/torch mismatch at import
        return False, f"vllm is not importable here: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return True, ""


class MurmurWorkerExtension:
    """Mixed into vLLM's GPU worker via `worker_extension_cls`; called through `collective_rpc`."""

    def murmur_apply_sparse(self, patches: list[tuple[str, Any, Any, tuple[int, ...]]]) -> int:
        import torch  # noqa: PLC0415
        from vllm.model_executor.model_loader.weight_utils import (  # noqa: PLC0415
            SparseWeightPatch,
            load_checkpoint_weight_patches,
        )

        model = self.model_runner.model  # type: ignore[attr-defined]
        objs = [SparseWeightPatch(name=n, indices=torch.as_tensor(i, dtype=torch.int32),
                                  values=torch.as_tensor(v).to(torch.bfloat16), full_shape=tuple(s))
                for n, i, v, s in patches]
        load_checkpoint_weight_patches(model, objs)
        return len(objs)

    def murmur_reload_dense(self, tensors: list[tuple[str, Any]]) -> int:
        self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)


class VLLMEngine:
    """Sampling through vLLM; log-prob re-scoring through prompt log-probs; weight updates in place."""

    def __init__(self, model_path: str | Path, sparse: bool = True, seed: int = 0, **llm_kwargs: Any) -> None:
        ok, why = vllm_available()
        if not ok:
            raise MurmurError(why)
        from vllm import LLM  # noqa: PLC0415

        p = Path(model_path)
        if not (p / "config.json").is_file():
            raise MurmurError(f"model path {str(p)!r} has no config.json: not a Hugging Face model directory")
        kwargs = dict(model=str(p), seed=seed, worker_extension_cls=f"{__name__}.MurmurWorkerExtension")
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.tokenizer_hash = tokenizer_hash_from_json(self.tokenizer.backend_tokenizer.to_str())
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.sparse = sparse
        self.version = 0
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _params(self, sampling: Sampling, n: int, prompt_logprobs: int | None = None) -> Any:
        from vllm import SamplingParams  # noqa: PLC0415

        return SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                              max_tokens=sampling.max_new_tokens, logprobs=0, prompt_logprobs=prompt_logprobs)

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
        outs = self.llm.generate(prompts, self._params(sampling, n), use_tqdm=False)
        groups = []
        for o in outs:
            g = []
            for c in o.outputs:
                lps = [float(next(iter(d.values())).logprob) if d else 0.0 for d in (c.logprobs or [])]
                ids = list(c.token_ids)
                g.append(Completion(prompt_ids=list(o.prompt_token_ids), ids=ids, text=c.text, logprobs=lps,
                                    finished=c.finish_reason == "stop"))
            groups.append(g)
        return groups

    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        sp = self._params(Sampling(temperature=max(temperature, 1e-5), max_new_tokens=1), 1, prompt_logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in sequences], sp, use_tqdm=False)
        res = []
        for (p, c), o in zip(sequences, outs):
            pl = o.prompt_logprobs or []
            toks = p + c
            res.append([float(pl[len(p) + j][toks[len(p) + j]].logprob) for j in range(len(c))])
        return res

    def apply_patch(self, updates: list[SparseUpdate]) -> None:
        """Sparse in-place patch on GPU builds; raises MurmurError where the backend cannot (use load_state)."""
        if not self.sparse:
            raise MurmurError("this vLLM engine is in dense mode: apply patches with load_state")
        payload = [(u.name, u.indices, u.values, self._shapes.get(u.name, ())) for u in updates]
        try:
            self.llm.collective_rpc("murmur_apply_sparse", args=(payload,))
        except Exception as e:
            raise MurmurError(f"vLLM sparse patch failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
        self.version += 1

    def set_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Full shapes of checkpoint tensors (from the lineage's base model), needed by SparseWeightPatch."""
        self._shapes = dict(shapes)

    def load_state(self, tensors: dict[str, Any]) -> None:
        """Dense reload; send every part of a fused module (q/k/v, gate/up) and tied heads together."""
        try:
            self.llm.collective_rpc("murmur_reload_dense", args=(list(tensors.items()),))
        except Exception as e:
            raise MurmurError(f"vLLM dense reload failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
        self.version += 1
