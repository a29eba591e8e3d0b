"""Gossip benchmark, and the honest/adversarial message factories its tests share.

`run_exchange(nodes)` starts `nodes` processes, each a producer at a fixed rate and a consumer of a fixed
demand on the rollout exchange (`gossip.exchange`: shard topics), and reports per-consumer inbound,
verification CPU, used over verified, distinct producers and delivery latency.
`run(nodes=8)` starts `nodes` real py-libp2p hosts as separate processes
(nodes-1 honest publishers and one adversary) on 127.0.0.1, in a full mesh,
publishes paced signed rollout batches and measures delivery and latency
(publish -> accepted at the last honest node), then measures the verification
pipeline alone on one core. See docs/gossip.md for why processes and the pacing.
"""

from __future__ import annotations

import os
import struct
import subprocess
import time
from typing import Any

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.training.schedule import ScheduleBook
from murmur.training.tasksets import BUILTIN_TRAIN

SWARM = "bench"
LINEAGE = b"\x4c" * 32
TOKENIZER = b"\x54" * 32


def registry() -> Any:
    from murmur.training.tasksets import TaskRegistry

    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    return reg


def make_rollout(
    reg: Any,
    seed: int,
    tokens: int = 256,
    version: int = 0,
    lineage: bytes = LINEAGE,
    forge: bool = False,
    task_set: bytes | None = None,
    generator: str | None = None,
) -> wire.Rollout:
    """A rollout on the built-in task set whose claimed reward is the true one (unless `forge`)."""
    from murmur.training.verifiers import score

    task_set = task_set if task_set is not None else reg.builtin_id
    if generator is None:  # the set's first training generator (the built-in set's: BUILTIN_TRAIN)
        generator = reg.get(task_set).generators[0].name if task_set in reg else BUILTIN_TRAIN
    ref = wire.TaskRef(task_set=task_set, generator=generator, seed=seed)
    try:
        task = reg.resolve(ref)
        text = task.answer if seed % 2 == 0 else "no idea"
        reward = score(task, text)
    except Exception:
        text, reward = "0", 0.0
    if forge:
        reward = 1.0 - reward
    return wire.Rollout(
        task=ref,
        lineage=lineage,
        version=version,
        completion_ids=[(seed + i) % 50_000 for i in range(tokens)],
        text=text,
        tokenizer_hash=TOKENIZER,
        logprobs=struct.pack(f"<{tokens}f", *([-0.25] * tokens)),
        token_versions=[(0, version)],
        sampling=wire.SamplingParams(max_new_tokens=max(1, tokens)),
        reward=reward,
        created_ms=wire.now_ms(),
    )


def make_batch(
    ident: Identity,
    reg: Any,
    seq: int,
    n: int = 4,
    tokens: int = 64,
    swarm: str = SWARM,
    version: int = 0,
    created_ms: int | None = None,
    **kw: Any,
) -> bytes:
    seeds = [(seq * 1009 + i * 7) % 1_000_000 for i in range(n)]
    return seal_rollouts(ident, [make_rollout(reg, s, tokens, version, **kw) for s in seeds], seq, swarm, created_ms)


def seal_rollouts(
    ident: Identity, rollouts: list[wire.Rollout], seq: int, swarm: str = SWARM, created_ms: int | None = None
) -> bytes:
    """`rollouts` as one batch signed by `ident` for `swarm`, created at `created_ms` (default: now)."""
    batch = wire.RolloutBatch(
        v=wire.FORMAT_VERSION,
        swarm=swarm,
        producer=ident.public,
        seq=seq,
        created_ms=wire.now_ms() if created_ms is None else created_ms,
        rollouts=rollouts,
    )
    return wire.seal(ident, wire.ROLLOUT_BATCH, batch, swarm=swarm)


def resign_with(signer: Identity, claimed: Identity, data: bytes) -> bytes:
    """The same body, claiming `claimed` as signer but signed by `signer`: a bad signature."""
    env = wire.decode_envelope(data, swarm=SWARM)
    sig = signer.sign(wire.signing_domain(env.kind, env.v, env.swarm) + env.body)
    return wire.encode(wire.Envelope(env.v, env.kind, env.swarm, env.body, claimed.public, sig))


