"""A trainer's worker learns the head of every lineage that publishes (publisher proven, a signed manifest
accepted), so the sampler's staleness
bound ages out the external groups of every lineage, not only its own (the core's `Head` message, the
worker's reader, the sampler; a real pipe between two threads)."""

from __future__ import annotations

import multiprocessing
import threading

import msgspec

from murmur.node import pipe
from murmur.node.core import machine as C
from murmur.node.worker.main import Inbox, _reader
from murmur.sync.ids import lineage_id
from tests import samples
from tests.test_core import BASE, W, announce, demand, key, make_core, manifest, of, to_worker


def test_a_trainer_core_tells_its_worker_every_head_once_and_again_after_a_restart() -> None:
    core, clock = make_core(roles=("trainer",))
    other = key(9)
    lid = lineage_id(other.public, BASE, "theirs")
    acts = core.handle(C.ManifestHeard(manifest(other, "theirs", 4, 5)))
    assert [(h.lineage, h.version) for h in to_worker(acts, pipe.Head)] == [(lid.hex(), 5)]
    assert to_worker(core.handle(C.ManifestHeard(manifest(other, "theirs", 4, 5))), pipe.Head) == []  # told once
    acts = core.handle(announce(other, 1, [demand(lid, "theirs", 9)]))  # the publisher's own signed demand
    assert [(h.lineage, h.version) for h in to_worker(acts, pipe.Head)] == [(lid.hex(), 9)]
    acts = core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": 1 << 20}))  # a new worker
    assert [(h.lineage, h.version) for h in to_worker(acts, pipe.Head)] == [(lid.hex(), 9)]


def test_a_claim_about_someone_elses_lineage_tells_the_worker_nothing() -> None:
    core, clock = make_core(roles=("trainer",))
    victim, liar = key(9), key(8)
    lid = lineage_id(victim.public, BASE, "theirs")
    acts = core.handle(announce(liar, 1, [demand(lid, "theirs", 10**9)]))
    assert to_worker(acts, pipe.Head) == [] and core.head_of(lid) is None
    assert "lineage claim refused" in [a.msg for a in of(acts, C.Log)]


def test_a_follower_core_sends_no_heads() -> None:
    core, clock = make_core(roles=("follower",))
    acts = core.handle(C.ManifestHeard(manifest(key(9), "theirs", 4, 5)))
    assert to_worker(acts, pipe.Head) == []


def test_the_worker_ages_out_another_lineages_groups_by_the_heads_it_is_told() -> None:
    other = key(9)
    lid = lineage_id(other.public, BASE, "theirs")
    base = samples.rollout(seed=1)
    group = [msgspec.structs.replace(base, lineage=lid, version=2, reward=x) for x in (1.0, 0.0)]
    inbox = Inbox(max_groups=16, max_staleness=4, swarm="t")
    inbox.sampler.add_rollouts(group)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    t = threading.Thread(target=_reader, args=(theirs, inbox))
    t.start()
    core, clock = make_core(roles=("trainer",))
    for act in core.handle(C.ManifestHeard(manifest(other, "theirs", 8, 9))):  # 7 versions past the group
        if isinstance(act, C.ToWorker):
            ours.send_bytes(pipe.encode_struct(act.msg))
    ours.send_bytes(pipe.encode_struct(pipe.Stop()))  # handled after the Head: one reader, in order
    t.join(10)
    assert not t.is_alive()
    assert inbox.sampler.head(lid) == 9
    assert inbox.sampler.take(4) == [] and inbox.sampler.counts["stale"] == 1


def test_a_lineage_that_only_announces_is_never_told_so_its_rollouts_never_train() -> None:
    """Attack (issue 43): a key announces a demand for a lineage of its own (the publisher is proven: the id
    derives from its key) but never publishes a signed version, then sends reward-correct rollouts under
    it. Its head never reaches the worker, whose sampler trains on no lineage it has no head for."""
    core, clock = make_core(roles=("trainer",))
    other = key(9)
    lid = lineage_id(other.public, BASE, "fresh")
    acts = core.handle(announce(other, 1, [demand(lid, "fresh", 0)]))
    assert to_worker(acts, pipe.Head) == [] and core.head_of(lid) == 0  # known, not told
    acts = core.handle(W("ready", {"base": BASE.hex(), "version": 0, "model_bytes": 1 << 20}))  # a new worker
    assert to_worker(acts, pipe.Head) == []
    acts = core.handle(C.ManifestHeard(manifest(other, "fresh", 0, 1)))  # its first signed version
    assert [(h.lineage, h.version) for h in to_worker(acts, pipe.Head)] == [(lid.hex(), 1)]
