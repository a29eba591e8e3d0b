"""A measurement node for the reachability benchmark: `python -m murmur.simulations.bench.reachability_node '<json>'`.

Why it exists next to the real node: the benchmark needs what a node does not do — a raw bulk stream
to time MB/s per path, a rollout publisher at a fixed cadence to time the first verified message —
and JSON events to read them. Everything about reachability is the real node's code: the host
(`gossip.host.open_transport`) and `node.shell.reachability.start_reachability` (dial-back, relay reservation,
announce-driven direct/circuit dials with the one-side-dials rule, DCUtR upgrade), and the doctor's
view (`ReachState.view`). The node tests (tests/test_reachability_nodes.py) run `murmur node start`.
It reports JSON lines on stdout (key "ev"), then waits for "quit" on stdin (bounded).

Script (JSON object; every key optional except name and seed):
    name, seed (int 0..255), listen (multiaddr), relay_service (bool), relays ([addr]),
    bootstrap ([addr]: dial directly, then run the reachability check against them),
    peers ([{name, id, addrs: [direct or circuit addrs, as a NodeAnnounce would carry them]}]),
    bulk_bytes (int), publish_rollouts (bool), expect_hello ([names]), linger_s (float),
    wait_webrtc_s (float: before "ready", wait for our /webrtc-direct listener and report its addresses),
    check_s (float, default 60: how long a node without bootstrap peers waits for its verdict),
    reach_bootstrap ([addr]: bootstrap addresses node.shell.reachability knows (WebRTC-direct is tried to them at once)
    but this harness does not dial itself)
The config is the defaults plus MURMUR_NETWORK_<KEY> overrides (MURMUR_NETWORK_WEBRTC=false turns
WebRTC-direct off, as in a node without the extra).
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # before the heavy imports: time-to-first-message counts them

import hashlib  # noqa: E402 - imported after T0, which times them
import json  # noqa: E402 - imported after T0, which times them
import os  # noqa: E402 - imported after T0, which times them
import sys  # noqa: E402 - imported after T0, which times them
from collections.abc import Iterator  # noqa: E402 - imported after T0, which times them
from typing import Any  # noqa: E402 - imported after T0, which times them

import trio  # noqa: E402 - imported after T0, which times them

BULK_PROTOCOL = "/murmur/bench/bulk/1"
OPEN_ATTEMPTS = 3
BULK_ATTEMPTS = 4  # each within a quarter of the transfer's bound
ROLLOUT_TOPIC = "/murmur/bench/rollouts/1"
HELLO_TOPIC = "/murmur/bench/hello/1"
WRITE = 1 << 20
MAX_BULK = 1 << 30
SWARM = "bench"  # the swarm its rollout batches are signed for


def ms() -> float:
    return round((time.monotonic() - T0) * 1000, 1)


def emit(ev: str, **kw: Any) -> None:
    sys.stdout.write(json.dumps({"ev": ev, "t_ms": ms(), "wall": round(time.time(), 4), **kw}) + "\n")
    sys.stdout.flush()


def sample_batch(identity: Any, seq: int) -> bytes:
    """A small signed RolloutBatch: what a receiver must verify before it counts as received."""
    import struct

    from murmur.gossip import wire

    r = wire.Rollout(
        task=wire.TaskRef(task_set=b"\x01" * 32, generator="add", seed=seq),
        lineage=b"\x02" * 32,
        version=1,
        completion_ids=list(range(8)),
        text="12",
        tokenizer_hash=b"\x03" * 32,
        logprobs=struct.pack("<8f", *([-0.5] * 8)),
        token_versions=[(0, 1)],
        sampling=wire.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16),
        reward=1.0,
        created_ms=wire.now_ms(),
    )
    body = wire.RolloutBatch(
        v=wire.FORMAT_VERSION, swarm=SWARM, producer=identity.public, seq=seq, created_ms=wire.now_ms(), rollouts=[r]
    )
    return wire.seal(identity, wire.ROLLOUT_BATCH, body, swarm=SWARM)


async def serve_bulk(stream: Any, remote: str) -> None:
    """Read an 8-byte length then that many bytes; answer their blake2b-256 digest."""
    from murmur.gossip.framing import read_exactly

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


def _chunks(block: bytes, n: int) -> Iterator[bytes]:
    """The `n` bytes of a bulk: `block` repeated, in writes of at most `WRITE`."""
    for start in range(0, n, WRITE):
        yield block[: min(WRITE, n - start)]


async def send_bulk(transport: Any, peer: str, n: int, timeout_s: float = 120) -> dict[str, Any]:
    from murmur.gossip.framing import read_exactly
    from murmur.gossip.holepunch import best_path

    block = os.urandom(WRITE)
    h = hashlib.blake2b(digest_size=32)
    path = best_path(transport, peer)
    t = time.perf_counter()
    for chunk in _chunks(block, n):
        h.update(chunk)
    opens = attempts = 0
    digest = b""
    with trio.fail_after(timeout_s):
        # Over WebRTC a transfer now and then stalls with every byte written and the reply never read
        # (cause not found; docs/reachability.md): a node gives up on the stream and sends again.
        while not digest:
            attempts += 1
            s = None
            with trio.move_on_after(timeout_s / BULK_ATTEMPTS) as cs:
                while True:  # a stray WebRTC stream open fails now and then; a node retries it, and so does this
                    opens += 1
                    try:
                        s = await transport.open_stream(peer, BULK_PROTOCOL)
                        break
                    except Exception:
                        if opens >= OPEN_ATTEMPTS:
                            raise
                await s.write(n.to_bytes(8, "big"))
                for chunk in _chunks(block, n):
                    await s.write(chunk)
                digest = await read_exactly(s, 32)
                await s.close()
            if cs.cancelled_caught:
                if s is not None:
                    with trio.move_on_after(2):
                        try:
                            await s.reset()
                        except Exception:  # the stalled stream is abandoned either way
                            pass
                if attempts >= BULK_ATTEMPTS:
                    raise trio.TooSlowError(f"{attempts} attempts stalled")
    dt = time.perf_counter() - t
    return {
        "path": path,
        "bytes": n,
        "s": round(dt, 3),
        "mb_s": round(n / dt / 1e6, 2),
        "hash_ok": digest == h.digest(),
        "opens": opens,
        "attempts": attempts,
    }


async def main(script: dict[str, Any]) -> None:
    from murmur.gossip.holepunch import UPGRADE_TIMEOUT_S, best_path
    from murmur.gossip.host import open_transport
    from murmur.gossip.identity import Identity
    from murmur.gossip.wire import ROLLOUT_BATCH, open_envelope
    from murmur.node.cli.doctor_reachability import reachability_checks
    from murmur.node.config import load_config
    from murmur.node.shell.reachability import process_start, start_reachability

    imported_ms = ms()
    name = script["name"]
    ident = Identity.from_seed(bytes([int(script["seed"])]) * 32)
    # MURMUR_NODE_LOG* are this harness's own variables, not config keys: only the network section
    cfg = load_config(None, {k: v for k, v in os.environ.items() if k.startswith("MURMUR_NETWORK_")})
    cfg.network.relay_service = bool(script.get("relay_service"))
    cfg.network.relays = list(script.get("relays", []))
    peers = {p["id"]: p for p in script.get("peers", [])}
    since_exec_ms = round((time.time() - process_start()) * 1000 - ms(), 1)  # interpreter start before T0
    async with (
        open_transport(ident, listen=[script.get("listen", "/ip4/0.0.0.0/tcp/4001")], dial_timeout_s=3.0) as t,
        trio.open_nursery() as nursery,
    ):
        host_ms = ms()
        t.set_stream_handler(BULK_PROTOCOL, serve_bulk)
        rollouts = await t.subscribe(ROLLOUT_TOPIC)
        hellos = await t.subscribe(HELLO_TOPIC)
        state = await start_reachability(
            t,
            cfg,
            nursery,
            list(script.get("bootstrap", [])) + list(script.get("reach_bootstrap", [])),
            known=lambda: {k: list(v["addrs"]) for k, v in peers.items()},
        )
        state.auto_upgrade = False  # time the relay first; the upgrade is driven below, after the relayed bulk
        if script.get("wait_webrtc_s"):
            with trio.move_on_after(float(script["wait_webrtc_s"])):
                while not (state.webrtc_addrs or state.webrtc_error):
                    await trio.sleep(0.05)
        emit(
            "ready",
            name=name,
            peer_id=t.peer_id,
            addrs=t.listen_addrs(),
            imported_ms=imported_ms,
            before_t0_ms=since_exec_ms,
            webrtc_addrs=state.webrtc_addrs,
            webrtc_error=state.webrtc_error,
        )
        ready_ms = ms()
        dialled_ms: list[float] = []  # when the first bootstrap dial returned
        first = trio.Event()

        async def watch_rollouts() -> None:
            while True:
                origin, data = await rollouts.receive()
                try:
                    open_envelope(data, expect=ROLLOUT_BATCH, swarm=SWARM)
                except Exception as e:
                    emit("bad_rollout", origin=origin, error=str(e)[:200])
                    continue
                if not first.is_set():
                    first.set()
                    emit(
                        "first_rollout",
                        origin=origin,
                        after_ready_ms=round(ms() - ready_ms, 1),
                        breakdown_ms={
                            "before_t0": since_exec_ms,
                            "imports": imported_ms,
                            "host": round(host_ms - imported_ms, 1),
                            "relay_dcutr_dialback": round(ready_ms - host_ms, 1),
                            "connect_and_mesh": round(ms() - ready_ms, 1),
                            # its two parts: our bootstrap dial, then subscriptions + mesh + delivery
                            "connect_and_mesh_parts": {
                                "dial": round(dialled_ms[0] - ready_ms, 1) if dialled_ms else None,
                                "after_dial": round(ms() - dialled_ms[0], 1) if dialled_ms else None,
                            },
                        },
                    )

        nursery.start_soon(watch_rollouts)

        async def watch_link(pid: str) -> None:
            """Events (no polling) for the steps between our dial and the first message: our pubsub
            stream to the peer is up, then its rollout subscription has reached us."""
            from libp2p.peer.id import ID

            try:
                await t.pubsub.wait_for_peer(ID.from_base58(pid), timeout=30)
                emit("pubsub_stream", peer=pid)
                await t.pubsub.wait_for_subscription(ID.from_base58(pid), ROLLOUT_TOPIC, timeout=30)
                emit("peer_subscribed", peer=pid)
            except trio.TooSlowError:
                emit("link_timeout", peer=pid)

        if script.get("publish_rollouts"):

            async def publish_loop() -> None:
                # fast while nobody listens (time-to-first-message), then 1/s to keep the CPU for the rest
                seen: set[str] = set()
                last_error = ""
                for seq in range(1, 100_000):
                    for p in set(t.topic_peers(ROLLOUT_TOPIC)) - seen:  # when each subscriber was first seen here
                        seen.add(p)
                        emit("subscriber", peer=p)
                    try:
                        await t.publish(ROLLOUT_TOPIC, sample_batch(ident, seq))
                    except Exception as e:  # no subscriber (or mesh peer) yet
                        if str(e) != last_error:
                            emit("publish_failed", error=str(e)[:120])
                        last_error = str(e)
                    else:
                        last_error = ""
                    await trio.sleep(0.05 if len(t.topic_peers(ROLLOUT_TOPIC)) < 2 else 1.0)

            nursery.start_soon(publish_loop)

        for a in script.get("bootstrap", []):
            try:
                with trio.fail_after(5):
                    pid = await t.connect(a)
                dialled_ms.append(ms())
                emit("bootstrap", addr=a, peer=pid)
                nursery.start_soon(watch_link, pid)
            except Exception as e:
                emit("bootstrap_failed", addr=a, error=str(e)[:200])
        names: dict[str, str] = {}
        if script.get("bootstrap"):
            with trio.move_on_after(60):
                await state.checked.wait()
            r = state.reach
            emit(
                "reachability",
                status=getattr(r, "status", "unknown"),
                reason=getattr(r, "reason", ""),
                observed=getattr(r, "observed_ips", []),
                port_preserved=getattr(r, "port_preserved", None),
            )
            emit("reserved", circuits=state.relay.circuit_addrs(), errors=state.relay.errors)
            names.update({p: "pub" for p in t.peers()})
        # node.shell.reachability dials the peers from their announced addresses (one side per pair); wait for it
        for pid, p in peers.items():
            t_c = time.perf_counter()
            with trio.move_on_after(float(script.get("connect_s", 90))):
                while pid not in t.peers():
                    await trio.sleep(0.05)
            names[pid] = p["name"]
            emit(
                "connected" if pid in t.peers() else "connect_failed",
                peer=p["name"],
                path=best_path(t, pid),
                s=round(time.perf_counter() - t_c, 2),
                dialled=pid in state.circuit_dialled,
                webrtc_dialled=pid in state.webrtc_dialled,
            )

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
        for pid, pname in names.items():
            first_path = best_path(t, pid)
            if bulk:
                try:
                    emit("bulk", peer=pname, **await send_bulk(t, pid, bulk))
                except Exception as e:
                    emit("bulk_failed", peer=pname, path=best_path(t, pid), error=f"{type(e).__name__}: {e}"[:300])
            if first_path == "relayed" and script.get("holepunch", True):
                # as node.shell.reachability does: the side that dialled the circuit drives DCUtR; the other waits as long as
                # an attempt may last, plus the other side's start-up margin
                t_hp = time.perf_counter()
                if pid in state.circuit_dialled:
                    await state.upgrade(pid)
                else:
                    with trio.move_on_after(UPGRADE_TIMEOUT_S + 10):
                        while best_path(t, pid) != "direct":
                            await trio.sleep(0.1)
                ok = best_path(t, pid) == "direct"
                emit(
                    "holepunch",
                    peer=pname,
                    ok=ok,
                    path=best_path(t, pid),
                    s=round(time.perf_counter() - t_hp, 2),
                    drove=pid in state.circuit_dialled,
                    error="" if ok else (state.holepuncher.last_error or "the other side drove the attempt"),
                )
                if ok and bulk:
                    try:
                        emit("bulk", peer=pname, **await send_bulk(t, pid, bulk))
                    except Exception as e:
                        emit("bulk_failed", peer=pname, path=best_path(t, pid), error=f"{type(e).__name__}: {e}"[:300])

        if not script.get("bootstrap"):  # a node without bootstrap peers asks those that dialled it
            with trio.move_on_after(float(script.get("check_s", 60))):
                await state.checked.wait()
            emit(
                "reachability",
                status=getattr(state.reach, "status", "unknown"),
                reason=getattr(state.reach, "reason", ""),
                observed=getattr(state.reach, "observed_ips", []),
            )
        view = state.view()
        view.peer_paths = {p: x for p, x in view.peer_paths.items() if p in names or not names}
        from murmur.node.cli.doctor_reachability import classify

        view.path = classify(view)
        emit(
            "doctor",
            path=view.path,
            port_preserved=view.port_preserved,
            checks=[{"name": c.name, "ok": c.ok, "detail": c.detail} for c in reachability_checks(view)],
        )
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

    logging.basicConfig(
        level=getattr(logging, os.environ.get("MURMUR_NODE_LOG", "CRITICAL")),
        format="%(relativeCreated)d %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("multiaddr").setLevel(logging.WARNING)  # a DEBUG line per address parsed drowns the rest
    trio.run(main, json.loads(sys.argv[1]))
