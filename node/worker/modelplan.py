"""Bring your own model: what a local Hugging Face causal LM costs in memory per role, and its training defaults.

The parameter count is read without loading weights (safetensors headers; else the
config instantiated on the meta device). Memory per role is an estimate from bytes per
parameter (what the worker holds, below) plus a fixed runtime share; a node whose budget
(`node.memory_budget_mb`) is below the estimate for a configured role is refused at start
with the figure, and `murmur doctor` says which roles fit.

Bytes per parameter, from what the processes keep:
- trainer: fp32 master weights (4) + fp32 gradients (4) + AdamW moments (8) + the fp32
  generation copy (4) + the bf16 published state and base copy (2 + 2) = 24;
- follower: the fp32 generating model (4) + the bf16 state the patches apply to (2) + the
  bf16 base copy (2) = 8;
- validator: scores with the model its follower role (or its trainer) already holds, and
  alone needs the fp32 checker (4) + the bf16 base (2) = 6.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from murmur.gossip.errors import MurmurError

if TYPE_CHECKING:
    from murmur.node.config import Config

BYTES_PER_PARAM = {"trainer": 24, "follower": 8, "validator": 6}
RUNTIME_MB = 700  # interpreter, torch, transformers, tokenizer, libp2p and pools: both processes, model excluded
ACTIVATION_SHARE = 0.6  # activations, KV caches and allocator slack, as a share of the weights' bytes
TINY_PARAMS = 5_000_000  # up to here the murmur-tiny learning rate applies
TINY_LR = 3e-4
MODEL_LR = 1e-6  # real models: larger steps change most bf16 elements per version (dense patches)
LR_WARN = 1e-5  # above this, a model over TINY_PARAMS gets a warning at start and from the doctor
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ModelPlan(msgspec.Struct, kw_only=True):
    model: str
    params: int
    need_mb: dict[str, int]  # role -> estimated MiB for the node (network process + worker)
    budget_mb: int
    lr: float  # suggested learning rate for this size

    def fits(self, roles: list[str]) -> bool:
        return self.need_for(roles) <= self.budget_mb

    def need_for(self, roles: list[str]) -> int:
        """MiB for holding `roles` together: the largest model footprint (they share the weights) + runtime."""
        weights = max((BYTES_PER_PARAM[r] for r in roles if r in BYTES_PER_PARAM), default=0) * self.params
        return int(RUNTIME_MB + weights * (1 + ACTIVATION_SHARE) / 2**20)

    def roles_that_fit(self) -> list[list[str]]:
        options = [["trainer", "validator"], ["trainer"], ["follower", "validator"], ["follower"], ["validator"]]
        return [r for r in options if self.fits(r)]


def count_params(model_dir: Path) -> int:
    """Parameters of a local model directory without loading its weights."""
    p = Path(model_dir)
    files = sorted(p.glob("*.safetensors"))
    if files:
        total = 0
        for f in files:
            total += _safetensors_params(f)
        return total
    if not (p / "config.json").is_file():
        raise MurmurError(f"model path {str(p)!r} has no config.json: not a Hugging Face model directory")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(p, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(t.numel() for t in model.parameters())


def _safetensors_params(path: Path) -> int:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise MurmurError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise MurmurError(f"{path}: safetensors header of {n} bytes")
        meta = json.loads(f.read(n))
    total = 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in info["shape"]:
            count *= int(d)
        total += count
    return total


def suggested_lr(params: int) -> float:
    return TINY_LR if params <= TINY_PARAMS else MODEL_LR


def plan(model: str, budget_mb: int, home: Path | None = None) -> ModelPlan | None:
    """The plan for `[training] model`; None for the built-in murmur-tiny (a few MiB, fits any allowed budget)."""
    from murmur.training.tokenizer import TINY_NAME

    if model == TINY_NAME:
        return None
    path = Path(model).expanduser()
    if not path.is_dir():
        raise MurmurError(
            f"model {model!r}: no such directory (use murmur-tiny or a local Hugging Face model directory)"
        )
    params = count_params(path)
    p = ModelPlan(model=str(path), params=params, need_mb={}, budget_mb=budget_mb, lr=suggested_lr(params))
    p.need_mb = {r: p.need_for([r]) for r in BYTES_PER_PARAM}
    return p


def refusal(p: ModelPlan, roles: list[str]) -> str | None:
    """Why a node with these roles cannot run this model in its budget, or None when it fits."""
    if p.fits(roles):
        return None
    fit = p.roles_that_fit()
    alt = f"; roles that fit: {' or '.join('+'.join(r) for r in fit)}" if fit else ""
    return (
        f"model {p.model} ({p.params / 1e6:.0f}M parameters) needs about {p.need_for(roles)} MiB as "
        f"{'+'.join(roles)}, over node.memory_budget_mb = {p.budget_mb} MiB: raise the budget{alt}"
    )


def lr_warning(p: ModelPlan, lr: float) -> str | None:
    """A warning when a model over TINY_PARAMS would train at a rate over LR_WARN, else None."""
    if p.params <= TINY_PARAMS or lr <= LR_WARN:
        return None
    return (
        f"training.lr {lr:g} for a {p.params / 1e6:.0f}M-parameter model is over {LR_WARN:g}: its patches turn "
        f"dense and its reward may fall; remove training.lr from the config for {p.lr:g}"
    )


def sized_lr(cfg: Config, lr_is_default: bool) -> tuple[Config, list[str]]:
    """`cfg` with an unset `training.lr` replaced by the rate for its model's size, and notes saying so."""
    p = plan(cfg.training.model, cfg.node.memory_budget_mb)
    if p is None:
        return cfg, []
    training, notes = cfg.training, []
    if lr_is_default and training.lr != p.lr:
        notes.append(
            f"training.lr {p.lr:g} for a model of this size (the default {training.lr:g} is murmur-tiny's; "
            "set training.lr to override)"
        )
        training = msgspec.structs.replace(training, lr=p.lr)
    return msgspec.structs.replace(cfg, training=training), notes


