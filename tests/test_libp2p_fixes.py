"""gossip/libp2p_fixes.py: the version guard, and one focused test per fix of py-libp2p 0.8.1 (the host
limits and the WebRTC-direct fixes included; the WebRTC ones skip where aiortc does not import).

Each test shows the fixed behaviour, then runs py-libp2p's own code (`libp2p_fixes.original`) on the
same input and shows the defect the fix is for. Fixes whose defect needs a whole swarm to show are
covered by the host tests named in docs/architecture.md.
"""

from __future__ import annotations

import importlib.metadata
import struct
import types

import pytest
import trio
import trio.testing

from murmur.gossip import libp2p_fixes as F
from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.transport import FrameError


def test_any_other_py_libp2p_version_is_refused_by_name() -> None:
    for other in ("0.8.2", "0.9.0", "0.8.0"):
        with pytest.raises(F.UnsupportedLibp2p) as e:
            F.check_version(other)
        assert other in str(e.value) and F.SUPPORTED_VERSION in str(e.value)
    F.check_version(importlib.metadata.version("libp2p"))  # what this environment installs is supported


def test_install_is_explicit_idempotent_and_keeps_the_originals() -> None:
    from libp2p.io.trio import TrioTCPStream
    from libp2p.network.connection.swarm_connection import SwarmConn
    from libp2p.network.swarm import Swarm
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    F.install()

    def now() -> dict[str, object]:
        return {
            "buffered_tcp_reads": TrioTCPStream.read,
            "lean_yamux_writes": YamuxStream.write,
            "go_yamux_credit": YamuxStream._auto_tune_and_send_window_update,
            "pubsub_message_guard": Pubsub.push_msg,
            "pubsub_stream_retry": Pubsub._handle_new_peer,
            "pubsub_keep_subscriptions": Pubsub._handle_dead_peer,
            "pubsub_stream_on_closed_connection": Pubsub.handle_dead_peer_queue,
            "stream_caps": SwarmConn._handle_muxed_stream,
            "connection_refusal": Swarm.add_conn,
        }

    patched = now()
    F.install()
    assert now() == patched
    for name, fix in patched.items():
        assert F.original(name) is not fix and F.original(name).__module__.startswith("libp2p."), name
    # the receive window was a plain instance attribute: nothing to keep, a property in its place
    assert F.original("yamux_window_limit") is None and isinstance(vars(YamuxStream)["recv_window"], property)


