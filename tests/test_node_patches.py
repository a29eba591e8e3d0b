"""Node patch plumbing without a network: the follower's accept rule, storing completed transfers,
sweeping partial downloads, and the bf16 published policy (trainer samples what validators hold)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from murmur.node.shell import patches as patchsync
from murmur.sync.errors import PatchError
from murmur.sync.hashing import canonical_state, state_hash
from murmur.sync.items import wanted
from murmur.sync.patchstore import LineageStore
from murmur.sync.versions import LineageFollower, LineagePublisher

SWARM = "test"

torch.set_num_threads(1)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.zeros(32, dtype=torch.bfloat16),
    }


@pytest.fixture
def lineage(identity, tmp_path: Path):
    pub = LineagePublisher(identity, "lin", _state(), tmp_path / "pub", chunk_bytes=1024, anchor_every=4, swarm=SWARM)
    s = {n: t.clone() for n, t in pub.base.items()}
    s["w"] += torch.full_like(s["w"], 0.01)
    bundle = pub.publish(s)
    return pub, bundle


def test_wanted_takes_only_the_served_lineage_from_its_publisher(lineage, other_identity) -> None:
    pub, bundle = lineage
    m, lid, key = bundle.manifest, pub.lineage.id, pub.lineage.publisher
    assert wanted(m, lid, key, held=0, need_anchor=False, have=set())
    assert not wanted(m, None, key, 0, False, set())  # serving nothing
    assert not wanted(m, bytes(32), key, 0, False, set())  # another lineage
    assert not wanted(m, lid, other_identity.public, 0, False, set())  # not the lineage's publisher
    assert not wanted(m, lid, key, held=1, need_anchor=False, have=set())  # already held
    assert not wanted(m, lid, key, 0, False, {("patch", 0, 1)})  # already stored


def test_wanted_takes_an_old_anchor_only_when_patches_cannot_start(lineage) -> None:
    pub, _ = lineage
    env, _ = pub.store.read_anchor(0)
    from murmur.sync.patchstore import open_manifest

    m = open_manifest(env, swarm=SWARM)
    assert not wanted(m, pub.lineage.id, pub.lineage.publisher, held=0, need_anchor=False, have=set())
    assert wanted(m, pub.lineage.id, pub.lineage.publisher, held=0, need_anchor=True, have=set())


def test_store_complete_then_read_item_round_trips(lineage, tmp_path: Path) -> None:
    pub, bundle = lineage
    home = tmp_path / "follower"
    item = patchsync.store_complete(home, bundle.manifest, bundle.envelope, bundle.payload)
    assert (item.kind, item.base, item.target) == ("patch", 0, 1)
    env, chunks = patchsync.read_item(home, pub.lineage.id, item, swarm=SWARM)
    assert env == bundle.envelope and b"".join(chunks) == bundle.payload
    assert [(i.kind, i.base, i.target) for i in LineageStore(home, pub.lineage.id).items()] == [("patch", 0, 1)]
    with pytest.raises(PatchError):
        patchsync.read_item(home, bytes(32), item, swarm=SWARM)


def test_sweep_partials_keeps_downloads_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "partial"
    for name in ("live", "done", "old", "fresh"):
        (root / name).mkdir(parents=True)
        (root / name / "0.chunk").write_bytes(b"x")
    old = time.time() - 3600
    os.utime(root / "old", (old, old))
    removed = patchsync.sweep_partials(root, in_flight={"live"}, done={"done"}, keep_s=600)
    assert sorted(removed) == ["done", "old"]
    assert sorted(p.name for p in root.iterdir()) == ["fresh", "live"]


def test_trainer_samples_the_published_bf16_weights_that_a_follower_holds(identity, tmp_path: Path) -> None:
    """The fp32 master trains; rollouts and spot checks use the published bf16 version, bit for bit."""
    from murmur.node.worker.policy import MasterEngine, to_published
    from murmur.training.engine import Sampling
    from murmur.training.tiny import new_tiny_engine

    master = new_tiny_engine(seed=3)
    base = to_published(canonical_state(master.model))
    pub = LineagePublisher(identity, "lin", base, tmp_path / "pub", chunk_bytes=64 * 1024, swarm=SWARM)
    eng = MasterEngine(master, pub.base, seed=1)
    fp32 = {n: t.detach().clone() for n, t in canonical_state(eng.model).items()}
    # an optimizer-sized step on the master: most bf16 elements do not move
    with torch.no_grad():
        for p in eng.model.parameters():
            p.add_(torch.randn_like(p) * 1e-5)
    bundle = pub.publish(to_published(canonical_state(eng.model)))
    eng.set_published(pub.base)
    n = sum(t.numel() for t in fp32.values())
    changed = sum(int((to_published({k: t})[k] != pub.base[k]).sum()) for k, t in fp32.items())
    assert changed < n  # sparse: not every element crossed a bf16 boundary
    assert bundle.manifest.total_bytes < n * 2  # smaller than a dense bf16 copy

    # a follower: fp32 compute model mirroring a patched bf16 copy
    follower_engine = new_tiny_engine(seed=3)
    live = to_published(canonical_state(follower_engine.model))
    follower_engine.load_state(live)
    fol = LineageFollower(pub.lineage, live, 0, swarm=SWARM)
    applied = fol.apply(bundle.envelope, bundle.chunks)
    follower_engine.take_version(fol.live, applied.changed)
    assert fol.state_hash == state_hash(pub.base)
    for name, t in canonical_state(follower_engine.model).items():
        assert torch.equal(t, pub.base[name].to(t.dtype)), name  # exactly the published values
        assert torch.equal(canonical_state(eng.gen_engine.model)[name], t), name

    prompt = eng.encode("1+2=")
    out = eng.sample([prompt], Sampling(temperature=1.0, max_new_tokens=4))
    ids, lps, _ = out[0]
    if ids:
        mine = follower_engine.logprobs([(prompt, list(ids))], 1.0)[0]
        assert max(abs(a - b) for a, b in zip(mine, lps)) < 1e-4  # what a validator recomputes
        master_lp = eng.logprobs([(prompt, list(ids))], 1.0)[0]  # the master is not the sampling policy
        assert master_lp != lps
