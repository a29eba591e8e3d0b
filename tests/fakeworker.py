"""A worker for `node.shell.runtime.Node` that runs as a trio task instead of a torch process.

It replaces only the process behind `node.shell.workerlink.Link`: the runtime's messages reach it as
`node.pipe`-encoded bytes and its replies go back as pipe bytes through `pipe.decode`, so the runtime
and its core handle them exactly as a real worker's. What it does with them is real where the node
depends on it: a trainer keeps a real `sync.versions.LineagePublisher` in the node home (a tiny bf16
state instead of a model) and publishes a version when the test says so; a follower applies what the
node stored with a real `LineageFollower` along `sync.catchup.local_plan`, as `node.worker.main` does.
A crash (`crash`) ends the task and closes the pipe, as a killed process would.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import torch
import trio

from murmur.gossip.errors import DecodeError
from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.pipe import WorkerState
from murmur.sync import chunks as chunking
from murmur.sync.catchup import local_plan
from murmur.sync.errors import PatchError
from murmur.sync.hashing import state_hash
from murmur.sync.patchstore import open_manifest
from murmur.sync.versions import Lineage, LineageFollower, LineagePublisher

_pids = itertools.count(70001)
QUEUE = 1024


def base_state() -> dict[str, torch.Tensor]:
    """The 'model' every fake worker starts from (so a follower's base is its trainer's)."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": (torch.randn(32, 16, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.zeros(16, dtype=torch.bfloat16),
    }


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class FakeWorkers:
    """`spawn` is the `spawn_worker` a test gives `Node`; every worker it started is in `links`.
    `checkpoints` stands for a follower worker's checkpoint files: a restarted worker resumes from it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.links: list[FakeLink] = []
        self.checkpoints: dict[bytes, tuple[dict[str, torch.Tensor], int, bytes]] = {}

    async def spawn(self, spec: dict[str, Any]) -> FakeLink:
        link = FakeLink(spec, self)
        self.links.append(link)
        self.nursery.start_soon(link.main)
        await trio.lowlevel.checkpoint()
        return link


class FakeLink:
    def __init__(self, spec: dict[str, Any], workers: FakeWorkers) -> None:
        self.spec = spec
        self.workers = workers
        self.home = Path(spec["home"])
        self.dropped = 0
        self._pid = next(_pids)
        self._exit: int | None = None
        self._to_send, self._to_recv = trio.open_memory_channel[bytes](QUEUE)
        self._from_send, self._from_recv = trio.open_memory_channel[bytes](QUEUE)
        self._scope = trio.CancelScope()
        self.done = trio.Event()
        self.received: list[pipe.Message] = []  # every message the runtime sent, decoded, in order
        self.pub: LineagePublisher | None = None
        self.follower: LineageFollower | None = None
        self.admitted: dict[str, bool] = {}

    # ------------------------------------------------------------ node.shell.workerlink.Link
    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._exit

    def send(self, msg: pipe.ToWorker) -> None:
        try:
            self._to_send.send_nowait(pipe.encode_struct(msg))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped += 1

    async def receive(self) -> pipe.FromWorker | None | bool:
        with trio.move_on_after(0.5):
            try:
                return pipe.decode(await self._from_recv.receive())  # type: ignore[return-value]
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return False
        return None

    async def stop(self, grace: float) -> None:
        self.send(pipe.Stop())
        with trio.move_on_after(grace):
            await self.done.wait()
        if not self.done.is_set():
            self.crash(-15)

    # ------------------------------------------------------------ test controls
    def crash(self, code: int = -9) -> None:
        """The process dies (an out-of-memory kill): no message more, the pipe closes."""
        if self._exit is None:
            self._exit = code
        self._scope.cancel()
        self._from_send.close()

    def publish(self) -> int:
        """A trainer's optimizer step that changed some weights, published as the next version."""
        assert self.pub is not None
        nxt = {n: t.clone() for n, t in self.pub.base.items()}
        nxt["w"][self.pub.version % nxt["w"].shape[0]] += 0.25
        bundle = self.pub.publish(nxt)
        self._out(pipe.Published(self.pub.version, bundle.envelope, bundle.manifest.total_bytes))
        return self.pub.version

    def _out(self, msg: msgspec.Struct) -> None:
        self._from_send.send_nowait(pipe.encode_struct(msg))

    # ------------------------------------------------------------ the worker
    async def main(self) -> None:
        from murmur.node.store import open_store

        db = open_store(self.home)
        try:
            with self._scope:
                self._out(pipe.State(WorkerState.LOADING))
                base = base_state()
                if "trainer" in self.spec["roles"]:
                    self._start_trainer(db, base)
                else:
                    self._out(pipe.Ready(base=state_hash(base).hex(), version=0, model_bytes=_bytes(base)))
                    self._out(pipe.State(WorkerState.STANDBY))
                async for data in self._to_recv:
                    try:
                        m = pipe.decode(data)
                    except DecodeError:
                        continue
                    self.received.append(m)
                    if isinstance(m, pipe.Stop):
                        break
                    self._on(m, db, base)
                if self._exit is None:
                    self._exit = 0
        finally:
            db.close()
            self._from_send.close()
            self.done.set()

    def _start_trainer(self, db: Any, base: dict[str, torch.Tensor]) -> None:
        s = self.spec
        ident = Identity.from_seed(bytes.fromhex(s["identity_seed"]))
        kw = dict(
            swarm=s["swarm"],
            anchor_every=s["anchor_every"],
            chunk_bytes=s["chunk_bytes"],
            retain_versions=s["retain_versions"],
            db=db,
        )
        own = db.get("own_lineage")
        self.pub = (
            LineagePublisher.resume(ident, self.home, bytes.fromhex(own), **kw)
            if own
            else LineagePublisher(ident, s["lineage_name"], base, self.home, **kw)
        )
        db.put("own_lineage", self.pub.lineage.id.hex())
        lin = self.pub.lineage
        self._out(
            pipe.Ready(
                base=lin.base_model_hash.hex(),
                version=self.pub.version,
                model_bytes=_bytes(base),
                lineage=lin.id.hex(),
                name=lin.name,
            )
        )
        self._out(pipe.State(WorkerState.TRAINING))

    def _on(self, m: pipe.Message, db: Any, base: dict[str, torch.Tensor]) -> None:
        if isinstance(m, pipe.Follow):
            self._follow(m.info, db, base)
        elif isinstance(m, pipe.Admit):
            self.admitted[m.lineage] = m.generate
        if self.follower is not None:
            self._apply_held()
            lid = self.follower.lineage.id.hex()
            self._out(pipe.State(WorkerState.GENERATING if self.admitted.get(lid) else WorkerState.CATCHING_UP))

    def _follow(self, info: pipe.FollowInfo | None, db: Any, base: dict[str, torch.Tensor]) -> None:
        self.follower = None
        if info is None:
            self._out(pipe.State(WorkerState.STANDBY))
            return
        lin = Lineage(bytes.fromhex(info.publisher), bytes.fromhex(info.base), info.name)
        state, version, h = self.workers.checkpoints.get(lin.id, (base, 0, None))
        self.follower = LineageFollower(
            lin,
            {n: t.clone() for n, t in state.items()},
            version,
            expected_hash=h,
            home=self.home,
            db=db,
            keep_patches=False,
            swarm=self.spec["swarm"],
        )
        self._out(pipe.Applied(lin.id.hex(), self.follower.version))

    def _apply_held(self) -> None:
        f = self.follower
        assert f is not None and f.store is not None
        while (plan := local_plan(f.version, f.store.items())) is not None:
            step = plan.steps[0]
            try:
                env, payload = (
                    f.store.read_anchor(step.target)
                    if step.kind == "anchor"
                    else f.store.read_patch(step.base, step.target)
                )
                f.apply(env, chunking.split(payload, open_manifest(env, swarm=f.swarm).chunk_bytes))
            except PatchError as e:
                self._out(pipe.ApplyFailed(f.lineage.id.hex(), step.base, step.target, str(e)))
                return
            self.workers.checkpoints[f.lineage.id] = (
                {n: t.clone() for n, t in f.live.items()},
                f.version,
                f.state_hash,
            )
            self._out(pipe.Applied(f.lineage.id.hex(), f.version))
