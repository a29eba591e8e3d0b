"""The network process of a node: libp2p host, gossip, patch broadcast, roles, control, metrics, dashboard.

Process structure (docs/architecture.md): this process runs trio with
py-libp2p as its main loop and never runs torch; training and generation run
in a spawned worker process (`node.worker`) that talks to it over one Pipe,
and patches travel between them as files in the node home. Blocking work
(SQLite, file reads, pipe I/O) goes to `trio.to_thread`.

Shutdown (SIGINT/SIGTERM or `Node.request_stop`): the worker is told to stop
(it writes its follower checkpoint), the tasks are cancelled, and a watchdog
guarantees the process is gone within 5 s. Everything accepted is already
durable (SQLite transactions, atomic files) before it is acknowledged, so
kill -9 at any moment loses nothing accepted.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from gossip import wire
from node import control, hardware, patchsync, roles, stall
from node.stall import StallMeter
from node.config import Config
from gossip.errors import DecodeError, MurmurError, PatchError
from gossip.transport import FrameError
from gossip.identity import Identity, peer_id_from_public
from gossip.ratelimit import RateMeter
from node.logs import event
from node.status import DiskMeter, Drops, LineageView, NodeStatus, PeerView, TREND_POINTS

log = logging.getLogger("murmur.node")

ANNOUNCE_EVERY_S = 2.0
PEER_EXPIRY_S = 30.0
STOP_GRACE_S = 2.5
EXIT_DEADLINE_S = 4.0
WORKER_QUEUE = 1024
BATCH_MAX_ROLLOUTS = 64
CATCH_UP_TIMEOUT_S = 120.0
IN_FLIGHT_PATIENCE_S = 30.0  # a transfer in flight longer than this no longer counts as on its way
TASK_SET_CHECK_EVERY = 5  # announce rounds between checks of the store for our own new task sets
PARTIAL_SWEEP_EVERY = 60  # catch-up rounds (~0.5 s each) between sweeps of finished partial downloads
MAX_SCORES_SHOWN = 256  # peer scores in the status reply (it has a size limit)
STREAM_FAULT_PENALTY = 20.0  # bytes that break a stream protocol: three such faults graylist the sender
PARTIAL_KEEP_S = 600.0  # an unfinished download's chunks are kept this long for a restart to resume from
SPOT_PENALTY = 25.0  # a failed log-prob spot check; two put a peer below the default graylist threshold


@dataclass
class PeerInfo:
    announce: wire.NodeAnnounce
    public: bytes
    seen: float


@dataclass
class LineageState:
    lineage: bytes
    name: str
    relation: str
    publisher: bytes = b""
    base: bytes = b""
    head: int = 0
    held: int = 0
    need_anchor: bool = False
    activation: roles.Activation | None = None
    admission: str = ""  # staleness state of a served lineage: unknown | fresh | stale
    admission_note: str = ""  # the last StalenessEvent message


@dataclass
class RunOptions:
    tui: bool = True
    listen: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    model_home: str = ""  # where murmur-tiny is built/cached (default: the node home)


def worker_spec(cfg: Config, home: Path, ident: Identity, node_roles: list[str], opts: RunOptions) -> dict[str, Any]:
    t = cfg.training
    return {
        "home": str(home), "swarm": cfg.node.swarm, "roles": node_roles, "model": t.model, "engine": t.engine,
        "model_home": opts.model_home or str(home),
        "device": t.device, "model_seed": 0, "seed": t.seed, "threads": t.threads,
        "memory_budget_mb": cfg.node.memory_budget_mb, "identity_seed": ident.seed.hex(),
        "lineage_name": f"{cfg.node.swarm}-{ident.peer_id[-8:]}", "anchor_every": cfg.sync.anchor_every,
        "chunk_bytes": cfg.sync.chunk_bytes, "retain_versions": cfg.sync.retain_versions,
        "publish_every": cfg.sync.publish_every, "spot_rate": 0.25,
        # the trainer's sampler (training/sampler.py): groups of ~group_size verified rollouts
        "sampler_max_rollouts": max(64, min(cfg.gossip.pool_max_rollouts, cfg.node.memory_budget_mb * 8)),
        "sampler_max_groups": max(16, min(cfg.gossip.pool_max_rollouts, cfg.node.memory_budget_mb * 8)
                                  // max(1, t.group_size)),
        "task_sets": msgspec.to_builtins(t.task_sets), "trusted": list(cfg.trust.coordinators),
        "trainer": {"local_groups": t.local_rollouts, "external_groups": t.external_rollouts,
                    "group_size": t.group_size, "lr": t.lr, "max_new_tokens": t.max_new_tokens,
                    "temperature": t.temperature, "seed": t.seed, "max_staleness": cfg.sync.max_staleness,
                    # every group is generated and used within its step: a group left over to the next
                    # step could be gossiped with a version label whose weights were never published
                    "overprovision": 1.0,
                    "memory_budget_mb": cfg.node.memory_budget_mb},
    }


class WorkerLink:
    """The worker process and its pipe; sends go through a bounded queue drained by a thread."""

    def __init__(self, spec: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        from node import worker

        python = worker.worker_python(spec)  # MurmurError at start when the engine asked for cannot run
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker.main, args=(child, spec), name="murmur-worker", daemon=True)
        from multiprocessing import spawn as mp_spawn

        before = mp_spawn.get_executable()
        ctx.set_executable(python)  # the vLLM environment's interpreter when engine = "vllm"
        try:
            self.proc.start()
        finally:
            ctx.set_executable(before)
        child.close()
        self.out: queue.Queue[tuple[str, Any]] = queue.Queue(WORKER_QUEUE)
        self.dropped = 0
        self.closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="murmur-worker-send", daemon=True)
        self._sender.start()

    def send(self, kind: str, body: Any, droppable: bool = False) -> None:
        try:
            self.out.put_nowait((kind, body))
        except queue.Full:
            if droppable:
                self.dropped += 1
                return
            self.out.put((kind, body), timeout=5)

    def _send_loop(self) -> None:
        while not self.closed.is_set():
            try:
                msg = self.out.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.conn.send(msg)
            except (OSError, BrokenPipeError, ValueError):
                self.closed.set()
                return

    def recv(self, timeout: float = 0.5) -> tuple[str, Any] | None:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError, ValueError):
            self.closed.set()
            return ("exited", None)
        if not self.proc.is_alive():
            return ("exited", None)
        return None

    def stop(self, grace: float) -> None:
        try:
            self.conn.send(("stop", None))
        except (OSError, BrokenPipeError, ValueError):
            pass
        self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(1.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.closed.set()


class Node:
    def __init__(self, cfg: Config, home: Path, ident: Identity, opts: RunOptions) -> None:
        from node.store import open_store

        self.cfg = cfg
        self.home = Path(home)
        self.ident = ident
        self.opts = opts
        self.store = open_store(self.home, cfg.disk.ledger_budget())
        self.hw = hardware.detect()
        self.hw_class = hardware.hardware_class(cfg.node.hardware, self.hw)
        self.roles, self.roles_reason = roles.choose_roles(cfg.node.roles, self.hw_class, cfg.node.memory_budget_mb,
                                                           hardware.available_memory())
        self.started = time.monotonic()
        self.state = "starting"
        self.worker_state = "starting"
        self.worker_error = ""
        self.engine = f"{cfg.training.engine} (starting)"  # what the worker runs; "<asked> unavailable: why"
        self.peers: dict[str, PeerInfo] = {}
        self.lineages: dict[bytes, LineageState] = {}
        self.own: bytes | None = None
        self.serving: bytes | None = None
        self.serving_reason = ""
        self.my_base = b""
        self.rewards: deque[float] = deque(maxlen=TREND_POINTS)
        self.reward_first: list[float] = []
        self.counters: dict[str, int] = {"bytes_up": 0, "bytes_down": 0, "published": 0, "applied": 0,
                                         "spot_checked": 0, "spot_failed": 0, "used": 0, "publish_failed": 0}
        self.ledger: dict[str, int] = {}
        self.verifiers: Any = None  # training.verifiers.VerifierPool, from run()
        self.publish_meter = RateMeter()  # batches/s we publish, announced (gossip.ratelimit)
        self.drops, self.disk = Drops(), DiskMeter(home, cfg)
        self.steps = 0
        self.step_times: deque[float] = deque(maxlen=8)  # seconds per optimizer step
        self.version_times: deque[float] = deque(maxlen=8)  # seconds between published versions
        self.last_publish = 0.0
        self.gen_tps = 0.0
        self.latency = 0.0
        self.fetch_s: deque[float] = deque(maxlen=8)
        self.seq = 0
        self.announce_seq = 0
        self.worker: WorkerLink | None = None
        self.transport: Any = None
        self.service: Any = None
        self.bcast: Any = None  # sync.broadcast.BroadcastNode
        self._nursery: trio.Nursery | None = None
        self.stored: dict[bytes, set[tuple[str, int, int]]] = {}  # lineage -> items in its store (cache)
        self.announced_task_sets: set[bytes] = set()
        self.pace_rate = 0.0  # follower generation cap sent to the worker (rollouts/s; 0 = none)
        from sync.staleness import StalenessGuard

        self.guard = StalenessGuard(cfg.sync.max_staleness)
        self.metrics: Any = None
        self.stall = StallMeter()
        self._cancel: trio.CancelScope | None = None
        self.tokens_per_rollout = float(cfg.training.max_new_tokens)

    # ------------------------------------------------------------ status
    def snapshot(self) -> NodeStatus:
        now = time.monotonic()
        peers = []
        for pid, p in sorted(self.peers.items()):
            a = p.announce
            peers.append(PeerView(peer_id=pid, roles=list(a.roles), hardware=a.hardware,
                                  gen_tokens_per_s=a.gen_tokens_per_s, rollout_latency_s=a.rollout_latency_s,
                                  serving=bytes(a.serving).hex(), last_seen_s=now - p.seen))
        lins = []
        for lin in self.lineages.values():
            if lin.relation == "seen" and lin.lineage != self.serving:
                relation = "seen"
            else:
                relation = lin.relation
            act = lin.activation
            lins.append(LineageView(lineage=lin.lineage.hex(), name=lin.name, relation=relation,
                                    publisher=peer_id_from_public(lin.publisher) if len(lin.publisher) == 32 else "",
                                    head=lin.head, held=lin.held,
                                    lag=max(0, lin.head - lin.held) if relation != "seen" else 0,
                                    need_rollouts_per_s=act.need if act else 0.0,
                                    supply_rollouts_per_s=act.supply if act else 0.0,
                                    active=list(act.active) if act else [], standby=list(act.standby) if act else [],
                                    rejected=dict(act.rejected) if act else {},
                                    admission=lin.admission, admission_note=lin.admission_note))
        led = self.ledger
        rejected = {k.split(":", 1)[1]: v for k, v in led.items() if k.startswith("rejected:")}
        if self.service is not None:
            for reason in ("graylisted", "blacklisted", "rate_limited", "over_announced_rate"):
                n = self.service.pipeline.counts.get(reason, 0)
                if n:
                    rejected[reason] = rejected.get(reason, 0) + n
        if self.counters["spot_failed"]:
            rejected["spot_check_failed"] = self.counters["spot_failed"]
        accepted = led.get("accepted", 0)
        k = 5
        start = sum(self.reward_first[:k]) / len(self.reward_first[:k]) if self.reward_first else None
        recent = list(self.rewards)[-k:]
        now_r = sum(recent) / len(recent) if recent else None
        pids = [self.worker.proc.pid] if self.worker and self.worker.proc.pid else []
        return NodeStatus(
            peer_id=self.ident.peer_id, swarm=self.cfg.node.swarm, roles=self.roles, hardware=self.hw_class,
            listen=self.transport.listen_addrs() if self.transport else [], state=self.state,
            uptime_s=now - self.started, worker=self.worker_state, worker_error=self.worker_error[:2000],
            engine=self.engine,
            peers=peers, lineages=lins, serving=self.serving.hex() if self.serving else "",
            serving_reason=self.serving_reason, steps=self.steps, versions_published=self.counters["published"],
            versions_applied=self.counters["applied"], rollouts_produced=led.get("produced", 0),
            rollouts_published=self.counters.get("rollouts_published", 0),
            rollouts_received=accepted + sum(v for k2, v in led.items() if k2.startswith("rejected")),
            rollouts_accepted=accepted, rollouts_used=self.counters["used"], rejected=rejected,
            spot_checked=self.counters["spot_checked"], spot_failed=self.counters["spot_failed"],
            reward_trend=list(self.rewards), reward_start=start, reward_now=now_r, gen_tokens_per_s=self.gen_tps,
            rollout_latency_s=self.latency, bytes_up=self._bytes_up(), bytes_down=self._bytes_down(),
            memory_rss_mb=hardware.rss_bytes(pids) / 2**20, memory_budget_mb=self.cfg.node.memory_budget_mb,
            metrics_port=self.metrics.port if self.metrics else 0,
            dropped=self.drops.view(self.worker.dropped if self.worker else 0), disk=self.disk.views(now),
            loop_stall_max_ms=round(self.stall.max_ms, 1),
            loop_stall_recent_ms=round(self.stall.recent_ms(trio.current_time()), 1) if self._nursery else 0.0,
            stream_faults=dict(self.transport.faults.counts) if self.transport is not None else {},
            peer_scores=self._peer_scores(),
            **({"reach": self.reach.view()} if getattr(self, "reach", None) else {}))

    def _peer_scores(self) -> dict[str, float]:
        if self.service is None:
            return {}
        p = self.service.pipeline
        return {peer: round(v["score"], 3) for peer, v in list(p.scores.snapshot(p.clock()).items())[:MAX_SCORES_SHOWN]}

    def _bytes_up(self) -> int:
        return int(self.bcast.counters["bytes_up"]) if self.bcast is not None else 0

    def _bytes_down(self) -> int:
        """Chunk bytes received: completed transfers plus those in flight."""
        live = 0
        if self.bcast is not None:
            live = sum(tr.session.bytes_in for tr in list(self.bcast.transfers.values()) if not tr.session.complete)
        return self.counters["bytes_down"] + live

    # ------------------------------------------------------------ main
    async def run(self) -> None:
        from gossip.discovery import Discovery
        from gossip.host import open_transport
        from gossip.service import GossipService
        from gossip.validation import Pipeline, PipelineConfig
        from training.tasksets import TaskRegistry
        from training.tokencheck import for_model
        from training.verifiers import VerifierPool, score

        cfg = self.cfg
        wire.bind_swarm(cfg.node.swarm)  # every envelope signed or accepted here names this swarm
        self.registry = TaskRegistry()
        self.registry.add_builtin()
        for ts in self.store.task_sets():
            try:
                self.registry.add(ts["envelope"], self._trusted())
            except MurmurError:
                pass
        self._load_lineages()
        watchdog_armed = threading.Event()
        self._stop_requested = False
        old_handlers = self._install_signals(watchdog_armed)
        listen = self.opts.listen or cfg.network.listen
        event(log, "starting", peer_id=self.ident.peer_id, roles=self.roles, why=self.roles_reason, listen=listen)
        self.worker = await trio.to_thread.run_sync(
            WorkerLink, worker_spec(cfg, self.home, self.ident, self.roles, self.opts))
        if cfg.metrics.port:
            from node.metrics import Metrics

            self.metrics = Metrics()
            try:
                self.metrics.serve(cfg.metrics.port)
            except OSError as e:
                log.warning("metrics port %s unavailable: %s", cfg.metrics.port, e)
                self.metrics = None
        try:
            async with open_transport(self.ident, listen) as t:
                self.transport = t
                self.verifiers = VerifierPool()  # other peers' completions: time-limited, own processes
                check_tokens = await trio.to_thread.run_sync(for_model, cfg.training.model)
                pipeline = Pipeline(PipelineConfig.from_config(cfg.node.swarm, cfg.gossip, cfg.sync.max_staleness),
                                    clock=time.time, resolve_task=self.registry.resolve, reward=score,
                                    head_version=self._head_of, task_set_trusted=lambda ts: ts in self.registry,
                                    reward_batch=self.verifiers.score_batch, check_tokens=check_tokens)
                self.service = GossipService(t, pipeline, cfg.node.swarm, self.store)
                t.faults.on_fault = self._on_stream_fault
                self.service.on_accept = self._on_accept
                self.service.on_announce(wire.NODE_ANNOUNCE, self._on_node_announce)
                self.service.on_announce(wire.PATCH_MANIFEST, self._on_manifest)
                self.service.on_announce(wire.TASK_SET, self._on_task_set)
                self.bcast = self._broadcast_node(t)
                t.set_stream_handler(patchsync.PROTOCOL, self._serve_catalog)
                bootstrap = list(dict.fromkeys(self.opts.bootstrap + cfg.network.bootstrap))
                disc = Discovery(t, bootstrap, self.store, dht=cfg.network.dht and bool(bootstrap))
                async with trio.open_nursery() as nursery:
                    self._cancel = nursery.cancel_scope
                    if self._stop_requested:
                        nursery.cancel_scope.cancel()
                    self._nursery = nursery
                    await nursery.start(self.service.run)
                    await nursery.start(self.bcast.run)
                    await nursery.start(disc.run)
                    from node.reach import start_reachability  # relay, hole punching, dial-back (docs/reachability.md)
                    self.reach = await start_reachability(
                        t, cfg, nursery, bootstrap, known=lambda: {p: list(i.announce.addrs) for p, i in self.peers.items()})
                    await nursery.start(control.serve, self.home, self.snapshot, cfg.metrics.control_socket)
                    self.state = "running"
                    await trio.to_thread.run_sync(self.store.put, "listen", t.listen_addrs())
                    event(log, "listening", addrs=t.listen_addrs(), metrics_port=self.metrics.port if self.metrics else 0)
                    nursery.start_soon(stall.run, self.stall)
                    nursery.start_soon(self._worker_loop)
                    nursery.start_soon(self._announce_loop)
                    nursery.start_soon(self._ledger_loop)
                    nursery.start_soon(self._catch_up_loop)
                    nursery.start_soon(self._view_loop)
        finally:
            self.state = "stopping"
            if not watchdog_armed.is_set():
                _arm_watchdog()
            if self.worker is not None:
                await trio.to_thread.run_sync(self.worker.stop, STOP_GRACE_S)
            if self.metrics is not None:
                self.metrics.close()
            if self.verifiers is not None:
                self.verifiers.close()
            self.store.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            event(log, "stopped", peer_id=self.ident.peer_id)

    def request_stop(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    def _install_signals(self, armed: threading.Event) -> dict[int, Any]:
        """SIGINT/SIGTERM: arm the exit watchdog at once (in the handler itself), then cancel on the loop.

        A plain handler rather than trio's signal receiver, so the 5 s clock starts when the signal
        arrives, not when a busy event loop gets round to it; installed before anything slow starts.
        """
        token = trio.lowlevel.current_trio_token()

        def handler(signum: int, frame: Any) -> None:
            if not armed.is_set():
                armed.set()
                _arm_watchdog()
            try:
                token.run_sync_soon(self._on_signal, signum)
            except trio.RunFinishedError:
                pass

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int) -> None:
        event(log, "signal: shutting down", signal=int(signum))
        self.state = "stopping"
        self._stop_requested = True
        self.request_stop()

    # ------------------------------------------------------------ lineages
    def _load_lineages(self) -> None:
        own = self.store.get("own_lineage")
        for row in self.store.lineages():
            lid = bytes(row["lineage_id"])
            head = self.store.head_version(lid) or 0
            rel = row["relation"]
            if own and lid.hex() == own:
                rel = "own"
            self.lineages[lid] = LineageState(lid, row["name"], rel, bytes(row["publisher"]),
                                              bytes(row["base_model_hash"]), head, head)
            if rel == "own":
                self.own = lid

    def _head_of(self, lineage: bytes) -> int | None:
        lin = self.lineages.get(bytes(lineage))
        return lin.head if lin is not None else None

    def _lineage(self, lid: bytes, name: str, publisher: bytes, base: bytes = b"") -> LineageState:
        lin = self.lineages.get(lid)
        if lin is None:
            lin = self.lineages[lid] = LineageState(lid, name, "seen", publisher, base)
        if base and not lin.base:
            lin.base = base
        return lin

    # ------------------------------------------------------------ gossip handlers
    async def _on_node_announce(self, origin: str, body: wire.NodeAnnounce, data: bytes) -> None:
        env = wire.decode_envelope(data)
        if peer_id_from_public(env.signer) != body.peer_id or body.peer_id == self.ident.peer_id:
            return
        prev = self.peers.get(body.peer_id)
        if prev is not None and prev.announce.seq >= body.seq:
            return
        self.peers[body.peer_id] = PeerInfo(body, bytes(env.signer), time.monotonic())
        self.service.pipeline.announced(body.peer_id, body)
        for d in body.owned:
            lin = self._lineage(bytes(d.lineage), d.name, bytes(env.signer))
            lin.head = max(lin.head, d.head_version)
            self._observe_head(lin)
        if prev is None:
            self.announced_task_sets.clear()  # a new peer: our own task sets go out again
            event(log, "peer announced", peer=body.peer_id, roles=list(body.roles))
            await trio.to_thread.run_sync(lambda: self.store.see_peer(body.peer_id, bytes(env.signer),
                                                                       list(body.addrs), data))

    async def _on_manifest(self, origin: str, m: wire.PatchManifest, data: bytes) -> None:
        lin = self._lineage(bytes(m.lineage), m.lineage_name, bytes(m.publisher), bytes(m.base_model_hash))
        if m.target_version > lin.head:
            lin.head = m.target_version
            self._observe_head(lin)

    async def _on_task_set(self, origin: str, m: wire.TaskSetManifest, data: bytes) -> None:
        """A signed task set from a coordinator this node trusts joins the registry and the store."""
        trusted = self._trusted()
        env = wire.decode_envelope(data)
        tid = wire.content_id(env.body)
        if tid in self.registry:
            return
        try:
            self.registry.add(data, trusted)
        except MurmurError as e:
            self.drops.add("task_set_refused")
            log.debug("task set from %s not accepted: %s", origin, e)
            return
        await trio.to_thread.run_sync(self.store.add_task_set, tid, m.name, m.version, bytes(m.coordinator), data)
        event(log, "task set added", name=m.name, version=m.version, id=tid.hex()[:16])

    def _on_accept(self, v: Any) -> None:
        if self.worker is None or v.batch is None:
            return
        lins = {bytes(r.lineage) for r in v.batch.rollouts}
        wanted = "trainer" in self.roles or ("validator" in self.roles and self.serving in lins)
        if wanted:
            self.worker.send("external", v.data, droppable=True)

    # ------------------------------------------------------------ patches over the broadcast
    def _broadcast_node(self, t: Any) -> Any:
        from sync.broadcast import BroadcastNode
        from sync.swarm import SwarmConfig

        return BroadcastNode(t, swarm=self.cfg.node.swarm, upload_bytes_per_s=self.cfg.network.upload_bytes_per_s,
                             config=SwarmConfig(stall_timeout_s=self.cfg.sync.stall_timeout_s),
                             partial_root=self.home / "partial", accept=self._accept_manifest,
                             on_penalty=self._on_penalty, on_complete=self._on_transfer_complete)

    def _accept_manifest(self, m: wire.PatchManifest) -> bool:
        lin = self.lineages.get(self.serving) if self.serving is not None else None
        if lin is None:
            return False
        return patchsync.wanted(m, self.serving, lin.publisher, lin.held, lin.need_anchor,
                                self.stored.get(lin.lineage, set()))

    def _on_penalty(self, peer: str, reason: str, amount: float) -> None:
        """Broadcast misbehaviour (stalls, bad frames, corrupt chunks) lowers the peer's gossip score."""
        if self.service is None:
            return
        p = self.service.pipeline
        p.scores.penalise(peer, f"broadcast: {reason}"[:120], abs(amount), p.clock())
        event(log, "broadcast penalty", peer=peer, reason=reason[:200], amount=abs(amount))

    def _on_stream_fault(self, peer: str, protocol: str, error: str) -> None:
        """Bytes that break a stream protocol (ours or py-libp2p's) lower the sender's gossip score."""
        p = self.service.pipeline
        p.scores.penalise(peer, f"stream: {protocol}"[:120], STREAM_FAULT_PENALTY, p.clock())
        event(log, "stream fault", peer=peer, protocol=protocol, error=error[:200])

    def _on_transfer_complete(self, tr: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._store_transfer, tr)

    async def _store_transfer(self, tr: Any) -> None:
        """A completed, chunk-verified patch: store it atomically, then tell the worker."""
        m = tr.manifest
        lid = bytes(m.lineage)
        item = patchsync.item_of(m)
        have = self.stored.setdefault(lid, set())
        if (item.kind, item.base, item.target) in have:
            return
        try:
            await trio.to_thread.run_sync(patchsync.store_complete, self.home, m, tr.envelope, tr.payload())
        except (MurmurError, OSError) as e:
            log.warning("could not store patch %s: %s", tr.pid.hex()[:12], e)
            return
        have.add((item.kind, item.base, item.target))
        await trio.to_thread.run_sync(patchsync.held_store(self.home, lid).prune, self.cfg.sync.retain_versions)
        self.counters["bytes_down"] += tr.session.bytes_in
        if tr.completed_wall is not None:
            self.fetch_s.append(max(0.0, tr.completed_wall - tr.started))
        event(log, "patch received", lineage=lid.hex()[:16], kind=item.kind, base=item.base, target=item.target,
              bytes=m.total_bytes, seconds=round((tr.completed_wall or time.time()) - tr.started, 2))
        if self.worker is not None:
            self.worker.send("patch", {"lineage": lid.hex(), "kind": item.kind, "base": item.base,
                                       "target": item.target})

    async def _publish_version(self, body: dict[str, Any]) -> None:
        """Our worker stored a new version: seed it on the broadcast (this also gossips the manifest)."""
        from sync.patchstore import open_manifest

        env = body["envelope"]
        m = open_manifest(env)
        item = patchsync.item_of(m)
        env2, chunks = await trio.to_thread.run_sync(patchsync.read_item, self.home, bytes(m.lineage), item)
        try:
            await self.bcast.publish(env2, chunks)
        except MurmurError as e:  # no gossip peers yet: the chunks are still offered to stream peers
            log.debug("manifest gossip: %s", e)

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

    def _trusted(self) -> set[bytes]:
        """Coordinators whose task sets this node accepts: the configured ones, and itself."""
        return {bytes.fromhex(k) for k in self.cfg.trust.coordinators} | {self.ident.public}

    # ------------------------------------------------------------ staleness admission
    def _staleness(self, lid: bytes, events: list[Any]) -> None:
        lin = self.lineages.get(lid)
        for ev in events:
            event(log, "staleness", lineage=lid.hex()[:16], state=ev.state, message=ev.message)
            if lin is not None:
                lin.admission, lin.admission_note = ev.state, ev.message
        if events:
            self._send_admit(lid)

    def _send_admit(self, lid: bytes) -> None:
        """Tell the worker whether it may generate for the lineage it serves (the guard decides)."""
        if self.worker is not None and lid == self.serving:
            self.worker.send("admit", {"lineage": lid.hex(), "generate": self.guard.may_generate(lid)})

    def _observe_head(self, lin: LineageState) -> None:
        if lin.lineage == self.serving:
            self._staleness(lin.lineage, self.guard.observe_head(lin.lineage, lin.head, time.monotonic()))

    # ------------------------------------------------------------ worker
    async def _worker_loop(self) -> None:
        assert self.worker is not None
        while True:
            msg = await trio.to_thread.run_sync(self.worker.recv, 0.5, abandon_on_cancel=True)
            if msg is None:
                continue
            kind, body = msg
            if kind == "exited":
                if self.worker_state != "stopped":
                    self.worker_state = "stopped"
                    code = self.worker.proc.exitcode
                    if code not in (0, None) and not self.worker_error:
                        self.worker_error = f"worker exited with code {code}"
                    event(log, "worker exited", code=code, error=self.worker_error[:300])
                await trio.sleep(1.0)
                continue
            try:
                await self._on_worker(kind, body)
            except MurmurError as e:
                log.warning("worker message %s: %s", kind, e)

    async def _on_worker(self, kind: str, body: Any) -> None:
        if kind == "state":
            self.worker_state = body
            event(log, "worker state", state=body)
        elif kind == "ready":
            self.my_base = bytes.fromhex(body["base"])
            if "lineage" in body:
                lid = bytes.fromhex(body["lineage"])
                self.own = lid
                lin = self._lineage(lid, body["name"], self.ident.public, self.my_base)
                lin.relation = "own"
                lin.held = lin.head = max(lin.head, int(body["version"]))
                self.counters["published"] = int(body["version"])
            event(log, "worker ready", **{k: v for k, v in body.items() if k != "tokenizer_hash"})
        elif kind == "rollouts":
            await self._publish_rollouts(body)
        elif kind == "step":
            self.steps += 1
            self._reward(body["reward_mean"])
            self.counters["used"] += int(body.get("n_external_groups", 0)) * self.cfg.training.group_size
            self.step_times.append(float(body["step_s"]))
            self.drops.from_worker(body.get("dropped"))
            event(log, "step", **{k: body[k] for k in ("step", "version", "reward_mean", "loss",
                                                       "n_external_groups", "step_s")})
        elif kind == "gen":
            self._reward(body["reward_mean"])
        elif kind == "published":
            lin = self.lineages[self.own] if self.own in self.lineages else None
            now = time.monotonic()
            if self.last_publish:
                self.version_times.append(now - self.last_publish)
            self.last_publish = now
            self.counters["published"] = int(body["version"])
            if lin is not None:
                lin.head = lin.held = int(body["version"])
            await self._publish_version(body)
        elif kind == "applied":
            lin = self.lineages.get(bytes.fromhex(body["lineage"]))
            if lin is not None:
                if int(body["version"]) > lin.held:
                    self.counters["applied"] += int(body["version"]) - lin.held
                lin.held = int(body["version"])
                lin.need_anchor = bool(body.get("need_anchor", False))
                lin.head = max(lin.head, lin.held)
                if lin.relation == "seen":
                    lin.relation = "follow"
                if not lin.need_anchor and lin.lineage == self.serving:
                    self._staleness(lin.lineage, self.guard.applied(lin.lineage, lin.held, time.monotonic()))
        elif kind == "apply_failed":
            event(log, "patch apply failed", **body)
            lid = bytes.fromhex(body["lineage"])
            self.stored.get(lid, set()).discard(("patch" if int(body["target"]) == int(body["base"]) + 1 else "union",
                                                 int(body["base"]), int(body["target"])))
            store = patchsync.held_store(self.home, lid)
            if store is not None:  # drop the bad item so it is fetched again (from another peer)
                for suffix in (".env", ".bin"):
                    p = store.root / "patches" / f"{int(body['base']):012d}-{int(body['target']):012d}{suffix}"
                    p.unlink(missing_ok=True)
        elif kind == "perf":
            a = 0.3
            self.gen_tps = body["gen_tokens_per_s"] if not self.gen_tps else (1 - a) * self.gen_tps + a * body["gen_tokens_per_s"]
            self.latency = body["rollout_latency_s"] if not self.latency else (1 - a) * self.latency + a * body["rollout_latency_s"]
        elif kind == "spot":
            self.counters["spot_checked"] += 1
            if not body["ok"]:
                self.counters["spot_failed"] += 1
                peer = peer_id_from_public(bytes.fromhex(body["producer"]))
                p = self.service.pipeline
                p.scores.penalise(peer, "spot_check_failed", SPOT_PENALTY, p.clock())
                event(log, "spot check failed", producer=peer, diff=body["diff"])
        elif kind == "engine":
            self.engine = body["mode"] or f"{body['requested']} unavailable: {body['error']}"
            event(log, "worker engine", engine=self.engine)
        elif kind == "error":
            self.worker_error = str(body)
            log.error("worker failed: %s", body)
        elif kind == "log":
            log.warning("worker: %s", body)

    def _reward(self, r: float) -> None:
        if r is None or (isinstance(r, float) and math.isnan(r)):
            return
        self.rewards.append(float(r))
        if len(self.reward_first) < 5:
            self.reward_first.append(float(r))

    async def _publish_rollouts(self, encoded: list[bytes]) -> None:
        rollouts = [wire.decode_struct(b, wire.Rollout, wire.KIND_LIMITS[wire.ROLLOUT_BATCH]) for b in encoded]
        from gossip.validation import rollout_id
        from gossip.transport import PublishError

        for i in range(0, len(rollouts), BATCH_MAX_ROLLOUTS):
            part = rollouts[i:i + BATCH_MAX_ROLLOUTS]
            self.seq = max(self.seq + 1, time.time_ns() // 1000)
            batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=self.cfg.node.swarm, producer=self.ident.public,
                                      seq=self.seq, created_ms=wire.now_ms(), rollouts=part)
            data = wire.seal(self.ident, wire.ROLLOUT_BATCH, batch)
            entries = [dict(rollout_id=rollout_id(r), direction="produced", status="produced",
                            producer=self.ident.public, lineage=bytes(r.lineage), version=r.version,
                            task_set=bytes(r.task.task_set), generator=r.task.generator, task_seed=r.task.seed,
                            reward=r.reward, tokens=len(r.completion_ids), payload=data if j == 0 else None)
                       for j, r in enumerate(part)]
            await trio.to_thread.run_sync(self.store.record_rollouts, entries)
            try:
                await self.service.publish_rollouts(data)
                self.publish_meter.tick(time.time())
                self.counters["rollouts_published"] = self.counters.get("rollouts_published", 0) + len(part)
            except PublishError as e:
                self.counters["publish_failed"] += 1
                log.debug("rollout publish: %s", e)

    # ------------------------------------------------------------ announces and the capacity rule
    def _demand(self) -> wire.LineageDemand | None:
        if self.own is None or self.own not in self.lineages:
            return None
        lin = self.lineages[self.own]
        t = self.cfg.training
        # The capacity rule counts in published versions (the staleness bound is in versions): one
        # version spans `publish_every` optimizer steps, and needs that many steps' external rollouts.
        k = max(1, self.cfg.sync.publish_every)
        if self.version_times:
            step_t = sorted(self.version_times)[len(self.version_times) // 2]
        else:
            step_t = k * sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else 0.0
        b = k * t.external_rollouts * t.group_size
        d = roles.Demand(rollouts_per_step=b, step_time_s=step_t, max_staleness=self.cfg.sync.max_staleness)
        offers = []
        prev_standby = set(lin.activation.standby) if lin.activation else set()
        now = time.monotonic()
        for pid, p in self.peers.items():
            a = p.announce
            if now - p.seen > PEER_EXPIRY_S or "follower" not in a.roles:
                continue
            if bytes(a.serving) == self.own or pid in prev_standby:
                offers.append(roles.Offer(pid, roles.offer_rate(a.gen_tokens_per_s, self.tokens_per_rollout),
                                          a.rollout_latency_s))
        lin.activation = roles.activate(d, offers, self._dissemination_s())
        return wire.LineageDemand(lineage=self.own, name=lin.name, head_version=lin.head, rollouts_per_step=b,
                                  step_time_s=step_t, max_staleness=self.cfg.sync.max_staleness,
                                  standby=lin.activation.standby[:256])

    def _dissemination_s(self) -> float:
        return sorted(self.fetch_s)[len(self.fetch_s) // 2] if self.fetch_s else 0.0

    def _choose_serving(self) -> None:
        if "follower" not in self.roles:
            return
        now = time.monotonic()
        options, by_lineage = [], {}
        for pid, p in self.peers.items():
            if now - p.seen > PEER_EXPIRY_S:
                continue
            for d in p.announce.owned:
                by_lineage[bytes(d.lineage)] = (d, p)
        for lid, (d, p) in by_lineage.items():
            others = sum(roles.offer_rate(q.announce.gen_tokens_per_s, self.tokens_per_rollout)
                         for qid, q in self.peers.items()
                         if bytes(q.announce.serving) == lid and now - q.seen <= PEER_EXPIRY_S)
            options.append(roles.LineageOption(lid, roles.Demand(d.rollouts_per_step, d.step_time_s, d.max_staleness),
                                               others, tuple(d.standby)))
        me = roles.Offer(self.ident.peer_id, roles.offer_rate(self.gen_tps, self.tokens_per_rollout), self.latency)
        configured = [bytes.fromhex(x) for x in self.cfg.sync.follow]
        choice = roles.choose_lineage(me, options, self._dissemination_s(), self.serving, configured=configured)
        self.serving_reason = choice.reason
        self._pace(next((o.demand for o in options if o.lineage == choice.lineage), None))
        if choice.lineage == self.serving:
            return
        if choice.lineage is not None:
            lin = self.lineages.get(choice.lineage)
            base = self._base_for(lin) if lin else b""
            if lin is None or not base:
                self.serving_reason = "waiting for the lineage's base model hash (first patch manifest)"
                return
            lin.relation = "follow"
            lin.base = base
            info = {"id": lin.lineage.hex(), "name": lin.name, "publisher": lin.publisher.hex(), "base": base.hex()}
        else:
            info = None
        self.serving = choice.lineage
        event(log, "serving", lineage=choice.lineage.hex() if choice.lineage else None, reason=choice.reason)
        if self.worker is not None:
            self.worker.send("follow", info)
        if choice.lineage is not None:
            self._observe_head(self.lineages[choice.lineage])
            self._send_admit(choice.lineage)

    def _pace(self, demand: roles.Demand | None) -> None:
        """Cap the follower's generation at its trainer's need, so surplus rollouts do not take CPU from trainers.

        The cap is the whole need `(1+m)·B/T_L` (not the unmet part: announced
        throughputs are capacities, not current rates); 0 means no cap (the
        trainer has not measured a step yet).
        """
        rate = roles.required_rate(demand) if demand is not None else 0.0
        if self.worker is not None and abs(rate - self.pace_rate) > 0.1 * max(rate, self.pace_rate, 1e-9):
            self.pace_rate = rate
            self.worker.send("pace", {"rollouts_per_s": rate})

    def _base_for(self, lin: LineageState) -> bytes:
        from sync.ids import lineage_id

        if lin.base:
            return lin.base
        if self.my_base and len(lin.publisher) == 32 and lineage_id(lin.publisher, self.my_base, lin.name) == lin.lineage:
            return self.my_base
        return b""

    def _announce(self) -> bytes:
        self.announce_seq += 1
        demand = self._demand()
        a = wire.NodeAnnounce(
            v=wire.FORMAT_VERSION, peer_id=self.ident.peer_id, seq=self.announce_seq, created_ms=wire.now_ms(),
            hardware=self.hw_class, gen_tokens_per_s=min(self.gen_tps, 1e9), rollout_latency_s=min(self.latency, 1e6),
            upload_bytes_per_s=float(self.cfg.network.upload_bytes_per_s),
            memory_bytes=self.cfg.node.memory_budget_mb * 2**20, roles=self.roles,
            lineages_followed=[self.serving] if self.serving else [], serving=self.serving or b"",
            owned=[demand] if demand else [],
            addrs=(self.reach.announce_addrs() if getattr(self, "reach", None) else self.transport.listen_addrs())[:16],
            publish_batches_per_s=self.publish_meter.rate(time.time()))
        return wire.seal(self.ident, wire.NODE_ANNOUNCE, a)

    async def _announce_loop(self) -> None:
        from gossip.transport import PublishError

        for i in range(2**62):
            self._choose_serving()
            try:
                await self.service.publish_announce(self._announce())
            except PublishError:
                self.drops.add("announce_unpublished")
            if i % TASK_SET_CHECK_EVERY == 0:
                await self._announce_task_sets()
            now = time.monotonic()
            for pid in [p for p, info in self.peers.items() if now - info.seen > PEER_EXPIRY_S * 4]:
                del self.peers[pid]
            await trio.sleep(ANNOUNCE_EVERY_S)

    async def _announce_task_sets(self) -> None:
        """Task sets signed by this node's key (`murmur tasks publish` stores them) go out on the announce topic.

        Each is sent once when it appears, and again whenever a new peer shows
        up (`_on_node_announce` clears the sent set), so late joiners get it too.
        """
        from gossip.transport import PublishError

        rows = await trio.to_thread.run_sync(self.store.task_sets)
        for ts in rows:
            tid = bytes(ts["task_set_id"])
            if bytes(ts["coordinator"]) != self.ident.public or tid in self.announced_task_sets:
                continue
            if tid not in self.registry:
                try:
                    self.registry.add(ts["envelope"], self._trusted())
                except MurmurError as e:
                    log.warning("own task set %s unusable: %s", tid.hex()[:16], e)
                    continue
            try:
                await self.service.publish_announce(bytes(ts["envelope"]))
            except PublishError:
                self.drops.add("task_set_unpublished")
                return  # no peers yet: try again next round
            self.announced_task_sets.add(tid)
            event(log, "task set announced", name=ts["name"], version=ts["version"], id=tid.hex()[:16])

    # ------------------------------------------------------------ catch-up
    async def _catch_up_loop(self) -> None:
        for i in range(2**62):
            if i % PARTIAL_SWEEP_EVERY == 0:
                trs = list(self.bcast.transfers.values())
                live = {tr.pid.hex() for tr in trs if not tr.session.complete}
                done = {tr.pid.hex() for tr in trs if tr.completed_wall and time.time() - tr.completed_wall > 5.0}
                await trio.to_thread.run_sync(patchsync.sweep_partials, self.home / "partial", live, done,
                                              PARTIAL_KEEP_S)
            lid = self.serving
            if lid is not None and lid in self.lineages:
                try:
                    with trio.fail_after(CATCH_UP_TIMEOUT_S):
                        await self._catch_up(self.lineages[lid])
                except (MurmurError, trio.TooSlowError) as e:
                    log.info("catch-up %s: %s", lid.hex()[:12], e)
                    await trio.sleep(1.0)
            await trio.sleep(0.5)

    async def _catch_up(self, lin: LineageState) -> None:
        """Get from the held version to the head without downloading anything held or already in flight.

        Steady-state versions arrive by the broadcast on their own; this only
        acts when what is held plus what is in flight cannot reach the head
        (joined late, restarted, missed a manifest): it asks the publisher
        (then peers serving the lineage) for its catalog, plans the cheapest
        route with `sync.catchup.choose`, and has the peer seed the missing
        items into the broadcast.
        """
        from sync.catchup import choose
        from sync.patchstore import StoredItem

        lid = lin.lineage
        store = patchsync.held_store(self.home, lid)
        local = await trio.to_thread.run_sync(store.items) if store else []
        self.stored[lid] = {(i.kind, i.base, i.target) for i in local}
        if lin.head <= lin.held and not lin.need_anchor:
            return
        start = None if lin.need_anchor else lin.held
        now = time.time()
        flying = [patchsync.item_of(tr.manifest) for tr in list(self.bcast.transfers.values())
                  if bytes(tr.manifest.lineage) == lid and (tr.session.complete or now - tr.started < IN_FLIGHT_PATIENCE_S)]
        free = {(i.kind, i.base, i.target): StoredItem(i.kind, i.base, i.target, 0) for i in local + flying}
        try:
            choose(start, lin.head, free.values())
            return  # everything needed is held or on its way
        except PatchError:
            pass
        publisher_peer = peer_id_from_public(lin.publisher)
        sources = [publisher_peer] + [pid for pid, p in self.peers.items()
                                      if bytes(p.announce.serving) == lid and pid != publisher_peer]
        connected = set(self.transport.peers())
        last: Exception | None = None
        for peer in [s for s in sources if s in connected][:4]:
            try:
                remote = [i for i in await patchsync.catalog(self.transport, peer, lid)
                          if (i.kind, i.base, i.target) not in free]
                items = list(free.values()) + remote
                head = min(lin.head, max((i.target for i in items), default=0))
                if start is not None and head <= start:
                    continue
                try:
                    plan = choose(start, head, items)
                except PatchError:  # the chain from what we hold was pruned there: an anchor will do
                    plan = choose(None, head, items)
                pids = []
                for step in plan.steps:
                    if (step.kind, step.base, step.target) in free:
                        continue
                    env = await patchsync.offer(self.transport, peer, lid, step)
                    pid = await self.bcast.add_manifest(env)
                    if pid is not None:
                        pids.append(pid)
                event(log, "catching up", lineage=lid.hex()[:16], plan=plan.kind, held=lin.held, head=head,
                      fetch=len(pids), bytes=plan.total_bytes, source=peer)
                for pid in pids:
                    await self.bcast.wait_complete(pid, CATCH_UP_TIMEOUT_S)
                return
            except MurmurError as e:
                last = e
        if last is not None:
            raise last

    # ------------------------------------------------------------ ledger, views
    async def _ledger_loop(self) -> None:
        while True:
            self.ledger = await trio.to_thread.run_sync(self.store.ledger_counts)
            await trio.sleep(1.0)

    async def _view_loop(self) -> None:
        if self.opts.tui and sys.stdout.isatty():
            from rich.live import Live

            from node.dashboard import node_panel

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
            if time.monotonic() - last_log >= 5.0:
                last_log = time.monotonic()
                own = next((x for x in s.lineages if x.relation == "own"), None)
                fol = next((x for x in s.lineages if x.lineage == s.serving), None)
                event(log, "status", peers=len(s.peers), worker=s.worker, steps=s.steps,
                      version=(own or fol).held if (own or fol) else None, lag=fol.lag if fol else None,
                      serving=s.serving[:16], reward=s.reward_now, produced=s.rollouts_produced,
                      accepted=s.rollouts_accepted, rejected=s.rejected, bytes_up=s.bytes_up,
                      bytes_down=s.bytes_down, rss_mb=round(s.memory_rss_mb))
            await trio.sleep(1.0)


def _arm_watchdog() -> None:
    """Whatever hangs during shutdown (a libp2p close, a stuck thread), the process exits 0 in time."""

    def fire() -> None:
        logging.getLogger("murmur.node").warning("shutdown watchdog: exiting")
        logging.shutdown()
        os._exit(0)

    t = threading.Timer(EXIT_DEADLINE_S, fire)
    t.daemon = True
    t.start()


def run_node(cfg: Config, home: Path, opts: RunOptions) -> None:
    """Blocking: run a node until signalled. Creates the home on first use."""
    from node.home import ensure_home

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
