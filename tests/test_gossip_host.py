"""Real py-libp2p hosts on 127.0.0.1: identity, Noise-only, gossip, bulk streams, publish errors."""

from __future__ import annotations

import pytest
import trio

from murmur.gossip.framing import read_frame, write_frame
from murmur.gossip.host import MAX_PUBLISH_BYTES, ConnectError, open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.transport import PublishError


async def wait_until(pred, timeout: float = 5.0, step: float = 0.02) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(step)


def test_peer_id_is_identity_peer_id() -> None:
    ident = Identity.from_seed(bytes(range(32)))

    async def main() -> None:
        async with open_transport(ident) as t:
            assert t.peer_id == ident.peer_id
            assert t.host.get_id().to_base58() == ident.peer_id
            assert all(a.endswith(f"/p2p/{ident.peer_id}") and "/tcp/" in a for a in t.listen_addrs())

    trio.run(main)


def test_gossip_stream_and_publish_errors() -> None:
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3)]

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b, open_transport(ids[2]) as c:
            assert await b.connect(a.listen_addrs()[0]) == a.peer_id
            await c.connect(a.listen_addrs()[0])
            await wait_until(lambda: set(a.peers()) == {b.peer_id, c.peer_id})
            chans = [await x.subscribe("/murmur/t/rollouts/1") for x in (a, b, c)]
            await wait_until(
                lambda: (
                    len(a.topic_peers("/murmur/t/rollouts/1")) == 2
                    and b.topic_peers("/murmur/t/rollouts/1")
                    and c.topic_peers("/murmur/t/rollouts/1")
                )
            )
            await b.publish("/murmur/t/rollouts/1", b"hello")
            with trio.fail_after(5):
                assert await chans[0].receive() == (b.peer_id, b"hello")
                assert await chans[2].receive() == (b.peer_id, b"hello")  # relayed by a

            # a validator that refuses stops delivery and forwarding
            async def refuse(fwd: str, origin: str, data: bytes) -> bool:
                return data != b"bad"

            for x in (a, c):
                x.set_validator("/murmur/t/rollouts/1", refuse)
            await b.publish("/murmur/t/rollouts/1", b"bad")
            await b.publish("/murmur/t/rollouts/1", b"good")
            with trio.fail_after(5):
                assert await chans[0].receive() == (b.peer_id, b"good")
                assert await chans[2].receive() == (b.peer_id, b"good")

            with pytest.raises(PublishError, match="gossip limit"):
                await a.publish("/murmur/t/rollouts/1", b"x" * (MAX_PUBLISH_BYTES + 1))
            with pytest.raises(PublishError, match="no connected peer"):
                await a.publish("/murmur/t/nobody/1", b"x")

            async def echo(stream, peer: str) -> None:
                assert peer == c.peer_id
                data = await read_frame(stream, 1 << 20)
                await write_frame(stream, data[::-1])
                await stream.close()

            a.set_stream_handler("/murmur/test-echo/1", echo)
            s = await c.open_stream(a.peer_id, "/murmur/test-echo/1")
            payload = bytes(range(256)) * 1000
            await write_frame(s, payload)
            with trio.fail_after(5):
                assert await read_frame(s, 1 << 20) == payload[::-1]
            await s.close()

            with pytest.raises(ConnectError):
                await a.connect("/ip4/127.0.0.1/tcp/1/p2p/" + ids[1].peer_id + "x")

    trio.run(main)


def test_plaintext_peer_is_refused() -> None:
    """A host offering only plaintext cannot connect to ours (py-libp2p's default would accept it)."""
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.exceptions import SwarmDialAllFailedError
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    async def main() -> None:
        async with open_transport(Identity.from_seed(b"\x09" * 32)) as a:
            kp = create_new_key_pair(b"\x0a" * 32)
            plain = new_host(key_pair=kp, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)})
            async with plain.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                # refused at security negotiation, promptly: a hang fails the test instead of passing it
                with trio.fail_after(10), pytest.raises(SwarmDialAllFailedError) as e:
                    await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(a.listen_addrs()[0])))
                assert "failed to negotiate the secure protocol" in str(e.value.__cause__), repr(e.value.__cause__)
                assert a.peers() == []

    trio.run(main)


