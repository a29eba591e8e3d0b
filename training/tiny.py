"""murmur-tiny: a built-in policy that needs no download.

A small Qwen2 config with a character-level tokenizer over printable ASCII,
built locally with `tokenizers` (a BPE model with no merges is exactly a
character tokenizer, and it saves and reloads offline as a Hugging Face
tokenizer directory). A short supervised warm-up on the built-in task set
teaches the answer format and part of the skill, leaving room for RL to add
the rest (a build for the worked-answer regime warms up on that regime's set
instead); the result is cached in `<home>/models/murmur-tiny/` keyed by the
recipe and seed, and is bit-for-bit deterministic given the seed (one thread).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Final

import torch

from murmur.gossip.errors import MurmurError
from murmur.gossip.wire import GeneratorSpec
from murmur.training.engine_hf import HFEngine, set_threads
from murmur.training.tasks import Task, generate
from murmur.training.tasksets import answers_manifest, train_generators
from murmur.training.tokenizer import TINY_NAME, build_tokenizer

RECIPE: Final = "v3"  # v3: 100 warm-up steps on the built-in set version 3

# Warm-up: enough supervised steps to learn the answer formats (at RL's start nearly every greedy answer
# has its family's shape) and part of each family's rule, leaving the rest to RL.
WARMUP_STEPS: Final = 100
# Worked answers are ten times longer than short ones and their format has a step per term: it takes longer
# to learn, and a build that has not learnt it gives its trainer no informative group to start from.
WORKED_WARMUP_STEPS: Final = 200
WARMUP_BATCH: Final = 64
WARMUP_LR: Final = 2e-3


def build_model(seed: int, vocab: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def warmup_generators(answers: str = "short") -> list[GeneratorSpec]:
    """What the warm-up of an answer regime draws from: its built-in set's training generators (never its
    eval ones; `training.tasksets.answers_manifest`)."""
    return train_generators(answers_manifest(answers))


def warmup_batch(rng: random.Random, count: int, answers: str = "short") -> list[Task]:
    """One warm-up batch: generators by weight, seeds uniform in their ranges."""
    m = answers_manifest(answers)
    gens = warmup_generators(answers)
    out = []
    for _ in range(count):
        g = rng.choices(gens, weights=[x.weight for x in gens])[0]
        out.append(
            generate(
                g.generator, g.config, rng.randrange(g.seed_start, g.seed_end), g.verifier or m.verifier, m.tolerance
            )
        )
    return out


def warmup_prompts(seed: int, steps: int = WARMUP_STEPS, batch: int = WARMUP_BATCH, answers: str = "short") -> set[str]:
    """Every prompt the warm-up of (seed, steps) trains on (it is deterministic), for overlap counts."""
    rng = random.Random(seed)
    return {t.prompt for _ in range(steps) for t in warmup_batch(rng, batch, answers)}


def warmup(
    engine: HFEngine,
    steps: int,
    seed: int,
    batch: int = WARMUP_BATCH,
    lr: float = WARMUP_LR,
    deadline: float | None = None,
    answers: str = "short",
) -> int:
    """Supervised steps on prompt -> answer + EOS, loss on the answer only. Returns steps done."""
    opt = torch.optim.AdamW(engine.model.parameters(), lr=lr, weight_decay=0.0)
    engine.model.train()
    rng = random.Random(seed)
    done = 0
    for step in range(steps):
        if deadline is not None and time.monotonic() > deadline:
            break
        tasks = warmup_batch(rng, batch, answers)
        prompts = [engine.encode(t.prompt) for t in tasks]
        comps = [engine.encode(t.answer) + [engine.eos_id] for t in tasks]
        lp, mask = engine.token_logprobs(prompts, comps)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
    engine.model.eval()
    return done


def default_warmup_steps(answers: str = "short") -> int:
    """The warm-up of an answer regime's murmur-tiny build."""
    return WORKED_WARMUP_STEPS if answers == "worked" else WARMUP_STEPS


def tiny_dir(home: str | Path, seed: int = 0, warmup_steps: int | None = None, answers: str = "short") -> Path:
    """One directory per build, so that building one (seed, warm-up, regime) never replaces another that a
    process in the same home is about to load (two benchmark seeds run side by side did exactly that).
    The default build keeps the plain name that node homes and emulation symlinks use."""
    warmup_steps = default_warmup_steps(answers) if warmup_steps is None else warmup_steps
    if (seed, warmup_steps, answers) == (0, WARMUP_STEPS, "short"):
        return Path(home) / "models" / TINY_NAME
    regime = "" if answers == "short" else f"-{answers}"
    return Path(home) / "models" / f"{TINY_NAME}{regime}-s{seed}-w{warmup_steps}"


def _cached(d: Path, stamp: dict[str, object]) -> bool:
    try:
        return bool(json.loads((d / "murmur-tiny.json").read_text()).get("key") == stamp)
    except (OSError, ValueError):
        return False


def ensure_tiny(
    home: str | Path, seed: int = 0, warmup_steps: int | None = None, force: bool = False, answers: str = "short"
) -> Path:
    """Build (once) and return the cached murmur-tiny directory under `home`, warmed up on the curriculum
    of the answer regime `answers` (`training.tasksets.ANSWERS`) for `warmup_steps` (None: the regime's,
    `default_warmup_steps`).

    Builders of one home take turns on a lock file: nodes started together (the demo, tests) would
    otherwise each spend the warm-up, and a late one would swap the directory under an early one
    that is already loading it."""
    import fcntl

    answers_manifest(answers)  # a clear error for an unknown regime, before any lock or build
    warmup_steps = default_warmup_steps(answers) if warmup_steps is None else warmup_steps
    d = tiny_dir(home, seed, warmup_steps, answers)
    stamp: dict[str, object] = {"recipe": RECIPE, "seed": seed, "warmup_steps": warmup_steps}
    if answers != "short":  # the short regime's stamp stays what existing caches hold
        stamp["answers"] = answers
    if not force and _cached(d, stamp):
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f".{d.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _cached(d, stamp):  # built by whoever held the lock before us
            return d
        set_threads(1)
        t0 = time.monotonic()
        engine = new_tiny_engine(seed)
        warmup(engine, warmup_steps, seed, answers=answers)
        tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        engine.model.save_pretrained(tmp)
        engine.tokenizer.save_pretrained(tmp)
        (tmp / "murmur-tiny.json").write_text(json.dumps({"key": stamp, "warmup_s": time.monotonic() - t0}))
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)
    return d


def new_tiny_engine(seed: int = 0, memory_budget_mb: int = 1024) -> HFEngine:
    """A fresh (untrained) murmur-tiny engine, built in memory."""
    tok = build_tokenizer()
    model = build_model(seed, len(tok))
    return HFEngine(model, tok, memory_budget_mb=memory_budget_mb, seed=seed)


def policy_path(model: str, home: str | Path, seed: int = 0) -> Path:
    """The model directory: `murmur-tiny` (built and cached on first use) or a local Hugging Face
    causal-LM directory."""
    if model == TINY_NAME:
        return ensure_tiny(home, seed)
    path = Path(model).expanduser()
    if not path.exists():
        raise MurmurError(f"model {model!r}: no such path (use murmur-tiny or a local Hugging Face model directory)")
    return path


def load_policy(
    model: str, home: str | Path, device: str = "auto", seed: int = 0, memory_budget_mb: int = 1024
) -> HFEngine:
    """The transformers engine of `policy_path(model, home, seed)`."""
    return HFEngine.from_path(
        policy_path(model, home, seed), device=device, memory_budget_mb=memory_budget_mb, seed=seed
    )
