"""WebRTC-direct as the node's fallback path (murmur.node.shell.reachability): TCP fails, UDP /webrtc-direct connects, gossip flows.

Loopback only: two real py-libp2p hosts with `start_reachability`; the "blocked" TCP path is a sink that
accepts connections and never speaks (like a filtering middlebox), so the TCP dial times out. The test
that needs aiortc skips with the reason without it (aiortc is a default dependency, so CI runs them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

import murmur.gossip.framing
import murmur.gossip.webrtc
import murmur.node.shell.reachability
from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.webrtc import is_webrtc_addr, webrtc_listen_for
from murmur.node.cli.doctor_reachability import WEBRTC, check_path
from murmur.node.config import Config
from murmur.node.shell import reachability as reach
from murmur.node.shell.reachability import start_reachability


def test_webrtc_listen_addresses_follow_tcp() -> None:
    got = webrtc_listen_for(
        [
            "/ip4/0.0.0.0/tcp/4001",
            "/ip4/10.0.0.2/tcp/5000/p2p/12D3KooW",
            "/ip4/1.2.3.4/tcp/4001/p2p/X/p2p-circuit/p2p/Y",
            "/ip4/1.2.3.4/tcp/80/ws",
        ]
    )
    assert got == ["/ip4/0.0.0.0/udp/4001/webrtc-direct", "/ip4/10.0.0.2/udp/5000/webrtc-direct"]
    assert is_webrtc_addr("/ip4/1.2.3.4/udp/1/webrtc-direct/certhash/uEi/p2p/X") and not is_webrtc_addr(got[0][:-14])


def test_webrtc_disabled_in_config_is_reported() -> None:
    async def main() -> None:
        cfg = Config()
        cfg.network.webrtc = False
        async with open_transport(Identity.from_seed(b"\x51" * 32)) as a, trio.open_nursery() as n:
            s = await start_reachability(a, cfg, n)
            with trio.fail_after(10):
                while not s.webrtc_error:
                    await trio.sleep(0.05)
            v = s.view()
            assert "network.webrtc = false" in v.webrtc_reason
            assert not any(is_webrtc_addr(x) for x in v.listen_addrs + v.announce_addrs)
            n.cancel_scope.cancel()

    trio.run(main)


def test_webrtc_attach_waits_until_the_first_connection_had_its_gossip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The WebRTC-direct attach (aiortc's import, its transport, UDP sockets) takes the event loop's thread:
    it must not run while the first connection brings up gossip (that cost the first message hundreds of
    ms), and must still start when no peer comes (UDP-only networks need it). Virtual time."""

    attached: list[float] = []

    async def fake_attach(transport: Any, listen: list[str]) -> list[str]:
        attached.append(trio.current_time())
        return ["/ip4/127.0.0.1/udp/4001/webrtc-direct/p2p/X"]

    monkeypatch.setattr(murmur.gossip.webrtc, "attach_webrtc", fake_attach)

    class Host:
        def listen_addrs(self) -> list[str]:
            return ["/ip4/127.0.0.1/tcp/4001/p2p/X"]

    async def run(first_peer_at: float | None) -> float:
        attached.clear()
        state = reach.ReachState(Host(), Config(), [], dict)
        async with trio.open_nursery() as n:
            n.start_soon(state.start_webrtc)
            if first_peer_at is not None:
                await trio.sleep(first_peer_at)
                state.first_peer.set()
            with trio.fail_after(60):
                while not state.webrtc_addrs:
                    await trio.sleep(0.01)
        assert len(attached) == 1
        return attached[0]

    async def main() -> None:
        t0 = trio.current_time()
        assert await run(0.3) - t0 >= 0.3 + reach.WEBRTC_SETTLE_S  # not during the first connection's start
        t1 = trio.current_time()
        assert await run(None) - t1 == pytest.approx(reach.WEBRTC_NO_PEER_S, abs=0.02)  # nobody came
        assert reach.WEBRTC_NO_PEER_S < reach.TCP_DIAL_S  # up before a failed TCP dial's retry needs it

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _stream_pair_on_a_list() -> tuple[Any, Any, list[bytes]]:
    """Two of py-libp2p's own WebRTC stream objects; what `tx` sends lands in the list (no aiortc)."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    wire: list[bytes] = []
    tx = WebRTCStream(connection=object(), channel_id=2, is_initiator=True)
    rx = WebRTCStream(connection=object(), channel_id=1, is_initiator=False)

    async def send(framed: bytes) -> None:
        wire.append(framed)

    tx._send_callback = send
    return tx, rx, wire


def test_webrtc_stream_takes_bytearray_writes() -> None:
    """py-libp2p 0.8.1's WebRTC stream rejected a bytearray write ("expected bytes, bytearray found");
    the chunk broadcast writes its coalesced frames as one bytearray, so over WebRTC-direct no patch
    chunk ever arrived. With the workaround a bytearray or memoryview write goes out, and the frames,
    fed to a receiving WebRTCStream, read back as the same bytes. py-libp2p's own stream class; only
    the wire is a list (no aiortc needed)."""
    from murmur.gossip import libp2p_fixes

    if not libp2p_fixes.install_webrtc():
        pytest.skip("aiortc does not import: py-libp2p's WebRTC transport needs it")
    data = bytearray(range(256)) * 200  # 51,200 bytes: four data-channel messages

    async def main() -> None:
        tx, rx, wire = _stream_pair_on_a_list()
        await tx.write(data)
        await tx.write(memoryview(b"tail"))
        assert len(wire) == 5 and all(type(m) is bytes for m in wire)
        for m in wire:
            rx.on_data(m)  # inside trio: applied inline
        got = bytearray()
        with trio.fail_after(5):
            while len(got) < len(data) + 4:
                got += await rx.read(1 << 20)
        assert bytes(got) == bytes(data) + b"tail"

    trio.run(main)


def test_webrtc_stream_resets_instead_of_dropping_when_its_read_queue_is_full() -> None:
    """py-libp2p 0.8.1 dropped an incoming message when 64 were queued for the reader and went on with
    the next ones: a silent hole in the byte stream. With the workaround the queue holds
    READ_QUEUE_MESSAGES and one more message resets the stream: the reader gets a prefix of what was
    sent and then an error, never bytes after a gap. No aiortc needed."""
    from libp2p.transport.webrtc.exceptions import WebRTCStreamError

    from murmur.gossip import libp2p_fixes
    from murmur.gossip.webrtc import READ_QUEUE_MESSAGES

    if not libp2p_fixes.install_webrtc():
        pytest.skip("aiortc does not import: py-libp2p's WebRTC transport needs it")
    head, tail = READ_QUEUE_MESSAGES + 40, 8
    sent = [b"m%05d" % i for i in range(head + tail)]

    async def main() -> None:
        tx, rx, wire = _stream_pair_on_a_list()
        for m in sent:
            await tx.write(m)
        await tx.close()
        assert len(wire) == head + tail + 1  # one data-channel message per write, then FIN
        got = bytearray()
        errors = 0

        async def drain() -> None:
            """Read what is queued (one task, nothing else runs: a read that finds none would wait)."""
            nonlocal errors
            try:
                while True:
                    with trio.move_on_after(0.3) as idle:
                        part = await rx.read(1 << 20)
                    if idle.cancelled_caught or not part:
                        return
                    got.extend(part)
            except WebRTCStreamError:
                errors += 1

        for m in wire[:head]:
            rx.on_data(m)  # nobody reads meanwhile: the queue overflows
        await drain()
        for m in wire[head:]:
            rx.on_data(m)  # later messages: without the fix they were delivered after the hole
        await drain()
        assert errors >= 1
        assert bytes(got) == b"".join(sent)[: len(got)], "bytes after a hole"

    trio.run(main)


@pytest.mark.slow
def test_tcp_blocked_peers_connect_over_webrtc_and_gossip(webrtc_extra: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # How long an announced peer must stay circuit-less before WebRTC-direct is tried is policy, not what this
    # test is about: a short grace keeps the rule (the first round tries TCP only) without 30 s of waiting.
    monkeypatch.setattr(reach, "WEBRTC_AFTER_S", 2.0)
    a_id, b_id = Identity.from_seed(b"\x52" * 32), Identity.from_seed(b"\x53" * 32)
    known: dict[str, list[str]] = {}

    async def sink(stream: trio.SocketStream) -> None:  # the filtered TCP path: accepts, never answers
        with trio.move_on_after(30):
            while await stream.receive_some(4096):
                pass

    async def main() -> None:
        async with open_transport(a_id) as a, open_transport(b_id) as b, trio.open_nursery() as n:
            listeners = await n.start(partial(trio.serve_tcp, sink, 0, host="127.0.0.1"))
            sink_port = listeners[0].socket.getsockname()[1]
            sa = await start_reachability(a, Config(), n)
            sb = await start_reachability(b, Config(), n, known=lambda: known)
            with trio.fail_after(30):
                while not (sa.webrtc_addrs and sb.webrtc_addrs):
                    assert not sa.webrtc_error and not sb.webrtc_error, (sa.webrtc_error, sb.webrtc_error)
                    await trio.sleep(0.05)
            announced = sa.announce_addrs()
            assert any(is_webrtc_addr(x) for x in announced), announced
            # what B learns of A: a TCP address that goes nowhere, then A's announced WebRTC addresses
            known[a.peer_id] = [f"/ip4/127.0.0.1/tcp/{sink_port}/p2p/{a.peer_id}"] + [
                x for x in announced if is_webrtc_addr(x)
            ]
            inbox = await b.subscribe("murmur/test/webrtc")
            await a.subscribe("murmur/test/webrtc")
            t0 = trio.current_time()
            with trio.fail_after(60):
                # the dial's own record (b.peers() shows the connection a moment before connect() returns)
                while a.peer_id not in sb.webrtc_dialled:
                    await trio.sleep(0.05)
            connect_s = trio.current_time() - t0
            # a first round of TCP only (A was announced a moment ago), then TCP again and WebRTC-direct
            assert connect_s >= 2 * reach.TCP_DIAL_S - 0.5, (
                f"two TCP dials should have been tried (and timed out) first: {connect_s:.2f} s"
            )
            vb, va = sb.view(), sa.view()
            assert vb.peer_paths[a.peer_id] == "webrtc" and vb.path == WEBRTC, vb
            assert va.peer_paths[b.peer_id] == "webrtc", va  # inbound side sees the same path
            assert "WebRTC-direct" in check_path(vb).detail
            with trio.fail_after(30):
                while b.peer_id not in a.topic_peers("murmur/test/webrtc"):
                    await trio.sleep(0.05)
                sent = b"rollout over webrtc " + bytes(range(200))
                while True:  # the mesh may take a heartbeat: publish again until delivered, bounded above
                    try:
                        await a.publish("murmur/test/webrtc", sent)
                        break
                    except Exception:
                        await trio.sleep(0.2)
                origin, data = await inbox.receive()
            assert origin == a.peer_id and data == sent
            print(f"webrtc fallback: connect {connect_s:.2f} s (6 s of it two TCP timeouts)")
            n.cancel_scope.cancel()

    _run_showing_the_failure(main)


def _run_showing_the_failure(main: Any) -> None:
    """trio.run, raising the failure itself rather than the nurseries' nested exception groups."""
    try:
        trio.run(main)
    except BaseExceptionGroup as e:
        leaf: BaseException = e
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None