class _CountingSocket:
    """A real trio socket stream that counts its receive calls (each one a `recv` system call)."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner, self.receives = inner, 0

    async def receive_some(self, n: int | None = None) -> bytes:
        self.receives += 1
        return await self.inner.receive_some(n)


def test_buffered_tcp_reads_serve_a_burst_of_noise_messages_from_one_recv() -> None:
    from libp2p.io.trio import TrioTCPStream

    F.install()
    burst = b"".join(struct.pack(">H", 40) + bytes([i]) * 40 for i in range(3))  # three framed messages

    async def reads(read) -> tuple[list[bytes], int]:  # type: ignore[no-untyped-def]
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as n:
            accepted = trio.Event()
            server: list[trio.SocketStream] = []

            async def accept() -> None:
                server.append(await listeners[0].accept())
                accepted.set()

            n.start_soon(accept)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await accepted.wait()
            await client.send_all(burst)
            counting = _CountingSocket(server[0])
            stream = TrioTCPStream(counting)  # type: ignore[arg-type]
            got = []
            for _ in range(3):
                (length,) = struct.unpack(">H", await read(stream, 2))
                got.append(await read(stream, length))
            await client.aclose()
            await server[0].aclose()
            await listeners[0].aclose()
        return got, counting.receives

    fixed = trio.run(reads, TrioTCPStream.read)
    unfixed = trio.run(reads, F.original("buffered_tcp_reads"))
    assert fixed[0] == unfixed[0] == [bytes([i]) * 40 for i in range(3)]
    assert fixed[1] == 1  # the whole burst from one recv
    assert unfixed[1] == 6  # py-libp2p: one recv per length and one per body


def test_go_yamux_credit_sends_no_window_update_for_a_small_read() -> None:
    """py-libp2p's credit rule answers a 40-byte read with a WINDOW_UPDATE frame; the fix waits until half
    the window is consumed."""
    from libp2p.stream_muxer.yamux import yamux as Y

    F.install()
    sent: list[bytes] = []

    async def main() -> None:
        got: list[object] = []
        arrived = trio.Event()

        async def keep(stream, peer: str) -> None:  # type: ignore[no-untyped-def]
            got.append(stream)
            arrived.set()
            await trio.sleep_forever()

        async with (
            open_transport(Identity.from_seed(b"\x61" * 32)) as a,
            open_transport(Identity.from_seed(b"\x62" * 32)) as b,
        ):
            b.set_stream_handler("/murmur/test-credit/1", keep)
            await a.connect(b.listen_addrs()[0])
            s = await a.open_stream(b.peer_id, "/murmur/test-credit/1")
            await s.write(b"x" * 40)
            with trio.fail_after(10):
                await arrived.wait()
            ys = got[0]._raw.muxed_stream  # type: ignore[attr-defined]
            with trio.fail_after(10):
                assert await ys.read(40) == b"x" * 40
            frame = Y.Yamux._write_frame

            async def record(self, data: bytes) -> None:  # type: ignore[no-untyped-def]
                if struct.unpack(Y.YAMUX_HEADER_FORMAT, data[: Y.HEADER_SIZE])[1] == Y.TYPE_WINDOW_UPDATE:
                    sent.append(data)
                await frame(self, data)

            Y.Yamux._write_frame = record
            try:
                await ys._auto_tune_and_send_window_update(bytes_read=40)
                fixed = len(sent)
                await F.original("go_yamux_credit")(ys, bytes_read=40)
                unfixed = len(sent) - fixed
            finally:
                Y.Yamux._write_frame = frame
            assert fixed == 0
            assert unfixed == 1
            await s.close()

    trio.run(main)


def test_an_oversized_pubsub_rpc_length_becomes_a_frame_error() -> None:
    """py-libp2p's limited reader raises MessageTooLarge, which its pubsub reader swallows (so nobody is
    charged); the fix raises our FrameError, which leaves the reader through the stream guard."""
    import libp2p.pubsub.pubsub as ps
    from libp2p.io.exceptions import MessageTooLarge
    from libp2p.io.trio import TrioTCPStream

    F.install()

    async def read_with(read) -> BaseException:  # type: ignore[no-untyped-def]
        a, b = trio.testing.memory_stream_pair()
        await a.send_all(b"\x80\x80\x80\x01" + b"\x00" * 16)  # a 2 MiB length prefix
        try:
            await read(TrioTCPStream(b), 1 << 20)  # type: ignore[arg-type]
        except Exception as e:
            return e
        raise AssertionError("an over-limit length was read")

    assert isinstance(trio.run(read_with, ps.read_varint_prefixed_bytes_limited), FrameError)
    assert isinstance(trio.run(read_with, F.original("pubsub_oversize_charge")), MessageTooLarge)


def test_a_failed_pubsub_negotiation_is_made_retryable() -> None:
    """py-libp2p retries a pubsub stream open that failed with SwarmException, and gives up for good on a
    StreamFailure (a negotiation that timed out): the fix raises the one it retries."""
    from libp2p.host.exceptions import StreamFailure
    from libp2p.network.exceptions import SwarmException
    from libp2p.peer.id import ID

    F.install()
    stranger = ID.from_base58(Identity.from_seed(b"\x63" * 32).peer_id)

    async def main() -> None:
        async with open_transport(Identity.from_seed(b"\x64" * 32)) as a:

            async def negotiation_fails(peer_id, protocols, *args, **kw):  # type: ignore[no-untyped-def]
                raise StreamFailure(f"failed to negotiate with {peer_id}")

            a.host.new_stream = negotiation_fails
            with pytest.raises(SwarmException):
                await a.pubsub._handle_new_peer(stranger)
            with pytest.raises(StreamFailure):
                await F.original("pubsub_stream_retry")(a.pubsub, stranger)
            assert a.faults.counts["pubsub stream open (retried)"] == 1

    trio.run(main)


def test_a_hello_write_on_a_reset_stream_is_made_retryable() -> None:
    """py-libp2p retries a pubsub stream open that failed with SwarmException or StreamClosed, and gives up for
    good when its hello write finds the stream reset (the connection it was opened on closed, while the peer
    stays connected through another): the fix raises the one it retries."""
    from libp2p.network.exceptions import SwarmException
    from libp2p.network.stream.exceptions import StreamClosed, StreamReset
    from libp2p.peer.id import ID

    F.install()
    stranger = ID.from_base58(Identity.from_seed(b"\x61" * 32).peer_id)

    class OnAClosedConnection:
        def get_protocol(self) -> str:
            return "/meshsub/1.2.0"

        async def write(self, data: bytes) -> None:
            raise StreamReset("Cannot write to stream; stream is reset")

    async def main() -> None:
        async with open_transport(Identity.from_seed(b"\x62" * 32)) as a:

            async def negotiated(peer_id, protocols, *args, **kw):  # type: ignore[no-untyped-def]
                return OnAClosedConnection()

            a.host.new_stream = negotiated
            with pytest.raises(SwarmException):
                await a.pubsub._handle_new_peer(stranger)
            with pytest.raises(StreamReset):
                await F.original("pubsub_stream_retry")(a.pubsub, stranger)
            assert not issubclass(StreamReset, (SwarmException, StreamClosed))  # what py-libp2p's loop retries
            assert stranger not in a.pubsub.peers
            assert a.faults.counts["pubsub stream open (retried)"] == 1

    trio.run(main)


class _Conn:
    def __init__(self, closed: bool) -> None:
        self.is_closed = closed
        self.muxed_conn = types.SimpleNamespace(is_closed=closed)


class _DeadPeerQueue:
    """What pubsub's dead-peer loop reads: the disconnected peers, the peer's connections (one still open)
    and our pubsub stream to it, on a connection that is open or closed."""

    def __init__(self, peer: str, stream_on: _Conn) -> None:
        self.send, self.dead_peer_receive_channel = trio.open_memory_channel[str](1)
        self.event_handle_dead_peer_queue_started = trio.Event()
        network = types.SimpleNamespace(get_connections=lambda p: [_Conn(closed=False)] if p == peer else [])
        self.host = types.SimpleNamespace(get_network=lambda: network)
        self.peers = {peer: types.SimpleNamespace(swarm_conn=stream_on, muxed_conn=stream_on.muxed_conn)}
        self.dead: list[str] = []

    def _peer_is_connected(self, peer_id: str) -> bool:
        from libp2p.pubsub.pubsub import Pubsub

        return Pubsub._peer_is_connected(self, peer_id)  # type: ignore[arg-type]

    def _handle_dead_peer(self, peer_id: str) -> None:
        self.dead.append(peer_id)


def test_a_pubsub_stream_on_a_closed_connection_is_replaced_while_another_connection_stays() -> None:
    """A peer's connection closed and another stays: py-libp2p leaves pubsub alone, even when our pubsub stream
    to the peer ran on the connection that closed (the dead stream stays the peer's stream). The fix hands
    that peer to `_handle_dead_peer`, which re-opens the stream on the surviving connection."""
    F.install()
    from libp2p.pubsub.pubsub import Pubsub

    async def dead_peers(loop, stream_on: _Conn) -> list[str]:  # type: ignore[no-untyped-def]
        q = _DeadPeerQueue("peer", stream_on)
        q.send.send_nowait("peer")
        q.send.close()
        await loop(q)
        return q.dead

    assert trio.run(dead_peers, Pubsub.handle_dead_peer_queue, _Conn(closed=True)) == ["peer"]
    assert trio.run(dead_peers, F.original("pubsub_stream_on_closed_connection"), _Conn(closed=True)) == []
    # a stream on a connection that is still open is left alone, as py-libp2p does
    assert trio.run(dead_peers, Pubsub.handle_dead_peer_queue, _Conn(closed=False)) == []


def test_a_still_connected_peer_keeps_its_subscriptions_when_our_stream_to_it_dies() -> None:
    F.install()
    topic = "/murmur/t/fixes/1"

    async def main() -> None:
        async with (
            open_transport(Identity.from_seed(b"\x65" * 32)) as a,
            open_transport(Identity.from_seed(b"\x66" * 32)) as b,
        ):
            await a.subscribe(topic)
            await b.subscribe(topic)
            await b.connect(a.listen_addrs()[0])
            with trio.fail_after(20):
                while a.topic_peers(topic) != [b.peer_id]:
                    await trio.sleep(0.02)
            peer = b.host.get_id()
            a.pubsub._handle_dead_peer(peer)  # our outbound stream died; the connection did not
            assert a.topic_peers(topic) == [b.peer_id]
            assert a.faults.counts["pubsub stream replaced (subscriptions kept)"] == 1
            F.original("pubsub_keep_subscriptions")(a.pubsub, peer)
            assert a.topic_peers(topic) == []  # forgotten, though b never sends them again
            assert b.peer_id in a.peers()

    trio.run(main)


def test_a_pubsub_message_task_that_raises_is_counted_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A local failure inside pubsub's per-message task (a closed verifier pool at shutdown raised OSError)
    is counted and the message dropped; py-libp2p lets it out, into the service that ends the host."""
    from libp2p.pubsub.pubsub import Pubsub

    F.install()
    topic = "/murmur/t/fixes/2"

    async def main() -> None:
        async with open_transport(Identity.from_seed(b"\x67" * 32)) as a:

            def pool_closed(forwarder, msg) -> bool:  # type: ignore[no-untyped-def]
                raise OSError(
                    "verifier pool closed"
                )  # py-libp2p turns only an async validator's errors into a rejection

            a.pubsub.set_topic_validator(topic, pool_closed, False)
            await a.pubsub.publish(topic, b"x")  # runs push_msg, as an inbound message's task does
            assert a.faults.counts["pubsub-message (error)"] == 1
            monkeypatch.setattr(Pubsub, "push_msg", F.original("pubsub_message_guard"))
            with pytest.raises(OSError, match="verifier pool closed"):
                await a.pubsub.publish(topic, b"y")

    trio.run(main)


def test_two_writers_on_one_yamux_stream_never_interleave_their_frames() -> None:
    """py-libp2p cuts a write into frames one at a time and lets a concurrent writer cut its own in
    between, so two messages over a frame long arrive mixed; the fix holds the stream for a whole write."""
    F.install()
    size = 150 * 1024  # three frames each

    async def main() -> tuple[bytes, bytes]:
        async with (
            open_transport(Identity.from_seed(b"\x68" * 32)) as a,
            open_transport(Identity.from_seed(b"\x69" * 32)) as b,
        ):
            received: list[bytes] = []
            done = trio.Event()

            async def sink(stream, peer: str) -> None:  # type: ignore[no-untyped-def]
                buf = b""
                while len(buf) < 4 * size:
                    buf += await stream.read(1 << 20)
                received.append(buf)
                done.set()

            b.set_stream_handler("/murmur/test-writes/1", sink)
            await a.connect(b.listen_addrs()[0])
            s = await a.open_stream(b.peer_id, "/murmur/test-writes/1")
            ys = s._raw.muxed_stream  # type: ignore[attr-defined]
            for write in (type(ys).write, F.original("lean_yamux_writes")):
                async with trio.open_nursery() as n:
                    n.start_soon(write, ys, b"A" * size)
                    n.start_soon(write, ys, b"B" * size)
            with trio.fail_after(20):
                await done.wait()
            return received[0][: 2 * size], received[0][2 * size :]

    fixed, unfixed = trio.run(main)
    assert fixed in (b"A" * size + b"B" * size, b"B" * size + b"A" * size)
    assert unfixed not in (b"A" * size + b"B" * size, b"B" * size + b"A" * size)  # mixed


def test_a_peer_record_already_checked_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-libp2p verifies the signed peer record that comes with every pubsub RPC, again and again for
    the same record; the fix checks a record once (per host, bounded, for RECORD_MEMO_TTL_S)."""
    import libp2p.pubsub.pubsub as ps
    import libp2p.pubsub.utils as pubsub_utils
    from libp2p.pubsub.pb import rpc_pb2

    F.install()
    checks: list[bytes] = []
    consume = pubsub_utils.consume_envelope

    def counted(data: bytes, domain: str):  # type: ignore[no-untyped-def]
        checks.append(data)
        return consume(data, domain)

    monkeypatch.setattr(pubsub_utils, "consume_envelope", counted)

    async def main() -> None:
        async with (
            open_transport(Identity.from_seed(b"\x6a" * 32)) as a,
            open_transport(Identity.from_seed(b"\x6b" * 32)) as b,
        ):
            record, _ = ps.env_to_send_in_RPC(b.host)
            rpc, peer = rpc_pb2.RPC(senderRecord=record), b.host.get_id()
            assert [ps.maybe_consume_signed_record(rpc, a.host, peer) for _ in range(3)] == [True] * 3
            assert len(checks) == 1
            original = F.original("peer_record_memo")
            assert [original(rpc, a.host, peer) for _ in range(3)] == [True] * 3
            assert len(checks) == 4  # py-libp2p: one signature check per RPC

    trio.run(main)


def test_a_stream_over_its_peers_cap_is_reset_before_negotiation() -> None:
    """py-libp2p hands every inbound stream to negotiation (behind a host-wide semaphore that queues); the
    fix (`stream_caps`) resets a stream over its peer's cap first, and gives a place back when one closes."""
    from libp2p.network.connection.swarm_connection import SwarmConn

    from murmur.gossip.limits import StreamBudget, StreamLimits

    F.install()
    budget = StreamBudget(StreamLimits(peer_streams=1, node_streams=8))
    assert budget.open_stream("p")  # the peer's one stream, held
    handled: list[object] = []
    resets: list[object] = []

    async def handler(net_stream: object) -> None:
        handled.append(net_stream)

    async def add_stream(muxed: object) -> object:
        return types.SimpleNamespace(muxed=muxed, _resource_released=True)

    conn = types.SimpleNamespace(
        swarm=types.SimpleNamespace(_murmur_budget=budget, common_stream_handler=handler),
        muxed_conn=types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda: "p")),
        _add_stream=add_stream,
        remove_stream=lambda s: None,
    )

    class Muxed:
        async def reset(self) -> None:
            resets.append(self)

    async def main() -> None:
        await SwarmConn._handle_muxed_stream(conn, Muxed())
        assert (len(resets), len(handled)) == (1, 0)
        await F.original("stream_caps")(conn, Muxed())
        assert (len(resets), len(handled)) == (1, 1)  # py-libp2p: handed on, over the cap
        budget.close_stream("p")
        await SwarmConn._handle_muxed_stream(conn, Muxed())
        assert (len(resets), len(handled)) == (1, 2) and budget.node_streams == 0

    trio.run(main)


