"""The network process of a node: the trio shell around `node.core.machine.NodeCore`.

Every decision is made by the sans-IO core (docs/architecture.md); this
module turns I/O into core events (gossip messages, worker messages, timer
ticks, finished transfers, catalog replies) and carries out the actions the
core returns. The core has one consumer, the core loop: every source puts its
events on one channel (`feed`), and the loop hands them to the core one at a
time, with one reading of the clocks, and carries out each event's actions in
order before the next event; an action's follow-up event (a publish that went
out, stored items loaded, a patch stored) is handled next. It never runs
torch: training and generation run in a spawned worker process
(`node.shell.workerlink`), restarted with backoff when it dies.
Blocking work (SQLite, file reads, pipe I/O) goes to `trio.to_thread`.

Shutdown (SIGINT/SIGTERM or `Node.request_stop`): the worker is told to stop
(it writes its follower checkpoint), the tasks are cancelled, and a watchdog
guarantees the process is gone within 5 s. Everything accepted is already
durable (SQLite transactions, atomic files) before it is acknowledged, so
kill -9 at any moment loses nothing accepted.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, assert_never

import trio

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.exchange import Sample
from murmur.gossip.identity import Identity
from murmur.gossip.transport import FrameError
from murmur.node import pipe
from murmur.node.config import Config
from murmur.node.core import machine as C
from murmur.node.core import roles
from murmur.node.logs import event
from murmur.node.shell import control, hardware, lifecycle, stall, views
from murmur.node.shell import patches as patchsync
from murmur.node.shell.stall import StallMeter
from murmur.node.shell.tasksync import TaskSetGossip
from murmur.node.shell.workerlink import Link, spawn, worker_spec
from murmur.node.status import DiskMeter, Drops, NodeStatus
from murmur.sync.ids import Relation
from murmur.sync.items import item_of
from murmur.sync.patchstore import LineageStore

log = logging.getLogger("murmur.node")

STOP_GRACE_S = 2.5
EXIT_DEADLINE_S = 4.0
CATALOG_TIMEOUT_S = 30.0
TASK_SET_CHECK_S = 10.0  # between checks of the store for our own new task sets
PARTIAL_SWEEP_S = 30.0  # between sweeps of finished partial downloads
STREAM_FAULT_PENALTY = 20.0  # bytes that break a stream protocol: three such faults graylist the sender
PARTIAL_KEEP_S = 600.0  # an unfinished download's chunks are kept this long for a restart to resume from
# Events waiting for the core loop. A source that finds the queue full waits (the gossip service's drain
# task, and so the transport's counted inboxes behind it, or the worker pipe), so a flood costs the queues
# that already count their drops, never this node's memory.
EVENT_QUEUE = 256


@dataclass
class RunOptions:
    tui: bool = True
    listen: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    model_home: str = ""  # where murmur-tiny is built/cached (default: the node home)


class Node:
    def __init__(
        self,
        cfg: Config,
        home: Path,
        ident: Identity,
        opts: RunOptions,
        *,
        clock: Callable[[], float] = time.monotonic,
        spawn_worker: Callable[[dict[str, Any]], Awaitable[Link]] = spawn,
    ) -> None:
        """`clock` is the runtime's one monotonic clock (seconds): the core loop reads it once per event and
        gives the core that `now`; the shell's loops and the status read it; trio sleeps until the core's
        deadlines. A test under trio's MockClock passes `trio.current_time` (and builds the node inside
        `trio.run`). `spawn_worker` starts the worker."""
        from murmur.node.store import open_store

        self.cfg = cfg
        self.home = Path(home)
        self.ident = ident
        self.opts = opts
        self.store = open_store(self.home, cfg.disk.ledger_budget(), cfg.disk.peer_budget())
        self.hw = hardware.detect()
        self.hw_class = hardware.hardware_class(cfg.node.hardware, self.hw)
        self.roles, self.roles_reason = roles.choose_roles(
            cfg.node.roles, self.hw_class, cfg.node.memory_budget_mb, hardware.available_memory()
        )
        self.core = C.NodeCore(C.CoreSettings.from_config(cfg, self.roles, self.hw_class), ident, clock())
        # The core has one consumer (`_core_loop`): every source puts its events on this channel (`feed`).
        self._events, self._events_out = trio.open_memory_channel[C.Event](EVENT_QUEUE)
        # Events the loop handles before the channel's next one: the store's lineages at start, then each
        # action's follow-up event (`_carry_out`), so they never wait behind a full channel the loop drains.
        self._next: deque[C.Event] = deque()
        own = self.store.get("own_lineage")
        for row in self.store.lineages():
            lid = bytes(row["lineage_id"])
            self._next.append(
                C.LineageKnown(
                    lid,
                    row["name"],
                    Relation.OWN if own and lid.hex() == own else Relation(row["relation"]),
                    bytes(row["publisher"]),
                    bytes(row["base_model_hash"]),
                    self.store.head_version(lid) or 0,
                )
            )
        self.clock = clock
        self._spawn_worker = spawn_worker
        self.started = clock()
        self.state = "starting"
        self.ledger: dict[str, int] = {}
        self.worker: Link | None = None
        self.transport: Any = None
        self.service: Any = None
        self.bcast: Any = None  # sync.broadcast.BroadcastNode
        self.reach: Any = None
        self.metrics: Any = None
        self._nursery: trio.Nursery | None = None
        self._cancel: trio.CancelScope | None = None
        self._stop_requested = False
        self._resend_task_sets = False
        self.verifiers: Any = None  # training.verifiers.VerifierPool, from run()
        self.drops, self.disk = Drops(), DiskMeter(home, cfg, peer_bytes=lambda: self.store.peer_bytes)
        self.stall = StallMeter()
        self.gc_timer = stall.GcTimer()

    @property
    def nursery(self) -> trio.Nursery:
        """The running node's nursery (actions that start tasks come only while the node runs)."""
        if self._nursery is None:
            raise RuntimeError("the node is not running")
        return self._nursery

    # ------------------------------------------------------------ status
    def snapshot(self) -> NodeStatus:
        return views.node_status(self, trio.current_time() if self._nursery is not None else None)

    # ------------------------------------------------------------ main
    async def run(self) -> None:
        """The node process: signals and the exit watchdog, metrics, the libp2p transport, then `run_on` with
        discovery, reachability and the control socket as its network services."""
        from murmur.gossip.host import open_transport

        cfg = self.cfg
        watchdog_armed = threading.Event()
        old_handlers = lifecycle.install_signals(watchdog_armed, self._on_signal, EXIT_DEADLINE_S)
        listen = self.opts.listen or cfg.network.listen
        if cfg.metrics.port:
            from murmur.node.ui.metrics import Metrics

            self.metrics = Metrics()
            try:
                self.metrics.serve(cfg.metrics.port)
            except OSError as e:
                log.warning("metrics port %s unavailable: %s", cfg.metrics.port, e)
                self.metrics = None

        def stopping() -> None:
            if not watchdog_armed.is_set():
                lifecycle.arm_watchdog(EXIT_DEADLINE_S)

        try:
            await self.run_on(partial(open_transport, self.ident, listen), self._network_services, stopping)
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)

    async def run_on(
        self,
        transport: Callable[[], AbstractAsyncContextManager[Any]],
        services: Callable[[Any, trio.Nursery], Awaitable[None]] | None = None,
        on_stopping: Callable[[], None] = lambda: None,
    ) -> None:
        """Run the node on the transport that `transport()` opens until `request_stop`: the worker, the
        handlers (`attach`), the gossip service, the broadcast, `services(t, nursery)` (what only a
        networked process has: discovery, reachability, the control socket), the core's timers and the
        worker link. `run` calls it with libp2p; tests call it with an in-memory transport under trio's
        MockClock (docs/testing.md). On the way out the worker is stopped and the store closed."""
        event(log, "starting", peer_id=self.ident.peer_id, roles=self.roles, why=self.roles_reason)
        try:
            await self._start_worker()  # it loads its model while the transport starts
            if self._stop_requested:  # a signal while the worker started: nothing else is opened
                return
            async with transport() as t:
                await self.attach(t)
                async with trio.open_nursery() as nursery:
                    self._cancel = nursery.cancel_scope
                    if self._stop_requested:
                        nursery.cancel_scope.cancel()
                    self._nursery = nursery
                    await nursery.start(self.service.run)
                    await nursery.start(self.bcast.run)
                    if services is not None:
                        await services(t, nursery)
                    self.state = "running"
                    await trio.to_thread.run_sync(self.store.put, "listen", t.listen_addrs())
                    event(
                        log, "listening", addrs=t.listen_addrs(), metrics_port=self.metrics.port if self.metrics else 0
                    )
                    nursery.start_soon(stall.watch_loop, self.stall, self.gc_timer)
                    for loop in (self._core_loop, self._worker_loop, self._slow_loop, self._view_loop):
                        nursery.start_soon(loop)
        finally:
            self.state = "stopping"
            on_stopping()
            if self.worker is not None:
                with trio.CancelScope(shield=True):
                    await self.worker.stop(STOP_GRACE_S)
            if self.metrics is not None:
                self.metrics.close()
            if self.verifiers is not None:
                self.verifiers.close()
            self.store.close()
            event(log, "stopped", peer_id=self.ident.peer_id)

    async def _network_services(self, t: Any, nursery: trio.Nursery) -> None:
        from murmur.gossip.discovery import Discovery
        from murmur.node.shell.reachability import (
            start_reachability,  # relay, hole punching, dial-back (docs/reachability.md)
        )

        cfg = self.cfg
        bootstrap = list(dict.fromkeys(self.opts.bootstrap + cfg.network.bootstrap))
        disc = Discovery(t, bootstrap, self.store, dht=cfg.network.dht and bool(bootstrap))
        await nursery.start(disc.run)
        self.reach = await start_reachability(
            t, cfg, nursery, bootstrap, known=lambda: {p: list(i.announce.addrs) for p, i in self.core.peers.items()}
        )
        await nursery.start(control.serve, self.home, self.snapshot, cfg.metrics.control_socket)

    async def attach(self, t: Any) -> None:
        """Wire this node's handlers onto transport `t`: task sets, the validation pipeline and gossip
        service, stream-fault penalties, the chunk broadcast and the catalog protocol (the caller runs the
        services). Tests attach a node to an in-process transport to fuzz exactly these handlers."""
        from murmur.gossip.service import GossipService
        from murmur.gossip.validation import Pipeline, PipelineConfig
        from murmur.training.schedule import ScheduleBook
        from murmur.training.tokencheck import for_model
        from murmur.training.verifiers import VerifierPool, score

        cfg = self.cfg
        self.tasks = TaskSetGossip(
            self.store, self.ident.public, cfg.trust.coordinators, self.drops, swarm=cfg.node.swarm
        )
        self.registry = self.tasks.registry
        self.transport = t
        self.verifiers = VerifierPool()  # other peers' completions: time-limited, own processes
        self.tasks.pool = self.verifiers  # ... and the task sets peers send, checked by generating from them
        check_tokens = await trio.to_thread.run_sync(for_model, cfg.training.model)
        pipeline = Pipeline(
            PipelineConfig.from_config(cfg.node.swarm, cfg.gossip, cfg.sync.max_staleness, cfg.training.max_new_tokens),
            clock=time.time,
            resolve_task=partial(self.registry.resolve, run=self.verifiers.call),
            reward=score,
            head_version=self.core.head_of,
            task_set_trusted=lambda ts: ts in self.registry,
            own_lineage=lambda lid: bytes(lid) == self.core.own,
            reward_batch=self.verifiers.score_batch,
            check_tokens=check_tokens,
            schedule=ScheduleBook.of(self.registry),
        )
        self.service = GossipService(t, pipeline, cfg.node.swarm, self.store)
        if "validator" in self.roles and "trainer" not in self.roles:
            # a secret key of this run: no producer can tell which of its batches fall in the sample
            self.service.sample = Sample(
                os.urandom(32), cfg.gossip.validator_sample, cfg.gossip.validator_sample_floor_per_min
            )
        t.faults.on_fault = self._on_stream_fault
        # a graylisted key's new connections are refused while its score stays below the threshold
        t.refuse_connections(
            lambda peer: (
                pipeline.scores.is_graylisted(peer, pipeline.clock())
                or pipeline.scores.is_blacklisted(peer, pipeline.clock())
            )
        )
        self.service.on_accept = self._on_accept
        if getattr(t, "budget", None) is not None:  # streams of keys neither established nor verified share a pool
            gate = self.service.gate
            t.budget.proven = lambda peer: (
                gate.established(peer, pipeline.clock()) or pipeline.cpu.proven(peer, pipeline.clock())
            )
        self.service.child_cpu = self.verifiers.thread_cpu_s  # verification CPU is charged to its sender's share
        self.service.on_announce(wire.NODE_ANNOUNCE, self._on_node_announce)
        self.service.on_announce(wire.PATCH_MANIFEST, self._on_manifest)
        self.service.on_announce(wire.TASK_SET, self.tasks.on_task_set)
        self.bcast = self._broadcast_node(t)
        t.set_stream_handler(patchsync.PROTOCOL, self._serve_catalog)

    def request_stop(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    def _on_signal(self, signum: int) -> None:
        event(log, "signal: shutting down", signal=int(signum))
        self.state = "stopping"
        self._stop_requested = True
        self.request_stop()

    # ------------------------------------------------------------ events in
    async def feed(self, ev: C.Event) -> None:
        """Queue an event for the core loop (waits while the queue is full)."""
        await self._events.send(ev)

    def _post(self, ev: C.Event) -> None:
        """`feed` from a synchronous callback: queued now, or by a task that waits for room."""
        try:
            self._events.send_nowait(ev)
        except trio.WouldBlock:
            assert self._nursery is not None  # the callbacks that post run only once the node's tasks are up
            self._nursery.start_soon(self.feed, ev)

    def _trio_deadline(self) -> float:
        """The core's next deadline (on the runtime's clock) on trio's clock."""
        return trio.current_time() + max(0.0, self.core.next_deadline() - self.clock())

    async def _core_loop(self) -> None:
        """The core's one consumer: take the next event (a follow-up first, then the channel's; a `Tick`
        when the core's next deadline comes first, h11-style), hand it to the core with one reading of the
        clocks, and carry out its actions in order before the next event: the actions of two events never
        interleave, though carrying one out may wait on I/O."""
        while True:
            if self._next:
                ev = self._next.popleft()
            else:
                got: C.Event | None = None
                with trio.move_on_at(self._trio_deadline()):
                    got = await self._events_out.receive()
                if got is None:  # the core's deadline came: the next announce states the current addresses
                    addrs = self.reach.announce_addrs() if self.reach is not None else self.transport.listen_addrs()
                    self._next.append(C.Tick())
                    got = C.ListenAddrs(tuple(addrs))
                ev = got
            for a in self.core.handle(ev, self.clock(), wire.now_ms()):
                follow_up = await self._carry_out(a)
                if follow_up is not None:
                    self._next.append(follow_up)

    async def _slow_loop(self) -> None:
        """The ledger counts (every second), our own task sets and the sweep of finished partial downloads."""
        last_ts = last_sweep = -1e9
        while True:
            self.ledger = await trio.to_thread.run_sync(self.store.ledger_counts)
            now = self.clock()
            if self._resend_task_sets:  # a new peer: our own task sets go out again
                self._resend_task_sets = False
                self.tasks.sent.clear()
                last_ts = -1e9
            if now - last_ts >= TASK_SET_CHECK_S:
                last_ts = now
                await self.tasks.announce_own(self.service)
            if now - last_sweep >= PARTIAL_SWEEP_S:
                last_sweep = now
                trs = list(self.bcast.transfers.values())
                live = {tr.pid.hex() for tr in trs if not tr.session.complete}
                done = {tr.pid.hex() for tr in trs if tr.completed_wall and time.time() - tr.completed_wall > 5.0}
                await trio.to_thread.run_sync(
                    patchsync.sweep_partials, self.home / "partial", live, done, PARTIAL_KEEP_S
                )
            await trio.sleep(1.0)

    async def _on_node_announce(self, origin: str, body: wire.NodeAnnounce, data: bytes) -> None:
        signer = bytes(wire.decode_envelope(data, swarm=self.cfg.node.swarm).signer)
        self.service.intake.heard_announce(signer, body)
        await self.feed(C.AnnounceHeard(signer, body, data))

    async def _on_manifest(self, origin: str, m: wire.PatchManifest, data: bytes) -> None:
        await self.feed(C.ManifestHeard(m))

    def _on_accept(self, v: Any) -> None:
        if v.batch is None:
            return
        self._post(C.RolloutsVerified.of(v.batch))  # the exchange meter; delivery backs a follower's rate
        # a pure query of the core: whether the worker learns from (or spot-checks) the batch
        if self.worker is not None and self.core.external_wanted({bytes(r.lineage) for r in v.batch.rollouts}):
            self.worker.send(pipe.External(v.data))

    # ------------------------------------------------------------ the broadcast
    def _broadcast_node(self, t: Any) -> Any:
        from murmur.sync.broadcast import BroadcastNode
        from murmur.sync.swarm import SwarmConfig

        return BroadcastNode(
            t,
            swarm=self.cfg.node.swarm,
            upload_bytes_per_s=self.cfg.network.upload_bytes_per_s,
            config=SwarmConfig(stall_timeout_s=self.cfg.sync.stall_timeout_s),
            partial_root=self.home / "partial",
            accept=self._offered,
            on_penalty=lambda peer, reason, amount: self._penalise(peer, f"broadcast: {reason}", amount),
            on_complete=self._on_transfer_complete,
        )

    def _offered(self, m: wire.PatchManifest) -> bool:
        """The broadcast's synchronous accept callback. It calls the core outside the core loop: its one action
        is the answer, with nothing to carry out, and it runs between the loop's awaits, never inside `handle`."""
        return self.core.offer_manifest(m, self.clock())

    def _penalise(self, peer: str, reason: str, amount: float) -> None:
        """Broadcast misbehaviour (stalls, bad frames, corrupt chunks) and failed spot checks lower the peer's score."""
        if self.service is not None:
            p = self.service.pipeline
            p.scores.penalise(peer, reason[:120], amount, p.clock())
            event(log, "penalty", peer=peer, reason=reason[:200], amount=amount)

    def _on_stream_fault(self, peer: str, protocol: str, error: str) -> None:
        """Bytes that break a stream protocol (ours or py-libp2p's) lower the sender's gossip score."""
        self._penalise(peer, f"stream: {protocol}", STREAM_FAULT_PENALTY)

    def _on_transfer_complete(self, tr: Any) -> None:
        self._post(C.TransferDone(tr.pid, tr.manifest))

    async def _serve_catalog(self, stream: Any, remote: str) -> None:
        try:
            with trio.fail_after(30):
                await patchsync.serve(stream, self.home, self.bcast)
        except (DecodeError, FrameError):
            raise  # a malformed request: the host's stream guard scores the asker
        except (MurmurError, trio.TooSlowError) as e:
            log.debug("catalog request from %s: %s", remote, e)
        with trio.move_on_after(2):
            await stream.close()

    # ------------------------------------------------------------ actions out
    async def _carry_out(self, a: C.Action) -> C.Event | None:
        """Carry out one action; its follow-up event (what came of it, for the core), if any."""
        from murmur.gossip.transport import PublishError

        if isinstance(a, C.Log):
            event(log, a.msg, **a.fields)
        elif isinstance(a, C.ToWorker):
            if self.worker is not None:
                self.worker.send(a.msg)
        elif isinstance(a, C.Publish):
            try:
                if a.topic == C.Topic.ANNOUNCE:
                    await self.service.publish_announce(a.data)
                else:
                    await self.service.publish_rollouts(a.data, a.shard)
                    return C.RolloutsPublished(a.count)
            except PublishError as e:
                if a.topic == C.Topic.ANNOUNCE:
                    self.drops.add("announce_unpublished")
                log.debug("publish %s: %s", a.topic, e)
        elif isinstance(a, C.Subscribe):
            await self.service.set_shards(a.shards, a.subscribe)
        elif isinstance(a, C.RecordRollouts):
            await trio.to_thread.run_sync(self.store.record_rollouts, list(a.entries))
        elif isinstance(a, C.SeePeer):
            connected = a.peer_id in self.transport.peers()  # a stranger's announce is not kept (node.store)
            await trio.to_thread.run_sync(self.store.see_peer, a.peer_id, a.public, list(a.addrs), a.data, connected)
        elif isinstance(a, C.Penalise):
            self._penalise(a.peer, a.reason, a.amount)
        elif isinstance(a, C.SeedVersion):
            await self._seed_version(a.envelope)
        elif isinstance(a, C.StorePatch):
            return await self._store_patch(a.pid)
        elif isinstance(a, C.LoadStored):
            store = patchsync.held_store(self.home, a.lineage)
            items = await trio.to_thread.run_sync(store.items) if store else []
            return C.StoredItems(a.lineage, tuple(items))
        elif isinstance(a, C.DropItem):
            await trio.to_thread.run_sync(patchsync.drop_item, self.home, a.lineage, a.base, a.target)
        elif isinstance(a, C.FetchCatalog):
            self.nursery.start_soon(self._fetch_catalog, a.peer, a.lineage)
        elif isinstance(a, C.RequestOffer):
            self.nursery.start_soon(self._request_offer, a)
        elif isinstance(a, C.RestartWorker):
            if a.roles:  # the core chose to train or to generate: the next worker runs that role
                self.roles = list(a.roles)
            # a live worker being replaced gets the shutdown grace to write its follower checkpoint
            self.nursery.start_soon(self._restart_worker, a.delay_s, STOP_GRACE_S if a.roles else 0.5)
        elif isinstance(a, C.ResendTaskSets):
            self._resend_task_sets = True
        elif isinstance(a, (C.Accept, C.Decline)):
            pass  # answers to ManifestOffered, which the broadcast asks through `_offered`
        else:
            assert_never(a)
        return None

    async def _seed_version(self, envelope: bytes) -> None:
        """Our worker stored a new version: seed it on the broadcast (this also gossips the manifest)."""
        from murmur.sync.patchstore import open_manifest

        m = open_manifest(envelope, swarm=self.cfg.node.swarm)
        env, chunks = await trio.to_thread.run_sync(
            partial(patchsync.read_item, swarm=self.cfg.node.swarm), self.home, bytes(m.lineage), item_of(m)
        )
        try:
            await self.bcast.publish(env, chunks)
        except MurmurError as e:  # no gossip peers yet: the chunks are still offered to stream peers
            log.debug("manifest gossip: %s", e)

    async def _store_patch(self, pid: bytes) -> C.PatchStored | None:
        """A completed, chunk-verified patch: store it atomically; what to tell the core (which tells the worker)."""
        tr = self.bcast.transfers.get(pid)
        if tr is None:
            return None
        try:
            await trio.to_thread.run_sync(patchsync.store_complete, self.home, tr.manifest, tr.envelope, tr.payload())
            await trio.to_thread.run_sync(
                LineageStore(self.home, bytes(tr.manifest.lineage)).prune, self.cfg.sync.retain_versions
            )
        except (MurmurError, OSError) as e:
            log.warning("could not store patch %s: %s", pid.hex()[:12], e)
            return None
        seconds = (tr.completed_wall or time.time()) - tr.started
        return C.PatchStored(tr.manifest, tr.session.bytes_in, seconds)

    async def _fetch_catalog(self, peer: str, lineage: bytes) -> None:
        try:
            with trio.fail_after(CATALOG_TIMEOUT_S):
                items = await patchsync.catalog(self.transport, peer, lineage)
        except Exception as e:  # a dial, stream or decode failure: the core tries the next source
            await self.feed(C.CatalogFailed(peer, lineage, f"{type(e).__name__}: {e}"))
            return
        await self.feed(C.CatalogReceived(peer, lineage, tuple(items)))

    async def _request_offer(self, a: C.RequestOffer) -> None:
        try:
            with trio.fail_after(CATALOG_TIMEOUT_S):
                env = await patchsync.offer(self.transport, a.peer, a.lineage, a.item)
                pid = await self.bcast.add_manifest(env)
        except Exception as e:  # a dial, stream or decode failure: the core tries the next source
            await self.feed(C.OfferFailed(a.peer, a.lineage, f"{type(e).__name__}: {e}"))
            return
        tr = self.bcast.transfers.get(pid) if pid is not None else None
        if tr is not None and tr.session.complete:
            # The broadcast finished this patch earlier, but the store lost it (a failed write, or dropped
            # after a failed apply): a completed transfer never completes again, so hand it to the core anew.
            await self.feed(C.TransferDone(tr.pid, tr.manifest))

    # ------------------------------------------------------------ worker
    async def _start_worker(self) -> None:
        self.worker = await self._spawn_worker(worker_spec(self.cfg, self.home, self.ident, self.roles, self.opts))
        await self.feed(C.WorkerStarted())

    async def _restart_worker(self, delay_s: float, grace_s: float = 0.5) -> None:
        await trio.sleep(delay_s)
        old = self.worker
        if old is not None:
            await old.stop(grace_s)
        await self._start_worker()
        event(log, "worker restarted", restarts=self.core.stats()["worker_restarts"])

    async def _worker_loop(self) -> None:
        while True:
            w = self.worker
            try:
                if w is None:
                    await trio.sleep(0.5)
                    continue
                msg = await w.receive()
            except DecodeError as e:
                log.warning("worker message: %s", e)
                continue
            if msg is None:
                continue
            if msg is False:
                if w is self.worker:
                    await self.feed(C.WorkerExited(w.exitcode))
                await trio.sleep(0.5)
                continue
            if isinstance(msg, pipe.Step):
                self.drops.from_worker(msg.dropped)
                if self.service is not None:
                    self.service.stats.used(msg.used_by_set)
            await self.feed(C.FromWorker(msg))

    # ------------------------------------------------------------ views
    async def _view_loop(self) -> None:
        if self.opts.tui and sys.stdout.isatty():
            from rich.live import Live

            from murmur.node.ui.dashboard import node_panel

            with Live(node_panel(self.snapshot()), auto_refresh=False, screen=False, transient=False) as live:
                while True:
                    s = self.snapshot()
                    live.update(node_panel(s), refresh=True)
                    if self.metrics is not None:
                        self.metrics.update(s)
                    await trio.sleep(1.0)
        last_log = 0.0
        while True:
            s = self.snapshot()
            if self.metrics is not None:
                self.metrics.update(s)
            if self.clock() - last_log >= 5.0:
                last_log = self.clock()
                event(log, "status", **views.status_fields(s))
            await trio.sleep(1.0)


def run_node(cfg: Config, home: Path, opts: RunOptions) -> None:
    """Blocking: run a node until signalled. Creates the home on first use."""
    from murmur.node.home import ensure_home

    home = Path(home)
    ident = ensure_home(home)
    roles.check_roles(cfg.node.roles)
    node = Node(cfg, home, ident, opts)
    trio.run(node.run)
    # Everything is durable by now (SQLite closed, files written atomically). Skip interpreter
    # finalization: py-libp2p leaves threads and tasks behind that can hang it past the 5 s promise.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
