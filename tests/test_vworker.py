"""The virtual simulator's worker model (`simulations/vworker.py`) against a stand-in core: what it tells
its core through the pipe, when it steps, and what a step learns."""

from __future__ import annotations

import heapq
import random

from murmur.node import pipe
from murmur.simulations import scenario as S
from murmur.simulations.vevents import EventQueue, StepDue, WorkerSends
from murmur.simulations.vnode import VNode, identity_for
from murmur.simulations.vreport import Recorder
from murmur.simulations.vworker import WORKER_S, Workers
from murmur.training.tasksets import TaskRegistry
from murmur.training.verifiers import score

LINEAGE = b"L" * 32
SCENARIO = """
duration_s = 60.0
[[group]]
count = 1
[[group]]
count = 1
role = "follower"
follow = 0
[training]
step_s = 2.0
local_groups = 2
external_groups = 2
group_size = 4
[learning]
initial = 0.0
spread = 0.0
train_share = 0.5
[sync]
publish_every = 2
"""


class StandInCore:
    """What the worker model reads of its node's core: the heads it knows, what it routes to the worker."""

    def head_of(self, lineage: bytes) -> int | None:
        return None


def setup() -> tuple[Workers, list[VNode], EventQueue, Recorder]:
    sc = S.loads(SCENARIO)
    registry = TaskRegistry(sc.swarm)
    registry.add_builtin()
    queue = EventQueue()
    recorder = Recorder(None, sc.report.format)
    nodes: list[VNode] = []
    workers = Workers(sc, nodes, queue, recorder, registry.builtin_id, registry.resolve, score, memo_horizon_s=5.0)
    for s in S.expand(sc):
        ident = identity_for(sc.seed, s.index)
        n = VNode(
            s,
            ident,
            ident.peer_id,
            LINEAGE if s.role == "trainer" else b"F" * 32,
            0.0,
            0.0,
            random.Random(s.index),
            core=StandInCore(),
            alive=True,
            inc=1,
        )  # type: ignore[arg-type]
        nodes.append(n)
        if s.role == "trainer":
            workers.equip(n)
    return workers, nodes, queue, recorder


def sent(queue: EventQueue) -> list[tuple[float, object]]:
    """Everything queued, in time order, emptying the queue."""
    out = []
    while queue.heap:
        t, _, ev = heapq.heappop(queue.heap)
        out.append((t, ev.msg if isinstance(ev, WorkerSends) else ev))
    return out


def test_stored_items_are_applied_by_the_node_workers_plan() -> None:
    """As `node/worker/main.py` (`sync.catchup.local_plan`): to the newest stored version, over a gap only through
    a stored anchor ahead, and nothing of a chain that no stored item carries to the newest version."""
    workers, nodes, queue, _ = setup()
    f = nodes[1]
    f.store[LINEAGE] = {("patch", 0, 1): b"", ("patch", 1, 2): b"", ("patch", 3, 4): b""}
    workers.receive(f, pipe.Follow(pipe.FollowInfo(LINEAGE.hex(), "sim", "", "")))
    assert f.following == f.held_lineage == LINEAGE and not f.admitted
    # it reports the base model it holds; 1 and 2 chain, but 2 -> 3 is missing, so no plan reaches 4: it
    # applies nothing until an item bridges the gap
    assert [m for _, m in sent(queue)] == [pipe.Applied(LINEAGE.hex(), 0)] and f.held == 0
    f.store[LINEAGE][("anchor", 0, 3)] = b""
    workers.receive(f, pipe.Patch(LINEAGE.hex(), "anchor", 0, 3))
    assert [m for _, m in sent(queue)] == [pipe.Applied(LINEAGE.hex(), 4)] and f.held == 4  # anchor, then 3 -> 4
    f.store[LINEAGE][("anchor", 0, 5)] = b""
    workers.receive(f, pipe.Patch(LINEAGE.hex(), "anchor", 0, 5))
    assert [m for _, m in sent(queue)] == [pipe.Applied(LINEAGE.hex(), 5)] and f.held == 5
    workers.receive(f, pipe.Admit(LINEAGE.hex(), True))
    assert f.admitted
    workers.receive(f, pipe.Admit((b"x" * 32).hex(), True))  # not the lineage it follows
    assert not f.admitted


def test_a_follower_generates_only_when_admitted_and_no_faster_than_its_pace() -> None:
    workers, nodes, queue, recorder = setup()
    f = nodes[1]
    workers.skill_at[LINEAGE] = [0.0, 1.0]  # its publisher's skill per version
    workers.on_step(StepDue(1, f.inc))
    [(t, ev)] = sent(queue)
    assert ev == StepDue(1, f.inc) and t == 2.0 and f.steps == 0  # no lineage yet: no step, next one as usual
    f.following = f.held_lineage = LINEAGE
    f.held, f.admitted, f.pace = 1, True, 2.0  # 8 rollouts a step at 2 rollouts/s: every 4 s
    workers.on_step(StepDue(1, f.inc))
    out = sent(queue)
    assert f.steps == 1 and out[-1] == (4.0, StepDue(1, f.inc))
    msgs = [m for _, m in out[:-1]]
    assert [type(m) for m in msgs] == [pipe.Rollouts, pipe.Gen, pipe.Perf]
    assert len(msgs[0].items) == 8 and msgs[1].reward_mean == 1.0 and msgs[1].version == 1  # at skill 1.0
    assert all(t == WORKER_S for t, _ in out[:-1])
    workers.on_step(StepDue(1, f.inc - 1))  # scheduled before a leave: ignored
    assert not queue.heap
    assert [r["lag"] for r in recorder.rows["lag"]] == [0]


def test_a_trainer_step_learns_nothing_from_uninformative_groups_and_costs_less_without_external_ones() -> None:
    workers, nodes, queue, recorder = setup()
    t = nodes[0]
    for step in (1, 2):
        workers.on_step(StepDue(0, t.inc))
        out = sent(queue)
        # skill 0: every answer wrong, no informative group, no external ones: 1 - 0.5 * (1 - 0 / 2) of step_s
        assert out[-1][0] == step * 1.0 and t.skill == 0.0 and t.version == step == t.steps
        queue.now = out[-1][0]
    msgs = [m for _, m in out[:-1]]
    assert [type(m) for m in msgs] == [pipe.Rollouts, pipe.Step, pipe.Perf, pipe.Published]  # every 2nd version
    assert msgs[1].version == 2 and msgs[1].used == 0 and msgs[1].reward_mean == 0.0
    assert set(t.store[LINEAGE]) == {("patch", 0, 2)} and workers.skill_at[LINEAGE] == [0.0, 0.0, 0.0]
    assert [r["version"] for r in recorder.rows["reward"]] == [1, 2]