def test_data_beyond_a_yamux_receive_window_is_a_charged_protocol_error() -> None:
    """py-libp2p's muxer lowers `recv_window` by each DATA frame and, below zero, logs and keeps the bytes;
    with the fix (`yamux_window_limit`) that assignment raises WindowExceeded (which the muxer loop answers
    by closing the connection) and charges the sender. py-libp2p had a plain attribute there
    (`original` is None), which takes any value."""
    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, YamuxStream

    from murmur.gossip.hostlimits import WindowExceeded

    F.install()
    charged: list[str] = []
    faults = types.SimpleNamespace(record=lambda peer, proto, err: charged.append(f"{peer} {proto}"))
    conn = types.SimpleNamespace(
        swarm=types.SimpleNamespace(_murmur_faults=faults), peer_id=types.SimpleNamespace(to_base58=lambda: "sender")
    )
    stream = YamuxStream(1, conn, True)  # type: ignore[arg-type]
    stream.recv_window -= DEFAULT_WINDOW_SIZE  # all the credit we granted: honest
    assert stream.recv_window == 0 and charged == []
    with pytest.raises(WindowExceeded):
        stream.recv_window -= 1
    assert charged == ["sender /yamux/1.0.0"] and stream.recv_window == 0
    assert F.original("yamux_window_limit") is None