# ------------------------------------------------------------ pipeline throughput

VERIFY_KINDS = ("numeric", "math_verify", "rg_score")
VERIFY_BATCH = 32  # a trainer's step as the node sends it: local_rollouts (4) x group_size (8)
VERIFY_GROUP = 8  # completions of one prompt (same task) in a batch
REASONING_CHARS = 1200  # ~300 tokens of a BPE tokenizer; murmur-tiny's ids are characters
_COORDINATOR = Identity.from_seed(b"\x0b" * 32)


def verify_registry() -> tuple[Any, dict[str, bytes]]:
    """The built-in set plus one task set per verifier kind, trusted."""
    from murmur.training.tasksets import sign_task_set

    reg = registry()
    ids: dict[str, bytes] = {}
    gens = {
        "numeric": wire.GeneratorSpec(
            name="arith", generator="arithmetic", config={"digits": 2, "ops": "+-*"}, seed_start=0, seed_end=2**40
        ),
        "math_verify": wire.GeneratorSpec(
            name="arith", generator="arithmetic", config={"digits": 2, "ops": "+-*"}, seed_start=0, seed_end=2**40
        ),
        "rg_score": wire.GeneratorSpec(
            name="arith",
            generator="rg:basic_arithmetic",
            config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
            seed_start=0,
            seed_end=2**40,
        ),
    }
    for kind, gen in gens.items():
        m = wire.TaskSetManifest(
            v=wire.FORMAT_VERSION,
            name=f"bench-{kind}",
            version=1,
            coordinator=_COORDINATOR.public,
            created_ms=1,
            verifier=kind,
            tolerance=0.0,
            generators=[gen],
        )
        env = sign_task_set(_COORDINATOR, m, swarm=SWARM)
        reg.add(env, {_COORDINATOR.public})
        ids[kind] = wire.content_id(wire.decode_envelope(env, swarm=SWARM).body)
    return reg, ids


def _reasoning(rng: Any, question: str) -> str:
    # murmur-tiny's characters are printable ASCII: sentences, no line breaks
    words = [
        "first",
        "we",
        "add",
        "the",
        "tens",
        "then",
        "carry",
        "check",
        "again",
        "so",
        "multiply",
        "digits",
        "which",
        "gives",
        "subtract",
        "result",
        "step",
        "next",
        "value",
        "is",
    ]
    parts = [f"Let me work through {question.strip()[:80]} step by step."]
    while sum(len(x) + 1 for x in parts) < REASONING_CHARS:
        parts.append(" ".join(rng.choice(words) for _ in range(8)) + f" {rng.randint(0, 999)}.")
    return " ".join(parts)


def _answer_forms(kind: str, answer: str, rng: Any) -> str:
    """How a policy trained on the answer format ends: mostly the plain value in <answer> or
    \\boxed{}, a quarter wrong, and for math_verify 15% in another form, one in five of
    which (3% of all) only the sympy-based math-verify package can settle."""
    roll = rng.random()
    if roll < 0.25:
        return f"<answer>{rng.randint(-99, 999)}</answer>"  # wrong
    if kind == "math_verify" and roll < 0.40:
        v = int(answer)
        return rng.choice(
            [
                f"\\boxed{{\\frac{{{2 * v}}}{{2}}}}",
                f"\\boxed{{{v}.0}}",
                f"\\boxed{{{v} + 0}}",
                f"<answer>$x = {v}$</answer>",
                f"\\boxed{{\\sqrt{{{v * v}}}}}" if v >= 0 else f"\\boxed{{-\\sqrt{{{v * v}}}}}",
            ]
        )
    if roll < 0.45:
        return f"The answer is \\boxed{{{answer}}}"
    return f"<answer>{answer}</answer>"


