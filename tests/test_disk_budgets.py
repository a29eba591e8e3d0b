"""Disk budgets on real files: a follower's patch store is pruned like a publisher's, logs rotate within budget."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from murmur.node import logs
from murmur.node.config import Config, load_config
from murmur.node.shell.patches import store_complete
from murmur.sync.patchstore import LineageStore, open_manifest
from murmur.sync.versions import LineagePublisher

SWARM = "test"

torch.set_num_threads(1)


def _publish(identity, home: Path, n: int) -> LineagePublisher:
    g = torch.Generator().manual_seed(3)
    s = {"w": (torch.randn(32, 32, generator=g) * 0.02).to(torch.bfloat16)}
    pub = LineagePublisher(
        identity,
        "budget",
        s,
        home,
        anchor_every=8,
        retain_versions=10**6,
        max_anchors=100,
        chunk_bytes=4096,
        swarm=SWARM,
    )
    for _ in range(n):
        s = {"w": s["w"].clone()}
        mask = torch.rand(s["w"].shape, generator=g) < 0.05
        s["w"][mask] = (s["w"][mask].float() * 1.01).to(torch.bfloat16)
        pub.publish(s)
    return pub


def _copy_as_follower(pub: LineagePublisher, home: Path, anchors: bool) -> LineageStore:
    """Every stored item goes into a follower's home the way completed transfers do (store_complete)."""
    src = pub.store
    for it in src.items():
        if it.kind == "anchor" and not anchors:
            continue
        env, payload = src.read_anchor(it.target) if it.kind == "anchor" else src.read_patch(it.base, it.target)
        store_complete(home, open_manifest(env, swarm=SWARM), env, payload)
    return LineageStore(home, pub.lineage.id)


def test_follower_store_without_anchors_is_pruned_to_the_window(identity, tmp_path: Path) -> None:
    pub = _publish(identity, tmp_path / "pub", 40)
    store = _copy_as_follower(pub, tmp_path / "fol", anchors=False)
    assert len([i for i in store.items() if i.kind == "patch"]) == 40  # the issue: everything kept
    store.prune(retain_versions=8)
    patches = [i for i in store.items() if i.kind == "patch"]
    assert max(i.target for i in patches) == 40
    assert min(i.base for i in patches) >= 40 - 8
    assert len(list((store.root / "patches").iterdir())) <= 2 * 9


def test_follower_store_with_anchors_stays_replayable(identity, tmp_path: Path) -> None:
    pub = _publish(identity, tmp_path / "pub", 40)
    store = _copy_as_follower(pub, tmp_path / "fol", anchors=True)
    store.prune(retain_versions=8, max_anchors=2)
    patches = [i for i in store.items() if i.kind == "patch"]
    assert min(i.base for i in patches) in store.anchors()
    assert len(patches) <= 8 + 8
    from murmur.sync.hashing import state_hash

    assert state_hash(store.load_state(40, swarm=SWARM)) == pub.state_hash


def test_log_file_rotates_within_its_budget(tmp_path: Path) -> None:
    logfile = tmp_path / "node.log"
    logs.setup("info", stream=None, logfile=logfile, max_bytes=64 * 1024)
    try:
        log = logging.getLogger("murmur.test")
        for i in range(3000):
            logs.event(log, "status", i=i, pad="x" * 60)
        files = list(tmp_path.glob("node.log*"))
        assert sum(f.stat().st_size for f in files) <= 64 * 1024 + 512
        assert len(files) == 2
        last = logfile.read_text().splitlines()[-1]
        assert json.loads(last)["i"] == 2999
    finally:
        logs.setup("info", stream=None, logfile=None)


def test_disk_section_in_config(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text("[disk]\nledger_max_rows = 500\nlogs_max_mb = 8\n")
    cfg = load_config(p, environ={})
    assert cfg.disk.ledger_budget().max_rows == 500 and cfg.disk.logs_max_mb == 8
    assert Config().disk.ledger_budget().payload_rows == 2000
    shutil.rmtree(tmp_path / "nothing", ignore_errors=True)


def test_disk_meter_measures_each_budget_and_caches(tmp_path: Path) -> None:
    from murmur.node.status import DiskMeter

    (tmp_path / "state.db").write_bytes(b"x" * 2**20)
    (tmp_path / "node.log").write_bytes(b"x" * 2**19)
    (tmp_path / "node.log.1").write_bytes(b"x" * 2**19)
    (tmp_path / "partial" / "ab").mkdir(parents=True)
    (tmp_path / "partial" / "ab" / "0.chunk").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "lineages" / "cd" / "patches").mkdir(parents=True)
    (tmp_path / "lineages" / "cd" / "patches" / "p.bin").write_bytes(b"x" * 2**21)
    meter = DiskMeter(tmp_path, Config(), every_s=30.0)
    views = {v.name: v for v in meter.views(now=100.0)}
    assert views["ledger"].used_mb == 1.0 and views["logs"].used_mb == 1.0 and views["logs"].limit_mb == 64
    assert views["partial"].used_mb == 3.0 and views["patches"].used_mb == 2.0
    (tmp_path / "state.db").write_bytes(b"x" * 2**21)
    assert {v.name: v.used_mb for v in meter.views(now=110.0)}["ledger"] == 1.0  # cached: no walk per second
    assert {v.name: v.used_mb for v in meter.views(now=131.0)}["ledger"] == 2.0
    # the peer table is counted against its own limit, not under the ledger
    meter = DiskMeter(tmp_path, Config(), every_s=30.0, peer_bytes=lambda: 2**19)
    views = {v.name: v for v in meter.views(now=100.0)}
    assert views["peers"].used_mb == 0.5 and views["peers"].limit_mb == Config().disk.peers_max_mb
    assert views["ledger"].used_mb == 1.5


def test_prune_spares_a_store_in_progress(identity, tmp_path: Path) -> None:
    """The live node stores completed transfers concurrently: a prune between a payload's temp write and its
    rename (or between payload and manifest) must not delete it, or the patch is lost for good."""
    import os
    import time

    from murmur.sync import patchstore

    pub = _publish(identity, tmp_path / "pub", 12)
    store = _copy_as_follower(pub, tmp_path / "fol", anchors=True)
    d = store.root / "patches"
    tmp = d / ".000000000012-000000000013.env.4242.tmp"  # another thread's atomic_write, not renamed yet
    tmp.write_bytes(b"x")
    orphan = d / "000000000012-000000000013.bin"  # payload written, manifest not yet
    orphan.write_bytes(b"y")
    store.prune(retain_versions=8)
    assert tmp.exists() and orphan.exists()
    old = time.time() - patchstore.WRITE_GRACE_S - 10  # an interrupted write from long ago is cleaned up
    for p in (tmp, orphan):
        os.utime(p, (old, old))
    removed = store.prune(retain_versions=8)
    assert not tmp.exists() and not orphan.exists()
    assert f"patches/{orphan.name}" in removed