def apply(cfg: Config, lr_is_default: bool) -> tuple[Config, list[str]]:
    """The config a node starts with for its model: roles that fit the budget and a learning rate for its size.

    Raises `ConfigError` naming the needed memory when configured roles do not fit. Roles left
    empty (chosen from hardware) become follower+validator when training does not fit. An lr left
    unset becomes the one suggested for the model's size.
    """
    from murmur.gossip.errors import ConfigError

    p = plan(cfg.training.model, cfg.node.memory_budget_mb)
    if p is None:
        return cfg, []
    notes = [
        f"model {p.model}: {p.params / 1e6:.1f}M parameters; estimated MiB per role: "
        + ", ".join(f"{r} {n}" for r, n in p.need_mb.items())
        + f" (budget {p.budget_mb})"
    ]
    node = cfg.node
    if node.roles:
        why = refusal(p, list(node.roles))
        if why:
            raise ConfigError(why)
    elif not p.fits(["trainer"]):
        if not p.fits(["follower", "validator"]):
            raise ConfigError(refusal(p, ["follower", "validator"]) or "model does not fit")
        node = msgspec.structs.replace(node, roles=["follower", "validator"])
        notes.append(f"training needs about {p.need_mb['trainer']} MiB: this node follows and validates")
    cfg, lr_notes = sized_lr(msgspec.structs.replace(cfg, node=node), lr_is_default)
    return cfg, notes + lr_notes


def start_config(path: Path) -> tuple[Config, list[str], list[str]]:
    """What `murmur node start` runs with from the config file at `path`: (config, notes, warnings)."""
    from murmur.node.config import load_config_with_sources

    cfg, sources = load_config_with_sources(path)
    cfg, notes = apply(cfg, lr_is_default=sources["training.lr"] == "default")
    p = plan(cfg.training.model, cfg.node.memory_budget_mb)
    warning = lr_warning(p, cfg.training.lr) if p is not None else None
    return cfg, notes, [warning] if warning else []
