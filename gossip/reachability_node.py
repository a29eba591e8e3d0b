"""A scripted Murmur network node for reachability experiments: `python -m gossip.reachability_node '<json>'`.

Why a separate process: each node of an emulated network runs inside its own network namespace
(`ip netns exec NS python -m gossip.reachability_node ...`), so it must be a real subprocess. It
uses the production pieces (gossip.host, gossip.relay, gossip.holepunch, gossip.reachability,
node.doctor_reachability) and reports what happened as JSON lines on stdout (one object per line,
key "ev"), then waits for "quit" on stdin (bounded) so its peers can finish.

Script (JSON object; every key optional except name and seed):
    name, seed (int 0..255), listen (multiaddr), relay_service (bool), relays ([addr]),
    bootstrap ([addr]: dial directly, then run the reachability check against them),
    peers ([{name, id, addrs: [direct or circuit addr, tried in order]}]),
    holepunch (bool), initiate_holepunch (bool), bulk_bytes (int), publish_rollouts (bool),
    expect_hello ([names]), linger_s (float)
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # before the heavy imports: time-to-first-message counts them

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import trio  # noqa: E402

BULK_PROTOCOL = "/murmur/bench/bulk/1"
ROLLOUT_TOPIC = "/murmur/bench/rollouts/1"
HELLO_TOPIC = "/murmur/bench/hello/1"
WRITE = 1 << 20
MAX_BULK = 1 << 30


def ms() -> float:
    return round((time.monotonic() - T0) * 1000, 1)


def emit(ev: str, **kw: Any) -> None:
    sys.stdout.write(json.dumps({"ev": ev, "t_ms": ms(), **kw}) + "\n")
    sys.stdout.flush()


def sample_batch(identity: Any, seq: int) -> bytes:
    """A small signed RolloutBatch: what a receiver must verify before it counts as received."""
    import struct

    from gossip import wire

    r = wire.Rollout(
        task=wire.TaskRef(task_set=b"\x01" * 32, generator="add", seed=seq),
        lineage=b"\x02" * 32, version=1, completion_ids=list(range(8)), text="12",
        tokenizer_hash=b"\x03" * 32, logprobs=struct.pack("<8f", *([-0.5] * 8)), token_versions=[(0, 1)],
        sampling=wire.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16), reward=1.0,
        created_ms=wire.now_ms(),
    )
    body = wire.RolloutBatch(v=1, swarm="bench", producer=identity.public, seq=seq, created_ms=wire.now_ms(), rollouts=[r])
    return wire.seal(identity, wire.ROLLOUT_BATCH, body)


async def serve_bulk(stream: Any, remote: str) -> None:
    """Read an 8-byte length then that many bytes; answer their blake2b-256 digest."""
    from gossip.framing import read_exactly

    n = int.from_bytes(await read_exactly(stream, 8), "big")
    if n > MAX_BULK:
        raise ValueError(f"bulk of {n} bytes refused")
    h = hashlib.blake2b(digest_size=32)
    got = 0
    with trio.fail_after(120):
        while got < n:
            part = await stream.read(min(WRITE, n - got))
            if not part:
                break
            h.update(part)
            got += len(part)
    await stream.write(h.digest())
    await stream.close()


async def send_bulk(transport: Any, peer: str, n: int, timeout_s: float = 120) -> dict[str, Any]:
    from gossip.framing import read_exactly
    from gossip.holepunch import best_path

    block = os.urandom(WRITE)
    h = hashlib.blake2b(digest_size=32)
    path = best_path(transport, peer)
    t = time.perf_counter()
    with trio.fail_after(timeout_s):
        s = await transport.open_stream(peer, BULK_PROTOCOL)
        await s.write(n.to_bytes(8, "big"))
        sent = 0
        while sent < n:
            chunk = block[: min(WRITE, n - sent)]
            await s.write(chunk)
            h.update(chunk)
            sent += len(chunk)
        digest = await read_exactly(s, 32)
        await s.close()
    dt = time.perf_counter() - t
    return {"path": path, "bytes": n, "s": round(dt, 3), "mb_s": round(n / dt / 1e6, 2), "hash_ok": digest == h.digest()}


async def connect_peer(transport: Any, relay: Any, addrs: list[str], deadline_s: float) -> tuple[str, str]:
    """Try each address (direct ones quickly, circuits with retries until the deadline). (peer id, path)."""
    from gossip.holepunch import best_path
    from gossip.relay import is_circuit
    from node.errors import MurmurError

    errors = []
    end = trio.current_time() + deadline_s
    for a in addrs:
        if not is_circuit(a):
            with trio.move_on_after(2.0):
                try:
                    pid = await transport.connect(a)
                    return pid, best_path(transport, pid)
                except MurmurError as e:
                    errors.append(str(e)[:120])
            continue
        for _ in range(40):  # the peer may not hold its reservation yet
            try:
                pid = await relay.dial(a, timeout_s=max(1.0, min(10.0, end - trio.current_time())))
                return pid, best_path(transport, pid)
            except MurmurError as e:
                errors.append(str(e)[:120])
            if trio.current_time() >= end:
                break
            await trio.sleep(0.5)
    raise RuntimeError("; ".join(errors[-3:]) or "no address")


async def main(script: dict[str, Any]) -> None:
    from gossip.holepunch import attach_holepunch, best_path
    from gossip.host import open_transport
    from gossip.reachability import DialbackServer, check_reachability
    from gossip.relay import attach_relay
    from gossip.wire import ROLLOUT_BATCH, open_envelope
    from node.config import NetworkSection
    from node.doctor_reachability import reachability_checks, snapshot
    from node.identity import Identity

    name = script["name"]
    ident = Identity.from_seed(bytes([int(script["seed"])]) * 32)
    net = NetworkSection(relay_service=bool(script.get("relay_service")), relays=list(script.get("relays", [])))
    async with open_transport(ident, listen=[script.get("listen", "/ip4/0.0.0.0/tcp/4001")], dial_timeout_s=3.0) as t, \
            attach_relay(t, net) as relay, attach_holepunch(t, auto=False) as hp, trio.open_nursery() as nursery:
        DialbackServer(t)
        t.set_stream_handler(BULK_PROTOCOL, serve_bulk)
        rollouts = await t.subscribe(ROLLOUT_TOPIC)
        hellos = await t.subscribe(HELLO_TOPIC)
        emit("ready", name=name, peer_id=t.peer_id, addrs=t.listen_addrs())
        ready_ms = ms()
        first = trio.Event()

        async def watch_rollouts() -> None:
            while True:
                origin, data = await rollouts.receive()
                try:
                    open_envelope(data, expect=ROLLOUT_BATCH)
                except Exception as e:
                    emit("bad_rollout", origin=origin, error=str(e)[:200])
                    continue
                if not first.is_set():
                    first.set()
                    emit("first_rollout", origin=origin, after_ready_ms=round(ms() - ready_ms, 1))

        nursery.start_soon(watch_rollouts)
        if script.get("publish_rollouts"):
            async def publish_loop() -> None:
                # fast while nobody listens (time-to-first-message), then 1/s to keep the CPU for the rest
                for seq in range(1, 100_000):
                    try:
                        await t.publish(ROLLOUT_TOPIC, sample_batch(ident, seq))
                    except Exception:
                        pass  # no subscriber yet
                    await trio.sleep(0.05 if len(t.topic_peers(ROLLOUT_TOPIC)) < 2 else 1.0)
            nursery.start_soon(publish_loop)

        reach = None
        for a in script.get("bootstrap", []):
            try:
                with trio.fail_after(5):
                    pid = await t.connect(a)
                emit("bootstrap", addr=a, peer=pid)
            except Exception as e:
                emit("bootstrap_failed", addr=a, error=str(e)[:200])
        if script.get("bootstrap"):
            reach = await check_reachability(t, t.peers())
            emit("reachability", status=reach.status, reason=reach.reason, observed=reach.observed_ips,
                 reachable=reach.reachable_addrs)
            if reach.status != "public" and net.relays:
                got = await relay.reserve_all(net.relays, timeout_s=float(script.get("reserve_timeout_s", 30)))
                emit("reserved", circuits=[r.circuit_addr for r in got], errors=relay.errors)

        peer_names: dict[str, str] = {pid: "pub" for pid in t.peers()} if script.get("bootstrap") else {}
        for p in script.get("await_peers", []):  # the other side dials us (one dial per pair: no crossed circuits)
            with trio.move_on_after(float(script.get("connect_s", 45)) + 30):
                while p["id"] not in t.peers():
                    await trio.sleep(0.05)
            peer_names[p["id"]] = p["name"]
            emit("connected" if p["id"] in t.peers() else "connect_failed", peer=p["name"],
                 path=best_path(t, p["id"]), inbound=True)
        for p in script.get("peers", []):
            try:
                pid, path = await connect_peer(t, relay, p["addrs"], float(script.get("connect_s", 45)))
                peer_names[pid] = p["name"]
                emit("connected", peer=p["name"], path=path)
            except Exception as e:
                emit("connect_failed", peer=p["name"], error=str(e)[:300])

        # gossip: publish our hello until we have everyone's (bounded)
        want = set(script.get("expect_hello", []))
        got_hello: set[str] = set()
        with trio.move_on_after(float(script.get("gossip_s", 60))):
            while not want <= got_hello:
                try:
                    await t.publish(HELLO_TOPIC, name.encode())
                except Exception:
                    pass
                with trio.move_on_after(0.3):
                    while True:
                        _, data = await hellos.receive()
                        got_hello.add(data.decode(errors="replace"))
        emit("gossip", got=sorted(got_hello), ok=want <= got_hello)

        async def keep_greeting() -> None:  # late joiners still get our hello
            for _ in range(300):
                try:
                    await t.publish(HELLO_TOPIC, name.encode())
                except Exception:
                    pass
                await trio.sleep(1.0)
        nursery.start_soon(keep_greeting)

        bulk = int(script.get("bulk_bytes", 0))
        for pid, pname in peer_names.items():
            if bulk:
                try:
                    emit("bulk", peer=pname, **await send_bulk(t, pid, bulk))
                except Exception as e:
                    emit("bulk_failed", peer=pname, path=best_path(t, pid), error=f"{type(e).__name__}: {e}"[:300])
            if script.get("holepunch") and best_path(t, pid) == "relayed":
                t_hp = time.perf_counter()
                if script.get("initiate_holepunch"):
                    ok = await hp.upgrade(pid, timeout_s=20)
                else:
                    ok = await hp.wait_direct(pid, 25)
                emit("holepunch", peer=pname, ok=ok, path=best_path(t, pid), s=round(time.perf_counter() - t_hp, 2),
                     error=hp.last_error)
                if ok and bulk:
                    try:
                        emit("bulk", peer=pname, **await send_bulk(t, pid, bulk))
                    except Exception as e:
                        emit("bulk_failed", peer=pname, path=best_path(t, pid), error=f"{type(e).__name__}: {e}"[:300])

        if reach is None and t.peers():  # a node without bootstrap peers asks those that connected to it
            reach = await check_reachability(t, t.peers())
            emit("reachability", status=reach.status, reason=reach.reason, observed=reach.observed_ips,
                 reachable=reach.reachable_addrs)
        snap = snapshot(t, relay, reach, hp, peers=list(peer_names) or t.peers())
        emit("doctor", path=snap.path, checks=[{"name": c.name, "ok": c.ok, "detail": c.detail}
                                               for c in reachability_checks(snap)])
        emit("done")
        with trio.move_on_after(float(script.get("linger_s", 120))):
            stdin = trio.lowlevel.FdStream(os.dup(0))
            buf = b""
            while b"quit" not in buf:
                part = await stdin.receive_some(64)
                if not part:
                    break
                buf += part
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=getattr(logging, os.environ.get("MURMUR_NODE_LOG", "CRITICAL")),
                        format="%(relativeCreated)d %(name)s %(levelname)s %(message)s")
    trio.run(main, json.loads(sys.argv[1]))