def test_yamux_credit_returns_at_half_window_and_never_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small reads send no WINDOW_UPDATE (py-libp2p 0.8.1 sent one per read); bulk data still flows."""
    import struct

    from libp2p.stream_muxer.yamux import yamux as Y

    updates: list[int] = []
    orig = Y.Yamux._write_frame

    async def counting(self, data: bytes) -> None:  # type: ignore[no-untyped-def]
        _, typ, flags, sid, increment = struct.unpack(Y.YAMUX_HEADER_FORMAT, data[: Y.HEADER_SIZE])
        if typ == Y.TYPE_WINDOW_UPDATE and not flags & (Y.FLAG_SYN | Y.FLAG_ACK) and increment > 0:
            updates.append((sid, increment))  # credit, not a stream opening
        await orig(self, data)

    monkeypatch.setattr(Y.Yamux, "_write_frame", counting)
    got = {"n": 0}
    changed = trio.Event()

    async def sink(stream, peer: str) -> None:
        nonlocal changed
        while data := await stream.read(1 << 20):
            got["n"] += len(data)
            changed.set()
            changed = trio.Event()

    async def until(n: int) -> None:
        with trio.fail_after(30):
            while got["n"] < n:
                await changed.wait()

    async def main() -> None:
        async with (
            open_transport(Identity.from_seed(b"\x21" * 32)) as a,
            open_transport(Identity.from_seed(b"\x22" * 32)) as b,
        ):
            b.set_stream_handler("/murmur/test-sink/1", sink)
            await a.connect(b.listen_addrs()[0] + "/p2p/" + b.peer_id)
            s = await a.open_stream(b.peer_id, "/murmur/test-sink/1")
            before = len(updates)
            for k in range(300):  # 300 control-sized frames, each read on its own: 12 KB < half a window
                await s.write(b"x" * 40)
                await until(40 * (k + 1))
            assert len(updates) == before, updates
            await s.write(b"y" * (3 * 2**20))  # 3 MiB: twelve initial windows, only possible with credit
            await until(300 * 40 + 3 * 2**20)
            assert len(updates) - before >= 1
            await s.close()

    trio.run(main)


@pytest.mark.parametrize(
    "garbage",
    [bytes.fromhex("03ffffff"), b"\x80\x80\x80\x01" + b"\x00" * 4096],
    ids=["not-protobuf", "length-over-the-limit"],
)
def test_garbage_on_a_pubsub_stream_costs_the_sender_not_the_host(garbage: bytes) -> None:
    """Four bytes that are not a protobuf RPC on /meshsub/1.1.0 used to end the receiving process; a
    length prefix over the RPC limit was swallowed by py-libp2p's reader without charging anyone."""
    from libp2p.peer.id import ID

    ids = [Identity.from_seed(bytes([i]) * 32) for i in (41, 42, 43)]
    faults: list[tuple[str, str]] = []

    async def main() -> None:
        async with (
            open_transport(ids[0]) as victim,
            open_transport(ids[1]) as hostile,
            open_transport(ids[2]) as honest,
        ):
            victim.faults.on_fault = lambda peer, proto, err: faults.append((peer, proto))
            await hostile.connect(victim.listen_addrs()[0])
            raw = await hostile.host.new_stream(ID.from_base58(victim.peer_id), ["/meshsub/1.1.0"])
            await raw.write(garbage)
            await wait_until(lambda: faults, timeout=10)
            assert faults == [(hostile.peer_id, "/meshsub/1.1.0")]
            assert victim.faults.counts == {"/meshsub/1.1.0": 1}
            await wait_until(lambda: hostile.peer_id not in victim.peers(), timeout=10)  # connection closed
            # the host still works: an honest peer connects and gossips to it
            chan = await victim.subscribe("/murmur/t/rollouts/1")
            await honest.subscribe("/murmur/t/rollouts/1")
            await honest.connect(victim.listen_addrs()[0])
            await wait_until(
                lambda: honest.topic_peers("/murmur/t/rollouts/1") and victim.topic_peers("/murmur/t/rollouts/1"),
                timeout=10,
            )
            await wait_until(lambda: honest.router.mesh.get("/murmur/t/rollouts/1"), timeout=10)
            await honest.publish("/murmur/t/rollouts/1", b"still here")
            with trio.fail_after(10):
                assert await chan.receive() == (honest.peer_id, b"still here")

    trio.run(main)


