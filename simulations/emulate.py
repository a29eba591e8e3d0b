"""Emulation: a scenario as real `murmur node start` processes on this machine.

Each honest node is its own process with its own home (identity, config,
SQLite store), listening on 127.0.0.1 (or, with namespaces, on its own
address), bootstrapped to node 0. Links:
- upload bandwidth: always, through the node's own bulk-transfer limiter
  (`MURMUR_NETWORK_UPLOAD_BYTES_PER_S`, see `wan.node_env`);
- download bandwidth, latency, jitter and loss: only with `MURMUR_SIM_NETNS=1`, as root with
  iproute2: each node then runs in its own network namespace behind a netem
  veth (`wan.NetnsLab`). Otherwise they are not emulated and the report says so.
Churn and events stop nodes with SIGTERM and start them again on the same
home (a restart keeps identity and state). Adversaries run as separate
processes (`simulations.adversary`) with their own libp2p host.
Metrics come from each node's control socket (`murmur node status`), polled
every `report.sample_every_s`.

A node process that exits when the scenario did not stop it (a refused config,
a crash) is a failure: the summary lists it under `nodes_failed` with its exit
code and the last line of its log, and `murmur simulate` exits non-zero. A
node's first step is its first optimizer step (trainer) or first applied
version (follower); `smoke` stops the run once every honest node has taken it, samples every second,
and, whenever every running honest node has taken it, moves the scenario clock on to the next scheduled
join, leave or restart instead of waiting for it (a smoke checks that each node steps, not timing).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from murmur.gossip.errors import MurmurError
from murmur.node.cli import launch
from murmur.node.core.roles import TRAINER_MIN_BUDGET_MB
from murmur.simulations.report import MetricsWriter, write_report
from murmur.simulations.scenario import NodeSpec, Scenario, dumps, expand
from murmur.simulations.vnode import identity_for
from murmur.simulations.wan import LinkSpec, NetnsLab, node_env
from murmur.sync.ids import Relation

MAX_REAL_NODES = 32
STOP_WAIT_S = 8.0
SMOKE_SAMPLE_S = 1.0
LOG = "process.log"  # a node's (or adversary's) stdout and stderr, in its home


class _Proc:
    def __init__(self, spec: NodeSpec, home: Path, addr: str, port: int) -> None:
        self.spec = spec
        self.home = home
        self.addr = addr
        self.port = port
        self.proc: launch.NodeProcess | None = None
        self.peer_id = ""
        self.last_rejected: dict[str, int] = {}
        self.last_bytes = (0, 0)  # (up, down) at its last status
        self.first_step_s: float | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


class Emulation:
    def __init__(self, sc: Scenario, out_dir: str | Path, progress: bool = False, smoke: bool = False) -> None:
        self.sc = sc
        self.out = Path(out_dir)
        self.progress = progress
        self.smoke = smoke
        self.failed: list[dict[str, Any]] = []
        self.specs = expand(sc)
        if len(self.specs) > MAX_REAL_NODES:
            raise MurmurError(
                f"{sc.name}: {len(self.specs)} nodes is over the emulator's limit of {MAX_REAL_NODES} "
                "real processes; use --virtual"
            )
        self.netns = None
        if os.environ.get("MURMUR_SIM_NETNS") == "1":
            self.netns = NetnsLab()
        self.procs: list[_Proc] = []
        self.metrics = MetricsWriter(self.out, sc.report.format)
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.t0 = 0.0

    def _row(self, kind: str, **f: Any) -> None:
        self.rows.setdefault(kind, []).append(f)
        self.metrics.add(kind, **f)

    # ------------------------------------------------------------ setup

    def _prepare(self) -> None:
        from murmur.node.home import init_home
        from murmur.training.tiny import ensure_tiny, tiny_dir

        shared = self.out / "shared-model"
        ensure_tiny(shared, seed=0)
        for s in self.specs:
            home = self.out / "nodes" / f"node{s.index:03d}"
            addr = self.netns.address(s.index) if self.netns else "127.0.0.1"
            p = _Proc(s, home, addr, 4001 if self.netns else launch.free_port())
            if s.role != "adversary":
                ident = init_home(home, force=True)
                p.peer_id = ident.peer_id
                dst = tiny_dir(home)
                if not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(tiny_dir(shared).resolve(), dst)
                launch.write_config(home, self._config(p))
            else:
                home.mkdir(parents=True, exist_ok=True)
                p.peer_id = identity_for(self.sc.seed, s.index).peer_id
            self.procs.append(p)
        if self.netns:
            self.netns.up([LinkSpec.of(s) for s in self.specs])

    def _config(self, p: _Proc) -> dict[str, dict[str, Any]]:
        tr, s, sc = self.sc.training, p.spec, self.sc
        # an auto node configures no roles and the least budget a trainer needs: it chooses, as a volunteer's does
        roles = [] if s.role == "auto" else ["trainer" if s.role == "trainer" else "follower"]
        return {
            "node": {
                "swarm": sc.swarm,
                "roles": roles,
                "hardware": "cpu",
                "memory_budget_mb": TRAINER_MIN_BUDGET_MB if s.role == "auto" else 1024,
            },
            "network": {"dht": False},
            "training": {
                "local_rollouts": tr.local_groups,
                "external_rollouts": tr.external_groups,
                "group_size": tr.group_size,
                "seed": sc.seed * 1000 + s.index,
                "threads": 1,
            },
            "sync": {
                "max_staleness": tr.max_staleness,
                "publish_every": sc.sync.publish_every,
                "chunk_bytes": sc.sync.chunk_bytes,
            },
            "gossip": {
                "rate_limit_per_s": sc.gossip.rate_limit_per_s,
                "rate_burst": sc.gossip.rate_burst,
                "graylist_threshold": sc.gossip.graylist_threshold,
            },
        }

    def _bootstrap(self, exclude: int) -> list[str]:
        first = next(p for p in self.procs if p.spec.role != "adversary" and p.spec.index != exclude)
        return [f"/ip4/{first.addr}/tcp/{first.port}/p2p/{first.peer_id}"]

    def _start(self, p: _Proc) -> None:
        if p.alive:
            return
        env = node_env(LinkSpec.of(p.spec))
        prefix = self.netns.exec_prefix(p.spec.index) if self.netns else []
        listen = f"/ip4/{p.addr}/tcp/{p.port}"
        boot = self._bootstrap(p.spec.index) if p.spec.index != self.procs[0].spec.index else []
        if p.spec.role == "adversary":
            cmd = [
                sys.executable,
                "-m",
                "murmur.simulations.adversary",
                identity_for(self.sc.seed, p.spec.index).seed.hex(),
                self.sc.swarm,
                p.spec.behaviour or "",
                str(p.spec.rate_per_s),
                str(self.sc.duration_s),
                listen,
                *boot,
            ]
            p.proc = launch.spawn(prefix + cmd, p.home, LOG, env)
        else:  # the config was written once in _prepare: a restart keeps it
            p.proc = launch.start(
                launch.NodeLaunch(home=str(p.home), listen=[listen], bootstrap=boot, env=env, prefix=prefix, log=LOG)
            )
        self._row("event", t=self._t(), node=p.spec.index, action="join")

    def _stop(self, p: _Proc) -> None:
        self._reap(p)
        if not p.alive:
            return
        assert p.proc is not None
        launch.stop_all([p.proc], STOP_WAIT_S)
        p.proc = None  # a planned exit: nothing for _reap to find
        self._row("event", t=self._t(), node=p.spec.index, action="leave")

    def _stop_all(self) -> None:
        """Stop every node at once: each gets SIGTERM before any is waited for, so their shutdowns overlap."""
        for p in self.procs:
            self._reap(p)
        alive = [p for p in self.procs if p.alive]
        launch.stop_all([p.proc for p in alive if p.proc is not None], STOP_WAIT_S)
        for p in alive:
            p.proc = None
            self._row("event", t=self._t(), node=p.spec.index, action="leave")

    def _reap(self, p: _Proc) -> None:
        """Record a process that exited although the scenario did not stop it."""
        if p.proc is None or p.proc.alive():
            return
        self.failed.append(
            {
                "node": p.spec.index,
                "group": p.spec.group,
                "role": p.spec.role,
                "t": round(self._t(), 1),
                "exit_code": p.proc.returncode(),
                "last_log_line": p.proc.last_log_line(),
            }
        )
        self._row("event", t=self._t(), node=p.spec.index, action="failed")
        p.proc = None

    def _done(self) -> bool:
        """Smoke runs end once every honest node has taken its first step, or at the first failure."""
        return self.smoke and (
            bool(self.failed) or all(p.first_step_s is not None for p in self.procs if p.spec.role != "adversary")
        )

    def _t(self) -> float:
        return time.monotonic() - self.t0 if self.t0 else 0.0

    def _waiting_for_a_step(self) -> bool:
        return any(p.alive and p.first_step_s is None for p in self.procs if p.spec.role != "adversary")

    # ------------------------------------------------------------ run

    def _schedule(self) -> list[tuple[float, str, int]]:
        import random

        sc = self.sc
        ev: list[tuple[float, str, int]] = []
        for s in self.specs:
            ev.append((s.join_s, "join", s.index))
            if s.leave_s is not None:
                ev.append((s.leave_s, "leave", s.index))
        for e in sc.events:
            if e.action == "restart":
                ev += [(e.at_s, "leave", e.node), (e.at_s + e.down_s, "join", e.node)]
            else:
                ev.append((e.at_s, e.action, e.node))
        if sc.churn.leaves_per_min > 0:
            rng = random.Random(sc.seed)
            honest = [i for i in range(sc.honest_nodes) if i not in set(sc.churn.protect) and i != 0]
            t = sc.churn.start_s
            for _ in range(10_000):
                t += rng.expovariate(sc.churn.leaves_per_min / 60.0)
                if t >= sc.duration_s or not honest:
                    break
                i = rng.choice(honest)
                ev += [(t, "leave", i), (t + sc.churn.down_s, "join", i)]
        return sorted(ev)

    def _sample(self) -> None:
        t = self._t()
        for p in self.procs:
            if p.spec.role == "adversary" or p.proc is None or not p.alive:
                continue
            s = p.proc.status(2.0)
            if s is None:
                continue
            if p.first_step_s is None and (s.steps > 0 or s.versions_applied > 0):
                p.first_step_s = t
            if s.reward_now is not None:
                self._row(
                    "reward",
                    t=t,
                    node=p.spec.index,
                    reward=s.reward_now,
                    isolated=None,
                    version=s.versions_published,
                    group=p.spec.group,
                )
            for lin in s.lineages:
                if lin.relation == Relation.FOLLOW:
                    self._row("lag", t=t, node=p.spec.index, lag=lin.lag)
            for reason, n in s.rejected.items():
                new = n - p.last_rejected.get(reason, 0)
                for _ in range(max(0, min(new, 1000))):
                    self._row("rejection", t=t, node=p.spec.index, peer=-1, reason=reason)
            p.last_rejected = dict(s.rejected)
            p.last_bytes = (s.bytes_up, s.bytes_down)

    def run(self) -> dict[str, Any]:
        wall = time.monotonic()
        self._prepare()
        events = self._schedule()
        self.t0 = time.monotonic()
        by_index = {p.spec.index: p for p in self.procs}
        next_sample = 0.0
        sample_every = (
            min(self.sc.report.sample_every_s, SMOKE_SAMPLE_S) if self.smoke else self.sc.report.sample_every_s
        )
        k = 0
        try:
            while self._t() < self.sc.duration_s and not self._done():
                if self.smoke and k < len(events):
                    skip = smoke_skip(self._t(), events[k][0], self._waiting_for_a_step())
                    self.t0 -= skip
                for p in self.procs:
                    self._reap(p)
                now = self._t()
                while k < len(events) and events[k][0] <= now:
                    _, action, i = events[k]
                    (self._start if action == "join" else self._stop)(by_index[i])
                    k += 1
                if now >= next_sample:
                    self._sample()
                    next_sample = now + sample_every
                    if self.progress:
                        print(
                            f"\remulate {self.sc.name}: {now:6.0f}/{self.sc.duration_s:g} s, "
                            f"{sum(p.alive for p in self.procs)} up",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                wake = min(next_sample, events[k][0] if k < len(events) else self.sc.duration_s, self.sc.duration_s)
                time.sleep(max(0.05, min(1.0, wake - self._t())))
        finally:
            self._stop_all()
            if self.netns:
                self.netns.down()
        for p in self.procs:
            up, down = p.last_bytes
            self._row("bytes", node=p.spec.index, group=p.spec.group, bytes_up=up, bytes_down=down)
        rewards = self.rows.get("reward", [])
        summary: dict[str, Any] = {
            "title": f"Murmur emulation: {self.sc.name}",
            "mode": "emulate",
            "scenario": self.sc.name,
            "seed": self.sc.seed,
            "nodes": len(self.specs),
            "nodes_failed": self.failed,
            "nodes_stepped": sum(p.first_step_s is not None for p in self.procs),
            "slowest_first_step_s": max(
                (p.first_step_s for p in self.procs if p.first_step_s is not None), default=None
            ),
            "wall_s": round(time.monotonic() - wall, 1),
            "links": "upload via node limiter; download, latency, loss via netem namespaces"
            if self.netns
            else "upload via node limiter only (download rate, latency, jitter, loss not emulated: "
            "set MURMUR_SIM_NETNS=1 as root)",
            "reward_samples": len(rewards),
            "final_reward_mean": (
                sum(r["reward"] for r in rewards[-len(self.procs) :]) / len(rewards[-len(self.procs) :])
                if rewards
                else None
            ),
            "rejections": {
                r: sum(1 for x in self.rows.get("rejection", []) if x["reason"] == r)
                for r in {x["reason"] for x in self.rows.get("rejection", [])}
            },
            "graylist_threshold": self.sc.gossip.graylist_threshold,
        }
        self.metrics.close()
        write_report(
            self.out,
            self.rows,
            summary,
            dumps(self.sc),
            title=summary["title"],
            notes=summary["links"],
            threshold=self.sc.gossip.graylist_threshold,
            plots=self.sc.report.plots,
        )
        return summary


def smoke_skip(now: float, next_event_s: float, waiting_for_a_step: bool) -> float:
    """How far a smoke run moves its scenario clock on: to the next scheduled event, once no running node
    still has its first step to take (nothing is left to watch until then)."""
    return 0.0 if waiting_for_a_step else max(0.0, next_event_s - now)


def run_emulation(sc: Scenario, out_dir: str | Path, progress: bool = False, smoke: bool = False) -> dict[str, Any]:
    return Emulation(sc, out_dir, progress, smoke).run()
