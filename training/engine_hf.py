"""Transformers policy engine: batched sampling with a KV cache, chunked log-probs, in-place updates.

Sampling is a hand-written loop over `past_key_values` rather than
`model.generate`: we need the exact log-prob of every sampled token under the
sampling distribution, and partial rollouts resume from (prompt + partial
completion) prefixes of different lengths, which left padding with explicit
position ids handles in one batch. Log-probs for training are computed from
the decoder's hidden states at completion positions only, in row chunks sized
from the memory budget, so the (batch x length x vocab) logits tensor never
exists at once.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from murmur.gossip.errors import MurmurError
from murmur.training.engine import (
    MODE_TRANSFORMERS,
    Completion,
    Sampling,
    SparseUpdate,
    generate_groups,
    tokenizer_hash_from_json,
)
from murmur.training.tokenizer import load_tokenizer

# transformers 5.24 renamed the cache argument; the old name works until 5.40 (we pin <6 and
# test the loop), so silence the per-call deprecation notice.
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise MurmurError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MurmurError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def load_causal_lm(path: str | Path, device: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory, offline; one-line MurmurError if unusable."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    if not p.is_dir():
        raise MurmurError(f"model path {str(p)!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise MurmurError(f"model path {str(p)!r} has no config.json: not a Hugging Face model directory")
    try:
        cfg = AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as e:
        raise MurmurError(f"model path {str(p)!r}: unreadable config: {str(e).splitlines()[0][:200]}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise MurmurError(f"model path {str(p)!r} is a {cfg.model_type!r} model, not a causal LM")
    try:
        tok = load_tokenizer(p)
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32)
    except Exception as e:
        raise MurmurError(f"model path {str(p)!r}: cannot load: {str(e).splitlines()[0][:200]}") from None
    model.to(pick_device(device))  # type: ignore[arg-type]  # transformers types PreTrainedModel.to through a decorator that hides its signature
    return model, tok


def set_threads(threads: int) -> None:
    """One thread by default: OpenMP busy-waiting collapses throughput when cores are shared."""
    threads = max(1, int(threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class HFEngine:
    """A causal LM and its tokenizer; also the trainable policy for the trainer."""

    mode = MODE_TRANSFORMERS

    def __init__(self, model: Any, tokenizer: Any, memory_budget_mb: int = 1024, seed: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.memory_budget_mb = memory_budget_mb
        eos = tokenizer.eos_token_id
        if eos is None:
            raise MurmurError("tokenizer has no EOS token; completions could never finish")
        self.eos_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.tokenizer_hash = tokenizer_hash_from_json(tokenizer.backend_tokenizer.to_str())
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])

    @classmethod
    def from_path(cls, path: str | Path, device: str = "auto", memory_budget_mb: int = 1024, seed: int = 0) -> HFEngine:
        model, tok = load_causal_lm(path, device)
        return cls(model, tok, memory_budget_mb, seed)

    # ------------------------------------------------------------ text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.eos_id], skip_special_tokens=True)

    # ------------------------------------------------------------ sampling

    @torch.no_grad()
    def sample(
        self, prefixes: list[list[int]], sampling: Sampling, max_new: int | None = None
    ) -> list[tuple[list[int], list[float], bool]]:
        """Continue each token prefix by up to `max_new` tokens: (new ids, log-probs, hit EOS)."""
        if not prefixes:
            return []
        max_new = sampling.max_new_tokens if max_new is None else max_new
        model = self.model
        was_training = model.training
        model.eval()
        try:
            return self._sample(prefixes, sampling, max_new)
        finally:
            model.train(was_training)

    def _sample(
        self, prefixes: list[list[int]], sampling: Sampling, max_new: int
    ) -> list[tuple[list[int], list[float], bool]]:
        b = len(prefixes)
        length = max(len(p) for p in prefixes)
        ids = torch.full((b, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, length), dtype=torch.long)
        for i, p in enumerate(prefixes):
            if p:
                ids[i, length - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[i, length - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(ids, mask, pos, None, keep_last=True)
        past, logits = out.past_key_values, out.logits[:, -1, :].float()
        cur = pos[:, -1].clone()
        new: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        temp = sampling.temperature
        for _ in range(max_new):
            if temp <= 0:
                lp = torch.log_softmax(logits, -1)
                tok = lp.argmax(-1)
            else:
                lp = torch.log_softmax(logits / temp, -1)
                probs = lp.exp()
                if sampling.top_p < 1.0:
                    sp, si = probs.sort(-1, descending=True)
                    keep = sp.cumsum(-1) - sp < sampling.top_p
                    probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
                tok = torch.multinomial(probs.cpu(), 1, generator=self.gen).squeeze(-1).to(self.device)
            tok_lp = lp.gather(-1, tok[:, None]).squeeze(-1)
            tl, tp, dl = tok.tolist(), tok_lp.tolist(), done.tolist()
            for i in range(b):
                if not dl[i]:
                    new[i].append(tl[i])
                    lps[i].append(tp[i])
            done = done | (tok == self.eos_id)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], 1)
            cur = cur + 1
            out = self._forward(tok[:, None], mask, cur[:, None], past, keep_last=False)
            past, logits = out.past_key_values, out.logits[:, -1, :].float()
        dl = done.tolist()
        return [(new[i], lps[i], bool(dl[i])) for i in range(b)]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past: Any, keep_last: bool) -> Any:
        kw: dict[str, Any] = dict(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True
        )
        if keep_last:
            try:
                return self.model(**kw, logits_to_keep=1)
            except TypeError:
                pass
        return self.model(**kw)

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]:
        return generate_groups(self, prompts, n, sampling)

    # ------------------------------------------------------------ scoring

    def _rows_per_chunk(self, tokens_per_row: int) -> int:
        bytes_per_row = max(1, tokens_per_row) * self.vocab * 4 * 3  # logits, log-softmax, grad
        return max(1, int(self.memory_budget_mb * 2**20 // 4 // bytes_per_row))

    def token_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp [B, T], mask [B, T]) of completion tokens; differentiable when grad is enabled."""
        b = len(prompts)
        tmax = max(1, max((len(c) for c in completions), default=1))
        out = torch.zeros((b, tmax), device=self.device)
        tmask = torch.zeros((b, tmax), device=self.device)
        chunk = self._rows_per_chunk(max(len(p) + len(c) for p, c in zip(prompts, completions)) if b else 1)
        temp = temperature if temperature > 0 else 1.0
        pieces = []
        for s in range(0, b, chunk):
            pieces.append(self._chunk_logprobs(prompts[s : s + chunk], completions[s : s + chunk], tmax, temp))
        if pieces:
            out = torch.cat([p[0] for p in pieces], 0)
            tmask = torch.cat([p[1] for p in pieces], 0)
        return out, tmask

    def _chunk_logprobs(
        self, prompts: list[list[int]], comps: list[list[int]], tmax: int, temp: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = len(prompts)
        seqs = [p + c for p, c in zip(prompts, comps)]
        length = max(len(s) for s in seqs)
        ids = torch.full((b, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, length), dtype=torch.long)
        rows, cols, tcols = [], [], []
        for i, (p, comp) in enumerate(zip(prompts, comps)):
            ids[i, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
            mask[i, : len(seqs[i])] = 1
            for j in range(len(comp)):
                rows.append(i)
                cols.append(len(p) - 1 + j)
                tcols.append(j)
        ids, mask = ids.to(self.device), mask.to(self.device)
        logp = torch.zeros((b, tmax), device=self.device)
        tmask = torch.zeros((b, tmax), device=self.device)
        if not rows:
            return logp, tmask
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        r = torch.tensor(rows, device=self.device)
        c = torch.tensor(cols, device=self.device)
        t = torch.tensor(tcols, device=self.device)
        h = hidden[r, c]
        logits = self.model.get_output_embeddings()(h).float() / temp
        targets = ids[r, c + 1]
        tok_lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        logp = logp.index_put((r, t), tok_lp)
        tmask = tmask.index_put((r, t), torch.ones_like(tok_lp))
        return logp, tmask

    @torch.no_grad()
    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        if not sequences:
            return []
        lp, _ = self.token_logprobs([p for p, _ in sequences], [c for _, c in sequences], temperature)
        return [lp[i, : len(c)].tolist() for i, (_, c) in enumerate(sequences)]

    # ------------------------------------------------------------ weight updates

    @torch.no_grad()
    def apply_patch(self, updates: list[SparseUpdate]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for u in updates:
            t = params.get(u.name)
            if t is None:
                raise MurmurError(f"patch names unknown tensor {u.name!r}")
            idx = torch.as_tensor(u.indices, dtype=torch.long, device=t.device)
            vals = torch.as_tensor(u.values, device=t.device).to(t.dtype)
            if idx.numel() != vals.numel():
                raise MurmurError(f"patch for {u.name!r}: {idx.numel()} indices but {vals.numel()} values")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.numel()):
                raise MurmurError(f"patch for {u.name!r}: index outside the tensor's {t.numel()} elements")
            t.view(-1)[idx] = vals

    @torch.no_grad()
    def load_state(self, tensors: dict[str, Any]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, v in tensors.items():
            t = params.get(name)
            if t is None:
                raise MurmurError(f"state names unknown tensor {name!r}")
            v = torch.as_tensor(v)
            if tuple(v.shape) != tuple(t.shape):
                raise MurmurError(f"state tensor {name!r} has shape {tuple(v.shape)}, expected {tuple(t.shape)}")
            t.copy_(v.to(t.dtype))

    @torch.no_grad()
    def take_version(self, state: Mapping[str, Any], changed: Mapping[str, Any] | None) -> None:
        """Copy the changed elements of the published state into the compute model (an exact upcast of
        bf16 values to the model's dtype); everything when `changed` is None."""
        if changed is None:
            self.load_state(dict(state))
            return
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, idx in changed.items():
            t = params.get(name)
            if t is None:
                raise MurmurError(f"version names unknown tensor {name!r}")
            t.view(-1)[idx] = torch.as_tensor(state[name]).view(-1)[idx].to(t.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