def verify_messages(kind: str, reg: Any, task_set: bytes, tokens: Any, rounds: int, seed: int = 0) -> list[bytes]:
    """`rounds` x 4 batches of VERIFY_BATCH realistic rollouts (distinct tasks, groups of
    VERIFY_GROUP on one task), named for murmur-tiny's tokenizer so the token check runs."""
    import random

    from murmur.training.verifiers import score

    rng = random.Random(seed)
    ident = Identity.from_seed(b"\x78" * 32)
    out = []
    for b in range(rounds * 4):
        rollouts = []
        for _ in range(VERIFY_BATCH // VERIFY_GROUP):
            ref = wire.TaskRef(task_set=task_set, generator="arith", seed=rng.randrange(2**40))
            task = reg.resolve(ref)
            for _ in range(VERIFY_GROUP):
                text = _reasoning(rng, task.prompt) + " " + _answer_forms(kind, task.answer, rng)
                ids = list(tokens.tokenizer.encode(text, add_special_tokens=False))
                rollouts.append(
                    wire.Rollout(
                        task=ref,
                        lineage=LINEAGE,
                        version=0,
                        completion_ids=ids,
                        text=tokens.decode(ids),
                        tokenizer_hash=tokens.hash,
                        logprobs=struct.pack(f"<{len(ids)}f", *([-0.25] * len(ids))),
                        token_versions=[(0, 0)],
                        sampling=wire.SamplingParams(max_new_tokens=wire.MAX_COMPLETION_TOKENS),
                        reward=score(task, tokens.decode(ids)),
                        created_ms=wire.now_ms(),
                    )
                )
        batch = wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=SWARM,
            producer=ident.public,
            seq=b + 1,
            created_ms=wire.now_ms(),
            rollouts=rollouts,
        )
        out.append(wire.seal(ident, wire.ROLLOUT_BATCH, batch, swarm=SWARM))
    return out


def verify_throughput(rounds: int = 8) -> dict[str, Any]:
    """Rollouts per CPU-second through the whole pipeline as a node runs it, per verifier kind:
    signature, decode, token check (murmur-tiny tokenizer), task regeneration and reward in
    the time-limited verifier pool (one worker process). CPU = this process + the pool worker."""
    from murmur.gossip.validation import Pipeline, PipelineConfig
    from murmur.training.tokencheck import for_model
    from murmur.training.verifiers import TIME_LIMIT_S, VerifierPool, score

    reg, ids = verify_registry()
    tokens = for_model("murmur-tiny")
    cfg = PipelineConfig(swarm=SWARM, rate_per_s=1e9, burst=10**9)
    producer = Identity.from_seed(b"\x78" * 32).peer_id
    out: dict[str, Any] = {
        "verify_batch": VERIFY_BATCH,
        "verify_group": VERIFY_GROUP,
        "verify_time_limit_s": TIME_LIMIT_S,
    }
    sizes = []
    for kind in VERIFY_KINDS:
        msgs = verify_messages(kind, reg, ids[kind], tokens, rounds)
        sizes += [len(m) for m in msgs]
        with VerifierPool(workers=1) as pool:
            pool.score_batch([])  # start the worker (imports) outside the measurement
            # every batch once: distinct tasks, cold task and verdict caches but for the
            # groups of one prompt inside a batch, as a node meets them
            p = Pipeline(
                cfg,
                clock=time.time,
                resolve_task=reg.resolve,
                reward=score,
                head_version=lambda _: None,
                reward_batch=pool.score_batch,
                check_tokens=tokens,
            )
            cpu0, pool0 = time.process_time(), pool.cpu_s
            for m in msgs:
                v = p.check(m, producer)
                if not v.accepted:
                    raise RuntimeError(f"benchmark batch rejected: {v.reason} {v.detail}")
            parent, child = time.process_time() - cpu0, pool.cpu_s - pool0
        n = len(msgs) * VERIFY_BATCH
        out[f"verify_per_s_core_{kind}"] = round(n / (parent + child), 1)
        out[f"verify_pool_cpu_share_{kind}"] = round(child / (parent + child), 3)
    out["verify_per_s_core"] = min(out[f"verify_per_s_core_{k}"] for k in VERIFY_KINDS)
    out["verify_batch_kb_mean"] = round(sum(sizes) / len(sizes) / 1024, 1)
    return out


# ------------------------------------------------------------ multi-process swarm