async def _echo(stream) -> None:  # type: ignore[no-untyped-def]
    await stream.write(await stream.read(100))
    await stream.close()


async def _open_stream(src: Any, dst: Any, protocol: Any, attempts: int = 3) -> Any:
    """A stream from `src` to `dst`, opened again (at most `attempts` times) when its negotiation fails: a
    stray WebRTC stream open stalls past multistream-select's timeout now and then, with or without the
    workarounds, and a node retries it. A stream stuck behind a flood fails every attempt."""
    from libp2p.host.exceptions import StreamFailure

    for k in range(attempts):
        try:
            return await src.new_stream(dst.get_id(), [protocol])
        except StreamFailure:
            if k == attempts - 1:
                raise
    raise AssertionError("unreachable")


@asynccontextmanager
async def _raw_webrtc_pair(handlers: dict[str, Any]) -> AsyncIterator[tuple[Any, Any]]:
    """Two bare py-libp2p hosts, `b` listening on /webrtc-direct only, `a` connected to it and a first
    stream through the connection answered; `handlers` (protocol -> handler) on both. The connect is
    retried: a WebRTC negotiation stalls now and then, and on a loaded machine a fresh connection's
    first stream can wait past multistream-select's timeout; the tests below are about what a working
    connection does, so a connection that does not carry a probe is dropped and dialled again."""
    import os

    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.host.exceptions import StreamFailure
    from libp2p.peer.peerinfo import PeerInfo

    from murmur.gossip import libp2p_fixes

    libp2p_fixes.install_webrtc()
    a = new_host(key_pair=create_new_key_pair(os.urandom(32)), enable_webrtc=True)
    b = new_host(key_pair=create_new_key_pair(os.urandom(32)), enable_webrtc=True)
    async with (
        b.run([multiaddr.Multiaddr("/ip4/127.0.0.1/udp/0/webrtc-direct")]),
        a.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]),
    ):
        probe_p = TProtocol("/test/probe/1")
        for proto, handler in {**handlers, probe_p: _echo}.items():
            a.set_stream_handler(TProtocol(proto), handler)
            b.set_stream_handler(TProtocol(proto), handler)
        target = PeerInfo(b.get_id(), [x for x in b.get_addrs() if "webrtc-direct" in str(x)])
        for _ in range(3):
            with trio.move_on_after(30):
                try:
                    await a.connect(target)
                    probe = await a.new_stream(b.get_id(), [probe_p])
                    await probe.write(b"probe")
                    answered = await probe.read(100) == b"probe"
                    await probe.close()
                    if answered:
                        break
                except StreamFailure:
                    pass
            await a.disconnect(b.get_id())
        else:
            raise AssertionError("no working WebRTC-direct connection in 3 attempts of 30 s")
        yield a, b