def test_a_refused_peers_connection_is_closed_before_py_libp2p_adds_it() -> None:
    """py-libp2p adds every connection that completed its handshake; with the fix (`connection_refusal`) one
    with a peer the host refuses is closed and never reaches py-libp2p's `add_conn`. The real-host test is
    test_stream_limits.py::test_a_refused_peer_cannot_reconnect_until_the_refusal_lifts."""
    from libp2p.network.exceptions import SwarmException
    from libp2p.network.swarm import Swarm

    F.install()
    closed: list[str] = []
    counted: list[str] = []

    class Muxed:
        peer_id = types.SimpleNamespace(to_base58=lambda: "graylisted")

        async def close(self) -> None:
            closed.append("closed")

    swarm = types.SimpleNamespace(
        _murmur_refuse=lambda peer: peer == "graylisted", _murmur_faults=types.SimpleNamespace(count=counted.append)
    )

    async def main() -> None:
        with pytest.raises(SwarmException, match="refused: graylisted"):
            await Swarm.add_conn(swarm, Muxed(), "inbound")  # type: ignore[arg-type]

    trio.run(main)
    assert closed == ["closed"] and counted == ["connection refused (graylisted)"]


def _webrtc_fixes() -> None:
    if not F.install_webrtc():
        pytest.skip("aiortc does not import: py-libp2p's WebRTC transport needs it")


