"""The trio runtime (`node.shell.runtime.Node`) in virtual time: two real nodes in one process under trio's
MockClock, on an in-memory transport (`tests/memnet.py`), each with a fake worker that speaks the real
pipe messages (`tests/fakeworker.py`). Everything between the transport and the worker pipe is the
node's own: its handlers, gossip service, validation, broadcast, catalog, store, core and timers.

Covered: start; announces both ways (roles, the lineage a follower serves); catch-up (a follower that
joins after two versions were published fetches them through the catalog, its worker applies them bit
for bit and is admitted to generate); a version published while connected arriving through the
broadcast; a worker that dies restarted after its backoff and applying again; shutdown by
`request_stop` and by the signal path, each stopping its worker, also while the node is starting.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio
import trio.testing

from murmur.gossip import exchange, topics, wire
from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.config import Config, NodeSection, SyncSection
from murmur.node.core import machine as C
from murmur.node.core import supervision as SV
from murmur.node.pipe import WorkerState
from murmur.node.shell import patches as patchsync
from murmur.node.shell.runtime import Node, RunOptions
from murmur.node.status import LineageView, NodeStatus
from tests.fakeworker import FakeLink, FakeWorkers
from tests.memnet import MemNet

SWARM = "virtual"
# Virtual time jumps once every task has waited this long in real time: long enough that the node's short
# thread calls (SQLite, patch files) finish before the clock moves, short enough to keep the test quick.
AUTOJUMP_S = 0.02
# Virtual seconds per wait, a bound that only fails the test. The longest phase takes about 7; the bound is
# far above that because a thread that is slow in real time (a cold import on a loaded machine) moves the
# clock too, up to 2.5x as fast.
WAIT_S = 300.0


def _config(node_roles: list[str]) -> Config:
    # While a thread works the clock may run 2.5x real time (0.05 s of the stall meter's timer per 0.02 s):
    # on a loaded machine a slow store write must not look like a peer that stalls a download.
    return Config(
        node=NodeSection(swarm=SWARM, roles=node_roles, memory_budget_mb=1536),
        sync=SyncSection(anchor_every=8, retain_versions=32, max_staleness=4, stall_timeout_s=30.0),
    )


async def _until(what: str, pred: Callable[[], bool]) -> None:
    with trio.move_on_after(WAIT_S):
        while not pred():
            await trio.sleep(0.1)
        return
    raise AssertionError(f"timed out waiting for {what} ({WAIT_S:.0f} virtual s)")


def _lin(s: NodeStatus, relation: str) -> LineageView | None:
    return next((x for x in s.lineages if x.relation == relation), None)


def test_two_nodes_start_announce_catch_up_apply_restart_a_worker_and_stop(tmp_path: Path) -> None:
    ida, idb = Identity.from_seed(b"\x31" * 32), Identity.from_seed(b"\x32" * 32)
    seen: dict[str, object] = {}

    async def main() -> None:
        net = MemNet()
        async with trio.open_nursery() as n:
            workers = FakeWorkers(n)
            spawned: list[float] = []

            async def spawn(spec: dict) -> FakeLink:
                spawned.append(trio.current_time())
                return await workers.spawn(spec)

            opts = RunOptions(tui=False)

            def node(name: str, ident: Identity, node_roles: list[str]) -> Node:
                return Node(
                    _config(node_roles), tmp_path / name, ident, opts, clock=trio.current_time, spawn_worker=spawn
                )

            stopped: dict[str, trio.Event] = {}

            async def run(name: str, node: Node, ident: Identity) -> None:
                stopped[name] = trio.Event()
                await node.run_on(partial(net.transport, ident))
                stopped[name].set()

            # start: the trainer comes up, its worker reports its lineage
            a = node("a", ida, ["trainer"])
            n.start_soon(run, "a", a, ida)
            await _until("trainer running", lambda: a.state == "running" and a.snapshot().worker == "training")
            wa = workers.links[0]
            own = _lin(a.snapshot(), "own")
            assert own is not None and own.lineage == wa.pub.lineage.id.hex() and own.held == 0
            assert [wa.publish(), wa.publish()] == [1, 2]
            await _until("trainer holds v2", lambda: _lin(a.snapshot(), "own").held == 2)

            # the signal path stops it (and its worker); started again on its home, it resumes at v2 with a
            # broadcast that no longer holds v1..v2: only the catalog can give them to a newcomer
            a._on_signal(signal.SIGTERM)
            with trio.fail_after(WAIT_S):
                await stopped["a"].wait()
            assert a.state == "stopping" and wa.done.is_set() and wa.exitcode == 0
            assert isinstance(wa.received[-1], pipe.Stop)
            a = node("a", ida, ["trainer"])
            n.start_soon(run, "a", a, ida)
            await _until("trainer running again", lambda: a.state == "running" and a.snapshot().worker == "training")
            wa = workers.links[1]
            assert _lin(a.snapshot(), "own").held == 2 and wa.pub.version == 2
            assert not a.bcast.transfers

            b = node("b", idb, ["follower"])
            n.start_soon(run, "b", b, idb)
            await _until("follower running", lambda: b.state == "running")
            await b.transport.connect(a.transport.listen_addrs()[0])
            # announces both ways: each node's status lists the other with its roles
            await _until(
                "announces heard",
                lambda: (
                    any(p.peer_id == ida.peer_id for p in b.snapshot().peers)
                    and any(p.peer_id == idb.peer_id for p in a.snapshot().peers)
                ),
            )
            assert next(p for p in b.snapshot().peers if p.peer_id == ida.peer_id).roles == ["trainer"]
            assert next(p for p in a.snapshot().peers if p.peer_id == idb.peer_id).roles == ["follower"]

            # catch-up: the follower serves the trainer's lineage, fetches v1..v2 through the catalog, applies them
            lid = wa.pub.lineage.id
            await _until("follower caught up", lambda: (f := _lin(b.snapshot(), "follow")) is not None and f.held == 2)
            assert b.snapshot().serving == lid.hex()
            wb = workers.links[2]
            assert wb.follower is not None and wb.follower.version == 2
            assert wb.follower.state_hash == wa.pub.state_hash  # bit for bit the trainer's v2
            stored = {(i.kind, i.base, i.target) for i in patchsync.held_store(b.home, lid).items()}
            assert stored & {("patch", 1, 2), ("anchor", 2, 2)}
            assert any(isinstance(m, pipe.Patch) for m in wb.received)  # the core told the worker what arrived
            assert b.core.stats()["bytes_down"] > 0
            # within the staleness bound: the follower's worker is admitted to generate, and the trainer hears
            # (in the follower's announce) that it serves its lineage
            await _until(
                "follower admitted",
                lambda: wb.admitted.get(lid.hex()) is True and _lin(b.snapshot(), "follow").admission == "fresh",
            )
            await _until(
                "trainer sees its follower",
                lambda: any(p.peer_id == idb.peer_id and p.serving == lid.hex() for p in a.snapshot().peers),
            )

            # a version published while connected arrives through the broadcast
            assert wa.publish() == 3
            await _until("follower applied v3", lambda: _lin(b.snapshot(), "follow").held == 3)
            assert wb.follower.state_hash == wa.pub.state_hash

            # the trainer's step reports the external rollouts it used per task set: its exchange view counts
            # them against the set, as coordinators read it
            ts = "ab" * 32
            wa._out(
                pipe.Step(
                    step=1,
                    version=3,
                    reward_mean=0.5,
                    loss=0.1,
                    n_external_groups=2,
                    step_s=1.0,
                    used=16,
                    used_by_set={ts: 16},
                )
            )
            await _until(
                "used per task set", lambda: a.snapshot().exchange.task_sets.get(ts, {}).get("used_rollouts") == 16
            )
            assert a.snapshot().rollouts_used == 16

            # the follower's worker dies: the node stays up, restarts it after its backoff, applies again
            before = b.snapshot()
            assert before.worker_restarts == 0 and before.worker_pid == wb.pid
            died = trio.current_time()
            wb.crash(-9)
            await _until("worker restarted", lambda: len(workers.links) == 4)
            assert spawned[-1] - died >= SV.RESTART_BACKOFF_S[0]  # waited out its backoff, in virtual time
            wb2 = workers.links[3]
            await _until("restarted worker following", lambda: wb2.follower is not None)
            s = b.snapshot()
            assert s.worker_restarts == 1 and s.worker_pid == wb2.pid != wb.pid
            assert wb.exitcode == -9
            assert wa.publish() == 4
            await _until(
                "follower applied v4", lambda: _lin(b.snapshot(), "follow").held == 4 and wb2.follower.version == 4
            )
            assert wb2.follower.state_hash == wa.pub.state_hash
            # ... and when the new one dies soon after, the next restart waits the next, longer backoff
            died = trio.current_time()
            wb2.crash(-9)
            await _until("worker restarted again", lambda: len(workers.links) == 5)
            assert spawned[-1] - died >= SV.RESTART_BACKOFF_S[1] > SV.RESTART_BACKOFF_S[0]
            wb2 = workers.links[4]
            await _until("worker following again", lambda: wb2.follower is not None and wb2.follower.version == 4)
            assert b.snapshot().worker_restarts == 2

            # shutdown: request_stop ends each node and stops its worker
            for name, nd, w in (("b", b, wb2), ("a", a, wa)):
                nd.request_stop()
                with trio.fail_after(WAIT_S):
                    await stopped[name].wait()
                assert nd.state == "stopping" and w.done.is_set() and w.exitcode == 0
                assert isinstance(w.received[-1], pipe.Stop)
            seen["worker_state"] = b.core.worker_state
            seen["end"] = trio.current_time()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=AUTOJUMP_S))
    assert seen["worker_state"] in (WorkerState.GENERATING, WorkerState.CATCHING_UP)


def test_a_signal_while_the_node_starts_stops_it_before_it_runs(tmp_path: Path) -> None:
    """SIGTERM that arrives while the worker is starting (before the node's tasks exist) still stops the
    node: it never starts its timers, and its worker is stopped."""
    ident = Identity.from_seed(b"\x33" * 32)
    seen: dict[str, object] = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            workers = FakeWorkers(n)

            async def spawn(spec: dict) -> FakeLink:
                link = await workers.spawn(spec)
                node._on_signal(signal.SIGTERM)  # what the signal handler runs, on the loop
                return link

            node = Node(
                _config(["follower"]),
                tmp_path / "n",
                ident,
                RunOptions(tui=False),
                clock=trio.current_time,
                spawn_worker=spawn,
            )
            with trio.fail_after(WAIT_S):
                await node.run_on(partial(MemNet().transport, ident))
            seen.update(
                state=node.state,
                done=workers.links[0].done.is_set(),
                announces=node.drops.counts.get("announce_unpublished", 0),
            )

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=AUTOJUMP_S))
    assert seen == {"state": "stopping", "done": True, "announces": 0}  # no announce was even tried


def _rollouts(lineages: tuple[bytes, ...]) -> pipe.Rollouts:
    """What a worker hands its network process to sign: one informative group (a right and a wrong answer)
    per lineage (one batch each; a node signs and publishes only groups a receiver can learn from)."""
    rs = [
        wire.Rollout(
            task=wire.TaskRef(b"\0" * 32, "arith", 1),
            lineage=lid,
            version=0,
            completion_ids=[1, 2],
            text="4",
            tokenizer_hash=b"\2" * 32,
            logprobs=bytes(8),
            token_versions=[],
            sampling=wire.SamplingParams(max_new_tokens=4),
            reward=reward,
            created_ms=5,
        )
        for lid in lineages
        for reward in (1.0, 0.0)
    ]
    return pipe.Rollouts([wire.encode(r) for r in rs])


def test_the_core_loop_carries_out_each_events_actions_as_one_sequence(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two sources at once, the worker pipe (rollouts to sign: two batches, each recorded and published)
    and the announce handler (new peers: a greeting with a store write each), every action giving every
    other task a turn: each event's actions are carried out in order, none of another event's between
    them, while the sources keep feeding."""
    # no rollout reaches this node's pipeline: building murmur-tiny's tokenizer for its check (a second of
    # CPU) would check nothing
    monkeypatch.setattr("murmur.training.tokencheck.for_model", lambda model: None)
    ident = Identity.from_seed(b"\x34" * 32)
    peers = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(6)]
    trace: list[tuple] = []  # ("event", ev, actions) | ("action", action), in the order they happened
    fed_while_busy = 0  # events a source queued while the loop was carrying out another event's actions
    busy = False
    seen: dict[str, object] = {}

    async def main() -> None:
        nonlocal fed_while_busy
        async with trio.open_nursery() as n:
            workers = FakeWorkers(n)
            node = Node(
                _config(["trainer"]),
                tmp_path / "n",
                ident,
                RunOptions(tui=False),
                clock=trio.current_time,
                spawn_worker=workers.spawn,
            )
            handle, carry_out, queue = node.core.handle, node._carry_out, node.feed

            def recorded_handle(ev: C.Event, now: float, wall_ms: int) -> list[C.Action]:
                acts = handle(ev, now, wall_ms)
                trace.append(("event", ev, acts))
                return acts

            async def slow_carry_out(a: C.Action) -> C.Event | None:
                nonlocal busy
                busy = True
                await (
                    trio.lowlevel.checkpoint()
                )  # a turn for every other task: a second caller of the core would get in
                trace.append(("action", a))
                try:
                    return await carry_out(a)
                finally:
                    busy = False

            node.core.handle, node._carry_out = recorded_handle, slow_carry_out  # type: ignore[method-assign]

            async def feed(ev: C.Event) -> None:
                nonlocal fed_while_busy
                fed_while_busy += busy
                await queue(ev)

            node.feed = feed  # type: ignore[method-assign]
            n.start_soon(node.run_on, partial(MemNet().transport, ident))
            await _until("node running", lambda: node.state == "running" and bool(workers.links))
            w = workers.links[0]
            lineages = (b"\1" * 32, b"\2" * 32)

            async def worker_source() -> None:
                for _ in range(6):
                    w._out(_rollouts(lineages))
                    await trio.lowlevel.checkpoint()

            async def gossip_source() -> None:
                for p in peers:
                    body = wire.NodeAnnounce(
                        v=1,
                        peer_id=p.peer_id,
                        seq=1,
                        created_ms=1,
                        hardware="cpu",
                        gen_tokens_per_s=0.0,
                        rollout_latency_s=0.5,
                        upload_bytes_per_s=0.0,
                        memory_bytes=0,
                        roles=["follower"],
                        lineages_followed=[],
                        serving=b"",
                        owned=[],
                    )
                    await node._on_node_announce(p.peer_id, body, wire.seal(p, wire.NODE_ANNOUNCE, body, swarm=SWARM))

            start = len(trace)
            async with trio.open_nursery() as sources:
                sources.start_soon(worker_source)
                sources.start_soon(gossip_source)

            def handled(cls: type) -> int:
                return sum(e[0] == "event" and isinstance(e[1], cls) for e in trace[start:])

            await _until(
                "both sources handled", lambda: handled(C.FromWorker) >= 6 and handled(C.AnnounceHeard) == len(peers)
            )
            seen["peers"] = {p.peer_id for p in peers} <= set(node.core.peers)
            node.request_stop()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=AUTOJUMP_S))
    assert seen["peers"] and fed_while_busy > 0  # the sources fed the loop while it was carrying out actions
    i, sequences = 0, 0
    while i < len(trace):
        kind, *rest = trace[i]
        assert kind == "event", f"entry {i}: an action outside its event's sequence: {rest}"
        acts = rest[1]
        done = [e[1] for e in trace[i + 1 : i + 1 + len(acts)]]
        if i + 1 + len(acts) <= len(trace):  # the last event may have been cut short by the stop
            assert all(e[0] == "action" for e in trace[i + 1 : i + 1 + len(acts)]), f"event {i} interleaved"
            assert all(a is b for a, b in zip(done, acts, strict=True)), f"event {i}: actions out of order"
        sequences += len(acts) > 1
        i += 1 + len(acts)
    greeted = [e for e in trace if e[0] == "event" and isinstance(e[1], C.AnnounceHeard)]
    assert sequences >= 12 and all(any(isinstance(a, C.SeePeer) for a in e[2]) for e in greeted)


