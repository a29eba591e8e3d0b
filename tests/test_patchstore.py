"""Lineage store on disk: retention, resumable downloads, replay, restart, transformers-loadable anchors."""

from __future__ import annotations

import json

import pytest
import torch

from murmur.node.store import open_store
from murmur.sync.chunks import ChunkAssembly
from murmur.sync.errors import PatchError
from murmur.sync.hashing import canonical_state, state_hash
from murmur.sync.patchstore import LineageStore
from murmur.sync.versions import LineageFollower, LineagePublisher

SWARM = "test"

torch.set_num_threads(1)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16), "b": torch.zeros(64)}


def _step(state: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    mask = torch.rand(out["w"].shape, generator=g) < 0.05
    out["w"][mask] = (out["w"][mask].float() * 1.01).to(torch.bfloat16)
    out["b"] += 1e-3
    return out


def test_retention_keeps_a_replayable_window(identity, tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    s = _state()
    pub = LineagePublisher(
        identity, "ret", s, tmp_path, anchor_every=5, retain_versions=6, max_anchors=2, chunk_bytes=4096, swarm=SWARM
    )
    for _ in range(23):
        s = _step(s, g)
        pub.publish(s)
    store = pub.store
    patches = [i for i in store.items() if i.kind == "patch"]
    assert min(i.target for i in patches) >= 23 - 6 + 1 - 5  # window plus the run back to the floor anchor
    assert max(i.target for i in patches) == 23
    assert len(store.anchors()) <= 2 and store.anchors()[-1] == 20
    oldest = min(i.base for i in patches)
    assert oldest in store.anchors()  # every kept patch is reachable from a kept anchor
    assert state_hash(store.load_state(23, swarm=SWARM)) == pub.state_hash
    assert state_hash(store.load_state(oldest + 1, swarm=SWARM)) != pub.state_hash
    with pytest.raises(PatchError):
        store.load_state(3, swarm=SWARM)  # pruned


def test_publisher_resumes_from_its_store(identity, tmp_path) -> None:
    g = torch.Generator().manual_seed(2)
    s = _state()
    db = open_store(tmp_path / "home")
    pub = LineagePublisher(identity, "resume", s, tmp_path, anchor_every=4, db=db, swarm=SWARM)
    for _ in range(6):
        s = _step(s, g)
        pub.publish(s)
    again = LineagePublisher.resume(identity, tmp_path, pub.lineage.id, anchor_every=4, swarm=SWARM)
    assert again.version == 6 and again.state_hash == pub.state_hash and again.lineage == pub.lineage
    s = _step(s, g)
    b = again.publish(s)
    assert b.manifest.base_version == 6 and b.manifest.base_hash == pub.state_hash
    rows = db.versions(pub.lineage.id)
    assert {r["version"] for r in rows if r["kind"] == "patch"} == set(range(1, 7))
    assert {r["version"] for r in rows if r["kind"] == "anchor"} == {0, 4}
    assert db.head_version(pub.lineage.id) == 6


def test_chunk_assembly_resumes_and_drops_bad_files(identity, tmp_path) -> None:
    g = torch.Generator().manual_seed(3)
    s0 = _state()
    pub = LineagePublisher(identity, "dl", s0, None, chunk_bytes=64, swarm=SWARM)
    b = pub.publish(_step(s0, g))
    assert len(b.chunks) >= 3
    store = LineageStore(tmp_path, pub.lineage.id)
    d = store.partial_dir(b.envelope)
    asm = ChunkAssembly(d, b.manifest)
    assert asm.put(0, b.chunks[0]) and not asm.put(0, b.chunks[0])
    asm.put(2, b.chunks[2])
    with pytest.raises(PatchError, match="corrupt"):
        asm.put(1, b.chunks[1][:-1] + b"\x00")
    (d / "1.chunk").write_bytes(b"garbage")  # a file a crash or a disk error left behind
    again = ChunkAssembly(d, b.manifest)  # "restart"
    assert again.missing() == [i for i in range(len(b.chunks)) if i not in (0, 2)]
    for i in again.missing():
        again.put(i, b.chunks[i])
    assert again.complete()
    live = {n: t.clone() for n, t in s0.items()}
    fol = LineageFollower(pub.lineage, live, 0, swarm=SWARM)
    assert fol.apply(b.envelope, again.chunks()).version == 1
    again.discard()
    assert not d.exists()


def test_anchor_loads_with_transformers(identity, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    state = canonical_state(model)
    assert "lm_head.weight" not in state  # tied alias dropped
    pub = LineagePublisher(identity, "hf", state, tmp_path, anchor_every=1, config_json=cfg.to_dict(), swarm=SWARM)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    pub.publish(model)
    d = pub.store.anchor_dir(1)
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen2"
    loaded = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    assert state_hash(canonical_state(loaded)) == pub.state_hash
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_follower_keeps_received_patches_for_peers(identity, tmp_path) -> None:
    g = torch.Generator().manual_seed(4)
    s = _state()
    pub = LineagePublisher(identity, "keep", s, tmp_path / "pub", anchor_every=100, swarm=SWARM)
    live = {n: t.clone() for n, t in s.items()}
    fol = LineageFollower(pub.lineage, live, 0, home=tmp_path / "fol", swarm=SWARM)
    for _ in range(3):
        s = _step(s, g)
        b = pub.publish(s)
        fol.apply(b.envelope, b.chunks)
    kinds = [(i.kind, i.base, i.target) for i in fol.store.items()]
    assert kinds == [("patch", 0, 1), ("patch", 1, 2), ("patch", 2, 3)]
    env, payload = fol.store.read_patch(1, 2)
    assert env == pub.store.read_patch(1, 2)[0] and payload == pub.store.read_patch(1, 2)[1]