def test_webrtc_fixes_are_installed_apart_with_their_originals() -> None:
    from libp2p.transport.webrtc import _aiortc_helpers as helpers
    from libp2p.transport.webrtc.stream import WebRTCStream

    _webrtc_fixes()
    patched = {
        "webrtc_forget_closed_streams": WebRTCStream._cleanup,
        "webrtc_bytes_like_writes": WebRTCStream.write,
        "webrtc_read_overflow_reset": WebRTCStream.__init__,
        "webrtc_backpressure": helpers.wire_pc_to_connection,
    }
    assert F.install_webrtc()
    assert {
        "webrtc_forget_closed_streams": WebRTCStream._cleanup,
        "webrtc_bytes_like_writes": WebRTCStream.write,
        "webrtc_read_overflow_reset": WebRTCStream.__init__,
        "webrtc_backpressure": helpers.wire_pc_to_connection,
    } == patched
    for name, fix in patched.items():
        assert F.original(name) is not fix and F.original(name).__module__.startswith("libp2p."), name


def test_a_closed_webrtc_stream_leaves_its_connections_registry() -> None:
    """py-libp2p never removes a closed WebRTC stream from its connection (so the 253rd stream of a
    connection's life failed); with the fix (`webrtc_forget_closed_streams`) its cleanup does."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    _webrtc_fixes()

    class Connection:
        def __init__(self) -> None:
            self.registry = {2: "open"}

        def remove_stream(self, channel_id: int) -> None:
            del self.registry[channel_id]

    fixed, unfixed = Connection(), Connection()
    WebRTCStream(connection=fixed, channel_id=2, is_initiator=True)._cleanup()
    F.original("webrtc_forget_closed_streams")(WebRTCStream(connection=unfixed, channel_id=2, is_initiator=True))
    assert fixed.registry == {} and unfixed.registry == {2: "open"}


def test_a_webrtc_stream_takes_a_bytearray_write() -> None:
    """py-libp2p's WebRTC write raised TypeError for a bytearray (the chunk broadcast's coalesced frames);
    with the fix (`webrtc_bytes_like_writes`) it goes out as bytes."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    _webrtc_fixes()
    wire: list[bytes] = []

    async def send(framed: bytes) -> None:
        wire.append(framed)

    async def main() -> None:
        stream = WebRTCStream(connection=object(), channel_id=2, is_initiator=True)
        stream._send_callback = send
        await stream.write(bytearray(b"frames"))
        assert len(wire) == 1 and b"frames" in wire[0]
        with pytest.raises(TypeError):
            await F.original("webrtc_bytes_like_writes")(stream, bytearray(b"frames"))

    trio.run(main)


