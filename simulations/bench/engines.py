"""`murmur bench engines`: transformers and vLLM on the same model, prompts and patches.

For each model (murmur-tiny, and a larger Qwen2-shaped model built locally with
random weights), a publisher makes `patches` versions from small fp32 steps on
a master (bf16 published, as a trainer does). Each engine then, in its own
process and environment (vLLM under `.venv-vllm`, as a node's worker):
- generates `batch` completions of up to `max_new` tokens for the same prompts
  at temperature 1 and reports tokens per second (wall clock, after one warm-up);
- applies every version through a `LineageFollower` (hash-checked) and times the
  engine's own share, `take_version` (transformers: copy of the changed
  elements; vLLM: dense reload on the CPU build, sparse in place on CUDA);
- reports the state hash it holds after the last version and its log-probs
  for a fixed set of sequences, and samples that the other engine re-scores.
`cross_engine_logprob_diff` is the largest per-token |Δ log-prob| between the
engines, both directions (a vLLM sample re-scored by transformers and the
reverse) and on the fixed sequences, at the last version.

The vLLM side runs `python -m murmur.simulations.bench.engines --side ...` under the
vLLM interpreter (`node.worker.main.vllm_python`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPT_SEED = 1234
BENCH_SWARM = "bench"  # the swarm its manifests are signed for (nothing leaves the machine)
STEP_NOISE = 3e-5  # fp32 step size on the master: a few % of bf16 elements move per version


def build_models(root: Path) -> dict[str, Path]:
    """murmur-tiny (trained warm-up) and a 28M-parameter Qwen2 (hidden 512, 8 layers, vocab 8192,
    untied head) with the same character tokenizer, both saved as Hugging Face directories."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from murmur.training.tiny import ensure_tiny
    from murmur.training.tokenizer import build_tokenizer

    out = {"murmur-tiny": ensure_tiny(root)}
    big = root / "models" / "qwen2-28m"
    if not (big / "config.json").exists():
        tok = build_tokenizer()
        cfg = Qwen2Config(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(big)
        tok.save_pretrained(big)
    out["qwen2-28m"] = big
    return out


def make_patches(model_dir: Path, work: Path, n: int, seed: int) -> dict[str, Any]:
    """n versions of a lineage over the model, written as (envelope, payload) files under `work`."""
    import torch

    from murmur.gossip.identity import Identity
    from murmur.node.worker.policy import to_published
    from murmur.sync.hashing import canonical_state
    from murmur.sync.versions import LineagePublisher
    from murmur.training.engine_hf import HFEngine

    eng = HFEngine.from_path(model_dir, device="cpu")
    master = canonical_state(eng.model)
    pub = LineagePublisher(
        Identity.from_seed(bytes([seed % 256]) * 32), "bench", to_published(master), swarm=BENCH_SWARM
    )
    g = torch.Generator().manual_seed(seed)
    work.mkdir(parents=True, exist_ok=True)
    density = []
    for v in range(1, n + 1):
        with torch.no_grad():
            for t in master.values():
                if t.dtype.is_floating_point:
                    t.add_(torch.randn(t.shape, generator=g) * STEP_NOISE)
        bundle = pub.publish(to_published(master))
        (work / f"{v}.env").write_bytes(bundle.envelope)
        (work / f"{v}.bin").write_bytes(b"".join(bytes(c) for c in bundle.chunks))
        density.append(bundle.manifest.total_bytes)
    lin = pub.lineage
    return {
        "publisher": lin.publisher.hex(),
        "base": lin.base_model_hash.hex(),
        "name": lin.name,
        "head_hash": pub.hasher.hash.hex(),
        "patch_bytes": density,
    }


def prompts(batch: int) -> list[str]:
    import random

    rng = random.Random(PROMPT_SEED)
    return [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(batch)]


def side(kind: str, model_dir: str, work: str, n: int, batch: int, max_new: int, rescore: str) -> dict[str, Any]:
    """One engine's measurements (run in the environment of that engine)."""
    import torch

    from murmur.node.worker.policy import to_published
    from murmur.sync.hashing import canonical_state
    from murmur.sync.versions import Lineage, LineageFollower
    from murmur.training.engine import Sampling, open_engine
    from murmur.training.engine_hf import HFEngine, set_threads

    set_threads(1)
    info = json.loads((Path(work) / "lineage.json").read_text())
    hf = HFEngine.from_path(model_dir, device="cpu", seed=0)
    live = to_published(canonical_state(hf.model))
    t0 = time.monotonic()
    eng = open_engine(kind, model_dir, hf, memory_budget_mb=4096, seed=0)
    start_s = time.monotonic() - t0
    eng.take_version(live, None)
    follower = LineageFollower(
        Lineage(bytes.fromhex(info["publisher"]), bytes.fromhex(info["base"]), info["name"]), live, 0, swarm=BENCH_SWARM
    )
    enc = [eng.encode(p) for p in prompts(batch)]
    sampling = Sampling(temperature=1.0, max_new_tokens=max_new)
    eng.sample(enc[:2], Sampling(temperature=1.0, max_new_tokens=4))  # warm-up
    t0 = time.monotonic()
    res = eng.sample(enc, sampling)
    gen_s = time.monotonic() - t0
    tokens = sum(len(r[0]) for r in res)
    apply_s = []
    for v in range(1, n + 1):
        env = (Path(work) / f"{v}.env").read_bytes()
        payload = (Path(work) / f"{v}.bin").read_bytes()
        applied = follower.apply_stored(env, payload)
        t0 = time.monotonic()
        eng.take_version(follower.live, applied.changed)
        apply_s.append(time.monotonic() - t0)
    torch.manual_seed(0)
    samples = eng.sample(enc, sampling)
    mine = [[e, ids, lps] for e, (ids, lps, _) in zip(enc, samples)]
    others = json.loads(Path(rescore).read_text()) if rescore and Path(rescore).exists() else []
    fixed = [(e, eng.encode(a) + [eng.eos_id]) for e, a in zip(enc, ["42", "7", "100", "13"] * (len(enc) // 4 + 1))]
    return {
        "mode": eng.mode,
        "start_s": start_s,
        "tokens": tokens,
        "gen_s": gen_s,
        "tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "apply_s": apply_s,
        "state_hash": follower.state_hash.hex(),
        "version": follower.version,
        "fixed_logprobs": eng.logprobs(fixed),
        "samples": mine,
        "rescored": eng.logprobs([(p, ids) for p, ids, _ in others]) if others else [],
    }


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def _run_side(
    python: str, kind: str, model_dir: Path, work: Path, n: int, batch: int, max_new: int, rescore: Path | None
) -> dict[str, Any]:
    cmd = [
        python,
        "-m",
        "murmur.simulations.bench.engines",
        "--side",
        kind,
        str(model_dir),
        str(work),
        str(n),
        str(batch),
        str(max_new),
        str(rescore or ""),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x),
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=str(ROOT))
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} side failed (exit {r.returncode}): {r.stderr.strip()[-1500:]}")
    return json.loads(lines[-1])


def run(
    patches: int = 5, batch: int = 32, max_new: int = 32, seed: int = 0, models: str = "murmur-tiny,qwen2-28m"
) -> dict[str, Any]:
    from murmur.node.worker.main import vllm_python

    vpy = vllm_python()
    if not vpy:
        return {"error": "no vLLM environment: run `bash install.sh --vllm cpu` (or --vllm gpu)"}
    with tempfile.TemporaryDirectory(prefix="murmur-bench-engines-") as tmp:
        root = Path(tmp)
        dirs = build_models(root)
        per_model: dict[str, Any] = {}
        for name in [m for m in models.split(",") if m]:
            work = root / f"patches-{name}"
            info = make_patches(dirs[name], work, patches, seed)
            (work / "lineage.json").write_text(json.dumps(info))
            print(f"[bench engines] {name}: {patches} versions, patch bytes {info['patch_bytes']}", file=sys.stderr)
            hf = _run_side(sys.executable, "transformers", dirs[name], work, patches, batch, max_new, None)
            hf_samples = root / f"hf-samples-{name}.json"
            hf_samples.write_text(json.dumps(hf["samples"]))
            vl = _run_side(vpy, "vllm", dirs[name], work, patches, batch, max_new, hf_samples)
            vl_samples = root / f"vllm-samples-{name}.json"
            vl_samples.write_text(json.dumps(vl["samples"]))
            # transformers re-scores vLLM's samples (a second, short transformers run at the same version)
            hf2 = _run_side(sys.executable, "transformers", dirs[name], work, patches, 4, 4, vl_samples)
            d_hf_by_vllm = _max_diff([s[2] for s in hf["samples"]], vl["rescored"])
            d_vllm_by_hf = _max_diff([s[2] for s in vl["samples"]], hf2["rescored"])
            d_fixed = _max_diff(hf["fixed_logprobs"], vl["fixed_logprobs"])
            per_model[name] = {
                "engines": {
                    k: {
                        "tokens_per_s": round(s["tokens_per_s"], 1),
                        "apply_s": round(sum(s["apply_s"]) / len(s["apply_s"]), 5) if s["apply_s"] else 0.0,
                        "mode": s["mode"],
                        "start_s": round(s["start_s"], 2),
                        "tokens": s["tokens"],
                    }
                    for k, s in (("transformers", hf), ("vllm", vl))
                },
                "patches_applied": min(hf["version"], vl["version"]),
                "hashes_match": hf["state_hash"] == vl["state_hash"] == info["head_hash"],
                "cross_engine_logprob_diff": max(d_hf_by_vllm, d_vllm_by_hf, d_fixed),
                "logprob_diff_vllm_sample_hf_rescore": d_vllm_by_hf,
                "logprob_diff_hf_sample_vllm_rescore": d_hf_by_vllm,
                "logprob_diff_fixed": d_fixed,
                "patch_bytes_mean": sum(info["patch_bytes"]) / len(info["patch_bytes"]),
            }
    first = next(iter(per_model.values()))
    return {
        "engines": first["engines"],
        "patches_applied": min(m["patches_applied"] for m in per_model.values()),
        "hashes_match": all(m["hashes_match"] for m in per_model.values()),
        "cross_engine_logprob_diff": max(m["cross_engine_logprob_diff"] for m in per_model.values()),
        "models": per_model,
        "batch": batch,
        "max_new_tokens": max_new,
        "temperature": 1.0,
    }


if __name__ == "__main__":
    if len(sys.argv) >= 8 and sys.argv[1] == "--side":
        kind, model_dir, work, n, batch, max_new, rescore = sys.argv[2:9]
        print(json.dumps(side(kind, model_dir, work, int(n), int(batch), int(max_new), rescore)))
    else:
        print("usage: murmur bench engines --json", file=sys.stderr)
        sys.exit(2)
