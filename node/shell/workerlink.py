"""The worker process as the network process sees it: its spec, its pipe, and sends that never block.

The worker (`node.worker.main`) runs torch in a spawned process. Messages to it go
through a bounded queue drained by a thread; when the worker is dead or the
queue is full a message is dropped and counted (`dropped`), so the network
event loop never waits on it. The node core decides when a dead worker is
restarted (`node.core.machine.RestartWorker`, with backoff) and re-sends what the new
worker needs (what to follow, whether it may generate).

The runtime sees a worker only as a `Link` (send, receive, stop, exit code, pid): `spawn` starts the real
process; a test may hand the runtime another `Link` that speaks the same `node.pipe` messages.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec
import trio

from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.config import Config
from murmur.training.foreign import FOREIGN_KEYS
from murmur.training.spotcheck import SPOT_RATE

if TYPE_CHECKING:
    from murmur.node.shell.runtime import RunOptions

WORKER_QUEUE = 1024


def worker_spec(cfg: Config, home: Path, ident: Identity, node_roles: list[str], opts: RunOptions) -> dict[str, Any]:
    t = cfg.training
    return {
        "home": str(home),
        "swarm": cfg.node.swarm,
        "roles": node_roles,
        "model": t.model,
        "engine": t.engine,
        "model_home": opts.model_home or str(home),
        "device": t.device,
        "model_seed": 0,
        "seed": t.seed,
        "threads": t.threads,
        "memory_budget_mb": cfg.node.memory_budget_mb,
        "identity_seed": ident.seed.hex(),
        "lineage_name": f"{cfg.node.swarm}-{ident.peer_id[-8:]}",
        "anchor_every": cfg.sync.anchor_every,
        "chunk_bytes": cfg.sync.chunk_bytes,
        "retain_versions": cfg.sync.retain_versions,
        "publish_every": cfg.sync.publish_every,
        "spot_rate": SPOT_RATE,
        # the trainer's sampler (training/sampler.py): groups of ~group_size verified rollouts
        "sampler_max_rollouts": max(64, min(cfg.gossip.pool_max_rollouts, cfg.node.memory_budget_mb * 8)),
        "sampler_max_groups": max(
            16, min(cfg.gossip.pool_max_rollouts, cfg.node.memory_budget_mb * 8) // max(1, t.group_size)
        ),
        "task_sets": msgspec.to_builtins(t.task_sets),
        "trusted": list(cfg.trust.coordinators),
        "schedule_share": t.schedule_share,
        "follower_oversample": t.follower_oversample,
        "trainer": {
            "local_groups": t.local_rollouts,
            "external_groups": t.external_rollouts,
            "group_size": t.group_size,
            "lr": t.lr,
            "max_new_tokens": t.max_new_tokens,
            "temperature": t.temperature,
            "seed": t.seed,
            "max_staleness": cfg.sync.max_staleness,
            "loss_norm": t.loss_norm,
            "minibatch_groups": t.minibatch_groups,
            "select_groups": t.select_groups,
            "pod_yield": t.pod_yield,
            "memory_budget_mb": cfg.node.memory_budget_mb,
            **{k: getattr(t, k) for k in FOREIGN_KEYS},
        },
    }


class Link(Protocol):
    """A worker as the runtime drives it."""

    dropped: int  # messages to the worker dropped (dead worker, full queue)

    @property
    def pid(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    def send(self, msg: pipe.ToWorker) -> None: ...
    async def receive(self) -> pipe.FromWorker | None | Literal[False]: ...
    async def stop(self, grace: float) -> None: ...


async def spawn(spec: dict[str, Any]) -> Link:
    """Start the worker process for `spec` (`worker_spec`)."""
    return await trio.to_thread.run_sync(WorkerLink, spec)


class WorkerLink:
    """The worker process and its pipe; sends go through a bounded queue drained by a thread and never block."""

    def __init__(self, spec: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        from multiprocessing import spawn as mp_spawn

        from murmur.node.worker import boot as workerboot
        from murmur.node.worker import main as worker

        python = worker.worker_python(spec)  # MurmurError at start when the engine asked for cannot run
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=workerboot.main, args=(child, spec), name="murmur-worker", daemon=True)
        before = mp_spawn.get_executable()
        ctx.set_executable(python)  # the vLLM environment's interpreter when engine = "vllm"
        try:
            self.proc.start()
        finally:
            ctx.set_executable(before)
        child.close()
        self.out: queue.Queue[bytes] = queue.Queue(WORKER_QUEUE)
        self.dropped = 0
        self.closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="murmur-worker-send", daemon=True)
        self._sender.start()

    def send(self, msg: pipe.ToWorker) -> None:
        """Queue a message; when the worker is dead or the queue is full it is dropped (and counted)."""
        if self.closed.is_set():
            self.dropped += 1
            return
        try:
            self.out.put_nowait(pipe.encode_struct(msg))
        except queue.Full:
            self.dropped += 1

    def _send_loop(self) -> None:
        while not self.closed.is_set():
            try:
                msg = self.out.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.conn.send_bytes(msg)
            except (OSError, BrokenPipeError, ValueError):
                self.closed.set()
                return

    @property
    def pid(self) -> int:
        return self.proc.pid or 0

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    async def receive(self) -> pipe.FromWorker | None | Literal[False]:
        """`recv` off the event loop."""
        return await trio.to_thread.run_sync(self.recv, 0.5, abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stubs predate abandon_on_cancel=

    def recv(self, timeout: float = 0.5) -> pipe.FromWorker | None | Literal[False]:
        """A message from the worker; None when there was none in time; False when the worker is gone."""
        try:
            if self.conn.poll(timeout):
                return pipe.decode(self.conn.recv_bytes(pipe.MAX_MESSAGE))  # type: ignore[return-value]  # the worker sends only FromWorker kinds
        except (EOFError, OSError):
            self.closed.set()
            self.proc.join(timeout)  # the pipe closes a moment before the process is reaped: its exit code
            return False
        if not self.proc.is_alive():
            self.closed.set()
            return False
        return None

    async def stop(self, grace: float) -> None:
        """Tell the worker to stop (it writes its checkpoint); terminate it after `grace` s."""
        await trio.to_thread.run_sync(self.close, grace)

    def close(self, grace: float) -> None:
        try:
            self.conn.send_bytes(pipe.encode_struct(pipe.Stop()))
        except (OSError, BrokenPipeError, ValueError):
            pass
        self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(1.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.closed.set()
        self.conn.close()
