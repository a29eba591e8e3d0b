"""Pods by default through the trio runtime, in virtual time (the harness of tests/test_runtime_virtual.py):
a node with no configured roles starts training, hears a publishing trainer short of rollouts, and its
runtime restarts its worker as a follower of that lineage, keeping its home and its own lineage's history."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.core.roles import PodRule
from murmur.node.pipe import WorkerState
from murmur.node.shell.runtime import Node, RunOptions
from tests.fakeworker import FakeLink, FakeWorkers
from tests.memnet import MemNet
from tests.test_runtime_virtual import AUTOJUMP_S, _config, _lin, _until


@pytest.mark.slow
@pytest.mark.onecore  # one process, in virtual time, about 6 s of wall clock (autojumps): no live-swarm slot
def test_a_node_with_default_roles_becomes_a_follower_of_a_short_lineage(tmp_path: Path) -> None:
    ida, idb = Identity.from_seed(b"\x41" * 32), Identity.from_seed(b"\x42" * 32)
    seen: dict[str, object] = {}

    async def main() -> None:
        net = MemNet()
        async with trio.open_nursery() as n:
            workers = FakeWorkers(n)
            specs: list[dict] = []

            async def spawn(spec: dict) -> FakeLink:
                specs.append(spec)
                return await workers.spawn(spec)

            def node(name: str, ident: Identity, node_roles: list[str]) -> Node:
                return Node(
                    _config(node_roles),
                    tmp_path / name,
                    ident,
                    RunOptions(tui=False),
                    clock=trio.current_time,
                    spawn_worker=spawn,
                )

            a, b = node("a", ida, ["trainer"]), node("b", idb, [])
            # a short first look (the default is a minute) keeps the virtual run, and so the test, short
            b.core.pods = PodRule("trainer", trio.current_time(), observe_s=6.0)
            n.start_soon(partial(a.run_on, partial(net.transport, ida)))
            await _until("trainer running", lambda: a.state == "running" and a.snapshot().worker == "training")
            n.start_soon(partial(b.run_on, partial(net.transport, idb)))
            await _until("b trains", lambda: b.state == "running" and b.snapshot().worker == "training")
            s = b.snapshot()
            assert s.roles == ["trainer"] and s.roles_chosen and "first choice in" in s.roles_reason
            own_b = _lin(s, "own").lineage
            await b.transport.connect(a.transport.listen_addrs()[0])
            wa = workers.links[0]

            wb = workers.links[1]

            async def publish() -> None:  # a trainer that publishes a version every 2 s, with no follower
                while True:
                    wa.publish()
                    if not wb.done.is_set():  # b's trainer worker reports its state each step, as a real one does
                        wb._out(pipe.State(WorkerState.TRAINING))
                    await trio.sleep(2.0)

            n.start_soon(publish)
            await _until("b switched", lambda: b.snapshot().role_switches == 1)
            s = b.snapshot()
            assert s.roles == ["follower"] and "short" in s.roles_reason and s.worker_restarts == 0
            await _until(
                "b's new worker follows a", lambda: len(workers.links) == 3 and workers.links[2].follower is not None
            )
            assert specs[1]["roles"] == ["trainer"] and specs[2]["roles"] == ["follower"]
            assert wb.done.is_set()  # the trainer worker was stopped, not left running
            await _until(
                "b applies a's versions", lambda: (f := _lin(b.snapshot(), "follow")) is not None and f.held >= 1
            )
            assert b.snapshot().serving == wa.pub.lineage.id.hex()
            own = _lin(b.snapshot(), "own")
            assert own is not None and own.lineage == own_b  # its own lineage stays in its store
            assert b.store.get("own_lineage") == own_b
            # the old worker's exit was the planned restart: nothing restarted the new one
            assert len(workers.links) == 3 and b.snapshot().worker_restarts == 0
            seen["ok"] = True
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=AUTOJUMP_S))
    assert seen.get("ok")