def test_concurrent_writes_on_one_stream_arrive_whole() -> None:
    """Two writers on one stream (py-libp2p pubsub's queue task and its recent-message replay do this)
    must not interleave their frames: before the per-stream message lock, a write split over several
    yamux frames let the other writer's bytes in, and the reader parsed garbage (protobuf DecodeError
    on honest gossip)."""
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (44, 45)]
    got: list[bytes] = []
    errors: list[str] = []

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b:
            done = trio.Event()

            async def handler(stream, remote: str) -> None:
                try:
                    for _ in range(8):
                        got.append(await read_frame(stream, 1 << 22))
                except Exception as e:
                    errors.append(repr(e))
                done.set()

            a.set_stream_handler("/murmur/test-interleave/1", handler)
            await b.connect(a.listen_addrs()[0])
            s = await b.open_stream(a.peer_id, "/murmur/test-interleave/1")
            async with trio.open_nursery() as n:
                for k in range(8):  # 150 KB each: three yamux frames, so the writers contend
                    n.start_soon(write_frame, s, bytes([k]) * 150_000)
            with trio.fail_after(20):
                await done.wait()

    trio.run(main)
    assert errors == []
    assert sorted(m[0] for m in got) == list(range(8))
    assert all(m == bytes([m[0]]) * 150_000 for m in got)


def test_a_closed_host_stops_listening() -> None:
    """py-libp2p's own shutdown path left the listening socket open: peers redialled a dead host."""
    ident = Identity.from_seed(bytes([46]) * 32)

    async def main() -> None:
        async with open_transport(ident) as t:
            addr = t.listen_addrs()[0]
        port = int(addr.split("/tcp/")[1].split("/")[0])
        try:
            with trio.fail_after(5):
                s = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return  # refused: nothing listens any more
        await s.aclose()
        raise AssertionError(f"{addr} still accepts connections after the host closed")

    trio.run(main)


def test_a_peer_record_is_checked_once_and_a_bad_one_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-libp2p verifies the signed peer record that rides on every pubsub RPC, so a peer sending many
    small RPCs bought a signature check each; an invalid record made the RPC vanish with an error log
    and no counter. Now a record is checked once per peer (and remembered), and each RPC ignored for an
    invalid one is counted."""
    import libp2p.pubsub.utils as pubsub_utils
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import env_to_send_in_RPC
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils.varint import encode_varint_prefixed

    checked: list[bytes] = []
    real = pubsub_utils.consume_envelope

    def counting(data: bytes, domain: str):  # type: ignore[no-untyped-def]
        checked.append(bytes(data))
        return real(data, domain)

    monkeypatch.setattr(pubsub_utils, "consume_envelope", counting)
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (51, 52)]
    n = 200
    key = "pubsub signed record (invalid)"

    async def main() -> None:
        async with open_transport(ids[0]) as victim, open_transport(ids[1]) as hostile:
            await hostile.connect(victim.listen_addrs()[0])
            record, _ = env_to_send_in_RPC(hostile.host)
            bad = record[:-1] + bytes([record[-1] ^ 1])  # the signature's last byte flipped
            raw = await hostile.host.new_stream(ID.from_base58(victim.peer_id), ["/meshsub/1.1.0"])
            await raw.write(
                b"".join(
                    encode_varint_prefixed(rpc_pb2.RPC(senderRecord=r).SerializeToString())
                    for r in [record] * n + [bad] * n
                )
            )
            await wait_until(lambda: victim.faults.counts.get(key, 0) >= n, timeout=20)
            assert victim.faults.counts[key] == n
            assert checked.count(bad) == 1
            assert checked.count(record) <= 1  # the hostile host's own pubsub hello may have carried it first
            assert victim.host.get_peerstore().get_peer_record(ID.from_base58(hostile.peer_id)) is not None
            assert hostile.peer_id in victim.peers()  # counted, not charged: the RPC is ignored, as before
            # the table keeps a digest per record, never the record (which can be as large as an RPC)
            assert all(len(digest) == 16 for _, digest in victim.host._murmur_records)

    trio.run(main)


def test_a_failed_pubsub_stream_open_is_retried_while_the_peer_stays_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-libp2p opens its outbound pubsub stream once per new connection and gives up for good when the
    protocol negotiation fails (`StreamFailure`): the peer stays connected, it still hears us, we never
    send to it, and nothing ever repairs that one-way partition. The open must be retried while the
    peer stays connected."""
    from libp2p.host.exceptions import StreamFailure

    ids = [Identity.from_seed(bytes([i]) * 32) for i in (21, 22)]
    failed: list[str] = []

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b:
            real = a.host.new_stream

            async def first_pubsub_open_fails(peer_id, protocols, *args, **kw):
                if any("meshsub" in str(p) for p in protocols) and not failed:
                    failed.append(peer_id.to_base58())
                    raise StreamFailure(f"failed to open a stream to peer {peer_id}")  # as a failed multiselect
                return await real(peer_id, protocols, *args, **kw)

            monkeypatch.setattr(a.host, "new_stream", first_pubsub_open_fails)
            chans = [await x.subscribe("/murmur/t/rollouts/1") for x in (a, b)]
            await b.connect(a.listen_addrs()[0])
            await wait_until(lambda: failed == [b.peer_id], timeout=10)
            await wait_until(lambda: a.topic_peers("/murmur/t/rollouts/1") == [b.peer_id], timeout=30)  # b -> a works
            sent = False
            with trio.move_on_after(30):  # the retry backs off (0.5 s, doubling, at most 10 s)
                while not sent:
                    try:
                        await a.publish("/murmur/t/rollouts/1", b"a to b")
                        sent = True
                    except PublishError:
                        await trio.sleep(0.2)
            assert sent, "a never got a pubsub stream to b"
            with trio.fail_after(10):
                assert await chans[1].receive() == (a.peer_id, b"a to b")

    trio.run(main)


