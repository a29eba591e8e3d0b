"""Held streams and per-peer limits against real py-libp2p hosts on 127.0.0.1 (gossip/limits.py, gossip/hostlimits.py).

Each test is an attack by one key holding a valid identity; the victim runs with small limits so the
attack is cheap to mount, and `_UNLIMITED` (the same node with limits too large to matter) shows what
the attack does without the defence.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio

from murmur.gossip import topics
from murmur.gossip.host import ConnectError, open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.limits import StreamLimits
from murmur.node.shell.views import _stream_limits
from murmur.sync.broadcast import PROTOCOL as CHUNKS
from murmur.sync.broadcast import BroadcastNode
from murmur.sync.swarm import MAX_FRAME_BYTES

MiB = 1 << 20
SMALL = StreamLimits(
    peer_streams=16,
    node_streams=64,
    peer_buffer_bytes=3 * MiB + 4096,
    node_buffer_bytes=64 * MiB,
    frame_deadline_s=2.0,
    offences=2,
)
_UNLIMITED = StreamLimits(
    peer_streams=10**6,
    node_streams=10**6,
    unproven_streams=10**6,
    peer_buffer_bytes=2**40,
    node_buffer_bytes=2**40,
    frame_deadline_s=1e6,
    offences=10**6,
)
SWARM = "limits"
STREAMS = 4  # one more than the share holds


async def wait_until(pred: Any, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


async def _ended(raw: Any) -> bool:
    """Whether the victim ended this stream (reset or EOF) instead of holding it open."""
    try:
        while True:
            if not await raw.read(65536):
                return True
    except Exception:
        return True


def _held_frames(limits: StreamLimits, watch_s: float) -> dict[str, Any]:
    """Four chunk streams each send 1 MiB of an 8 MiB frame and wait; an honest peer gossips meanwhile.
    The held streams are watched for up to `watch_s` seconds for the victim to end them."""
    victim, attacker, honest = (Identity.from_seed(bytes([i]) * 32) for i in (71, 72, 73))
    out: dict[str, Any] = {}

    async def main() -> None:
        from libp2p.peer.id import ID

        async with (
            open_transport(victim, limits=limits) as v,
            open_transport(attacker) as a,
            open_transport(honest) as h,
        ):
            charged: list[tuple[str, str]] = []
            v.faults.on_fault = lambda peer, proto, err: charged.append((peer, proto))
            bcast = BroadcastNode(v, swarm=SWARM)
            chan = await v.subscribe(topics.rollouts(SWARM))
            await h.subscribe(topics.rollouts(SWARM))
            async with trio.open_nursery() as n:
                await n.start(bcast.run)
                await a.connect(v.listen_addrs()[0])
                await h.connect(v.listen_addrs()[0])
                streams = []
                for _ in range(STREAMS):
                    raw = await a.host.new_stream(ID.from_base58(v.peer_id), [CHUNKS])
                    streams.append(raw)
                    try:
                        with trio.move_on_after(3):
                            await raw.write(struct.pack(">I", MAX_FRAME_BYTES) + b"\0" * MiB)
                    except Exception:
                        pass  # already reset by the victim
                # the honest peer is served while the attacker holds what it may
                await wait_until(lambda: h.router.mesh.get(topics.rollouts(SWARM)))
                await h.publish(topics.rollouts(SWARM), b"honest")
                with trio.fail_after(10):
                    assert await chan.receive() == (h.peer_id, b"honest")
                out["held_bytes"] = v.budget.node_buffered
                ended = []
                with trio.move_on_after(watch_s):
                    for raw in streams:
                        ended.append(await _ended(raw))
                out["ended"] = len(ended)
                out["counters"] = dict(v.budget.counters)
                out["status"] = _stream_limits(v)  # what `murmur node status` shows
                if len(ended) == STREAMS:  # every reservation given back once its stream ended
                    with trio.move_on_after(5):
                        await wait_until(lambda: v.budget.node_buffered == 0)
                out["left_bytes"] = v.budget.node_buffered
                out["charged"] = charged
                n.cancel_scope.cancel()

    trio.run(main)
    return out


def test_held_partial_frames_are_bounded_reset_and_charged() -> None:
    out = _held_frames(SMALL, watch_s=SMALL.frame_deadline_s * 3 + 5)
    assert out["held_bytes"] <= SMALL.peer_buffer_bytes  # never more than the peer's share
    assert out["ended"] == STREAMS  # every held stream was reset: by the buffer cap, or at its deadline
    assert out["counters"]["buffer_full_peer"] >= 1 and out["counters"]["frame_timeouts"] >= 1, out["counters"]
    assert any(proto == "stream budget" for _, proto in out["charged"]), out["charged"]
    assert out["left_bytes"] == 0  # every reservation was given back
    assert out["status"]["frame_timeouts"] == out["counters"]["frame_timeouts"]


def test_held_partial_frames_without_limits_stay_buffered() -> None:
    """The same attack against a node whose limits are too large to matter: the bytes stay held, the streams open."""
    out = _held_frames(_UNLIMITED, watch_s=SMALL.frame_deadline_s * 2)  # twice as long as the defended node waits
    assert out["held_bytes"] >= STREAMS * MiB
    assert out["ended"] < STREAMS


def test_one_peer_cannot_hold_more_than_its_streams_and_others_are_served() -> None:
    victim, attacker, honest = (Identity.from_seed(bytes([i]) * 32) for i in (74, 75, 76))
    out: dict[str, Any] = {}

    async def main() -> None:
        from libp2p.peer.id import ID

        async with (
            open_transport(victim, limits=SMALL) as v,
            open_transport(attacker) as a,
            open_transport(honest) as h,
        ):
            bcast = BroadcastNode(v, swarm=SWARM)
            async with trio.open_nursery() as n:
                await n.start(bcast.run)
                await a.connect(v.listen_addrs()[0])
                opened = 0
                for _ in range(3 * SMALL.peer_streams):  # idle streams: opened, never written to
                    try:
                        with trio.fail_after(5):
                            await a.host.new_stream(ID.from_base58(v.peer_id), [CHUNKS])
                        opened += 1
                    except Exception:
                        pass
                out["attacker_open"] = v.budget.streams.get(a.peer_id, 0)
                out["opened"] = opened
                await h.connect(v.listen_addrs()[0])
                with trio.fail_after(10):
                    s = await h.open_stream(v.peer_id, CHUNKS)  # a new peer still gets a stream
                await wait_until(lambda: v.budget.streams.get(h.peer_id, 0) >= 1)
                await s.close()
                out["counters"] = dict(v.budget.counters)
                n.cancel_scope.cancel()

    trio.run(main)
    assert out["attacker_open"] <= SMALL.peer_streams
    assert out["opened"] <= SMALL.peer_streams
    assert out["counters"]["streams_refused_peer"] >= 2 * SMALL.peer_streams - 4, out["counters"]


def test_bytes_beyond_a_yamux_window_close_the_connection_and_charge_the_sender() -> None:
    """py-libp2p buffers what a peer sends beyond a stream's receive window; go-yamux calls it a protocol error."""
    from libp2p.stream_muxer.yamux import yamux as ym

    victim, attacker = (Identity.from_seed(bytes([i]) * 32) for i in (77, 78))
    out: dict[str, Any] = {}

    async def main() -> None:
        from libp2p.peer.id import ID

        async with open_transport(victim) as v, open_transport(attacker) as a:
            charged: list[str] = []
            v.faults.on_fault = lambda peer, proto, err: charged.append(proto)

            async def never_reads(stream: Any, remote: str) -> None:
                await trio.sleep_forever()

            v.set_stream_handler("/murmur/test-idle/1", never_reads)
            await a.connect(v.listen_addrs()[0])
            raw = await a.host.new_stream(ID.from_base58(v.peer_id), ["/murmur/test-idle/1"])
            sid, conn = raw.muxed_stream.stream_id, raw.muxed_conn
            frame = 64 * 1024
            for _ in range(ym.DEFAULT_WINDOW_SIZE // frame + 2):  # past the window, ignoring our send credit
                try:
                    await conn._write_frame(
                        struct.pack(ym.YAMUX_HEADER_FORMAT, 0, ym.TYPE_DATA, 0, sid, frame) + b"\0" * frame
                    )
                except Exception:
                    break
            await wait_until(lambda: a.peer_id not in v.peers())
            out["charged"] = charged

    trio.run(main)
    assert "/yamux/1.0.0" in out["charged"]


def test_a_refused_peer_cannot_reconnect_until_the_refusal_lifts() -> None:
    victim, attacker, honest = (Identity.from_seed(bytes([i]) * 32) for i in (79, 80, 81))

    async def main() -> None:
        async with open_transport(victim) as v, open_transport(attacker) as a, open_transport(honest) as h:
            refused = {a.peer_id}
            v.refuse_connections(lambda p: p in refused)
            for _ in range(3):
                await a.disconnect(v.peer_id)  # a fresh dial each time
                try:
                    await a.connect(v.listen_addrs()[0])
                except ConnectError:
                    pass
                assert a.peer_id not in v.peers()
            assert v.faults.counts.get("connection refused (graylisted)", 0) >= 3
            with pytest.raises(ConnectError):  # nor does the node dial it
                await v.connect(a.listen_addrs()[0])
            await h.connect(v.listen_addrs()[0])
            await wait_until(lambda: h.peer_id in v.peers())
            refused.clear()  # the graylist's time is over
            await a.connect(v.listen_addrs()[0])
            await wait_until(lambda: a.peer_id in v.peers())

    trio.run(main)


def test_a_held_pubsub_rpc_is_reset_at_its_deadline() -> None:
    """py-libp2p's pubsub reader read an RPC's body for as long as its sender took; here it is budgeted too."""
    victim, attacker = (Identity.from_seed(bytes([i]) * 32) for i in (82, 83))
    out: dict[str, Any] = {}

    async def main() -> None:
        from libp2p.peer.id import ID
        from libp2p.utils.varint import encode_uvarint

        async with open_transport(victim, limits=SMALL) as v, open_transport(attacker) as a:
            await v.subscribe(topics.rollouts(SWARM))
            await a.connect(v.listen_addrs()[0])
            raw = await a.host.new_stream(ID.from_base58(v.peer_id), ["/meshsub/1.1.0"])
            await raw.write(encode_uvarint(MiB - 1) + b"\0" * (MiB // 2))  # half an RPC, then nothing
            await wait_until(lambda: v.budget.node_buffered >= MiB // 2)
            out["held"] = v.budget.node_buffered
            with trio.fail_after(SMALL.frame_deadline_s + 10):
                out["ended"] = await _ended(raw)
            out["timeouts"] = v.budget.counters["frame_timeouts"]
            await wait_until(lambda: v.budget.node_buffered == 0)

    trio.run(main)
    assert out["held"] <= SMALL.peer_buffer_bytes
    assert out["ended"] and out["timeouts"] == 1


def test_the_bench_stream_classes_are_bounded_and_the_held_frames_charged() -> None:
    """`murmur bench attacks`' held_frames and idle_streams against a node's default limits."""
    from murmur.simulations.bench import attacks

    victim = Identity.from_seed(bytes([84]) * 32)
    out: dict[str, Any] = {"max_buffered": 0, "max_streams": 0}

    async def main() -> None:
        async with open_transport(victim) as v:
            charged: list[tuple[str, str]] = []
            v.faults.on_fault = lambda peer, proto, err: charged.append((peer, proto))
            bcast = BroadcastNode(v, swarm=SWARM)
            async with trio.open_nursery() as n:
                await n.start(bcast.run)

                async def watch() -> None:
                    while True:
                        out["max_buffered"] = max(out["max_buffered"], v.budget.buffered.get(held.peer_id, 0))
                        out["max_streams"] = max(out["max_streams"], v.budget.streams.get(idle.peer_id, 0))
                        await trio.sleep(0.01)

                held, idle = attacks.attack_key("held_frames"), attacks.attack_key("idle_streams")
                n.start_soon(watch)
                for ident, attack in ((held, attacks.held_frames), (idle, attacks.idle_streams)):
                    async with open_transport(ident) as t:
                        a = attacks.Attacker(t, ident, SWARM, {v.peer_id: v.listen_addrs()[0]})
                        await attack(a, attacks.Knowledge(SWARM), [v.peer_id])
                        out[ident.peer_id] = a.sent
                out["charged"] = {p for p, proto in charged if proto == "stream budget"}
                out["refused"] = v.budget.counters["streams_refused_peer"]
                n.cancel_scope.cancel()

    trio.run(main)
    limits = StreamLimits()
    assert out["max_buffered"] <= limits.peer_buffer_bytes
    assert out["max_streams"] <= limits.peer_streams
    assert attacks.attack_key("held_frames").peer_id in out["charged"]
    assert attacks.attack_key("idle_streams").peer_id not in out["charged"]  # a cap is local: no one is charged
    assert out["refused"] >= attacks.IDLE_STREAMS - 2 * limits.peer_streams


def test_minted_keys_share_one_stream_pool_and_proven_peers_always_find_room() -> None:
    """Keys are free: 100 fresh keys each holding their 64 inbound streams would fill the node-wide cap (4,096,
    64 keys' worth) and lock every other peer out. Peers the node does not count as proven draw on one pool
    below that cap, so a proven peer still opens its whole share; the pool's places come back as streams
    close, a peer proven meanwhile gives its pooled streams back, and the refusals are counted."""
    from murmur.gossip.limits import StreamBudget

    limits = StreamLimits()
    budget = StreamBudget(limits)
    proven = {"established"}
    budget.proven = proven.__contains__
    minted = [f"minted-{i}" for i in range(100)]
    opened = sum(budget.open_stream(k) for k in minted for _ in range(limits.peer_streams))
    assert opened <= limits.unproven_streams < limits.node_streams
    assert budget.counters["streams_refused_unproven"] == 100 * limits.peer_streams - opened
    assert all(budget.open_stream("established") for _ in range(limits.peer_streams))
    assert not budget.open_stream(minted[-1])  # the pool stays full while the minted keys hold it
    for _ in range(limits.peer_streams):  # one minted key's streams close: their places return to the pool
        budget.close_stream(minted[0])
    proven.add(minted[1])  # proven while it holds pooled streams: closing them frees pool places too
    for _ in range(limits.peer_streams):
        budget.close_stream(minted[1])
    assert budget.pool_streams == opened - 2 * limits.peer_streams
    assert all(budget.open_stream(minted[-1]) for _ in range(limits.peer_streams))
    for k in minted:
        while budget.streams.get(k):
            budget.close_stream(k)
    budget.close_stream("established")
    assert budget.pool_streams == 0 and budget.pooled == {}
    assert budget.node_streams == limits.peer_streams - 1