def test_a_full_webrtc_read_queue_resets_the_stream_instead_of_dropping_a_message() -> None:
    """py-libp2p queues 64 messages for a WebRTC stream's reader and silently drops the 65th; with the fix
    (`webrtc_read_overflow_reset`) the queue is larger and a message that does not fit resets the stream.
    The end-to-end reads are in test_reachability_webrtc.py."""
    from libp2p.transport.webrtc.stream import WebRTCStream

    from murmur.gossip.webrtc import READ_QUEUE_MESSAGES

    _webrtc_fixes()
    resets: list[WebRTCStream] = []

    def stream_made_by(init) -> WebRTCStream:  # type: ignore[no-untyped-def]
        stream = WebRTCStream.__new__(WebRTCStream)
        init(stream, connection=object(), channel_id=1, is_initiator=False)
        stream._reset_on_trio_thread = lambda: resets.append(stream)  # type: ignore[method-assign]
        return stream

    fixed, unfixed = stream_made_by(WebRTCStream.__init__), stream_made_by(F.original("webrtc_read_overflow_reset"))
    refused = 0
    for i in range(READ_QUEUE_MESSAGES + 1):
        fixed._read_send.send_nowait(b"m%d" % i)
        try:
            unfixed._read_send.send_nowait(b"m%d" % i)
        except trio.WouldBlock:  # py-libp2p's `on_data` logs this and drops the message: a hole
            refused += 1
    assert refused == READ_QUEUE_MESSAGES + 1 - 64 and resets == [fixed]


def test_a_manual_dcutr_service_does_not_drive_hole_punches() -> None:
    """py-libp2p's DCUtR service checks every relayed peer for a hole punch every 2 s and has no switch; with
    the fix (`dcutr_manual_drive`) a service marked manual waits instead, and any other drives as before."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    F.install_dcutr()
    looked: list[str] = []

    def service(manual: bool) -> object:
        def get_network() -> object:
            looked.append("manual" if manual else "auto")
            return types.SimpleNamespace(connections={})

        return types.SimpleNamespace(_murmur_manual=manual, host=types.SimpleNamespace(get_network=get_network))

    async def main() -> None:
        for manual in (True, False):
            with trio.move_on_after(9):
                await DCUtRProtocol._auto_drive_loop(service(manual))  # type: ignore[arg-type]
        assert looked == ["auto"] * 4  # every 2 s, 9 s of mock time
        with trio.move_on_after(9):
            await F.original("dcutr_manual_drive")(service(True))
        assert looked.count("manual") == 4  # py-libp2p's loop drives whatever is asked

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