def test_own_record_is_reused_and_the_record_memo_is_bounded() -> None:
    """Per pubsub RPC, py-libp2p rebuilds our signed peer record and checks the sender's: ours is reused for
    OWN_RECORD_REUSE_S, a record already checked is not checked again, and the table of them is bounded."""
    import libp2p.pubsub.pubsub as ps
    from libp2p.pubsub.pb import rpc_pb2

    from murmur.gossip import libp2p_fixes as H

    async def main() -> None:
        async with (
            open_transport(Identity.from_seed(b"\x0b" * 32)) as a,
            open_transport(Identity.from_seed(b"\x0c" * 32)) as b,
        ):
            env, _ = ps.env_to_send_in_RPC(a.host)
            stamp = a.host._murmur_own_record[0]
            again, fresh = ps.env_to_send_in_RPC(a.host)
            assert again == env and not fresh and a.host._murmur_own_record[0] == stamp  # reused, not rebuilt

            peer = b.host.get_id()
            junk = rpc_pb2.RPC(senderRecord=b"\x01junk")
            assert ps.maybe_consume_signed_record(junk, a.host, peer) is False
            ((key, (checked_at, ok)),) = a.host._murmur_records.items()
            assert ps.maybe_consume_signed_record(junk, a.host, peer) is False
            assert a.host._murmur_records[key] == (checked_at, False)  # a memo hit: not checked again
            assert a.faults.counts["pubsub signed record (invalid)"] == 2  # each ignored RPC counted
            for i in range(H.RECORD_MEMO_SIZE + 10):
                ps.maybe_consume_signed_record(rpc_pb2.RPC(senderRecord=i.to_bytes(4, "big")), a.host, peer)
            assert len(a.host._murmur_records) == H.RECORD_MEMO_SIZE
            assert key not in a.host._murmur_records  # the oldest went first

    trio.run(main)


def test_no_backlog_is_kept_for_peers_that_have_not_subscribed() -> None:
    """py-libp2p queued each message for every connected peer not subscribed to its topic (100 a peer, 30 s)
    and flushed the queue when that peer subscribed: memory of 100 messages times every peer, and a burst
    of old messages with every shard joined. The host keeps at most one message a peer, and it expires."""
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (4, 5, 6)]
    topic = "/murmur/t/rollouts/7"

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b, open_transport(ids[2]) as c:
            await b.connect(a.listen_addrs()[0])
            await c.connect(a.listen_addrs()[0])
            await wait_until(lambda: set(a.peers()) == {b.peer_id, c.peer_id})
            chan = await c.subscribe(topic)
            await wait_until(lambda: c.peer_id in a.topic_peers(topic))
            for i in range(20):
                await a.publish(topic, b"m%d" % i)
            got = []
            with trio.fail_after(10):
                while len(got) < 20:
                    got.append((await chan.receive())[1])
            pending = a.router._pending_messages
            held = sum(len(q) for q in pending.values())
            assert held <= 2, f"{held} messages held for peers that did not subscribe ({len(pending)} peers)"

    trio.run(main)