@pytest.mark.slow
def test_webrtc_writes_wait_for_the_send_queue_and_new_streams_open_during_a_flood(webrtc_extra: None) -> None:
    """py-libp2p's WebRTC write returns once aiortc queued the bytes; without `libp2p_fixes.install_webrtc()`
    a bulk writer queued 10+ MiB ahead of the wire and a stream opened meanwhile waited behind it past
    multistream-select's 10 s timeout (how a real node behind a UDP-only NAT failed to fetch patches).
    With it, the bytes written but not yet received stay bounded and a new stream opens mid-flood."""
    import os

    from libp2p.custom_types import TProtocol

    from murmur.gossip.webrtc import SEND_QUEUE_HIGH

    sink_p, echo_p = TProtocol("/test/sink/1"), TProtocol("/test/echo/1")
    got = [0]
    total = 6 << 20

    async def sink(stream) -> None:
        while got[0] < total:
            part = await stream.read(65536)
            if not part:
                break
            got[0] += len(part)

    async def main() -> None:
        async with _raw_webrtc_pair({sink_p: sink, echo_p: _echo}) as (a, b):
            with trio.fail_after(60):
                s = await _open_stream(a, b, sink_p)
            block, sent, ahead = os.urandom(16384), 0, []
            opened = trio.Event()

            async def open_mid_flood() -> None:
                while sent < total // 3:  # bounded by the flood below, which is bounded by `total`
                    await trio.sleep(0.01)
                for src, dst in ((a, b), (b, a)):
                    e = await _open_stream(src, dst, echo_p, attempts=2)
                    await e.write(b"ping")
                    assert await e.read(100) == b"ping"
                opened.set()

            with trio.fail_after(120):
                async with trio.open_nursery() as n:
                    n.start_soon(open_mid_flood)
                    while sent < total:
                        await s.write(block)
                        sent += len(block)
                        ahead.append(sent - got[0])
                    with trio.fail_after(30):
                        await opened.wait()
            assert max(ahead) <= SEND_QUEUE_HIGH + (2 << 20), f"writer ran {max(ahead) >> 10} KiB ahead"

    _run_showing_the_failure(main)


