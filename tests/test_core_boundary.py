"""The node core's boundary (h11-style): drivers tick it at the deadline it states, feed it events for what they
did, read it through queries, and never write its state. Each rule here is driven as plain calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import murmur.gossip.scoring
import murmur.node.core.events
import murmur.node.core.machine
import murmur.sync.catchup
import murmur.sync.items
import murmur.sync.patchstore
import murmur.sync.swarm
import murmur.sync.transfers
from murmur.gossip.errors import DecodeError
from murmur.node import pipe
from murmur.node.core import catchup as CM
from murmur.node.core import machine as C
from murmur.sync.ids import Relation, lineage_id
from murmur.sync.patchstore import StoredItem
from tests.test_core import BASE, W, announce, demand, key, make_core, of

ROOT = Path(__file__).resolve().parent.parent


def test_next_deadline_is_when_the_core_acts_again() -> None:
    core, clock = make_core(roles=("trainer",))
    assert of(core.handle(C.Tick()), C.Publish)  # the first tick announces
    assert core.next_deadline() == clock.t + C.CATCH_UP_EVERY_S
    clock.t = core.next_deadline() - 1e-6
    assert core.handle(C.Tick()) == []  # nothing is due before the deadline
    clock.t = start = clock.t + 1e-6
    core.handle(C.Tick())
    assert core.next_deadline() > start
    clock.t = 1000.0 + C.ANNOUNCE_EVERY_S
    assert [a.topic for a in of(core.handle(C.Tick()), C.Publish)] == [C.Topic.ANNOUNCE]


def _catching_up_with_two_sources(core: C.NodeCore):
    trainer, peer = key(9), key(11)
    lid = lineage_id(trainer.public, BASE, "lin")
    core.handle(announce(trainer, 1, [demand(lid, "lin", 6)]))
    core.handle(announce(peer, 1, serving=lid, roles=("follower",)))
    acts = core.handle(C.Tick())
    assert of(acts, C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]
    items = (StoredItem("anchor", 4, 4, 900), StoredItem("patch", 4, 5, 10), StoredItem("patch", 5, 6, 10))
    assert len(of(core.handle(C.CatalogReceived(trainer.peer_id, lid, items)), C.RequestOffer)) == 3
    return trainer, peer, lid


def test_a_failed_offer_moves_catch_up_to_the_next_source_at_once() -> None:
    core, clock = make_core()
    trainer, peer, lid = _catching_up_with_two_sources(core)
    assert core.handle(C.OfferFailed(peer.peer_id, lid, "not asked")) == []  # not the source: ignored
    acts = core.handle(C.OfferFailed(trainer.peer_id, lid, "StreamError: reset"))
    assert of(acts, C.FetchCatalog) == [C.FetchCatalog(peer.peer_id, lid)]
    assert core.catching is not None and core.catching.phase is CM.CatchUpPhase.ASKING
    # the other offers of the same failed attempt do not skip the new source
    assert of(core.handle(C.OfferFailed(trainer.peer_id, lid, "again")), C.FetchCatalog) == []


def test_every_source_failing_waits_out_the_patience_then_starts_over() -> None:
    core, clock = make_core()
    trainer, peer, lid = _catching_up_with_two_sources(core)
    core.handle(W("applied", {"lineage": lid.hex(), "version": 1}))  # it delivered before: not on trial
    core.handle(C.OfferFailed(trainer.peer_id, lid, "x"))
    assert of(core.handle(C.CatalogFailed(peer.peer_id, lid, "y")), C.FetchCatalog) == []
    assert core.catching.phase is CM.CatchUpPhase.EXHAUSTED
    assert core.handle(C.CatalogFailed(peer.peer_id, lid, "late")) == []
    clock.t += CM.CATCH_UP_PATIENCE_S - 1
    core.handle(announce(trainer, 2, [demand(lid, "lin", 6)]))  # the trainer is still there
    assert of(core.handle(C.Tick()), C.FetchCatalog) == []
    clock.t += 2
    assert of(core.handle(C.Tick()), C.FetchCatalog) == [C.FetchCatalog(trainer.peer_id, lid)]


def test_a_new_peer_asks_the_driver_to_resend_task_sets_once() -> None:
    core, clock = make_core()
    trainer = key(9)
    assert of(core.handle(announce(trainer, 1)), C.ResendTaskSets) == [C.ResendTaskSets()]
    assert of(core.handle(announce(trainer, 2)), C.ResendTaskSets) == []


def test_counters_are_the_cores_and_read_as_a_copy() -> None:
    core, clock = make_core(roles=("trainer",))
    core.handle(C.RolloutsPublished(5))
    core.handle(C.RolloutsPublished(-3))  # a driver bug cannot lower a count
    got = core.stats()
    assert got["rollouts_published"] == 5
    got["rollouts_published"] = 0
    assert core.stats()["rollouts_published"] == 5


def test_a_lineage_known_from_the_store_is_loaded_through_an_event() -> None:
    core, clock = make_core()
    trainer = key(9)
    lid = lineage_id(trainer.public, BASE, "lin")
    assert core.handle(C.LineageKnown(lid, "lin", Relation.FOLLOW, trainer.public, BASE, 7)) == []
    assert core.lineages[lid].held == 7 and core.lineages[lid].relation == Relation.FOLLOW


def test_worker_state_is_explicit() -> None:
    core, clock = make_core()
    assert core.worker_state is pipe.WorkerState.READY
    core.handle(W("state", "catching-up"))
    assert core.worker_state is pipe.WorkerState.CATCHING_UP
    core.handle(C.WorkerExited(1))
    assert core.worker_state is pipe.WorkerState.RESTARTING
    core.handle(C.WorkerStarted())
    assert core.worker_state is pipe.WorkerState.STARTING
    with pytest.raises(DecodeError):
        pipe.encode("state", "dancing")  # the worker cannot send a state the core does not know


def test_an_unknown_event_is_a_driver_bug_not_silence() -> None:
    core, clock = make_core()
    with pytest.raises(AssertionError):
        core.handle(object())  # type: ignore[arg-type]


def test_drivers_do_not_reach_into_the_core() -> None:
    # the check on the node core's former timer fields (`next_deadline()` is its query, and
    # simulations/vsim.py's `core.next_upload` is the broadcast core's); and no driver assigns into a core
    reach = re.compile(
        r"core\.(next_(announce|catch_up)|counters|new_peer|table)|core\.[a-z_]+(\.[a-z_]+)* *[-+*/]?=[^=]"
    )
    files = [ROOT / "node" / "shell" / "runtime.py", *sorted((ROOT / "simulations").rglob("*.py"))]
    hits = [
        f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1) if reach.search(line)
    ]
    assert hits == []


def test_the_core_reads_no_clock_and_its_drivers_drop_no_actions() -> None:
    """Time comes with each event (`handle(event, now, wall_ms)`): no clock is read in the core or its
    sub-machines. And every driver uses what `handle` returns: no call statement discards it."""
    read = re.compile(r"clock\(|self\.clock|wall_ms\(\)|time\.(time|monotonic|perf_counter)\(")
    machines = sorted((ROOT / "node" / "core").glob("*.py"))  # the core's room: the core and its sub-machines
    assert len(machines) >= 9
    hits = [
        f"{m.name}:{i}" for m in machines for i, line in enumerate(m.read_text().splitlines(), 1) if read.search(line)
    ]
    assert hits == []
    dropped = re.compile(r"^\s*(await\s+)?[\w.\[\]]+\.handle\(")
    files = [ROOT / "node" / "shell" / "runtime.py", *sorted((ROOT / "simulations").rglob("*.py"))]
    hits = [
        f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1) if dropped.search(line)
    ]
    assert hits == []


def test_one_penalty_action_with_one_sign() -> None:
    from murmur.gossip.scoring import PeerScores, ScoreParams
    from murmur.sync.swarm import SwarmConfig

    assert (
        murmur.sync.swarm.Penalise
        is murmur.sync.transfers.Penalise
        is murmur.node.core.events.Penalise
        is murmur.gossip.scoring.Penalise
    )
    cfg = SwarmConfig()
    scores = PeerScores(ScoreParams())
    for amount in (cfg.penalty_corrupt, cfg.penalty_stall, cfg.penalty_protocol, C.SPOT_PENALTY, C.CLAIM_PENALTY):
        before = scores.score("p", 0.0)
        scores.penalise("p", "x", amount, 0.0)  # as both drivers apply it: no abs(), no sign flip
        assert scores.score("p", 0.0) < before


def test_the_core_imports_no_io_module() -> None:
    import subprocess
    import sys

    code = (
        "import sys, murmur.node.core.machine; print(sorted(m for m in ('trio', 'murmur.node.shell.patches', 'murmur.sync.patchstore', 'torch', "
        "'libp2p', 'sqlite3') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_items_are_one_vocabulary() -> None:

    assert murmur.sync.patchstore.StoredItem is murmur.sync.catchup.StoredItem is murmur.sync.items.StoredItem
    assert C.item_of is murmur.sync.items.item_of
    assert {murmur.sync.items.KIND_CODEC[k] for k in murmur.sync.items.KINDS} == set(murmur.sync.items.CODEC_KIND)


def test_an_offered_manifest_is_an_event_answered_accept_or_decline() -> None:
    from tests.test_core import follow_trainer, manifest

    core, clock = make_core()
    trainer, other = key(9), key(10)
    lid = follow_trainer(core, clock, trainer, head=3)
    assert core.handle(C.ManifestOffered(manifest(trainer, "lin", 3, 4))) == [C.Accept()]
    assert core.handle(C.ManifestOffered(manifest(other, "other", 3, 4))) == [C.Decline()]
    assert (lid, "patch", 3, 4) in core.in_flight  # what was accepted counts as on its way
    assert core.offer_manifest(manifest(trainer, "lin", 4, 5)) is True


def test_a_verified_batch_feeds_the_exchange_meter_through_its_event() -> None:
    core, clock = make_core(roles=("trainer",))
    core.handle(C.RolloutsVerified("p", ((b"l" * 32, 8), (b"m" * 32, 4))))
    clock.t += core.inbound.window_s / 2
    core.handle(C.RolloutsVerified("p", ((b"l" * 32, 12),)))
    clock.t += core.inbound.window_s / 2
    assert core.inbound.rate(clock.t) == 12 / core.inbound.window_s  # the first batch slid out of the window
