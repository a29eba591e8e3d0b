"""Run under the vLLM environment's interpreter by tests/test_vllm.py: the engine against the
transformers engine on one model, through a few patch-sized updates. Prints one JSON line.

`python -m tests.vllm_side MODEL_DIR`
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(model_dir: str) -> dict:
    import torch

    from murmur.node.worker.policy import to_published
    from murmur.sync.hashing import canonical_state
    from murmur.training.engine import Sampling, open_engine
    from murmur.training.engine_hf import HFEngine

    hf = HFEngine.from_path(model_dir, device="cpu")
    state = to_published(canonical_state(hf.model))
    hf.take_version(state, None)
    eng = open_engine("vllm", model_dir, hf, memory_budget_mb=1024)
    eng.take_version(state, None)
    out: dict = {"mode": eng.mode, "tokenizer_hash_equal": eng.tokenizer_hash == hf.tokenizer_hash}
    prompts = [eng.encode(p) for p in ("12+34=", "7+8=", "40+2=", "3+3=")]
    gen = torch.Generator().manual_seed(0)

    def cross(temperature: float) -> dict:
        res = eng.sample([p for p in prompts for _ in range(4)], Sampling(temperature=temperature, max_new_tokens=8))
        seqs = [(p, ids) for p, (ids, _, _) in zip([p for p in prompts for _ in range(4)], res)]
        theirs = hf.logprobs(seqs, temperature)
        ours = eng.logprobs(seqs, temperature)
        claimed = [lps for _, lps, _ in res]
        flat = lambda a, b: [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]  # noqa: E731
        # the other way round: transformers samples, vLLM re-scores
        hres = hf.sample([p for p in prompts for _ in range(4)], Sampling(temperature=temperature, max_new_tokens=8))
        hseqs = [(p, ids) for p, (ids, _, _) in zip([p for p in prompts for _ in range(4)], hres)]
        return {
            "tokens": sum(len(s[1]) for s in seqs),
            "eos": sum(1 for r in res if r[2]),
            "max_sample_vs_hf": max(flat(claimed, theirs)),
            "max_rescore_vs_hf": max(flat(ours, theirs)),
            "max_hf_sample_vs_vllm_rescore": max(flat([x[1] for x in hres], eng.logprobs(hseqs, temperature))),
        }

    out["t1"] = cross(1.0)
    out["t07"] = cross(0.7)
    # patch-sized updates: a few elements of each of some tensors, fused parts and the tied embedding among them
    names = [n for n in state if n.endswith(("q_proj.weight", "up_proj.weight", "embed_tokens.weight", "norm.weight"))]
    diffs = []
    for step in range(3):
        changed = {}
        for n in names[step::2]:
            t = state[n].view(-1)
            idx = torch.randperm(t.numel(), generator=gen)[: max(1, t.numel() // 50)]
            t[idx] = (t[idx].float() + torch.randn(idx.numel(), generator=gen) * 0.2).to(t.dtype)
            changed[n] = idx
        hf.take_version(state, changed)
        eng.take_version(state, changed)
        seqs = [(p, eng.encode("46") + [eng.eos_id]) for p in prompts]
        diffs.append(max(abs(x - y) for u, v in zip(hf.logprobs(seqs), eng.logprobs(seqs)) for x, y in zip(u, v)))
    out["patched_max_diff"] = diffs
    # hostile lengths: past the model's context nothing is generated and re-scoring gives NaN (a failed check)
    long = [5] * eng.max_len
    out["past_context_sample"] = eng.sample([long], Sampling(max_new_tokens=4))[0][0]
    scored = eng.logprobs([(long, [5, 6])])[0]
    out["past_context_nan"] = len(scored) == 2 and all(x != x for x in scored)
    out["updates"] = eng.version_updates
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
