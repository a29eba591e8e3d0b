"""Live broadcast over real libp2p hosts on 127.0.0.1 (in-process), and the upload token bucket."""

from __future__ import annotations

import hashlib
import random
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from murmur.gossip.errors import DecodeError
from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.wire import decode_envelope, encode
from murmur.simulations.bench.broadcast import make_patch
from murmur.sync.broadcast import BroadcastNode
from murmur.sync.swarm import SwarmConfig
from murmur.sync.transfers import Stored
from murmur.sync.uplink import TokenBucket

CHUNK = 64 * 1024


def ident(i: int) -> Identity:
    return Identity.from_seed(hashlib.blake2b(b"bc-test-%d" % i, digest_size=32).digest())


# ---------------------------------------------------------------- token bucket


def test_token_bucket_long_run_rate_is_exact() -> None:
    b = TokenBucket(1000.0, burst_bytes=100, now=0.0)
    t = 0.0
    for _ in range(50):
        t += b.reserve(200, t)  # writer waits as told, then writes
    # 50*200 bytes at 1000 B/s, minus the 100-byte initial burst
    assert t == pytest.approx((50 * 200 - 100) / 1000.0)
    assert b.total == 10_000


def test_token_bucket_refund_and_unlimited() -> None:
    b = TokenBucket(1000.0, burst_bytes=100, now=0.0)
    assert b.reserve(1100, 0.0) == pytest.approx(1.0)
    b.refund(1000, 0.0)
    assert b.reserve(100, 0.0) == pytest.approx(0.1)
    u = TokenBucket(0)
    assert u.reserve(10**9, 0.0) == 0.0
    with pytest.raises(ValueError):
        TokenBucket(-1)


def test_token_bucket_idle_credit_is_capped() -> None:
    b = TokenBucket(1000.0, burst_bytes=100, now=0.0)
    assert b.reserve(100, 1000.0) == 0.0  # a long idle period banks only the burst
    assert b.reserve(1000, 1000.0) == pytest.approx(1.0)


# ---------------------------------------------------------------- live helpers


class CorruptNode(BroadcastNode):
    """A real node that stores (and so serves) every chunk it verifies with its bytes flipped."""

    def _apply(self, actions: list[Any]) -> None:
        super()._apply(actions)
        for a in actions:
            if isinstance(a, Stored):
                self.transfers[a.pid].chunks[a.index] = bytes(x ^ 0xFF for x in a.data)


@asynccontextmanager
async def live_node(
    i: int,
    *,
    upload: int = 0,
    partial: Path | None = None,
    cls: type = BroadcastNode,
    penalties: list | None = None,
    cfg: SwarmConfig | None = None,
):
    async with open_transport(ident(i)) as t:
        node = cls(
            t,
            swarm="test",
            upload_bytes_per_s=upload,
            partial_root=partial,
            seed=i,
            config=cfg,
            on_penalty=(lambda p, r, a: penalties.append((p, r, a))) if penalties is not None else None,
        )
        async with trio.open_nursery() as n:
            await n.start(node.run)
            yield t, node
            n.cancel_scope.cancel()


async def wait_until(pred, timeout: float) -> None:
    """Bounded poll, only for what no event of ours signals (py-libp2p's pubsub subscriptions)."""
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


async def mesh(nodes: list[tuple[Any, BroadcastNode]]) -> None:
    for i, (t, _) in enumerate(nodes):
        for u, _ in nodes[:i]:
            await t.connect(u.listen_addrs()[0])
    for _, n in nodes:  # generous bounds: under load a stream negotiation can take many seconds
        await n.wait_conns(len(nodes) - 1, 120)
    await wait_until(lambda: all(t.topic_peers(n.topic) for t, n in nodes), 60)


