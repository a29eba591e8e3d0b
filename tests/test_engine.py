"""Transformers engine, murmur-tiny, rollout wire conversion, and the vLLM engine (opt-in)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from murmur.gossip.errors import MurmurError
from murmur.gossip.identity import Identity
from murmur.gossip.wire import FORMAT_VERSION, ROLLOUT_BATCH, RolloutBatch, TaskRef, open_envelope, seal
from murmur.training.engine import Engine, Sampling, SparseUpdate
from murmur.training.engine_hf import HFEngine, load_causal_lm
from murmur.training.rollouts import expand_versions, from_wire, to_wire
from murmur.training.tasksets import TaskRegistry
from murmur.training.tiny import ensure_tiny, load_policy, new_tiny_engine, tiny_dir

SWARM = "t"

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*past_key_values.*")


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return new_tiny_engine(seed=1)


def test_generate_groups_and_rescoring_match(engine: HFEngine) -> None:
    assert isinstance(engine, Engine)
    groups = engine.generate(["3+4=", "12+7="], 4, Sampling(temperature=1.0, max_new_tokens=5))
    assert [len(g) for g in groups] == [4, 4]
    flat = [c for g in groups for c in g]
    for c in flat:
        assert 1 <= len(c.ids) <= 5 and len(c.logprobs) == len(c.ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.finished == (c.ids[-1] == engine.eos_id)
    again = engine.logprobs([(c.prompt_ids, c.ids) for c in flat])
    for c, lps in zip(flat, again):
        assert lps == pytest.approx(c.logprobs, abs=2e-4)  # KV-cache sampling == full forward


def test_continuation_from_a_partial_prefix_is_consistent(engine: HFEngine) -> None:
    prompt = engine.encode("5+5=")
    first = engine.sample([prompt, engine.encode("1+1=")], Sampling(max_new_tokens=2), max_new=2)
    ids, lps, _ = first[0]
    cont = engine.sample([prompt + ids], Sampling(max_new_tokens=3))[0]
    full = engine.logprobs([(prompt, ids + cont[0])])[0]
    assert full == pytest.approx(lps + cont[1], abs=2e-4)


def test_greedy_is_deterministic(engine: HFEngine) -> None:
    s = Sampling(temperature=0.0, max_new_tokens=4)
    assert engine.sample([engine.encode("9+9=")], s) == engine.sample([engine.encode("9+9=")], s)


def test_chunked_logprobs_equal_unchunked(engine: HFEngine) -> None:
    seqs = [(engine.encode(f"{i}+{i}="), engine.encode(str(2 * i)) + [engine.eos_id]) for i in range(6)]
    full = engine.logprobs(seqs)
    old = engine.memory_budget_mb
    engine.memory_budget_mb = 0  # one row per chunk
    try:
        assert engine.logprobs(seqs) == [pytest.approx(x, abs=1e-5) for x in full]
    finally:
        engine.memory_budget_mb = old


def test_in_place_updates(engine: HFEngine) -> None:
    name, p = next(iter(engine.model.named_parameters()))
    before = p.detach().clone()
    engine.apply_patch([SparseUpdate(name, torch.tensor([0, 5]), torch.tensor([1.5, -2.0]))])
    assert p.view(-1)[0].item() == 1.5 and p.view(-1)[5].item() == -2.0
    with pytest.raises(MurmurError, match="outside"):
        engine.apply_patch([SparseUpdate(name, torch.tensor([p.numel()]), torch.tensor([0.0]))])
    with pytest.raises(MurmurError, match="unknown tensor"):
        engine.apply_patch([SparseUpdate("nope", torch.tensor([0]), torch.tensor([0.0]))])
    with pytest.raises(MurmurError, match="shape"):
        engine.load_state({name: torch.zeros(3)})
    engine.load_state({name: before})
    assert torch.equal(p.detach(), before)


def test_missing_or_non_causal_model_paths_give_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(MurmurError, match="no such path") as e:
        load_policy(str(tmp_path / "absent"), tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(MurmurError, match="not a directory|does not exist"):
        load_causal_lm(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MurmurError, match="no config.json"):
        load_causal_lm(tmp_path / "empty")
    d = tmp_path / "t5"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "clip_text_model"}))
    with pytest.raises(MurmurError, match="not a causal LM") as e:
        load_causal_lm(d)
    assert "\n" not in str(e.value)
    (d / "config.json").write_text("{not json")
    with pytest.raises(MurmurError, match="unreadable config"):
        load_causal_lm(d)


def test_concurrent_builders_of_one_home_build_once(tmp_path: Path) -> None:
    """Nodes started together share a home: one builds, the others wait and load the same files."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, json; from murmur.training.tiny import ensure_tiny; from murmur.training.engine_hf import HFEngine; "
        "d = ensure_tiny(sys.argv[1], seed=3, warmup_steps=2); HFEngine.from_path(d, device='cpu'); "
        "print(json.loads((d / 'murmur-tiny.json').read_text())['warmup_s'])"
    )
    root = Path(__file__).resolve().parent.parent
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    # every process read the marker of one and the same build
    assert len({o.strip() for o, _ in outs}) == 1
    assert not list((tmp_path / "models").glob("*.tmp*"))


