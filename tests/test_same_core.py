"""The simulator, `murmur bench swarm` and the live node run the same node core and the same sampler, and the
simulated broadcasts the live node's broadcast core, so a simulated or benchmarked result describes the node's
code (issue: the simulator runs node cores)."""

from __future__ import annotations

import copy

import murmur.gossip.intake
import murmur.gossip.service
import murmur.node.shell.runtime
import murmur.node.worker.main
import murmur.simulations.bench.swarm
import murmur.simulations.vbroadcast
import murmur.simulations.vruntime
import murmur.simulations.vsim
import murmur.simulations.vworker
import murmur.sync.broadcast
import murmur.sync.catchup
import murmur.sync.staleness
import murmur.sync.transfers
import murmur.training.sampler
from murmur.node.core.machine import ManifestOffered, NodeCore, SwarmHeard
from murmur.simulations import scenario as S
from murmur.simulations.virtual import VirtualSim

SCENARIO = """
seed = 5
duration_s = 12.0
[[group]]
count = 3
[[group]]
count = 2
role = "follower"
follow = 0
[[adversary]]
behaviour = "forged_reward"
[training]
step_s = 1.0
[sync]
patch_bytes = 65536
chunk_bytes = 16384
broadcasts = 0
"""


def test_simulator_and_runtime_import_one_core_and_one_sampler() -> None:
    assert murmur.simulations.vruntime.NodeCore is murmur.node.shell.runtime.C.NodeCore is NodeCore
    assert murmur.simulations.vruntime.CoreSettings is murmur.node.shell.runtime.C.CoreSettings
    sampler = murmur.training.sampler.Sampler
    assert (
        murmur.simulations.vworker.Sampler
        is murmur.simulations.bench.swarm.Sampler
        is murmur.node.worker.main.Sampler
        is sampler
    )
    assert murmur.simulations.vworker.split is murmur.training.sampler.split
    assert murmur.simulations.vworker.informative is murmur.training.sampler.informative
    assert (
        murmur.simulations.vworker.local_plan is murmur.sync.catchup.local_plan
    )  # what node/worker/main.py applies by


def test_simulator_and_gossip_service_run_one_batch_intake() -> None:
    """Every batch copy a simulated node receives goes through the object a live node's gossip service runs."""
    assert murmur.gossip.service.BatchIntake is murmur.gossip.intake.BatchIntake
    sim = VirtualSim(S.loads(SCENARIO))
    sim.run()
    honest = [n for n in sim.nodes if n.spec.role != "adversary"]
    assert all(type(n.intake) is murmur.gossip.intake.BatchIntake for n in honest)
    assert len({id(n.intake) for n in honest}) == len(honest)
    assert sum(n.intake.stats.counts["verified_batches"] for n in honest) > 0


def test_simulated_broadcasts_run_the_live_nodes_broadcast_core() -> None:
    core = murmur.sync.transfers.BroadcastCore
    assert murmur.simulations.vsim.BroadcastCore is murmur.sync.broadcast.BroadcastCore is core
    assert (
        murmur.simulations.vbroadcast.VirtualSwarm is murmur.simulations.vsim.VirtualSwarm
    )  # the start-up broadcasts' driver
    sw = murmur.simulations.vsim.VirtualSwarm(3, [4096] * 2, seed=0)
    assert all(type(nd.core) is core for nd in sw.nodes) and len({id(nd.core) for nd in sw.nodes}) == 4


def test_every_simulated_node_is_driven_by_its_own_core() -> None:
    sim = VirtualSim(S.loads(SCENARIO))
    s = sim.run()
    honest = [n for n in sim.nodes if n.spec.role != "adversary"]
    assert len(honest) == 5 and all(n.spec.role == "adversary" for n in sim.nodes if n.core is None)
    cores = [n.core for n in honest]
    assert all(type(c) is NodeCore for c in cores) and len({id(c) for c in cores}) == 5
    # staleness admission is the core's guard, the rule the live node runs
    assert all(type(c.guard) is murmur.sync.staleness.StalenessGuard for c in cores)
    for n in honest:
        # the driver gives the core virtual time, not the host's clock (which is years from the simulation's epoch)
        assert n.core.ident is n.ident and abs(n.core.next_deadline() - sim.queue.unix()) < 60
        if n.spec.role == "trainer":
            assert type(n.sampler) is murmur.training.sampler.Sampler
            assert n.core.own == n.lineage and n.core.head_of(n.lineage) == n.version
    # the cores stamp created_ms with the virtual clock the receivers' freshness checks read (a wall-clock
    # stamp is years away from the simulation's epoch: every honest batch would be `expired`)
    assert "expired" not in s["rejections"] and s["external_groups_consumed"] > 0
    # announces, sealing and the follower's lineage choice came out of the cores
    acts = s["cores"]["actions"]
    assert acts["announces"] > 0 and acts["rollouts_recorded"] > 0 and acts["versions_seeded"] > 0
    assert s["cores"]["logs"].get("serving", 0) >= 1
    lead = sim.nodes[0].lineage
    assert any(n.core.serving == lead for n in honest if n.spec.role == "follower")


class RecordingCore(NodeCore):
    """A NodeCore that records every call a driver makes into it, with the times the driver gave."""

    def __init__(self, settings, identity, now) -> None:  # type: ignore[no-untyped-def]
        self.trace: list[tuple] = [("init", now, None, None, None)]
        super().__init__(settings, identity, now)

    def handle(self, ev, now, wall_ms):  # type: ignore[no-untyped-def]
        # the simulator's swarm sums are its live tally, read when the core plans (at the Tick fed right
        # after): recorded as a copy taken before the driver's next event changes it
        rec = copy.deepcopy(ev) if isinstance(ev, SwarmHeard) else ev
        out = super().handle(ev, now, wall_ms)
        self.trace.append(("handle", now, wall_ms, rec, list(out)))
        return out

    def offer_manifest(self, m, now):  # type: ignore[no-untyped-def]
        ok = super().offer_manifest(m, now)
        self.trace.append(("offer_manifest", now, None, ManifestOffered(m), ok))
        return ok


def replay(core: RecordingCore) -> None:
    """Feed a fresh core the recorded calls with the recorded times: every answer must be the same."""
    fresh = NodeCore(core.s, core.ident, core.trace[0][1])
    for i, (call, t, w, arg, want) in enumerate(core.trace[1:], 1):
        got = fresh.handle(arg, t, w) if call == "handle" else fresh.offer_manifest(arg.manifest, t)
        assert got == want, f"call {i} ({call} {type(arg).__name__} at t={t}): {got!r} != {want!r}"


def test_same_inputs_give_the_same_actions(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A recorded trace of what the simulator's driver fed each core, replayed into a fresh core, gives
    identical actions and answers: the core's decisions depend on its events and the times the driver gives
    with them only (no clock read, randomness or driver-written state), so what a driver feeds is all that
    decides."""
    monkeypatch.setattr(murmur.simulations.vruntime, "NodeCore", RecordingCore)
    sim = VirtualSim(S.loads(SCENARIO))
    sim.run()
    cores = [n.core for n in sim.nodes if n.core is not None]
    assert len(cores) == 5 and all(isinstance(c, RecordingCore) for c in cores)
    kinds = {type(e[3]).__name__ for c in cores for e in c.trace[1:]}
    assert {
        "Tick",
        "AnnounceHeard",
        "ManifestHeard",
        "FromWorker",
        "RolloutsVerified",
        "ManifestOffered",
        "SwarmHeard",
    } <= kinds
    assert sum(len(c.trace) for c in cores) > 500
    for c in cores:
        replay(c)