def payload(n: int = 12 * CHUNK + 1234, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------- live tests


def test_live_broadcast_reaches_every_follower_with_forwarding() -> None:
    data = payload()
    digest = hashlib.blake2b(data, digest_size=32).digest()

    async def main() -> None:
        async with live_node(0, upload=2 * 2**20) as o, live_node(1) as f1, live_node(2) as f2, live_node(3) as f3:
            nodes = [o, f1, f2, f3]
            await mesh(nodes)
            env, chunks = make_patch(ident(0), data, CHUNK, swarm="test")
            pid = await o[1].publish(env, chunks)  # the manifest travels by gossip
            for _, f in nodes[1:]:
                tr = await f.wait_for_transfer(60, lambda t: t.pid == pid)
                await f.wait_complete(pid, 120)
                assert hashlib.blake2b(tr.payload(), digest_size=32).digest() == digest
            origin_out = o[1].stats(pid)["bytes_out"]
            follower_out = sum(f.stats(pid)["bytes_out"] for _, f in nodes[1:])
            assert follower_out > 0, "followers must forward chunks to each other"
            assert origin_out < 3 * len(data)  # not one copy per follower
            # once everyone holds the patch nothing is left to time out: the tickers go to sleep
            assert not any(f.ticking for _, f in nodes[1:])
            await wait_until(lambda: not o[1].ticking, 30)  # the origin after its last super-seeding round

    trio.run(main)


def test_forged_manifest_is_rejected_before_any_fetch() -> None:
    data = payload(3 * CHUNK)

    async def main() -> None:
        async with live_node(10) as f:
            env, _ = make_patch(ident(11), data, CHUNK, swarm="test")
            e = decode_envelope(env, swarm="test")
            forged = encode(msgspec.structs.replace(e, body=e.body[:-1] + bytes([e.body[-1] ^ 1])))
            with pytest.raises(DecodeError):
                await f[1].add_manifest(forged)
            assert not f[1].transfers and f[1].counters["manifests_rejected"] == 1

    trio.run(main)


def test_live_corrupt_server_is_banned_and_others_complete() -> None:
    data = payload(16 * CHUNK)
    digest = hashlib.blake2b(data, digest_size=32).digest()
    penalties: list = []

    async def main() -> None:
        async with (
            live_node(20, upload=1 * 2**20) as o,
            live_node(21, cls=CorruptNode) as bad,
            live_node(22, penalties=penalties) as f2,
            live_node(23, penalties=penalties) as f3,
            live_node(24, penalties=penalties) as f4,
        ):
            nodes = [o, bad, f2, f3, f4]
            await mesh(nodes)
            env, chunks = make_patch(ident(20), data, CHUNK, swarm="test")
            pid = await o[1].publish(env, chunks)
            for _, f in (f2, f3, f4):
                await f.wait_for_transfer(60, lambda t: t.pid == pid)
                tr = await f.wait_complete(pid, 120)
                assert hashlib.blake2b(tr.payload(), digest_size=32).digest() == digest
            bad_id = bad[0].peer_id
            banned_by = [f for _, f in (f2, f3, f4) if bad_id in f.banned]
            assert banned_by, "the corrupt peer served someone and must be banned"
            assert any(p == bad_id and a > 0 and "hash" in r for p, r, a in penalties)

    trio.run(main)


def test_live_restart_resumes_from_stored_chunks(tmp_path: Path) -> None:
    data = payload(24 * CHUNK)
    digest = hashlib.blake2b(data, digest_size=32).digest()
    part = tmp_path / "partial"

    async def main() -> None:
        async with live_node(30, upload=512 * 1024) as o:
            env, chunks = make_patch(ident(30), data, CHUNK, swarm="test")
            pid = None
            held = 0
            async with live_node(31, partial=part) as f:
                await mesh([o, f])
                pid = await o[1].publish(env, chunks)
                tr = await f[1].wait_for_transfer(60, lambda t: t.pid == pid)
                await f[1].wait_have(pid, 8, 60)
                assert not tr.session.complete
                await wait_until(lambda: len(list((part / pid.hex()).glob("*.chunk"))) >= 8, 30)
            held = len(list((part / pid.hex()).glob("*.chunk")))
            assert 8 <= held < len(chunks)
            async with live_node(31, partial=part) as f:  # same identity, same disk: a restart
                await f[0].connect(o[0].listen_addrs()[0])
                # it learns the manifest from the origin's have-map (ManifestRequest), then resumes
                tr = await f[1].wait_for_transfer(60, lambda t: t.pid == pid)
                assert tr.session.nhave >= held
                await f[1].wait_complete(pid, 120)
                assert hashlib.blake2b(tr.payload(), digest_size=32).digest() == digest
                assert tr.session.bytes_in <= (len(chunks) - held) * CHUNK

    trio.run(main)


@pytest.mark.slow
def test_live_kill_followers_mid_broadcast_survivors_complete() -> None:
    data = payload(32 * CHUNK)
    digest = hashlib.blake2b(data, digest_size=32).digest()

    async def main() -> None:
        async with trio.open_nursery() as n:
            nodes: list = []
            scopes: list[trio.CancelScope] = []

            async def run_node(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as sc:
                    async with live_node(i, upload=1 * 2**20 if i == 40 else 0) as nd:
                        nodes.append(nd)
                        scopes.append(sc)
                        task_status.started()
                        await trio.sleep_forever()

            for i in range(40, 57):  # origin + 16 followers, full mesh, one process
                await n.start(run_node, i)
            await mesh(nodes)
            o = nodes[0]
            env, chunks = make_patch(ident(40), data, CHUNK, swarm="test")
            pid = await o[1].publish(env, chunks)
            victims = nodes[1:5]
            tr = await victims[0][1].wait_for_transfer(60, lambda t: t.pid == pid)
            await victims[0][1].wait_have(pid, 4, 60)
            assert not tr.session.complete
            for k in (1, 2, 3, 4):
                scopes[k].cancel()  # kill 4 of 16 followers mid-broadcast
            for _, f in nodes[5:]:
                await f.wait_for_transfer(60, lambda t: t.pid == pid)
                t2 = await f.wait_complete(pid, 180)
                assert hashlib.blake2b(t2.payload(), digest_size=32).digest() == digest
            n.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------- stream framing and manifest races


class _TrioStream:
    """gossip.transport.Stream over one end of a trio in-memory stream pair."""

    def __init__(self, s: Any) -> None:
        self.s = s

    async def read(self, n: int) -> bytes:
        return bytes(await self.s.receive_some(n))

    async def write(self, data: bytes) -> None:
        await self.s.send_all(data)

    async def close(self) -> None:
        await self.s.aclose()

    async def reset(self) -> None:
        await self.s.aclose()


def test_coalesced_frames_parse_back_and_limits_hold() -> None:
    from murmur.gossip.framing import FrameReader, encode_frames
    from murmur.gossip.transport import StreamError
    from murmur.sync.swarm import Chunk, Have, HaveChunk, Request, decode_frame

    pid = b"p" * 32
    frames = [Have(pid, b"\x01", True), HaveChunk(pid, 3), Request(pid, 7), Chunk(pid, 2, b"z" * 300_000)]

    async def main() -> None:
        a, b = trio.testing.memory_stream_pair()
        w, r = _TrioStream(a), _TrioStream(b)
        async with trio.open_nursery() as n:
            n.start_soon(w.write, bytes(encode_frames(frames)))
            reader = FrameReader(r, 400_000)
            got = [decode_frame(await reader.next()) for _ in frames]
        assert got == frames
        # a length over the limit is refused before its body is awaited
        a, b = trio.testing.memory_stream_pair()
        await _TrioStream(a).write((1_000_000).to_bytes(4, "big"))
        with pytest.raises(StreamError, match="limit"):
            await FrameReader(_TrioStream(b), 400_000).next()
        # a stream that ends inside a frame is an error, a clean end is None
        a, b = trio.testing.memory_stream_pair()
        await _TrioStream(a).write(bytes(encode_frames([HaveChunk(pid, 1)]))[:-2])
        await a.aclose()
        with pytest.raises(StreamError, match="inside a frame"):
            await FrameReader(_TrioStream(b), 400_000).next()
        a, b = trio.testing.memory_stream_pair()
        await a.aclose()
        assert await FrameReader(_TrioStream(b), 400_000).next() is None

    trio.run(main)


def test_concurrent_add_manifest_makes_one_transfer(tmp_path: Path) -> None:
    """Gossip and a Manifest reply often deliver the same manifest at once: one Transfer, one completion."""
    data = payload(4 * CHUNK)

    async def main() -> None:
        async with live_node(60, partial=tmp_path / "p") as (_, f):
            env, _ = make_patch(ident(61), data, CHUNK, swarm="test")
            got: list = []
            seen: list = []

            async def add() -> None:
                got.append(await f.add_manifest(env))

            async def watch() -> None:  # like a follower waiting for its patch to show up
                seen.append(await f.wait_for_transfer(30))

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()
                for _ in range(3):
                    n.start_soon(add)
            pid = got[0]
            assert got == [pid, pid, pid] and len(f.transfers) == 1
            assert seen[0] is f.transfers[pid], "a waiter must hold the one live Transfer, not a replaced one"

    trio.run(main)


def test_wait_complete_on_an_unknown_or_evicted_transfer_is_a_clear_error() -> None:
    """The node's catch-up loop waits on transfers that the 64-transfer limit may evict: that must be an
    error it can handle, not a KeyError that kills the node."""
    from murmur.gossip.transport import StreamError

    async def main() -> None:
        async with live_node(0) as (_, node):
            with pytest.raises(StreamError, match="not being transferred"):
                await node.wait_complete(b"\x01" * 32, 1.0)

    trio.run(main)


def test_stuck_transfers_never_block_new_patches() -> None:
    """Patches whose chunks never come (pruned at every peer, or manifests a publisher signs and never
    serves) must not fill the transfer table for good: the oldest unfinished transfer gives way, is
    counted, and waiting on it is the clear error catch-up already handles."""
    from murmur.gossip.transport import StreamError
    from murmur.sync.transfers import MAX_TRANSFERS

    publisher = ident(70)

    async def main() -> None:
        async with live_node(71) as (_, f):
            pids = []
            for v in range(1, MAX_TRANSFERS + 3):  # nobody ever serves a chunk of these
                env, _ = make_patch(publisher, payload(2 * CHUNK, seed=v), CHUNK, version=v, swarm="test")
                pids.append(await f.add_manifest(env))
            assert all(p is not None for p in pids)
            assert len(f.transfers) == MAX_TRANSFERS
            assert pids[-1] in f.transfers and pids[0] not in f.transfers and pids[1] not in f.transfers
            assert f.counters["transfers_evicted"] == 2
            with pytest.raises(StreamError, match="not being transferred"):
                await f.wait_complete(pids[0], 1.0)

    trio.run(main)
