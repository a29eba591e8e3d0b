"""Stream fuzzer: a connected real libp2p peer sends random and mutated frames on every protocol the node serves.

The victim is a real `node.shell.runtime.Node` attached to an in-process transport (`Node.attach`: its own
validation pipeline and gossip service, stream-fault penalty wiring, chunk broadcast and catalog handler),
plus dial-back, circuit relay with HOP, DCUtR, Kademlia, and what py-libp2p serves by itself (identify,
ping, ...); the protocol list is read from the host's multistream table, so a protocol added later is
fuzzed too. For each protocol the attacker opens streams, writes
seeded random bytes, length-prefixed random frames, oversized length prefixes and bit-flipped valid
frames, closes its side, and waits (bounded) for the node to end the stream. Afterwards: the node is
up and serves an honest peer, every stream ended, and the attacker lost score for the faults it
provably committed on the node's own protocols and on pubsub.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from murmur.gossip import topics, wire
from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.node.config import Config, NetworkSection, NodeSection
from murmur.node.shell import patches as patchsync
from murmur.node.shell.runtime import Node, RunOptions
from murmur.sync.errors import PatchError
from murmur.sync.swarm import Have, ManifestRequest, encode_frame

SEED = 15
EXTRA_MUTATIONS = 4  # per protocol, on top of one payload of every kind
STREAM_END_S = 6.0  # the node must end a stream this soon after we close our side
SWARM = "fuzz"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _flip(rng: random.Random, data: bytes, flips: int = 3) -> bytes:
    b = bytearray(data)
    for _ in range(flips):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _valid_frames(protocol: str, attacker: Identity) -> list[bytes]:
    """Well-formed frames of `protocol` (as a peer would send them) to mutate."""
    if protocol.startswith("/meshsub/"):
        from libp2p.pubsub.pb import rpc_pb2

        rpc = rpc_pb2.RPC()
        sub = rpc.subscriptions.add()
        sub.subscribe, sub.topicid = True, topics.rollouts(SWARM)
        msg = rpc.publish.add()
        msg.from_id = bytes(attacker.peer_id.encode())
        msg.data, msg.seqno, msg.signature = b"\x00" * 64, b"\x00" * 8, b"\x01" * 64
        msg.topicIDs.append(topics.announce(SWARM))
        ctl = rpc.control
        ctl.graft.add().topicID = topics.rollouts(SWARM)
        ih = ctl.ihave.add()
        ih.topicID = topics.announce(SWARM)
        ih.messageIDs.extend([b"x" * 40] * 50)
        body = rpc.SerializeToString()
        return [_varint(len(body)) + body]
    if protocol == "/murmur/chunks/1":
        frames = [encode_frame(Have(b"\x11" * 32, b"\xff" * 4)), encode_frame(ManifestRequest(b"\x22" * 32))]
        return [len(f).to_bytes(4, "big") + f for f in frames]
    if protocol == patchsync.PROTOCOL:
        req = wire.encode(patchsync.CatalogRequest("catalog", b"\x33" * 32))
        return [len(req).to_bytes(4, "big") + req]
    if protocol == "/murmur/dialback/1":
        from murmur.gossip.dialback import DialbackRequest

        req = msgspec.msgpack.encode(DialbackRequest(1, b"\x55" * 16, ["/ip4/127.0.0.1/tcp/1"]))
        return [len(req).to_bytes(4, "big") + req]
    return [_varint(20) + bytes(range(20))]  # libp2p protobuf protocols: a varint-prefixed message


def _payloads(rng: random.Random, protocol: str, attacker: Identity) -> list[tuple[str, bytes]]:
    valid = _valid_frames(protocol, attacker)
    kinds: list[tuple[str, bytes]] = [
        ("random", rng.randbytes(rng.randrange(1, 2048))),
        ("varint_random", _varint(rng.randrange(1, 4096)) + rng.randbytes(rng.randrange(0, 512))),
        ("len32_random", (n := rng.randrange(1, 4096)).to_bytes(4, "big") + rng.randbytes(n)),
        ("huge_prefix", bytes.fromhex("ffffffff") + rng.randbytes(16)),
        ("not_protobuf", bytes.fromhex("03ffffff")),
        ("mutated_valid", _flip(rng, rng.choice(valid))),
        ("valid_then_garbage", rng.choice(valid) + rng.randbytes(64)),
        ("truncated_valid", rng.choice(valid)[: max(1, len(rng.choice(valid)) // 2)]),
    ]
    for _ in range(EXTRA_MUTATIONS):
        kinds.append(("mutated_valid", _flip(rng, rng.choice(valid), rng.randrange(1, 16))))
    rng.shuffle(kinds)
    return kinds


async def _redial(a: Any, v: Any) -> None:
    with trio.fail_after(10):
        while True:
            try:
                await a.connect(v.listen_addrs()[0])
                return
            except Exception:
                await trio.sleep(0.1)


async def _wait(pred: Any, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


async def _send_and_wait_end(attacker: Any, victim_id: str, protocol: str, payload: bytes) -> str:
    """Open `protocol`, write `payload`, close our side; how the node ended the stream."""
    from libp2p.peer.id import ID

    try:
        with trio.fail_after(5):
            raw = await attacker.host.new_stream(ID.from_base58(victim_id), [protocol])
    except Exception as e:
        return f"refused: {type(e).__name__}"
    try:
        await raw.write(payload)
        await raw.close_write()  # our side is done: the node sees EOF
    except Exception:
        return "reset"  # the node already reset it
    with trio.move_on_after(STREAM_END_S):
        try:
            total = 0
            while total < 1 << 20:
                part = await raw.read(65536)
                if not part:
                    return "eof"
                total += len(part)
        except Exception:
            return "reset"
        return "flooded"
    return "open"


def test_every_protocol_survives_random_and_mutated_frames(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    victim_id, attacker_id, honest_id = (Identity.from_seed(bytes([i]) * 32) for i in (61, 62, 63))
    outcomes: dict[str, list[tuple[str, str]]] = {}
    served: list[str] = []
    faults: dict[str, int] = {}
    cfg = Config(node=NodeSection(swarm=SWARM), network=NetworkSection(relay_service=True, dht=True))
    node = Node(cfg, tmp_path / "victim", victim_id, RunOptions())

    async def main() -> None:
        from murmur.gossip.discovery import Discovery
        from murmur.node.shell.reachability import start_reachability

        async with open_transport(victim_id) as v, open_transport(attacker_id) as a, open_transport(honest_id) as h:
            await node.attach(v)  # the runtime's own handlers and penalty wiring
            async with trio.open_nursery() as n:
                await n.start(node.service.run)
                await n.start(node.bcast.run)
                await n.start(Discovery(v, [], None, dht=True).run)
                await start_reachability(v, cfg, n)
                protocols = sorted(str(p) for p in v.host.get_mux().handlers)
                served.extend(protocols)
                for proto in protocols:
                    for kind, payload in _payloads(rng, proto, attacker_id):
                        for _ in range(3):  # the node closes our connection after a fault: redial
                            if v.peer_id not in a.peers():
                                await _redial(a, v)
                            end = await _send_and_wait_end(a, v.peer_id, proto, payload)
                            if not end.startswith("refused"):
                                break
                            await a.disconnect(v.peer_id)
                        outcomes.setdefault(proto, []).append((kind, end))
                faults.update(v.faults.counts)

                # the node is up and serves an honest peer: its catalog answers, its gossip mesh takes the peer
                await h.subscribe(topics.rollouts(SWARM))
                await h.connect(v.listen_addrs()[0])
                with trio.fail_after(15), pytest.raises(PatchError, match="lineage not held here"):
                    await patchsync.catalog(h, v.peer_id, b"\x44" * 32)
                await _wait(lambda: h.router.mesh.get(topics.rollouts(SWARM)), 15)
                n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        if node.verifiers is not None:
            node.verifiers.close()
        node.store.close()
    # every protocol the node serves was fuzzed, py-libp2p's and ours
    for must in (
        "/meshsub/1.1.0",
        "/meshsub/1.2.0",
        "/ipfs/id/1.0.0",
        "/ipfs/ping/1.0.0",
        "/ipfs/kad/1.0.0",
        "/libp2p/circuit/relay/0.2.0/hop",
        "/libp2p/circuit/relay/0.2.0/stop",
        "/libp2p/dcutr",
        "/murmur/chunks/1",
        patchsync.PROTOCOL,
        "/murmur/dialback/1",
    ):
        assert must in served, (must, served)
    # the node ended every stream (no stream left hanging after we closed our side, none flooded us)
    hanging = {p: [o for o in outs if o[1] in ("open", "flooded")] for p, outs in outcomes.items()}
    assert not any(hanging.values()), hanging
    # faults provable against the attacker cost it in the node's own score table: pubsub garbage, and on our
    # own protocols
    scores = node.service.pipeline.scores
    rec = scores.record(attacker_id.peer_id)
    assert rec is not None and rec.score < 0
    reasons = set(rec.rejections)
    assert "stream: /meshsub/1.1.0" in reasons and "stream: /meshsub/1.2.0" in reasons, reasons
    assert any(r.startswith("broadcast: ") for r in reasons), reasons  # /murmur/chunks/1
    for own in (patchsync.PROTOCOL, "/murmur/dialback/1"):
        assert f"stream: {own}" in reasons, (own, reasons)
    assert faults.get("/meshsub/1.1.0", 0) >= 1
    assert scores.record(honest_id.peer_id) is None  # the honest peer lost nothing