def test_pubsub_heals_both_ways_when_the_connection_under_its_streams_closes_and_a_duplicate_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two hosts that dial each other at once hold two connections. Here the pubsub streams both ways run
    on the first one, X, whose hellos (the subscriptions) are written as X dies and never arrive; the
    second, Y, stays. py-libp2p keeps the dead streams as each side's pubsub stream to the other (the
    peer is still connected) and writes nothing to a peer whose subscriptions it does not know, so
    neither side ever learns the other's subscriptions or sends it anything. Both streams must be
    re-opened on Y, and their hellos carry the subscriptions."""
    import multiaddr

    ids = [Identity.from_seed(bytes([i]) * 32) for i in (41, 42)]
    topic = "/murmur/t/rollouts/9"
    lost: list[str] = []  # hosts whose hello went down with X
    on_x = [True]  # pubsub streams opened before Y is dialled run on X

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b:
            chans = [await x.subscribe(topic) for x in (a, b)]
            for t in (a, b):
                real = t.host.new_stream

                async def hello_lost_on_x(peer_id, protocols, *args, _t=t, _real=real, **kw):  # type: ignore[no-untyped-def]
                    stream = await _real(peer_id, protocols, *args, **kw)
                    if any("meshsub" in str(p) for p in protocols) and on_x[0]:

                        async def written_as_x_dies(data: bytes) -> None:
                            lost.append(_t.peer_id)

                        stream.write = written_as_x_dies  # only the hello: nothing else is written before X closes
                    return stream

                monkeypatch.setattr(t.host, "new_stream", hello_lost_on_x)
            a_id, b_id = a.host.get_id(), b.host.get_id()
            await a.connect(b.listen_addrs()[0])  # X
            await wait_until(lambda: sorted(lost) == sorted([a.peer_id, b.peer_id]), timeout=10)
            assert a_id in b.pubsub.peers and b_id in a.pubsub.peers  # each holds a stream on X ...
            assert a.topic_peers(topic) == [] and b.topic_peers(topic) == []  # ... whose hello never arrived
            [x] = a.host.get_network().get_connections(b_id)

            on_x[0] = False
            await b.host.get_network().dial_addr(multiaddr.Multiaddr(a.listen_addrs()[0]), a_id)  # Y
            await wait_until(
                lambda: (
                    len(a.host.get_network().get_connections(b_id)) == 2
                    and len(b.host.get_network().get_connections(a_id)) == 2
                )
            )
            await x.close()
            await wait_until(
                lambda: (
                    len(a.host.get_network().get_connections(b_id)) == 1
                    and len(b.host.get_network().get_connections(a_id)) == 1
                )
            )

            await wait_until(
                lambda: a.topic_peers(topic) == [b.peer_id] and b.topic_peers(topic) == [a.peer_id], timeout=20
            )
            for src, dst, chan in ((a, b, chans[1]), (b, a, chans[0])):
                sent = False
                with trio.move_on_after(10):  # a re-opened stream's peer joins the mesh within a heartbeat
                    while not sent:
                        try:
                            await src.publish(topic, b"from " + src.peer_id.encode())
                            sent = True
                        except PublishError:
                            await trio.sleep(0.1)
                assert sent, f"{src.peer_id} could not publish to {dst.peer_id}"
                with trio.fail_after(10):  # a subscriber's channel also carries its own publishes
                    while await chan.receive() != (src.peer_id, b"from " + src.peer_id.encode()):
                        pass
            assert sorted(lost) == sorted([a.peer_id, b.peer_id])  # the re-opened streams' hellos were sent

    trio.run(main)


def test_a_peer_that_never_heard_our_subscriptions_hears_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hello lost as its connection closed leaves a peer not knowing we subscribe: py-libp2p sends
    subscriptions only in a stream's hello and on a change, so that peer would send us nothing for as long as
    the link lasts. Each host tells its pubsub peers its subscriptions again every SUBSCRIPTIONS_REFRESH_S."""
    from murmur.gossip import host as host_mod

    monkeypatch.setattr(host_mod, "SUBSCRIPTIONS_REFRESH_S", 0.3)
    ids = [Identity.from_seed(bytes([i]) * 32) for i in (51, 52)]
    topic = "/murmur/t/announce/1"

    async def main() -> None:
        async with open_transport(ids[0]) as a, open_transport(ids[1]) as b:
            chan_b = await b.subscribe(topic)
            await a.subscribe(topic)
            await a.connect(b.listen_addrs()[0])
            await wait_until(lambda: a.topic_peers(topic) == [b.peer_id] and b.topic_peers(topic) == [a.peer_id])
            b_id = b.host.get_id()
            for peers in a.pubsub.peer_topics.values():  # what a lost hello leaves: a never heard b subscribe
                peers.discard(b_id)
            assert a.topic_peers(topic) == []
            await wait_until(lambda: a.topic_peers(topic) == [b.peer_id], timeout=5)
            sent = False
            with trio.move_on_after(10):  # b rejoins a's mesh within a heartbeat
                while not sent:
                    try:
                        await a.publish(topic, b"after the refresh")
                        sent = True
                    except PublishError:
                        await trio.sleep(0.1)
            assert sent
            with trio.fail_after(10):
                while await chan_b.receive() != (a.peer_id, b"after the refresh"):
                    pass
            assert a.counters["subscriptions_refresh_dropped"] == 0

    trio.run(main)