@pytest.mark.slow
def test_webrtc_carries_broadcast_frames_written_as_a_bytearray(webrtc_extra: None) -> None:
    """The chunk broadcast's coalesced write (`murmur.gossip.framing.encode_frames`, a bytearray) over a real
    WebRTC-direct connection arrives intact: without `libp2p_fixes.install_webrtc()` the write raised TypeError."""
    import hashlib
    import os

    from libp2p.custom_types import TProtocol

    from murmur.gossip.framing import encode_frames
    from murmur.sync.swarm import Have

    proto = TProtocol("/test/frames/1")
    payload = encode_frames([Have(os.urandom(32), os.urandom(8)) for _ in range(40)])
    payload += os.urandom(100_000)  # a chunk-sized tail in the same write
    assert isinstance(payload, bytearray)

    async def digest(stream) -> None:  # type: ignore[no-untyped-def]
        h, got = hashlib.blake2b(digest_size=32), 0
        while got < len(payload):
            part = await stream.read(65536)
            if not part:
                break
            h.update(part)
            got += len(part)
        await stream.write(h.digest())
        await stream.close()

    async def main() -> None:
        async with _raw_webrtc_pair({proto: digest}) as (a, b):
            with trio.fail_after(60):
                s = await _open_stream(a, b, proto)
                await s.write(payload)
                answer = await s.read(32)
            assert answer == hashlib.blake2b(bytes(payload), digest_size=32).digest()

    _run_showing_the_failure(main)


