"""The training / generation process of a node (torch lives here, never in the network process).

Started by the runtime with multiprocessing *spawn* and one duplex Pipe. A
reader thread drains the pipe at once into bounded local structures, so the
network process never blocks on a busy worker; the main thread trains or
generates. Messages are the msgspec Structs of `node.pipe` (msgpack bytes,
checked on both ends); `send(kind, body)` builds one from a kind and a mapping.

network -> worker
  Follow(info | None)        lineage to serve as follower {id, name, publisher, base} or None (stand by)
  Patch                      a patch/anchor is in the lineage store: {lineage, kind, base, target}
  Admit                      {lineage, generate}: the node core's staleness guard (sync.staleness) says
                             whether this follower may generate for the lineage (within the bound)
  Pace                       {rollouts_per_s}: cap on a follower's generation rate (its trainer's need; 0 = none)
  Head                       {lineage, version}: a publisher-proven head the core knows (the sampler's staleness rule)
  External(data)             a verified RolloutBatch envelope (the trainer's training.sampler.Sampler, spot checks)
  Stop
worker -> network
  Ready                      {lineage?, name?, base, version, tokenizer_hash, model_bytes}
  State                      loading | waiting-for-tasks | training | generating | standby | catching-up
  Rollouts(items)            encoded wire.Rollout of one group/step, for the network to sign and gossip
  Step                       trainer step stats; Gen: follower group stats
  Published                  {version, envelope}: a new version is in the lineage store
  Applied                    {lineage, version}; ApplyFailed {lineage, base, target, error}
  Perf                       {gen_tokens_per_s, rollout_latency_s}
  Spot                       {ok, producer, lineage, version, diff}
  Engine                     {requested, mode, error}: the engine it opened (training.engine MODE_*) or why not
  Error                      fatal; the worker exits
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from murmur.training.sampler import Sampler
from murmur.training.spotcheck import SPOT_PER_ROUND, SPOT_RATE, SPOT_TOLERANCE

if TYPE_CHECKING:
    from murmur.training.schedule import ScheduledDraw

EXTERNAL_GROUPS_MAX = 256  # informative external groups a trainer worker's sampler holds, unless the spec says
PACE_MAX_WAIT_S = 10.0  # a follower never idles longer than this between groups
FOLLOW_CHECKPOINT_EVERY = 5  # versions between follower checkpoints (plus one at shutdown)
ACCEPTED_SETS_MAX = 256  # task sets counted in the accepted-rollouts tally between two takes
EVAL_EVERY_STEPS = 25  # a trainer measures held-out accuracy every this many steps (and at its first)
# A follower measures the held-out accuracy of the weights it holds when they changed, while its evaluations
# have taken at most this share of its generation time (its first is free): its rollouts are what it is for.
FOLLOW_EVAL_SHARE = 0.1
TASKS_WAIT_S = 2.0  # poll interval while waiting for a chosen task set to arrive
VLLM_PYTHON_VAR = "MURMUR_VLLM_PYTHON"  # the vLLM environment's interpreter, when not the default below
VLLM_ENV_DIR = ".venv-vllm"  # built by `install.sh --vllm cpu|gpu` next to the package
ENGINE_PROBE_TIMEOUT_S = 180.0
_PROBE = (
    "import json, sys\n"
    "from murmur.training.engine_vllm import check_support\n"
    "try:\n"
    "    mode, _ = check_support(sys.argv[1] or None, archs=json.loads(sys.argv[2]) or None)\n"
    "    print(json.dumps({'mode': mode}))\n"
    "except Exception as e:\n"
    "    print(json.dumps({'error': str(e)}))\n"
)


def vllm_python() -> str:
    """The interpreter of the vLLM environment: $MURMUR_VLLM_PYTHON, else `.venv-vllm` in the checkout
    this package runs from, else this interpreter when a vLLM build is installed in it; "" when none."""
    from murmur.training.engine_vllm import installed_build

    env = os.environ.get(VLLM_PYTHON_VAR, "")
    if env:
        return env
    cand = Path(__file__).resolve().parents[2] / VLLM_ENV_DIR / "bin" / "python"
    if cand.exists():
        return str(cand)
    return sys.executable if installed_build()[0] else ""


def worker_python(spec: dict[str, Any]) -> str:
    """The interpreter the worker process runs under, checked now so that a node asked for vLLM fails at
    start with the reason (not installed, not importable, no GPU and no CPU build, unsupported
    architecture) instead of falling back to transformers. The check imports vLLM in a subprocess."""
    return engine_check(spec)[0]


def engine_check(spec: dict[str, Any]) -> tuple[str, str]:
    """(worker interpreter, engine mode) for the spec's engine and model; MurmurError saying why not."""
    import subprocess

    from murmur.gossip.errors import MurmurError
    from murmur.training.engine import MODE_TRANSFORMERS
    from murmur.training.tokenizer import TINY_ARCHS, TINY_NAME

    if spec.get("engine", "transformers") != "vllm":
        return sys.executable, MODE_TRANSFORMERS
    py = vllm_python()
    if not py or not Path(py).exists():
        raise MurmurError(
            f'[training] engine = "vllm" but no vLLM environment was found ({py or VLLM_ENV_DIR}); '
            "build one with `bash install.sh --vllm cpu` (or `--vllm gpu`), or point "
            f"{VLLM_PYTHON_VAR} at an interpreter that has vLLM"
        )
    tiny = spec["model"] == TINY_NAME
    path = "" if tiny else str(Path(spec["model"]).expanduser())
    try:
        r = subprocess.run(
            [py, "-c", _PROBE, path, json.dumps(TINY_ARCHS if tiny else [])],
            capture_output=True,
            text=True,
            timeout=ENGINE_PROBE_TIMEOUT_S,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MurmurError(f"vLLM check under {py} failed: {e}") from None
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    try:
        res = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise MurmurError(f"vLLM check under {py} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}") from None
    if "error" in res:
        raise MurmurError(f'[training] engine = "vllm" cannot be used: {res["error"]}')
    return py, str(res["mode"])


class Inbox:
    """What the reader thread collected; everything bounded."""

    def __init__(
        self, max_groups: int, max_staleness: int, max_rollouts: int | None = None, seed: int = 0, *, swarm: str
    ) -> None:
        self.swarm = swarm  # external batches signed for another swarm are dropped
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.follow: dict | None | Literal["unset"] = "unset"
        self.patches: collections.deque[dict] = collections.deque(maxlen=4096)
        self.admit: dict[str, bool] = {}
        self.pace = 0.0
        self.sampler = Sampler(max_groups, max_staleness, max_rollouts, seed)  # the trainer's external groups
        self.spot: collections.deque[tuple[bytes, Any]] = collections.deque(maxlen=64)
        self.accepted: dict[bytes, int] = {}  # verified swarm rollouts received per task set, since last taken


def _reader(conn: Any, inbox: Inbox) -> None:
    from msgspec.structs import asdict

    from murmur.gossip.errors import DecodeError
    from murmur.node import pipe

    while not inbox.stop.is_set():
        try:
            if not conn.poll(0.5):
                continue
            m = pipe.decode(conn.recv_bytes(pipe.MAX_MESSAGE))
        except (EOFError, OSError):
            inbox.stop.set()  # the network process is gone: stop too
            inbox.wake.set()
            return
        except DecodeError:
            continue
        with inbox.lock:
            if isinstance(m, pipe.Stop):
                inbox.stop.set()
            elif isinstance(m, pipe.Follow):
                inbox.follow = asdict(m.info) if m.info is not None else None
            elif isinstance(m, pipe.Patch):
                inbox.patches.append(asdict(m))
            elif isinstance(m, pipe.Pace):
                inbox.pace = max(0.0, m.rollouts_per_s)
            elif isinstance(m, pipe.Admit):
                inbox.admit[m.lineage] = m.generate
            elif isinstance(m, pipe.Head):
                try:
                    inbox.sampler.observe_head(bytes.fromhex(m.lineage), m.version)
                except ValueError:
                    continue
            elif isinstance(m, pipe.External) and not take_external(inbox, m.data):
                continue
        inbox.wake.set()


def take_external(inbox: Inbox, data: bytes) -> bool:
    """Open a rollout batch the network process sent (`pipe.External`) and hand it to the sampler and the spot
    checks, with `inbox.lock` held; False, and nothing taken, when the envelope does not open.

    The network process verified the batch before sending it (gossip/validation.py, the authoritative check);
    opening it in full here again is defence in depth: the worker decodes it anyway, the signature costs about
    60 us more a batch, and a network-side path that forwarded a batch unverified still trains on nothing unsigned."""
    from murmur.gossip import wire

    try:
        _, batch = wire.open_envelope(data, wire.ROLLOUT_BATCH, swarm=inbox.swarm)
    except Exception:
        return False
    inbox.spot.append((bytes(batch.producer), batch))
    for r in batch.rollouts:
        tid = bytes(r.task.task_set)
        if tid in inbox.accepted or len(inbox.accepted) < ACCEPTED_SETS_MAX:
            inbox.accepted[tid] = inbox.accepted.get(tid, 0) + 1
    inbox.sampler.add_rollouts(batch.rollouts, bytes(batch.producer))
    return True


def follower_eval_due(
    held: tuple[bytes, int],
    last: tuple[bytes, int] | None,
    eval_s: float,
    gen_s: float,
    share: float = FOLLOW_EVAL_SHARE,
) -> bool:
    """Whether a follower holding `held` (lineage, version) evaluates it now, having last evaluated `last`
    (None: never) and spent `eval_s` seconds evaluating against `gen_s` generating."""
    if held == last:
        return False
    return last is None or eval_s <= share * gen_s


class Worker:
    def __init__(self, conn: Any, spec: dict[str, Any]) -> None:
        self.conn = conn
        self.spec = spec
        self.swarm: str = spec["swarm"]  # every envelope it signs or opens names this swarm
        self.home = Path(spec["home"])
        max_rollouts = spec.get("sampler_max_rollouts")
        self.inbox = Inbox(
            int(spec.get("sampler_max_groups", EXTERNAL_GROUPS_MAX)),
            int(spec.get("trainer", {}).get("max_staleness", 4)),
            None if max_rollouts is None else int(max_rollouts),
            int(spec.get("seed", 0)),
            swarm=self.swarm,
        )
        self.rng = random.Random(spec.get("seed", 0) + 7)
        self.spot: Any = None  # training.spotcheck.SpotSampler, on the first round
        self._send_lock = threading.Lock()
        self.tokens = 0
        self.gen_s = 0.0
        self.heldout_tasks = 0  # tasks the last `_evaluate` measured on
        self.eval_s = 0.0  # a follower's time evaluating held-out accuracy (bounded by FOLLOW_EVAL_SHARE)
        self.evaluated: tuple[bytes, int] | None = None  # the (lineage, version) a follower last evaluated
        self.need_anchor = False
        self.held_lineage = b""
        self.engine: Any = None  # loaded in run(); until then nothing is trained on

    def send(self, kind: str, body: Any) -> None:
        from murmur.node import pipe

        data = pipe.encode(kind, body)
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except (OSError, BrokenPipeError):
                self.inbox.stop.set()

    # ------------------------------------------------------------ setup
    def load(self) -> None:
        self.send("state", "loading")  # before the imports: torch and transformers take seconds to import
        from murmur.node.store import open_store
        from murmur.training.engine import open_engine
        from murmur.training.engine_hf import set_threads
        from murmur.training.tasksets import TaskRegistry
        from murmur.training.tiny import load_policy, policy_path

        set_threads(int(self.spec.get("threads", 1)))
        import torch

        torch.set_num_threads(int(self.spec.get("threads", 1)))
        model_home = self.spec.get("model_home") or self.home
        budget = max(64, int(self.spec["memory_budget_mb"]) // 4)
        # the transformers copy: the trainer's fp32 master, and the source of the base state everywhere
        self.engine = load_policy(
            self.spec["model"],
            model_home,
            device=self.spec.get("device", "auto"),
            seed=int(self.spec.get("model_seed", 0)),
            memory_budget_mb=budget,
        )
        self.master = self.engine
        self.registry = TaskRegistry(self.swarm)
        self.registry.add_builtin()
        self.db = open_store(self.home)
        from murmur.node.worker.taskmix import TaskMix
        from murmur.training.tiny import warmup_generators
        from murmur.training.tokenizer import TINY_NAME

        self.tasks = TaskMix(
            self.registry,
            self.db,
            self.spec.get("task_sets") or ["builtin"],
            {bytes.fromhex(k) for k in self.spec.get("trusted", [])},
            warmup_generators() if self.spec["model"] == TINY_NAME else [],
        )
        self.tasks.refresh(force=True)
        from murmur.node.worker.policy import to_published
        from murmur.sync.hashing import canonical_state, state_hash

        # lineages version the bf16 copy (node/worker/policy.py); the base hash is over those bytes
        self.base_state = to_published(canonical_state(self.engine.model))
        self.base_hash = state_hash(self.base_state)
        kind = self.spec.get("engine", "transformers")
        try:
            # the engine that generates (and spot-checks): the master itself, or vLLM on the same weights
            self.engine = open_engine(
                kind,
                policy_path(self.spec["model"], model_home, int(self.spec.get("model_seed", 0))),
                self.master,
                role="trainer" if "trainer" in self.spec["roles"] else "follower",
                memory_budget_mb=int(self.spec["memory_budget_mb"]),
                seed=int(self.spec.get("seed", 0)),
                threads=int(self.spec.get("threads", 1)),
            )
        except Exception as e:
            self.send("engine", {"requested": kind, "mode": "", "error": str(e)})
            raise
        self.send("engine", {"requested": kind, "mode": self.engine.mode, "error": ""})
        if self.engine is not self.master and "trainer" not in self.spec["roles"]:
            self.master = None  # a vLLM follower generates and checks with vLLM only: free the torch copy
        # the network process bounds a lineage's manifests by this size
        self.model_bytes = sum(t.numel() * t.element_size() for t in self.base_state.values())
        self.checker = self.engine  # the engine holding the published weights, for spot checks

    # ------------------------------------------------------------ task sets
    def _wait_for_tasks(self) -> bool:
        """Block (a stop ends it) until the chosen task sets resolve to something; never fall back."""
        said = ""
        while not self.inbox.stop.is_set():
            self.tasks.refresh()
            if self.tasks.mixture:
                return True
            msg = self.tasks.describe_waiting()
            if msg != said:
                self.send("state", "waiting-for-tasks")
                self.send("log", msg)
                self.tasks.save()
                said = msg
            self.inbox.stop.wait(TASKS_WAIT_S)
        return False

    def _take_accepted(self) -> None:
        with self.inbox.lock:
            got, self.inbox.accepted = self.inbox.accepted, {}
        self.tasks.accepted(got)

    def _evaluate(self, step: int) -> float | None:
        """Held-out accuracy of every task set in the mixture that has eval generators (recorded for
        `murmur tasks list`); returns their mean, None when none has any."""
        from murmur.training.evaluation import accuracy_by_family

        max_new = int(self.spec["trainer"]["max_new_tokens"])
        alls = []
        self.heldout_tasks = 0
        for tid, _ in self.tasks.mixture:
            tasks = self.tasks.eval_tasks(tid)
            if tasks:
                acc = accuracy_by_family(self.checker, tasks, max_new)
                self.tasks.record_eval(tid, step, acc)
                alls.append(acc["all"])
                self.heldout_tasks += len(tasks)
        return sum(alls) / len(alls) if alls else None

    # ------------------------------------------------------------ trainer
    def run_trainer(self) -> None:
        from murmur.gossip import wire
        from murmur.gossip.identity import Identity
        from murmur.node.worker.policy import MasterEngine, to_published
        from murmur.sync.errors import NonFiniteWeights
        from murmur.sync.hashing import canonical_state
        from murmur.sync.versions import LineagePublisher
        from murmur.training.rollouts import to_wire
        from murmur.training.trainer import Trainer, TrainerConfig

        ident = Identity.from_seed(bytes.fromhex(self.spec["identity_seed"]))
        s = self.spec
        kw = dict(
            swarm=self.swarm,
            anchor_every=s["anchor_every"],
            chunk_bytes=s["chunk_bytes"],
            retain_versions=s["retain_versions"],
            db=self.db,
        )
        own = self.db.get("own_lineage")
        pub = None
        if own:
            try:
                pub = LineagePublisher.resume(ident, self.home, bytes.fromhex(own), **kw)
                if {n: t.dtype for n, t in pub.base.items()} != {n: t.dtype for n, t in self.base_state.items()}:
                    raise ValueError("stored lineage is not in the published (bf16) layout")
                self.master.load_state(pub.base)
            except Exception as e:  # a damaged store must not stop the node: start the lineage afresh
                self.send("log", f"cannot resume lineage {own[:16]}: {e}; starting a new one")
                pub = None
        if pub is None:
            pub = LineagePublisher(ident, s["lineage_name"], self.base_state, self.home, **kw)
            self.db.put("own_lineage", pub.lineage.id.hex())
        self.pub = pub
        # fp32 master for the optimizer; rollouts are sampled from the published bf16 version (by vLLM
        # when it was asked for: the engine opened in load())
        self.engine = MasterEngine(
            self.master, pub.base, seed=int(s.get("seed", 0)), gen=None if self.engine is self.master else self.engine
        )
        self.checker = self.engine.gen_engine
        self.held_lineage = pub.lineage.id
        self.send(
            "ready",
            {
                "lineage": pub.lineage.id.hex(),
                "name": pub.lineage.name,
                "base": pub.lineage.base_model_hash.hex(),
                "version": pub.version,
                "model_bytes": self.model_bytes,
                "tokenizer_hash": self.engine.tokenizer_hash.hex(),
            },
        )
        cfg = TrainerConfig(**s["trainer"])
        if not self._wait_for_tasks():
            return
        trainer = Trainer(
            self.engine, self.registry, self.tasks.mixture[0][0], cfg, lineage=pub.lineage.id, external=self._external
        )
        trainer.set_mixture(self.tasks.mixture)
        trainer.schedule = self._scheduled_draw()
        self.send(
            "log",
            "training on "
            + ", ".join(
                f"{self.registry.get(t).name} v{self.registry.get(t).version} x{w:g}" for t, w in self.tasks.mixture
            ),
        )
        trainer.version = pub.version
        self._observe_own_head(pub.lineage.id, pub.version)
        publish_every = max(1, int(s.get("publish_every", 1)))
        self.send("state", "training")
        steps = 0
        while not self.inbox.stop.is_set():
            if self.tasks.refresh():  # a new version of a followed set, or a chosen set arrived
                trainer.set_mixture(self.tasks.mixture)
                self.send(
                    "log",
                    "task sets now "
                    + ", ".join(
                        f"{self.registry.get(t).name} v{self.registry.get(t).version} x{w:g}"
                        for t, w in self.tasks.mixture
                    ),
                )
            heldout = self._evaluate(steps) if steps % EVAL_EVERY_STEPS == 0 else None
            t0 = time.monotonic()
            res = trainer.step()
            steps += 1
            self.tokens += res.tokens
            self.tasks.produced(res.rollouts)
            self.tasks.used(res.used_by_set)
            self._take_accepted()
            self.tasks.save()
            if res.rollouts:
                # sampled from the published version pub.version: any peer holding it can spot-check them
                self.send("rollouts", [wire.encode(to_wire(r)) for r in res.rollouts])
            # followers' rollouts of the version we hold, before the next replaces it in the checker
            self._spot_checks(pub.lineage.id, pub.version)
            published = None
            if res.version != pub.version and steps % publish_every == 0:
                try:
                    bundle = pub.publish(to_published(canonical_state(self.engine.model)))
                except NonFiniteWeights as e:  # never signed: back to the last published state
                    trainer.drops["publish_not_finite"] = trainer.drops.get("publish_not_finite", 0) + 1
                    self.master.load_state(pub.base)
                    trainer.opt.state.clear()  # its moments may hold what made the weights non-finite
                    self.send("log", f"{e}; training resumes from version {pub.version}")
                else:
                    self.engine.set_published(pub.base)
                    published = pub.version
                    self.send(
                        "published",
                        {"version": pub.version, "envelope": bundle.envelope, "bytes": bundle.manifest.total_bytes},
                    )
            trainer.version = pub.version
            self._observe_own_head(pub.lineage.id, pub.version)
            with self.inbox.lock:
                sampler_counts = dict(self.inbox.sampler.counts)
            step_s = time.monotonic() - t0
            self.send(
                "step",
                {
                    "step": res.step,
                    "version": pub.version,
                    "reward_mean": res.reward_mean,
                    "loss": res.loss,
                    "n_external_groups": res.n_external_groups,
                    "used": sum(res.external_by_set.values()),
                    "step_s": step_s,
                    "used_by_set": {k.hex(): v for k, v in res.external_by_set.items()},
                    "external_groups": res.trained_external_groups,
                    "external_lineages": res.external_lineages,
                    "updates": res.updates,
                    "trained_groups": res.trained_groups,
                    "heldout": heldout,
                    "heldout_tasks": self.heldout_tasks if heldout is not None else 0,
                    "published": published,
                    "sampler": sampler_counts,
                    "dropped": {
                        **trainer.drops,
                        "worker_inbox_full": sampler_counts["evicted"],
                        "below_min_version": sampler_counts["stale"],
                    },
                    "rollouts_per_step": cfg.local_groups * cfg.group_size,
                },
            )
        self._evaluate(steps)  # the last measurement, for `murmur tasks list` and the demo's summary
        self.tasks.save()

    def _scheduled_draw(self) -> ScheduledDraw | None:
        """The share of prompts drawn from the shared prompt schedule (`[training] schedule_share`,
        training/schedule.py): a `ScheduledDraw` over the task sets this worker holds, None at share 0."""
        from murmur.training.schedule import ScheduleBook, ScheduledDraw

        share = float(self.spec.get("schedule_share", 0.0))
        return ScheduledDraw(ScheduleBook.of(self.registry), share) if share > 0 else None

    def _external(self, max_groups: int, min_version: int, prefer: dict | None = None) -> list:
        """The trainer's `external` hook: J groups from the shared sampler (training/sampler.py), each
        rollout's ids in the vocabulary and decoding to the text that was verified; `prefer` is the
        trainer's rescue selection (its own tasks this step, ranked), which the sampler draws first."""
        from murmur.training.tokencheck import consistent

        t = self.spec.get("trainer", {})
        # J groups of this trainer's own shape: a step's external work in proportion to its own
        budget = max_groups * int(t["group_size"]) * int(t["max_new_tokens"]) if "group_size" in t else None
        with self.inbox.lock:
            taken = self.inbox.sampler.take_rollouts(max_groups, min_version, budget, prefer=prefer)
        return [s for s in taken if self.engine is None or consistent(s.rollout, self.engine)]

    def _observe_own_head(self, lineage: bytes, version: int) -> None:
        # this worker publishes its lineage, so its own version is that lineage's head
        with self.inbox.lock:
            self.inbox.sampler.own = lineage
            self.inbox.sampler.observe_head(lineage, version)

    # ------------------------------------------------------------ follower
    def _checkpoint_dir(self, lineage: bytes) -> Path:
        return self.home / "follow" / lineage.hex()

    def _save_checkpoint(self, follower: Any) -> None:
        from safetensors.torch import save

        from murmur.sync.atomic import atomic_write

        d = self._checkpoint_dir(follower.lineage.id)
        state = {n: t.detach().contiguous().clone() for n, t in follower.live.items()}
        atomic_write(d / "state.safetensors", save(state))
        atomic_write(
            d / "state.json",
            json.dumps({"version": follower.version, "state_hash": follower.state_hash.hex()}).encode(),
        )

    def _open_follower(self, info: dict) -> Any:
        """A LineageFollower at the last durable version this node holds (checkpoint + stored patches)."""
        from safetensors.torch import load_file

        from murmur.sync.errors import PatchError
        from murmur.sync.versions import Lineage, LineageFollower

        lin = Lineage(bytes.fromhex(info["publisher"]), bytes.fromhex(info["base"]), info["name"])
        # the follower patches a bf16 copy (what versions hash); the fp32 compute model mirrors it exactly
        live = {n: t.clone() for n, t in self.base_state.items()}  # whatever we held before, start from the base
        d = self._checkpoint_dir(lin.id)
        if (d / "state.json").exists():
            try:
                meta = json.loads((d / "state.json").read_text())
                state = load_file(str(d / "state.safetensors"))
                if set(state) != set(live) or any(state[n].dtype != live[n].dtype for n in live):
                    raise PatchError("checkpoint tensors differ from the published layout")
                self.need_anchor = False
                follower = LineageFollower(
                    lin,
                    state,
                    version=int(meta["version"]),
                    expected_hash=bytes.fromhex(meta["state_hash"]),
                    home=self.home,
                    db=self.db,
                    keep_patches=False,
                    swarm=self.swarm,
                )
                self.engine.take_version(follower.live, None)
                return follower
            except Exception as e:
                self.send("log", f"follower checkpoint unusable ({e}); starting from the base model")
        self.engine.take_version(live, None)
        self.need_anchor = False
        try:
            return LineageFollower(
                lin, live, version=0, home=self.home, db=self.db, keep_patches=False, swarm=self.swarm
            )
        except PatchError:
            # our base model differs from the publisher's: only an anchor (a full state) can start us
            self.need_anchor = True
            return LineageFollower(
                lin,
                live,
                version=0,
                expected_hash=self.base_hash,
                home=self.home,
                db=self.db,
                keep_patches=False,
                swarm=self.swarm,
            )

    def _apply_held(self, follower: Any) -> int:
        """Apply what the lineage store holds beyond our version (no download), plus announced arrivals."""
        from murmur.sync.catchup import local_plan

        applied = 0
        with self.inbox.lock:
            self.inbox.patches.clear()
        store = follower.store
        for _ in range(10_000):
            plan = local_plan(None if self.need_anchor else follower.version, store.items())
            if plan is None:
                break  # nothing newer, or a gap no stored anchor bridges: the network fetches what is missing
            progressed = False
            for step in plan.steps:
                if self._apply_item(follower, step.kind, step.base, step.target):
                    applied += 1
                    progressed = True
                else:
                    break
            if not progressed:
                break
        return applied

    def _apply_item(self, follower: Any, kind: str, base: int, target: int) -> bool:
        from murmur.sync.errors import NonFiniteWeights, PatchError

        store = follower.store
        try:
            env, payload = store.read_anchor(target) if kind == "anchor" else store.read_patch(base, target)
            applied = follower.apply_stored(env, payload)
        except PatchError as e:
            # a non-finite value comes from chunks the publisher signed, applied to the base it named
            self.send(
                "apply_failed",
                {
                    "lineage": follower.lineage.id.hex(),
                    "base": base,
                    "target": target,
                    "error": str(e),
                    "fault": "non_finite_patch" if isinstance(e, NonFiniteWeights) else "",
                },
            )
            return False
        self.engine.take_version(follower.live, applied.changed)
        if kind == "anchor":
            self.need_anchor = False
        self.send(
            "applied",
            {"lineage": follower.lineage.id.hex(), "version": follower.version, "need_anchor": self.need_anchor},
        )
        if follower.version % FOLLOW_CHECKPOINT_EVERY == 0:
            self._save_checkpoint(follower)
        return True

    def _measure_held(self, lineage: bytes, version: int) -> float | None:
        """Held-out accuracy of the weights a follower holds, recorded per task set at that version."""
        t0 = time.monotonic()
        acc = self._evaluate(version)
        self.eval_s += time.monotonic() - t0
        self.evaluated = (lineage, version)
        return acc

    def _follower_heldout(self, lineage: bytes, version: int) -> float | None:
        """The held version's held-out accuracy when an evaluation is due (`follower_eval_due`), else None."""
        if not follower_eval_due((lineage, version), self.evaluated, self.eval_s, self.gen_s):
            return None
        return self._measure_held(lineage, version)

    def run_follower(self) -> None:
        from murmur.gossip import wire
        from murmur.training.engine import Sampling
        from murmur.training.rollouts import RolloutRec, to_wire
        from murmur.training.tasksets import is_eval
        from murmur.training.verifiers import score

        s = self.spec
        tcfg = s["trainer"]
        sampling = Sampling(temperature=tcfg["temperature"], top_p=1.0, max_new_tokens=tcfg["max_new_tokens"])
        group = int(tcfg["group_size"])
        self.send(
            "ready",
            {
                "base": self.base_hash.hex(),
                "model_bytes": self.model_bytes,
                "tokenizer_hash": self.engine.tokenizer_hash.hex(),
                "version": 0,
            },
        )
        follower = None
        current: dict | None = None
        state = ""
        last_ckpt = -1

        def set_state(x: str) -> None:
            nonlocal state
            if x != state:
                state = x
                self.send("state", x)

        if not self._wait_for_tasks():
            return
        scheduled = self._scheduled_draw()
        set_state("standby")
        while not self.inbox.stop.is_set():
            self.tasks.refresh()
            self._take_accepted()
            with self.inbox.lock:
                want = self.inbox.follow
            if want != "unset" and (want or None) != current:
                if follower is not None and follower.version != last_ckpt:
                    self._save_checkpoint(follower)
                current = want or None
                follower = None
                if current is not None:
                    set_state("catching-up")
                    follower = self._open_follower(current)
                    self.held_lineage = follower.lineage.id
                    self.send(
                        "applied",
                        {
                            "lineage": follower.lineage.id.hex(),
                            "version": follower.version,
                            "need_anchor": self.need_anchor,
                        },
                    )
            if follower is None:
                set_state("standby")
                self.inbox.wake.wait(0.5)
                self.inbox.wake.clear()
                continue
            self._apply_held(follower)
            lid = follower.lineage.id.hex()
            with self.inbox.lock:
                admitted = self.inbox.admit.get(lid, False)
            if self.need_anchor or not admitted:
                set_state("catching-up")  # beyond the staleness bound (or nothing held): no rollouts until caught up
                self.inbox.wake.wait(0.5)
                self.inbox.wake.clear()
                continue
            set_state("generating")
            heldout = self._follower_heldout(follower.lineage.id, follower.version)
            tid = self.rng.choices([t for t, _ in self.tasks.mixture], [w for _, w in self.tasks.mixture])[0]
            drawn = None if scheduled is None else scheduled.draw(tid, wire.now_ms())
            if drawn is not None:  # a prompt of the shared schedule's current round (training/schedule.py)
                ref, schedule_round = drawn
            else:
                gens = [x for x in self.registry.get(tid).generators if not is_eval(x)]
                g = self.rng.choices(gens, weights=[x.weight for x in gens])[0]
                ref, schedule_round = wire.TaskRef(tid, g.name, self.rng.randrange(g.seed_start, g.seed_end)), 0
            task = self.registry.resolve(ref)
            prompt = self.engine.encode(task.prompt)
            t0 = time.monotonic()
            version = follower.version
            res = self.engine.sample([prompt] * group, sampling)
            dt = time.monotonic() - t0
            recs, rewards = [], []
            for ids, lps, _eos in res:
                text = self.engine.decode(ids)
                r = score(task, text)
                rewards.append(r)
                recs.append(
                    RolloutRec(
                        ref=ref,
                        task=task,
                        prompt_ids=prompt,
                        ids=list(ids),
                        text=text,
                        logprobs=list(lps),
                        token_versions=[(0, version)] if ids else [],
                        version=version,
                        lineage=follower.lineage.id,
                        tokenizer_hash=self.engine.tokenizer_hash,
                        sampling=sampling,
                        reward=r,
                        schedule_round=schedule_round,
                    )
                )
            ntok = sum(len(x[0]) for x in res)
            self.tokens += ntok
            self.gen_s += dt
            self.send("rollouts", [wire.encode(to_wire(r)) for r in recs])
            self.tasks.produced(recs)
            self.tasks.save()
            self.send(
                "gen",
                {
                    "reward_mean": sum(rewards) / len(rewards),
                    "version": version,
                    "tokens": ntok,
                    "latency_s": dt,
                    "heldout": heldout,
                    "heldout_tasks": self.heldout_tasks if heldout is not None else 0,
                },
            )
            self.send("perf", {"gen_tokens_per_s": ntok / dt if dt > 0 else 0.0, "rollout_latency_s": dt})
            self._spot_checks(follower.lineage.id, follower.version)
            # the pace is the trainer's need; oversampling makes up for the groups that stay local (all rewards
            # equal: node.core.sealing), so what reaches the trainer comes nearer the need
            self._wait_pace(t0, group / max(1.0, float(s.get("follower_oversample", 1.0))))
        if follower is not None:
            self._save_checkpoint(follower)
            if self.evaluated != (follower.lineage.id, follower.version) and not self.need_anchor:
                self._measure_held(follower.lineage.id, follower.version)  # the last, for the demo's summary
                self.tasks.save()

    def _wait_pace(self, t0: float, produced: float) -> None:
        """Hold the next group until `produced` rollouts fit the pace (a stop ends the wait at once)."""
        with self.inbox.lock:
            pace = self.inbox.pace
        if pace <= 0:
            return
        until = t0 + min(PACE_MAX_WAIT_S, produced / pace)
        for _ in range(int(PACE_MAX_WAIT_S / 0.5) + 2):
            left = until - time.monotonic()
            if left <= 0 or self.inbox.stop.wait(min(left, 0.5)):
                return

    # ------------------------------------------------------------ validator
    def _spot_checks(self, lineage: bytes, version: int) -> None:
        """Recompute log-probs of a sample of received rollouts of (lineage, version), which we hold: a
        validator's followed lineage, and a trainer's own (called before it publishes the next version)."""
        if "validator" not in self.spec["roles"] and "trainer" not in self.spec["roles"]:
            with self.inbox.lock:
                self.inbox.spot.clear()
            return
        from murmur.training.rollouts import logprobs_from_bytes
        from murmur.training.spotcheck import SpotSampler, mean_abs_diff
        from murmur.training.tokencheck import consistent

        if self.spot is None:
            self.spot = SpotSampler(
                float(self.spec.get("spot_rate", SPOT_RATE)), SPOT_PER_ROUND, seed=int(self.spec.get("seed", 0))
            )
        with self.inbox.lock:
            batches = list(self.inbox.spot)
            self.inbox.spot.clear()
        tasks: dict[int, Any] = {}

        def usable(r: Any) -> bool:
            if not consistent(r, self.checker):  # never feed a model ids outside its vocabulary
                return False
            try:
                tasks[id(r)] = self.registry.resolve(r.task)
            except Exception:  # a task set this worker does not hold: nothing to check against
                return False
            return True

        eligible, chosen = self.spot.pick(batches, lineage, version, self.checker.tokenizer_hash, usable)
        if eligible:
            self.send("spot_round", {"eligible": eligible})
        for producer, r in chosen:
            prompt = self.checker.encode(tasks[id(r)].prompt)
            got = self.checker.logprobs([(prompt, list(r.completion_ids))], r.sampling.temperature)[0]
            diff = mean_abs_diff(got, logprobs_from_bytes(r.logprobs))
            if not diff <= SPOT_TOLERANCE:
                self.spot.failed(producer)
                with self.inbox.lock:  # what it pooled is as unproven as what was checked
                    self.inbox.sampler.drop_producer(producer)
            self.send(
                "spot",
                {
                    "ok": diff <= SPOT_TOLERANCE,
                    "producer": producer.hex(),
                    "diff": diff,
                    "lineage": lineage.hex(),
                    "version": version,
                },
            )

    # ------------------------------------------------------------ main
    def run(self) -> None:
        reader = threading.Thread(target=_reader, args=(self.conn, self.inbox), name="murmur-worker-ipc", daemon=True)
        reader.start()
        try:
            self.load()
            if "trainer" in self.spec["roles"]:
                self.run_trainer()
            else:
                self.run_follower()
            self.send("state", "stopped")
        except BaseException as e:  # reported to the network process, then exit
            self.send("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
            raise SystemExit(1) from None
        finally:
            self.inbox.stop.set()


# The network process must answer within yamux's 5 s window waits and keep gossip latency low, and
# uses a fraction of a core; the worker is throughput work that would take every core it can. Lower
# priority lets the network process's loop run first when they contend, at little cost to the worker.
WORKER_NICE = 5


def main(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of the spawned worker process."""
    os.nice(WORKER_NICE)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ.setdefault("MKL_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import signal
    import warnings

    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the network process decides when we stop
    Worker(conn, spec).run()