def _bad_messages(mal: Identity, other: Identity, victim: Identity, reg: Any, k: int) -> bytes:
    """The k-th adversarial message, cycling through every class of bad input."""
    seq = 10_000 + k
    kinds = [
        lambda: b"\x00\xffgarbage" * 8,
        lambda: make_batch(mal, reg, seq, n=1, tokens=8, version=0, lineage=b"\x5a" * 32),  # stale (head 100)
        lambda: make_batch(mal, reg, seq, n=1, tokens=8, task_set=b"\xee" * 32),
        lambda: make_batch(other, reg, seq, n=1, tokens=8),  # signed by another key
        lambda: make_batch(mal, reg, seq, n=1, tokens=8, forge=True),
        lambda: resign_with(mal, victim, make_batch(victim, reg, seq, n=1, tokens=8)),
        lambda: b"\x01" * (600 * 1024),
    ]
    return kinds[k % len(kinds)]()


async def _child(index: int, role: str, params: dict[str, Any]) -> None:
    import json
    import sys

    import trio

    from murmur.gossip.host import open_transport
    from murmur.gossip.service import GossipService
    from murmur.gossip.validation import Pipeline, PipelineConfig, Verdict
    from murmur.training.verifiers import score

    reg = registry()
    ident = Identity.from_seed(bytes([index + 1]) * 32)
    stdin = trio.wrap_file(sys.stdin)

    def say(*parts: Any) -> None:
        print(*parts, flush=True)

    cfg = PipelineConfig(swarm=SWARM, rate_per_s=params["rate_limit"], burst=params["burst"])
    heads = {b"\x5a" * 32: 100}
    pipeline = Pipeline(
        cfg,
        clock=time.time,
        resolve_task=reg.resolve,
        reward=score,
        head_version=heads.get,
        task_set_trusted=reg.__contains__,
        schedule=ScheduleBook.of(reg),
    )
    accepted: dict[str, float] = {}
    async with open_transport(ident) as t, trio.open_nursery() as nursery:
        service = GossipService(t, pipeline, SWARM)

        def on_accept(v: Verdict) -> None:
            if v.batch is not None:  # an accepted verdict carries its batch
                accepted.setdefault(f"{v.batch.producer.hex()}:{v.batch.seq}", time.time())

        service.on_accept = on_accept
        await nursery.start(service.run)
        say("ADDR", t.listen_addrs()[0])
        peers = (await stdin.readline()).split()[1:]
        for a in peers:
            await t.connect(a)
        say("READY")
        want = int((await stdin.readline()).split()[1])
        with trio.fail_after(60):
            while len(t.topic_peers(service.rollout_topic)) < want:
                await trio.sleep(0.05)
            await t._top_up_mesh(service.rollout_topic)
        say("MESH")
        start = float((await stdin.readline()).split()[1])
        sent: dict[str, float] = {}
        errors = 0
        await trio.sleep_until(trio.current_time() + max(0.0, start - time.time()))
        if role == "honest":
            gap = 1.0 / params["rate_per_node"]
            await trio.sleep(gap * index / params["nodes"])  # stagger publishers
            for seq in range(1, params["batches"] + 1):
                data = make_batch(ident, reg, seq, n=params["rollouts"], tokens=params["tokens"])
                t_pub = time.time()
                try:
                    await service.publish_rollouts(data)
                    sent[f"{ident.public.hex()}:{seq}"] = t_pub
                except Exception as e:
                    print("publish failed:", e, file=sys.stderr)
                    errors += 1
                await trio.sleep(gap)
        else:
            other, victim = Identity.from_seed(b"\xfe" * 32), Identity.from_seed(b"\x01" * 32)
            for k in range(params["adversarial"]):
                with trio.move_on_after(2):
                    while max((len(q) for q in t.pubsub.peer_queues.values()), default=0) > 8:
                        await trio.sleep(0.005)
                try:
                    await t._top_up_mesh(service.rollout_topic)
                    await t.pubsub.publish(service.rollout_topic, _bad_messages(ident, other, victim, reg, k))
                    sent[f"bad:{k}"] = time.time()
                except Exception:  # banned and disconnected everywhere: nothing left to attack
                    errors += 1
                await trio.sleep(params["adv_gap"])
        expect = params["expect"] if role == "honest" else 0
        with trio.move_on_after(params["timeout"]):
            while len(accepted) < expect:
                await trio.sleep(0.05)
        await trio.sleep(1.0)  # late arrivals (an adversary's) would show up here
        mal = Identity.from_seed(bytes([params["nodes"]]) * 32).peer_id
        say(
            "DONE",
            json.dumps(
                dict(
                    sent=sent,
                    accepted=accepted,
                    errors=errors,
                    counts=dict(pipeline.counts),
                    mal_score=pipeline.scores.score(mal, time.time()),
                    mal_banned=pipeline.scores.is_blacklisted(mal, time.time()),
                )
            ),
        )
        await stdin.readline()
        nursery.cancel_scope.cancel()


