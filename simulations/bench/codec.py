"""Patch codec benchmark: real optimizer steps on a locally built causal LM, every step published and applied.

A trainer keeps an fp32 master model, takes AdamW steps on a language-model
loss over synthetic tokens, and publishes the bf16 copy of every step through
`LineagePublisher`; a follower applies every patch to its own bf16 replica.
`run()` returns one dict (the CLI prints it as JSON): sizes against dense and
raw COO, encode/apply times, union vs chain over 8 versions, and whether the
replica's full state hash equalled the trainer's at every version.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from typing import Any

import torch

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.sync.codec import read_header
from murmur.sync.hashing import state_hash
from murmur.sync.versions import LineageFollower, LineagePublisher, encode_states


def _config(params: int) -> Any:
    from transformers import Qwen2Config

    if params >= 50_000_000:
        h, inter, vocab, heads = 768, 2048, 32768, 12
    elif params >= 5_000_000:
        h, inter, vocab, heads = 256, 688, 8192, 4
    else:
        h, inter, vocab, heads = 64, 172, 1024, 4
    per_layer = 4 * h * h + 3 * h * inter + 3 * h + 2 * h
    layers = max(1, round((params - 2 * vocab * h) / per_layer))
    return Qwen2Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}


def run(
    params: int = 100_000_000,
    steps: int = 50,
    lr: float = 1e-6,
    seed: int = 0,
    seq_len: int = 32,
    batch: int = 1,
    threads: int = 1,
    union_k: int = 8,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train `steps` AdamW steps, publish and apply each version; return the measurements."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = _config(params)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.state_dict().values())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)

    identity = Identity.from_seed(bytes(32))
    init = _bf16(model)
    publisher = LineagePublisher(identity, "bench", init, None, swarm=wire.DEFAULT_SWARM)  # no network: any swarm
    replica = {n: t.clone() for n, t in init.items()}
    follower = LineageFollower(publisher.lineage, replica, 0, swarm=wire.DEFAULT_SWARM)
    del init

    fractions, sizes, enc_s, app_s, train_s, enc_cpu, app_cpu = [], [], [], [], [], [], []
    pos_modes: Counter[int] = Counter()
    val_modes: Counter[int] = Counter()
    bit_exact = True
    snapshot: dict[str, torch.Tensor] | None = None
    snapshot_hash = b""
    for step in range(steps):
        if steps - step == union_k:
            snapshot = {n: t.clone() for n, t in replica.items()}
            snapshot_hash = follower.state_hash
        t0 = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        new = _bf16(model)
        t1, c1 = time.perf_counter(), time.process_time()
        bundle = publisher.publish(new)
        t2, c2 = time.perf_counter(), time.process_time()
        applied = follower.apply(bundle.envelope, bundle.chunks)
        t3, c3 = time.perf_counter(), time.process_time()
        enc_cpu.append(c2 - c1)
        app_cpu.append(c3 - c2)
        changed = sum(int(i.numel()) for i in applied.changed.values())
        exact = applied.state_hash == publisher.state_hash and state_hash(replica) == state_hash(new)
        bit_exact &= exact
        header, _ = read_header(bundle.payload)
        for e in header.tensors:
            pos_modes[e.pos_mode] += e.count
            val_modes[e.val_mode] += e.count
        fractions.append(changed / n_params)
        sizes.append((bundle.manifest.total_bytes, changed))
        train_s.append(t1 - t0)
        enc_s.append(t2 - t1)
        app_s.append(t3 - t2)
        if verbose:
            print(
                f"step {step + 1}/{steps}: loss {loss.item():.3f} changed {changed / n_params:.4%} "
                f"patch {bundle.manifest.total_bytes} B ({bundle.manifest.total_bytes / max(changed, 1):.3f} B/changed) "
                f"train {t1 - t0:.2f}s publish {t2 - t1:.3f}s apply {t3 - t2:.3f}s exact {exact}",
                file=sys.stderr,
                flush=True,
            )
    union_bytes = chain_bytes = 0
    if snapshot is not None:
        payload, th, _, _ = encode_states(snapshot, replica, snapshot_hash)
        union_bytes = len(payload)
        chain_bytes = sum(s for s, _ in sizes[-union_k:])
        bit_exact &= th == publisher.state_hash
    total_bytes = sum(s for s, _ in sizes)
    total_changed = sum(c for _, c in sizes)

    def mean(xs: list[float]) -> float:
        return sum(xs) / max(len(xs), 1)

    tot_modes = max(sum(val_modes.values()), 1)
    return {
        "params": n_params,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "versions": len(sizes),
        "lr": lr,
        "threads": threads,
        "changed_fraction": mean(fractions),
        "changed_fraction_min": min(fractions, default=0.0),
        "changed_fraction_max": max(fractions, default=0.0),
        "patch_bytes": mean([s for s, _ in sizes]),
        "bytes_per_changed": total_bytes / max(total_changed, 1),
        "ratio_vs_dense": (2 * n_params * len(sizes)) / max(total_bytes, 1),
        "ratio_vs_coo": (6 * total_changed) / max(total_bytes, 1),
        "encode_s": mean(enc_s),
        "apply_s": mean(app_s),
        "apply_s_per_100m": mean(app_s) * 1e8 / n_params,
        # CPU seconds of this (single-threaded) process: what wall time is on an idle core,
        # robust to neighbours on a shared machine
        "encode_cpu_s": mean(enc_cpu),
        "apply_cpu_s": mean(app_cpu),
        "apply_cpu_s_per_100m": mean(app_cpu) * 1e8 / n_params,
        "train_step_s": mean(train_s),
        "union_k": union_k,
        "union_bytes_k8": union_bytes,
        "chain_bytes_k8": chain_bytes,
        "value_modes": {
            f"{('abs', 'xor', 'ulp_delta', '?')[m & 3]}/{('planes', 'escaped', 'packed', '?')[(m >> 2) & 3]}"
            + ("/sorted" if m & 16 else ""): c / tot_modes
            for m, c in sorted(val_modes.items())
        },
        "position_modes": {
            ("all", "gaps", "bitmask", "gaps_escaped")[m]: c / tot_modes for m, c in sorted(pos_modes.items())
        },
        "bit_exact": bit_exact,
    }


if __name__ == "__main__":  # python -m murmur.simulations.bench.codec [params] [steps]
    import json

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = [int(float(a)) for a in sys.argv[1:3]]
    print(json.dumps(run(*args)))  # type: ignore[arg-type]  # at most two arguments: params and steps
