"""Bring your own model: a locally built Qwen2-shaped model by path is planned, refused or adjusted, and checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from murmur.gossip.errors import ConfigError
from murmur.node.cli.doctor import Context, check_model
from murmur.node.config import Config, NodeSection, TrainingSection
from murmur.node.worker import modelplan

torch.set_num_threads(1)


def build_qwen2(d: Path, hidden: int = 320, layers: int = 5) -> int:
    """A Qwen2-shaped causal LM with random weights and murmur-tiny's tokenizer, saved like a downloaded one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from murmur.training.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    d = tmp_path_factory.mktemp("qwen2")
    return d, build_qwen2(d)


def _cfg(model: Path, budget: int, roles: list[str] | None = None, lr: float = 3e-4) -> Config:
    return Config(
        node=NodeSection(memory_budget_mb=budget, roles=roles or []), training=TrainingSection(model=str(model), lr=lr)
    )


def test_params_counted_without_loading_weights(qwen: tuple[Path, int], tmp_path: Path) -> None:
    d, n = qwen
    assert modelplan.count_params(d) == n
    (tmp_path / "config.json").write_bytes((d / "config.json").read_bytes())  # no weights: meta device
    assert modelplan.count_params(tmp_path) == n
    p = modelplan.plan(str(d), 4096)
    assert p is not None and p.params == n and p.lr == modelplan.MODEL_LR
    assert p.need_mb["trainer"] > p.need_mb["follower"] > p.need_mb["validator"] > modelplan.RUNTIME_MB
    assert modelplan.plan("murmur-tiny", 4096) is None


def test_configured_trainer_that_does_not_fit_is_refused_with_the_figure(qwen: tuple[Path, int]) -> None:
    d, _ = qwen
    p = modelplan.plan(str(d), 1)
    need = p.need_for(["trainer"])
    budget = need - 1
    with pytest.raises(ConfigError, match=f"needs about {need} MiB as trainer, over node.memory_budget_mb = {budget}"):
        modelplan.apply(_cfg(d, budget, ["trainer"]), lr_is_default=True)
    cfg, _ = modelplan.apply(_cfg(d, need, ["trainer"]), lr_is_default=True)
    assert cfg.node.roles == ["trainer"]


def test_unset_roles_follow_when_training_does_not_fit(qwen: tuple[Path, int]) -> None:
    d, _ = qwen
    p = modelplan.plan(str(d), 1)
    cfg, notes = modelplan.apply(_cfg(d, p.need_for(["follower", "validator"])), lr_is_default=True)
    assert cfg.node.roles == ["follower", "validator"]
    assert any("this node follows" in n for n in notes)
    with pytest.raises(ConfigError, match="needs about"):
        modelplan.apply(_cfg(d, modelplan.RUNTIME_MB), lr_is_default=True)


def test_learning_rate_default_fits_the_model_size(qwen: tuple[Path, int]) -> None:
    d, _ = qwen
    cfg, notes = modelplan.apply(_cfg(d, 8192), lr_is_default=True)
    assert cfg.training.lr == modelplan.MODEL_LR and any("training.lr" in n for n in notes)
    cfg, _ = modelplan.apply(_cfg(d, 8192, lr=5e-5), lr_is_default=False)
    assert cfg.training.lr == 5e-5  # the user's choice stands
    cfg, notes = modelplan.apply(Config(), lr_is_default=True)
    assert cfg.training.lr == 3e-4 and notes == []  # murmur-tiny keeps its own


def test_doctor_says_which_roles_fit(qwen: tuple[Path, int], tmp_path: Path) -> None:
    d, _ = qwen
    p = modelplan.plan(str(d), 1)
    big = check_model(Context(_cfg(d, 10**6), tmp_path, 1.0, []))[0]
    assert "can take: trainer+validator" in big.detail and "M parameters" in big.detail
    small = check_model(Context(_cfg(d, p.need_for(["follower"])), tmp_path, 1.0, []))[0]
    assert small.ok and "trainer" not in small.detail.split("can take:")[1] and small.severity == "warning"
    none = check_model(Context(_cfg(d, 100), tmp_path, 1.0, []))[0]
    assert not none.ok and "no role" in none.detail
    missing = check_model(Context(_cfg(tmp_path / "nope", 4096), tmp_path, 1.0, []))[0]
    assert not missing.ok and "no such directory" in missing.detail


