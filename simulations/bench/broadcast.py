"""`murmur bench broadcast`: one origin, N followers, one patch; measured against the broadcast bounds.

Live mode starts 1 + N real processes with real libp2p hosts on 127.0.0.1,
every node's upload capped by its token bucket; sim mode runs the same
`SwarmSession` core in virtual time (`simulations.vsim`). Both report completion
times against T* = (S/B)(1 + floor(log2 N)/M) (docs/broadcast.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from murmur.gossip.identity import Identity
from murmur.gossip.wire import FORMAT_VERSION, PATCH_MANIFEST, PatchManifest, now_ms, seal
from murmur.sync.chunks import refs, split

SIM_FULL_MESH_MAX = 64  # larger simulated swarms use a random overlay of this degree
SIM_DEGREE = 16


def make_patch(
    identity: Identity, payload: bytes, chunk_bytes: int, version: int = 1, *, swarm: str
) -> tuple[bytes, list[bytes]]:
    """A manifest envelope signed for `swarm` for an opaque payload, and its chunks (for benchmarks and tests)."""
    chunks = split(payload, chunk_bytes)
    lineage = hashlib.blake2b(b"bench" + identity.public, digest_size=32).digest()
    m = PatchManifest(
        v=FORMAT_VERSION,
        lineage=lineage,
        lineage_name="bench",
        base_model_hash=b"\0" * 32,
        publisher=identity.public,
        base_version=version - 1,
        target_version=version,
        base_hash=b"\1" * 32,
        target_hash=hashlib.blake2b(payload, digest_size=32).digest(),
        codec="sparse-v1",
        total_bytes=len(payload),
        chunk_bytes=chunk_bytes,
        chunks=refs(chunks),
        created_ms=now_ms(),
    )
    return seal(identity, PATCH_MANIFEST, m, swarm=swarm), chunks


def lower_bound_s(size: int, upload: float, n: int, m: int) -> float:
    return (size / upload) * (1 + math.floor(math.log2(max(n, 1))) / m)


def _summary(
    peers: int,
    size: int,
    chunk_bytes: int,
    upload: float,
    times: list[float],
    origin_out: int,
    ok: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    m = -(-size // chunk_bytes)
    lb = lower_bound_s(size, upload, peers, m)
    times = sorted(times)
    p50 = times[len(times) // 2] if times else None
    mx = times[-1] if len(times) == peers else None
    out = {
        "peers": peers,
        "bytes": size,
        "chunk_bytes": chunk_bytes,
        "chunks": m,
        "upload_bytes_per_s": upload,
        "completion_s_p50": p50,
        "completion_s_max": mx,
        "lower_bound_s": lb,
        "ratio_to_bound": (mx / lb) if mx is not None else None,
        "origin_upload_ratio": origin_out / size,
        "unicast_s": peers * size / upload,
        "all_hashes_match": ok,
        "completed": len(times),
    }
    out.update(extra)
    return out


def run(
    peers: int = 16,
    sim: bool = False,
    bytes: int = 8 * 2**20,
    chunk_bytes: int = 256 * 2**10,
    upload_bytes_per_s: int = 2 * 2**20,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    if peers < 1 or bytes < 1 or chunk_bytes < 1 or upload_bytes_per_s <= 0:
        raise ValueError("peers, bytes, chunk_bytes and upload_bytes_per_s must be positive")
    if sim:
        return _run_sim(peers, bytes, chunk_bytes, upload_bytes_per_s, seed)
    return _run_live(peers, bytes, chunk_bytes, upload_bytes_per_s, seed, timeout_s)


def _run_sim(peers: int, size: int, chunk_bytes: int, upload: int, seed: int) -> dict[str, Any]:
    from murmur.simulations.vsim import SimLink, VirtualSwarm

    sizes = [min(chunk_bytes, size - o) for o in range(0, size, chunk_bytes)]
    degree = None if peers <= SIM_FULL_MESH_MAX else SIM_DEGREE
    sw = VirtualSwarm(peers, sizes, link=SimLink(up_bps=upload, latency_s=0.005), degree=degree, seed=seed)
    r = sw.run()
    times = [nd.completed_at for nd in sw.nodes[1:] if nd.completed_at is not None]
    return _summary(
        peers,
        size,
        chunk_bytes,
        upload,
        times,
        r["origin_bytes_out"],
        r["all_hashes_match"],
        {
            "mode": "sim",
            "overlay_degree": degree or peers,
            "latency_s": 0.005,
            "sim_events": r["events"],
            "sim_wall_s": round(r["sim_wall_s"], 2),
        },
    )


# ---------------------------------------------------------------- live mode


def _run_live(peers: int, size: int, chunk_bytes: int, upload: int, seed: int, timeout_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    payload = rng.randbytes(size)
    digest = hashlib.blake2b(payload, digest_size=32).hexdigest()
    wall0 = time.time()
    phases: dict[str, float] = {}

    def mark(name: str) -> None:
        phases[name] = round(time.time() - wall0, 2)
        print(f"bench broadcast: {name} at {phases[name]} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="murmur-bench-bc-") as tmp:
        (Path(tmp) / "payload").write_bytes(payload)
        procs = []
        done: dict[int, dict[str, Any]] = {}
        stragglers: dict[int, Any] = {}
        try:
            setup_deadline = time.monotonic() + timeout_s
            origin = _spawn(tmp, "origin", 0, upload, chunk_bytes, seed)
            procs.append(origin)
            followers = [_spawn(tmp, "follower", i + 1, upload, chunk_bytes, seed) for i in range(peers)]
            procs += followers
            oaddr = _expect(origin, "addr", setup_deadline)["addrs"][0]
            addrs = [_expect(p, "addr", setup_deadline)["addrs"][0] for p in followers]
            mark("started")
            # full mesh: each dials the origin and the followers before it, one follower at a time
            # (a storm of simultaneous inbound handshakes makes py-libp2p time stream negotiations out)
            for i, p in enumerate(followers):
                _tell(p, {"cmd": "connect", "addrs": [oaddr] + addrs[:i]})
                _expect(p, "connected", setup_deadline)
            mark("connected")
            for p in followers:
                _tell(p, {"cmd": "ready?", "peers": peers})
            conns = [_expect(p, "ready", setup_deadline)["conns"] for p in followers]
            mark("mesh ready")
            idle_s = float(os.environ.get("MURMUR_BENCH_IDLE_S", "0"))  # debugging aid: CPU of an idle mesh
            if idle_s > 0:
                idle_cpu0 = _children_cpu(procs)
                time.sleep(idle_s)
                phases["idle_cpu_s_per_s"] = round((_children_cpu(procs) - idle_cpu0) / idle_s, 3)
            _tell(origin, {"cmd": "publish", "peers": peers})
            t0 = _expect(origin, "published", setup_deadline)["t0"]
            # a generous, bounded wait for the transfer itself: a follower that never completes is reported
            deadline = time.monotonic() + timeout_s
            for i, p in enumerate(followers):
                try:
                    done[i] = _expect(p, "complete", deadline)
                except TimeoutError:
                    _tell(p, {"cmd": "progress"})
                    try:
                        stragglers[i] = _expect(p, "progress", time.monotonic() + 10)
                    except (TimeoutError, RuntimeError) as e:
                        stragglers[i] = str(e)
            mark("transfer done")
            _tell(origin, {"cmd": "stats"})
            ostats = _expect(origin, "stats", time.monotonic() + 30)
        finally:
            for p in procs:
                _tell(p, {"cmd": "exit"})
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    times = [d["t"] - t0 for d in done.values()]
    ok = len(done) == peers and all(d["digest"] == digest for d in done.values())
    follower_transfer_cpu = sum(d["cpu_s"] - d["cpu_s_t0"] for d in done.values())
    extra: dict[str, Any] = {
        "mode": "live",
        "processes": peers + 1,
        "cpus": os.cpu_count(),
        "min_follower_streams": min(conns),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "wasted_in_bytes": sum(d["wasted_in"] for d in done.values()),
        "follower_frames_out": sum(d["frames_out"] for d in done.values()),
        "follower_cpu_s_mean": round(sum(d["cpu_s"] for d in done.values()) / max(1, len(done)), 2),
        "follower_transfer_cpu_s_mean": round(follower_transfer_cpu / max(1, len(done)), 3),
        "origin_transfer_cpu_s": ostats.get("cpu_s_transfer"),
        # the transfer's CPU spread over every core: no run on this machine can finish sooner
        "cpu_floor_s": round(
            (follower_transfer_cpu + (ostats.get("cpu_s_transfer") or 0.0)) / (os.cpu_count() or 1), 2
        ),
        "phases_s": phases,
        "bench_wall_s": round(time.time() - wall0, 1),
    }
    if stragglers:
        extra["stragglers"] = {str(i + 1): v for i, v in stragglers.items()}
    return _summary(peers, size, chunk_bytes, upload, times, ostats["bytes_out"], ok, extra)


def _children_cpu(procs: list[subprocess.Popen[str]]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            c = psutil.Process(p.pid).cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def _spawn(tmp: str, role: str, idx: int, upload: int, chunk_bytes: int, seed: int) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "murmur.simulations.bench.broadcast",
        role,
        tmp,
        str(idx),
        str(upload),
        str(chunk_bytes),
        str(seed),
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        cwd=str(Path(__file__).resolve().parents[2]),
    )  # the checkout this module is in


def _tell(p: subprocess.Popen[str], msg: dict[str, Any]) -> None:
    try:
        assert p.stdin is not None
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _expect(p: subprocess.Popen[str], event: str, deadline: float) -> dict[str, Any]:
    """The worker's next `event` line, waiting until `deadline` (time.monotonic()) at most."""
    import selectors

    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker did not report {event!r} in time")
            if not sel.select(timeout=left):
                continue
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited (rc={p.poll()}) before reporting {event!r}")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == event:
                return msg
            if msg.get("event") == "error":
                raise RuntimeError(f"worker failed: {msg.get('error')}")
    finally:
        sel.close()