def test_a_recorded_trace_gives_the_same_actions_from_the_runtime_and_the_simulators_driver(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The runtime's core loop and the simulator's driver (`simulations.vruntime.CoreDriver.feed`) order a
    core's events alike: the runtime runs two sources at once (worker rollouts to sign, peers' announces)
    with every event, its time and each action's follow-up recorded; a copy of the core taken when the
    recording starts is then driven by the simulator's loop with the same events at the same times, each
    action answered with the follow-up the runtime got for it, and gives the same action sequence."""
    import copy
    from types import SimpleNamespace

    from murmur.simulations.vruntime import CoreDriver

    monkeypatch.setattr("murmur.training.tokencheck.for_model", lambda model: None)
    ident = Identity.from_seed(b"\x35" * 32)
    peers = [Identity.from_seed(bytes([0x50 + i]) * 32) for i in range(4)]
    rec: dict[str, object] = {"on": False, "core": None}
    handled: list[tuple[C.Event, float, int, list[C.Action]]] = []
    follow_ups: list[C.Event | None] = []  # what carrying out each action gave back, in order

    async def main() -> None:
        async with trio.open_nursery() as n:
            workers = FakeWorkers(n)
            node = Node(
                _config(["trainer"]),
                tmp_path / "n",
                ident,
                RunOptions(tui=False),
                clock=trio.current_time,
                spawn_worker=workers.spawn,
            )
            handle, carry_out = node.core.handle, node._carry_out

            def recorded_handle(ev: C.Event, now: float, wall_ms: int) -> list[C.Action]:
                if rec["on"] and rec["core"] is None:
                    rec["core"] = copy.deepcopy(node.core)
                acts = handle(ev, now, wall_ms)
                if rec["core"] is not None:
                    handled.append((ev, now, wall_ms, list(acts)))
                return acts

            async def recorded_carry_out(a: C.Action) -> C.Event | None:
                got = await carry_out(a)
                if rec["core"] is not None:
                    follow_ups.append(got)
                return got

            node.core.handle, node._carry_out = recorded_handle, recorded_carry_out  # type: ignore[method-assign]
            net, ready, done = MemNet(), trio.Event(), trio.Event()
            n.start_soon(node.run_on, partial(net.transport, ident))
            await _until("node running", lambda: node.state == "running" and bool(workers.links))
            w = workers.links[0]

            async def subscriber() -> None:  # a peer on our shard: a publish goes out and its follow-up comes back
                async with net.transport(peers[-1]) as t:
                    await t.subscribe(topics.rollouts(SWARM, exchange.shard_of(node.core.own or b"", 1)))
                    await t.connect(node.transport.listen_addrs()[0])
                    ready.set()
                    await done.wait()

            n.start_soon(subscriber)
            await ready.wait()
            rec["on"] = True

            async def worker_source() -> None:
                for _ in range(4):
                    w._out(_rollouts((node.core.own or b"", b"\2" * 32)))
                    await trio.lowlevel.checkpoint()

            async def gossip_source() -> None:
                for k, p in enumerate(peers):
                    # the first a validator of our lineage: its sample is demand, so our rollouts are published
                    # (a publish that went out comes back to the core as a follow-up event)
                    body = wire.NodeAnnounce(
                        v=1,
                        peer_id=p.peer_id,
                        seq=1,
                        created_ms=1,
                        hardware="cpu",
                        gen_tokens_per_s=0.0,
                        rollout_latency_s=0.5,
                        upload_bytes_per_s=0.0,
                        memory_bytes=0,
                        roles=["follower", "validator"] if k == 0 else ["follower"],
                        lineages_followed=[],
                        serving=node.core.own or b"" if k == 0 else b"",
                        owned=[],
                    )
                    await node._on_node_announce(p.peer_id, body, wire.seal(p, wire.NODE_ANNOUNCE, body, swarm=SWARM))

            async with trio.open_nursery() as sources:
                sources.start_soon(worker_source)
                sources.start_soon(gossip_source)
            await _until(
                "both sources handled",
                lambda: (
                    sum(isinstance(h[0], C.FromWorker) for h in handled) >= 4
                    and sum(isinstance(h[0], C.AnnounceHeard) for h in handled) == len(peers)
                ),
            )
            await trio.sleep(1.0)  # a tick or two more, in virtual time
            rec["on"] = False
            node.request_stop()
            done.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=AUTOJUMP_S))
    actions = sum(len(h[3]) for h in handled)
    # the stop may cut the last event's actions short: compare what the runtime carried out in full
    while actions > len(follow_ups):
        actions -= len(handled.pop()[3])
    made_by_follow_up = {id(f) for f in follow_ups if f is not None}
    sources = [h for h in handled if id(h[0]) not in made_by_follow_up]
    assert len(sources) >= 8 and len(made_by_follow_up) >= 4  # both sources, and publishes answered
    times = iter([(h[1], h[2]) for h in handled])
    answers = iter(follow_ups)
    replayed: list[tuple[C.Event, list[C.Action]]] = []
    core = rec["core"]
    assert isinstance(core, C.NodeCore)
    clock = SimpleNamespace(now=(0.0, 0))

    def sim_handle(ev: C.Event, now: float, wall_ms: int) -> list[C.Action]:
        clock.now = next(times)
        acts = handle_copy(ev, *clock.now)
        replayed.append((ev, list(acts)))
        return acts

    handle_copy = partial(C.NodeCore.handle, core)  # the copy's own (the recording wrapper was copied with it)
    core.handle = sim_handle  # type: ignore[method-assign]
    driver = SimpleNamespace(
        queue=SimpleNamespace(unix=lambda: clock.now[0], unix_ms=lambda: clock.now[1]), do=lambda n, a: next(answers)
    )
    vnode = SimpleNamespace(core=core)
    for ev, *_ in sources:
        CoreDriver.feed(driver, vnode, ev)  # type: ignore[arg-type]
    assert [type(e).__name__ for e, _ in replayed] == [type(h[0]).__name__ for h in handled]
    assert all(e is h[0] or e == h[0] for (e, _), h in zip(replayed, handled, strict=True))
    assert [a for _, acts in replayed for a in acts] == [a for h in handled for a in h[3]]