def test_node_start_refuses_a_model_over_budget(qwen: tuple[Path, int], tmp_path: Path) -> None:
    """The real command: exit 2 and one line naming the memory needed, before any model is loaded."""
    d, _ = qwen
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[node]\nroles = ["trainer"]\nmemory_budget_mb = 600\n[training]\nmodel = "{d}"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run(
        [sys.executable, "-m", "murmur.node", "node", "start", "--home", str(home), "--no-tui"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "needs about" in r.stderr and "MiB as trainer" in r.stderr


@pytest.mark.slow
def test_own_model_trains_and_is_followed(qwen: tuple[Path, int], tmp_path: Path) -> None:
    """A trainer and a follower+validator, both with the Qwen2-shaped model by path and no lr set: the trainer
    steps with the size's learning rate, the follower serves its lineage and the trainer accepts the follower's
    rollouts, nothing errors. Completions are one token: random weights then answer a one-digit task about
    one time in a hundred, so the trainer's first rewarded step, and with it the first version (a follower's
    worker generates for a new lineage only once it holds an item of it), comes within seconds instead of
    at a rare chance of a one-digit answer followed by end-of-text. Applying many versions is what the
    tiny-model swarm tests cover."""
    from murmur.node.cli import launch

    d, _ = qwen
    homes = [tmp_path / f"n{i}" for i in range(2)]
    specs = [
        launch.NodeLaunch(
            home=str(h),
            config={
                "node": {"swarm": "byo", "roles": roles, "memory_budget_mb": 4096},
                "network": {"dht": False},
                "sync": {"publish_every": 1, "anchor_every": 8},
                "training": {"model": str(d), "max_new_tokens": 1, "local_rollouts": 4},
            },
        )
        for h, roles in zip(homes, (["trainer"], ["follower", "validator"]))
    ]
    procs = launch.start_bootstrapped(specs, 300)
    try:
        launch.wait_until(
            "trainer steps on the follower's rollouts",
            lambda: bool(
                (a := procs[0].status())
                and (b := procs[1].status())
                and a.steps >= 3
                and a.rollouts_accepted > 0
                and b.serving
                and b.serving == next((x.lineage for x in a.lineages if x.relation == "own"), None)
            ),
            procs,
            300,
        )  # under pytest-timeout's 600 s, so the wait reports its own failure
    finally:
        launch.stop_all(procs)
    log = (homes[0] / "stderr.log").read_text()
    assert f"training.lr {modelplan.MODEL_LR:g}" in log
    for h in homes:
        lines = [json.loads(x) for x in (h / "stderr.log").read_text().splitlines() if x.startswith("{")]
        assert not [x for x in lines if x.get("level") == "error"], h


def qwen2_config_only(d: Path, hidden: int = 512, layers: int = 10) -> int:
    """A Qwen2-shaped model directory (10 layers, width 512), config.json only, counted on the meta device: 30M."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from murmur.training.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    cfg.save_pretrained(d)
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())


def test_fresh_home_trains_a_large_model_at_the_documented_rate(tmp_path: Path) -> None:
    """A new home's config.toml, model given by path: the node trains at 1e-6, not murmur-tiny's 3e-4."""
    from murmur.node.cli.doctor import Context, check_model
    from murmur.node.home import init_home

    d = tmp_path / "model"
    d.mkdir()
    assert qwen2_config_only(d) > 25_000_000
    home = tmp_path / "home"
    init_home(home)
    cfg_file = home / "config.toml"
    text = cfg_file.read_text()
    assert 'model = "murmur-tiny"' in text
    cfg_file.write_text(text.replace('model = "murmur-tiny"', f'model = "{d}"'))
    cfg, notes, warnings = modelplan.start_config(cfg_file)
    assert cfg.training.lr == modelplan.MODEL_LR == 1e-6
    assert warnings == [] and any("training.lr 1e-06" in n for n in notes)
    from typer.testing import CliRunner

    from murmur.node.cli.app import app

    shown = CliRunner().invoke(app, ["config", "show", "--home", str(home), "--json"])
    assert json.loads(shown.stdout.splitlines()[-1])["training.lr"] == {
        "value": 1e-6,
        "source": "default for the model's size",
    }
    # a rate the volunteer sets stands, and is flagged when it would hurt a model this size
    cfg_file.write_text(cfg_file.read_text().replace("[training]\n", "[training]\nlr = 3e-4\n"))
    cfg, _, warnings = modelplan.start_config(cfg_file)
    assert cfg.training.lr == 3e-4 and len(warnings) == 1 and "over 1e-05" in warnings[0]
    checks = {c.name: c for c in check_model(Context(cfg, home, 1.0, []))}
    assert not checks["learning rate"].ok and checks["learning rate"].severity == "warning"
    cfg_file.write_text(cfg_file.read_text().replace("lr = 3e-4\n", "lr = 5e-6\n"))
    cfg, _, warnings = modelplan.start_config(cfg_file)
    assert cfg.training.lr == 5e-6 and warnings == []
    assert "learning rate" not in {c.name for c in check_model(Context(cfg, home, 1.0, []))}