def _spawn(entry: str, args: str, params: dict[str, Any]) -> subprocess.Popen[str]:
    """One bench node process running `entry(*args, params)` under trio, spoken to line by line."""
    import json
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    code = (
        f"import trio, json; from murmur.simulations.bench.gossip import {entry}; "
        f"trio.run({entry}, {args}, json.loads({json.dumps(json.dumps(params))}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _expect(p: subprocess.Popen[str], word: str) -> str:
    """The rest of the bench node's next line, which must start with `word`."""
    line = p.stdout.readline() if p.stdout else ""
    if not line.startswith(word):
        raise RuntimeError(f"bench node said {line!r}, expected {word}")
    return line[len(word) :].strip()


def _send(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _start_and_collect(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Start every bench node at one instant, read each one's DONE summary, then let them exit (a crashed
    node's stderr shows above)."""
    import json

    start = time.time() + 0.5
    for p in procs:
        _send(p, f"START {start}")
    results = [json.loads(_expect(p, "DONE")) for p in procs]
    for p in procs:
        _send(p, "EXIT")
    return results


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def run_swarm(
    nodes: int,
    batches_per_node: int,
    rate_per_node: float,
    rollouts_per_batch: int,
    tokens: int,
    adversarial: bool,
    timeout_s: float,
) -> dict[str, Any]:
    honest = nodes - 1 if adversarial else nodes
    params = dict(
        nodes=nodes,
        batches=batches_per_node,
        rate_per_node=rate_per_node,
        rollouts=rollouts_per_batch,
        tokens=tokens,
        rate_limit=20.0,
        burst=40,
        expect=(honest - 1) * batches_per_node,
        adversarial=batches_per_node * 7 if adversarial else 0,
        adv_gap=1.0 / (10 * 20.0),
        timeout=timeout_s,
    )
    procs: list[subprocess.Popen] = []
    try:
        for i in range(nodes):
            role = "adversary" if adversarial and i == nodes - 1 else "honest"
            procs.append(_spawn("_child", f"{i}, {role!r}", params))
        addrs = [_expect(p, "ADDR") for p in procs]
        for i, p in enumerate(procs):
            _send(p, "PEERS " + " ".join(addrs[:i]))
            _expect(p, "READY")
        for p in procs:
            _send(p, f"WANT {nodes - 1}")
        for p in procs:
            _expect(p, "MESH")
        results = _start_and_collect(procs)
    finally:
        _reap(procs)
    hon = results[:honest]
    sent = {k: v for r in hon for k, v in r["sent"].items()}
    lat, delivered = [], 0
    for key, t_pub in sent.items():
        receivers = [r for r in hon if key not in r["sent"]]
        got = [r["accepted"].get(key) for r in receivers]
        if all(g is not None for g in got):
            delivered += 1
            lat.append((max(got) - t_pub) * 1000)
    lat.sort()
    bad_sent = len(results[-1]["sent"]) if adversarial else 0
    adv_pub = Identity.from_seed(bytes([nodes]) * 32).public.hex() if adversarial else ""
    adv_accepted = sum(1 for r in hon for k in r["accepted"] if k.startswith(adv_pub + ":")) if adversarial else 0

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else float("nan")

    return dict(
        nodes=nodes,
        honest_nodes=honest,
        processes=True,
        rollouts_sent=len(sent) * rollouts_per_batch,
        batches_sent=len(sent),
        delivery_ratio=round(delivered / max(1, len(sent)), 4),
        p50_ms=pct(0.5),
        p95_ms=pct(0.95),
        max_ms=round(lat[-1], 1) if lat else float("nan"),
        publish_errors=sum(r["errors"] for r in hon),
        adversarial_sent=bad_sent,
        adversarial_accepted=adv_accepted,
        adversary_graylisted_at=sum(1 for r in hon if r["mal_score"] < -50.0),
        adversary_banned_at=sum(1 for r in hon if r["mal_banned"]),
        rate_per_node=rate_per_node,
        rollouts_per_batch=rollouts_per_batch,
        tokens=tokens,
    )


# ------------------------------------------------------------ the rollout exchange at a fixed rate and demand


REAL_PRODUCER_FACTOR = 5.0  # a real producer makes this many times one consumer's demand (generation outruns use)


def bench_lineage(ident: Identity) -> bytes:
    import hashlib

    return hashlib.blake2b(b"murmur/bench-lineage" + ident.public, digest_size=32).digest()


async def _exchange_child(index: int, params: dict[str, Any]) -> None:
    """One producer and consumer: publishes `rate` batches/s of its own lineage to that lineage's shard and
    joins the shards `gossip.exchange` plans for its demand (the node core's rule, fed as the announces
    would feed it: every peer produces for its own lineage at the fixed rate). With `real` it is a producer
    as a trainer is: it makes `rate` batches/s (as fast as it can generate) and publishes what the
    exchange's publish rule lets out (`publish_budget` over the other consumers' demands on its shard,
    through an `Outbox`, as the node core does); the rest stays local."""
    import json
    import sys

    import trio

    from murmur.gossip import exchange, topics
    from murmur.gossip.host import open_transport
    from murmur.gossip.service import GossipService
    from murmur.gossip.transport import PublishError
    from murmur.gossip.validation import Pipeline, PipelineConfig
    from murmur.training.verifiers import score

    reg = registry()
    ident = Identity.from_seed(bytes([index + 1]) * 32)
    lineage = bench_lineage(ident)
    stdin = trio.wrap_file(sys.stdin)
    cfg = PipelineConfig(swarm=SWARM, rate_per_s=20.0, burst=40)
    pipeline = Pipeline(
        cfg,
        clock=time.time,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda _: None,
        task_set_trusted=reg.__contains__,
        schedule=ScheduleBook.of(reg),
    )
    cpu = [0.0]  # seconds of CPU in the pipeline's stages (admit on the loop, verify in a thread)

    def timed(f: Any) -> Any:
        def g(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                cpu[0] += time.thread_time() - t0

        return g

    pipeline.admit = timed(pipeline.admit)  # type: ignore[method-assign]  # the stage timed in place
    pipeline.verify = timed(pipeline.verify)  # type: ignore[method-assign]  # the stage timed in place
    pipeline.commit = timed(pipeline.commit)  # type: ignore[method-assign]  # the stage timed in place
    accepted: dict[str, float] = {}
    rate, per_batch, demand = params["rate"], params["rollouts"], params["demand"]
    async with open_transport(ident) as t, trio.open_nursery() as nursery:
        service = GossipService(t, pipeline, SWARM)
        ex = exchange.Exchange(ident.public)
        meter = exchange.Meter()

        def on_accept(v: Any) -> None:
            accepted.setdefault(f"{v.batch.producer.hex()}:{v.batch.seq}", time.time())
            meter.add(time.monotonic(), len(v.batch.rollouts))

        service.on_accept = on_accept
        await nursery.start(service.run)
        print("ADDR", t.listen_addrs()[0], flush=True)
        line = (await stdin.readline()).split()
        addrs = line[1].split(",") if line[1] != "-" else []
        for a in addrs:
            await t.connect(a)
        others = [Identity.from_seed(bytes([k + 1]) * 32) for k in range(params["nodes"]) if k != index]
        now = pipeline.clock()
        for o in others:  # heard announcing long enough ago: not newcomers
            service.gate.announced(o.peer_id, now - exchange.ESTABLISHED_S)
        supply = {bench_lineage(o): rate * per_batch for o in others}
        outbox = exchange.Outbox(time.monotonic()) if params.get("real") else None

        async def replan() -> None:
            plan = ex.plan(
                time.monotonic(), params["nodes"], supply, demand, home=[], measured_rps=meter.rate(time.monotonic())
            )
            await service.set_shards(plan.shards, plan.subscribe)
            if outbox is not None:  # every other peer consumes `demand`; those publishing on our shard share it
                mine = ex.publish_shard(lineage)
                sharing = 1 + sum(1 for o in others if ex.publish_shard(bench_lineage(o)) == mine)
                outbox.set_rate(
                    exchange.publish_budget([demand] * len(others), 0.0, sharing, False, per_batch), time.monotonic()
                )

        await replan()
        print("READY", flush=True)
        await stdin.readline()  # everyone has planned: wait for our shard's subscribers to be known
        my_topic = topics.rollouts(SWARM, ex.publish_shard(lineage))
        with trio.move_on_after(15):
            while not t.topic_peers(my_topic):
                await trio.sleep(0.05)
        print("MESH", flush=True)
        start = float((await stdin.readline()).split()[1])
        await trio.sleep_until(trio.current_time() + max(0.0, start - time.time()))
        sent: dict[str, float] = {}
        errors = 0
        gap = 1.0 / rate
        await trio.sleep(gap * index / params["nodes"])  # stagger publishers
        t_end = time.time() + params["duration"]
        next_plan = time.monotonic() + 2.0
        seq = made = 0
        stats0 = dict(service.stats.counts), cpu[0], time.time()
        while time.time() < t_end:
            made += 1
            t_pub = time.time()
            if outbox is not None and not outbox.take(per_batch, time.monotonic()):
                await trio.sleep(max(0.0, gap - (time.time() - t_pub)))  # kept local, as a trainer keeps it
                continue
            seq += 1
            data = make_batch(ident, reg, seq, n=per_batch, tokens=params["tokens"], lineage=lineage)
            try:
                await service.publish_rollouts(data, ex.publish_shard(lineage))
                sent[f"{ident.public.hex()}:{seq}"] = t_pub
            except PublishError:
                errors += 1
            if time.monotonic() >= next_plan:  # the core re-plans on its announce tick
                next_plan += 2.0
                await replan()
            await trio.sleep(max(0.0, gap - (time.time() - t_pub)))
        span = time.time() - stats0[2]
        await trio.sleep(2.0)  # batches in flight arrive
        st = service.stats
        print(
            "DONE",
            json.dumps(
                dict(
                    sent=sent,
                    accepted=accepted,
                    errors=errors,
                    span=span,
                    cpu=cpu[0] - stats0[1],
                    made=made,
                    counts={k: st.counts[k] - stats0[0].get(k, 0) for k in st.counts},
                    dropped=dict(st.dropped),
                    distinct=st.distinct_producers(pipeline.clock()),
                    shards=service.shards,
                    subscribed=list(service.subscribed_shards),
                )
            ),
            flush=True,
        )
        await stdin.readline()
        nursery.cancel_scope.cancel()


def run_exchange(
    nodes: int,
    rate_per_node: float = 1.0,
    rollouts_per_batch: int = 8,
    tokens: int = 64,
    demand: float = 8.0,
    duration_s: float = 30.0,
    real_producers: bool = False,
) -> dict[str, Any]:
    """`nodes` processes, each a producer (`rate_per_node` batches/s of `rollouts_per_batch`) and a consumer
    of `demand` rollouts/s, on the rollout exchange; per-consumer inbound, verification CPU, use, reach.
    `real_producers`: each makes `REAL_PRODUCER_FACTOR` times the demand and publishes by the exchange's
    publish rule, as a trainer does (`produced` and `published` say how much went out)."""
    if real_producers:
        rate_per_node = REAL_PRODUCER_FACTOR * demand / rollouts_per_batch
    params = dict(
        nodes=nodes,
        rate=rate_per_node,
        rollouts=rollouts_per_batch,
        tokens=tokens,
        demand=demand,
        duration=duration_s,
        real=real_producers,
    )
    procs: list[subprocess.Popen] = []
    try:
        for i in range(nodes):
            procs.append(_spawn("_exchange_child", f"{i}", params))
        addrs = [_expect(p, "ADDR") for p in procs]
        for i, p in enumerate(procs):
            _send(p, f"PEERS {','.join(addrs[:i]) or '-'}")
        for p in procs:
            _expect(p, "READY")
        for p in procs:
            _send(p, "GO")
        for p in procs:
            _expect(p, "MESH")
        results = _start_and_collect(procs)
    finally:
        _reap(procs)
    sent = {k: v for r in results for k, v in r["sent"].items()}
    lat = sorted((t_acc - sent[k]) * 1000 for r in results for k, t_acc in r["accepted"].items() if k in sent)
    inbound = [r["counts"].get("received_rollouts", 0) / r["span"] for r in results]
    verified = [r["counts"].get("verified_rollouts", 0) for r in results]
    want = [demand * r["span"] for r in results]
    used = [min(v, w) for v, w in zip(verified, want)]
    cpu = [r["cpu"] / r["span"] for r in results]
    distinct = [r["distinct"] for r in results]

    def mm(xs: list[float], nd: int = 2) -> dict[str, float]:
        return {"mean": round(sum(xs) / len(xs), nd), "max": round(max(xs), nd), "min": round(min(xs), nd)}

    dropped: dict[str, int] = {}
    for r in results:
        for k, v in r["dropped"].items():
            dropped[k] = dropped.get(k, 0) + v
    return dict(
        nodes=nodes,
        processes=True,
        rate_per_node=rate_per_node,
        rollouts_per_batch=rollouts_per_batch,
        demand_rollouts_per_s=demand,
        duration_s=duration_s,
        shards=max(r["shards"] for r in results),
        subscribed_per_consumer=mm([float(len(r["subscribed"])) for r in results]),
        inbound_rollouts_per_s=mm(inbound),
        verify_cpu_s_per_s=mm(cpu, 4),
        used_over_verified=round(sum(used) / max(1, sum(verified)), 3),
        demand_met=round(min(v / w for v, w in zip(verified, want)), 3),
        distinct_producers=mm([float(d) for d in distinct]),
        delivery_p50_ms=round(lat[len(lat) // 2], 1) if lat else None,
        delivery_p95_ms=round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 1) if lat else None,
        batches_published=len(sent),
        batches_made=sum(r["made"] for r in results),
        real_producers=real_producers,
        publish_errors=sum(r["errors"] for r in results),
        dropped=dropped,
    )


def run(
    nodes: int = 8,
    batches_per_node: int = 10,
    rate_per_node: float = 0.5,
    rollouts_per_batch: int = 4,
    tokens: int = 64,
    adversarial: bool = True,
    timeout_s: float = 60.0,
    exchange_only: bool = False,
    demand: float = 8.0,
    duration_s: float = 30.0,
    real_producers: bool = False,
) -> dict[str, Any]:
    """The rollout exchange at a fixed rate and demand (`exchange`), then (unless `exchange_only`) the
    adversarial delivery run on one shard (`nodes` processes, the last one adversarial) and the pipeline alone."""
    if nodes < 3:
        raise ValueError("the gossip benchmark needs at least 3 nodes")
    out: dict[str, Any] = {
        "exchange": run_exchange(nodes, demand=demand, duration_s=duration_s, real_producers=real_producers)
    }
    out.update(
        {
            k: out["exchange"][k]
            for k in (
                "inbound_rollouts_per_s",
                "verify_cpu_s_per_s",
                "used_over_verified",
                "distinct_producers",
                "delivery_p95_ms",
                "demand_met",
            )
        }
    )
    if exchange_only:
        return out
    out.update(
        run_swarm(
            nodes=nodes,
            batches_per_node=batches_per_node,
            rate_per_node=rate_per_node,
            rollouts_per_batch=rollouts_per_batch,
            tokens=tokens,
            adversarial=adversarial,
            timeout_s=timeout_s,
        )
    )
    out.update(verify_throughput())
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run()))