async def _worker(role: str, tmp: str, idx: int, upload: int, chunk_bytes: int, seed: int) -> None:
    import trio

    from murmur.gossip.host import open_transport
    from murmur.sync.broadcast import BroadcastNode

    def say(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    identity = Identity.from_seed(hashlib.blake2b(f"bench-{seed}-{idx}".encode(), digest_size=32).digest())
    partial = Path(tmp) / f"node{idx}"
    import logging

    logdir = os.environ.get("MURMUR_BENCH_LOGDIR")  # debugging aid: per-node logs and a status line a second
    if not logdir:
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its stream-open retries flood stderr
    else:
        logging.basicConfig(
            filename=f"{logdir}/node{idx}.log",
            level=logging.WARNING,
            format="%(relativeCreated)8.0f %(name)s %(levelname)s %(message)s",
        )
        logging.getLogger("murmur").setLevel(logging.DEBUG)
    async with open_transport(identity, dial_timeout_s=20.0) as t:
        node = BroadcastNode(t, swarm="bench", upload_bytes_per_s=upload, partial_root=partial, seed=seed + idx)
        async with trio.open_nursery() as n:
            await n.start(node.run)
            if logdir:
                n.start_soon(_status_loop, node)
            say(event="addr", addrs=t.listen_addrs())
            lines = trio.wrap_file(sys.stdin)
            pid = None
            cpu_t0 = 0.0
            while True:
                line = await lines.readline()
                if not line:
                    break
                msg = json.loads(line)
                cmd = msg["cmd"]
                if cmd == "connect":
                    async with trio.open_nursery() as cn:
                        for a in msg["addrs"]:
                            cn.start_soon(_connect, t, a)
                    say(event="connected")
                elif cmd == "ready?":
                    # the whole mesh is connected and our chunk streams are up; on a starved box some
                    # stream opens time out: go on after 90 s with the mesh we have (reported)
                    with trio.move_on_after(90):
                        while len(node.conns) < msg["peers"] or not t.topic_peers(node.topic):
                            await trio.sleep(0.05)
                    n.start_soon(_follow, node, say)
                    say(event="ready", conns=len(node.conns))
                elif cmd == "publish":
                    payload = (Path(tmp) / "payload").read_bytes()
                    envelope, chunks = make_patch(identity, payload, chunk_bytes, swarm=node.swarm)
                    with trio.move_on_after(60):
                        while len(node.conns) < msg["peers"]:
                            await trio.sleep(0.05)
                    t0 = time.time()
                    cpu_t0 = time.process_time()
                    pid = await node.publish(envelope, chunks)
                    say(event="published", t0=t0)
                elif cmd == "stats":
                    st = node.stats(pid) if pid else {"bytes_out": 0}
                    say(event="stats", bytes_out=st["bytes_out"], cpu_s_transfer=round(time.process_time() - cpu_t0, 3))
                elif cmd == "progress":
                    say(
                        event="progress",
                        conns=len(node.conns),
                        transfers=[{k: v for k, v in node.stats(p).items() if k != "peers"} for p in node.transfers],
                    )
                elif cmd == "exit":
                    break
            n.cancel_scope.cancel()


async def _status_loop(node: Any) -> None:
    import logging

    import trio

    log = logging.getLogger("murmur.bench")
    while True:
        await trio.sleep(1.0)
        parts = [f"conns={len(node.conns)} cpu={time.process_time():.2f} {node.counters} {node.frames_by_type}"]
        for tr in node.transfers.values():
            s = tr.session
            busy = {p[:16]: (len(q.inflight), len(q.serve)) for p, q in s.peers.items() if q.inflight or q.serve}
            parts.append(f"have={s.nhave}/{s.n} peers={len(s.peers)} req={len(s.requested)} busy={busy}")
        log.info(" | ".join(parts))


async def _connect(t: Any, addr: str, attempts: int = 5) -> None:
    """Dial with retries: on a loaded 2-core box a Noise handshake can miss the dial timeout."""
    import trio

    from murmur.gossip.errors import MurmurError

    for i in range(attempts):
        try:
            await t.connect(addr)
            return
        except MurmurError:
            if i == attempts - 1:
                raise
            await trio.sleep(0.5 * (i + 1))


async def _follow(node: Any, say: Any) -> None:
    tr = await node.wait_for_transfer(600)
    cpu_t0 = time.process_time()
    prof = _PROFILE.get("prof")
    if prof is not None:  # the transfer only, not start-up and connecting
        prof.enable()
    await node.wait_complete(tr.pid, 600)
    if prof is not None:
        prof.disable()
    digest = hashlib.blake2b(tr.payload(), digest_size=32).hexdigest()
    say(
        event="complete",
        t=tr.completed_wall,
        digest=digest,
        wasted_in=tr.session.wasted_in,
        frames_out=node.counters["frames_out"],
        cpu_s=time.process_time(),
        cpu_s_t0=cpu_t0,
    )


_PROFILE: dict[str, Any] = {}


def _main(argv: list[str]) -> None:
    import trio

    role, tmp, idx, upload, chunk_bytes, seed = argv
    prof_dir = os.environ.get("MURMUR_BENCH_PROFILE")  # debugging aid: cProfile of each follower's transfer
    prof = None
    if prof_dir and role == "follower":
        import cProfile

        prof = _PROFILE["prof"] = cProfile.Profile(time.process_time)  # CPU, not wall: fair on a shared box
    try:
        trio.run(_worker, role, tmp, int(idx), int(upload), int(chunk_bytes), int(seed))
    except BaseException as e:  # report, so the parent fails fast with the reason
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
            e = e.exceptions[0]
        sys.stdout.write(json.dumps({"event": "error", "error": f"{type(e).__name__}: {e}"}) + "\n")
        sys.stdout.flush()
        raise
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{prof_dir}/{role}{idx}.prof")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("origin", "follower"):
        _main(sys.argv[1:])
    else:
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        print(
            json.dumps(
                run(
                    peers=int(args[0]) if args else 16,
                    sim="--sim" in sys.argv,
                    bytes=int(args[1]) if len(args) > 1 else 8 * 2**20,
                )
            )
        )