@pytest.mark.slow
def test_webrtc_connection_outlives_256_streams(webrtc_extra: None) -> None:
    """py-libp2p 0.8.1 never removed closed WebRTC streams from their connection, so its 253rd stream
    failed at once (the 256-stream limit); `libp2p_fixes.install_webrtc()` makes closed streams leave the registry.
    A stray open fails now and then, with or without the fix, and more often on a loaded machine: it is opened
    again once, as a node does, so only an open that fails twice counts."""
    from libp2p.custom_types import TProtocol

    echo_p = TProtocol("/test/echo/1")
    LANES = 4

    def registered(host) -> int:
        conns = list(host.get_network().connections.values())
        flat = [c for x in conns for c in (x if isinstance(x, list) else [x])]
        return sum(len(getattr(getattr(c, "muxed_conn", c), "_streams", {}) or {}) for c in flat)

    async def main() -> None:
        async with _raw_webrtc_pair({echo_p: _echo}) as (a, b):
            ok: list[int] = []
            failed: list[int] = []
            stray: list[int] = []  # opens that failed once and worked when opened again, as a node does

            async def lane(first: int) -> None:
                for i in range(first, 280, LANES):
                    for attempt in range(2):
                        try:
                            with trio.fail_after(20):
                                s = await a.new_stream(b.get_id(), [echo_p])
                                await s.write(b"n%d" % i)
                                assert await s.read(100) == b"n%d" % i
                                await s.close()
                            ok.append(i)
                            break
                        except Exception:
                            (stray if attempt == 0 else failed).append(i)

            # a few opens at a time, as a node's streams come: a stray open that stalls holds up one lane
            async with trio.open_nursery() as n:
                for first in range(LANES):
                    n.start_soon(lane, first)
            # without the workaround, every open from the 253rd on fails, opened again or not
            assert len(ok) >= 275, f"{len(failed)} of 280 opens failed twice, first at {sorted(failed)[:1]}"
            # every closed stream leaves the registry (without the fix: all 280 stay); a stray failed
            # open may leave its half-made stream behind, at most one per failure
            left = len(failed) + len(stray)
            with trio.fail_after(10):
                while registered(a) > left or registered(b) > left:
                    await trio.sleep(0.05)

    _run_showing_the_failure(main)