def test_murmur_tiny_builds_of_one_home_do_not_replace_each_other(tmp_path: Path) -> None:
    """Benchmark seeds run side by side share a home: each must keep loading its own model."""
    a = ensure_tiny(tmp_path, seed=3, warmup_steps=2)
    before = (a / "model.safetensors").read_bytes()
    b = ensure_tiny(tmp_path, seed=4, warmup_steps=2)
    assert a != b and (b / "model.safetensors").read_bytes() != before
    assert (a / "model.safetensors").read_bytes() == before  # still seed 3's
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path, seed=3, warmup_steps=2) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert tiny_dir(tmp_path) == tmp_path / "models" / "murmur-tiny"  # the default build: the node's path


def test_murmur_tiny_is_cached_deterministic_and_loads_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = ensure_tiny(tmp_path / "a", seed=3, warmup_steps=2)
    b = ensure_tiny(tmp_path / "b", seed=3, warmup_steps=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path / "a", seed=3, warmup_steps=2) == a  # cached, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    e1 = HFEngine.from_path(a, device="cpu")
    e2 = new_tiny_engine()
    assert e1.tokenizer_hash == e2.tokenizer_hash and len(e1.tokenizer_hash) == 32
    assert e1.encode("12+3=") == e2.encode("12+3=") and e1.decode(e1.encode("sort 1,2=")) == "sort 1,2="
    assert 300_000 < e1.num_params() < 2_000_000


def test_rollout_wire_round_trip_and_retokenisation(engine: HFEngine) -> None:
    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    from murmur.training.trainer import Trainer, TrainerConfig

    tr = Trainer(
        engine,
        reg,
        reg.builtin_id,
        TrainerConfig(local_groups=1, group_size=4, max_new_tokens=4, external_groups=0, lr=1e-5),
        lineage=b"\x07" * 32,
    )
    res = tr.step()
    assert len(res.rollouts) == 4
    ident = Identity.from_seed(b"\x09" * 32)
    wires = [to_wire(r) for r in res.rollouts]
    env = seal(
        ident,
        ROLLOUT_BATCH,
        RolloutBatch(v=FORMAT_VERSION, swarm="t", producer=ident.public, seq=1, created_ms=1, rollouts=wires),
        swarm=SWARM,
    )
    _, batch = open_envelope(env, ROLLOUT_BATCH, swarm=SWARM)
    for r, w in zip(res.rollouts, batch.rollouts):
        task = reg.resolve(w.task)
        back = from_wire(w, task, engine.encode(task.prompt), engine.tokenizer_hash, engine.encode)
        assert back.ids == r.ids and back.text == r.text and not back.foreign
        assert back.logprobs == pytest.approx(r.logprobs, abs=1e-6)
        assert back.token_versions == r.token_versions
        other = from_wire(w, task, [], b"\x01" * 32, engine.encode)
        assert other.foreign and other.logprobs == []  # another tokenizer's log-probs are never ours
        assert other.ids == engine.encode(w.text)


def test_expand_versions() -> None:
    assert expand_versions([(0, 3), (2, 5)], 4, 3) == [3, 3, 5, 5]
    assert expand_versions([], 2, 7) == [7, 7]


def test_engine_selection_never_falls_back(tmp_path: Path) -> None:
    """The node's environment has no vLLM: asking for it is an error that says so, not transformers."""
    import murmur.training.engine_vllm as ev
    from murmur.training.engine import open_engine
    from murmur.training.tiny import new_tiny_engine

    ref = new_tiny_engine(seed=0)
    assert open_engine("transformers", tmp_path, ref) is ref
    assert ev.installed_build() == ("", "")
    with pytest.raises(MurmurError, match="vLLM is not installed"):
        open_engine("vllm", tmp_path, ref)
    with pytest.raises(MurmurError, match="unknown engine"):
        open_engine("tensorrt", tmp_path, ref)


def test_task_ref_types() -> None:
    ref = TaskRef(b"\x00" * 32, "add", 1)
    assert ref.seed == 1
