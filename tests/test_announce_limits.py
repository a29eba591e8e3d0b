"""The announce topic's per-signer rate limit charges only the peer that provably exceeded it.

A message's originator (the pubsub author) is charged for going over its announce rate only when it
sent the copy itself; copies of one message relayed by other peers (every mesh peer forwards it, and
py-libp2p validates concurrent copies before it marks any of them seen) count once, and an over-rate
copy that another peer relayed is dropped, counted and charged to no one.
"""

from __future__ import annotations

import time

import msgspec
import trio

from murmur.gossip import wire
from murmur.gossip.identity import Identity, peer_id_from_public
from murmur.gossip.service import GossipService
from murmur.gossip.validation import Pipeline, PipelineConfig
from murmur.simulations.bench.gossip import SWARM, registry
from murmur.training.tasksets import builtin_manifest
from murmur.training.verifiers import score

REG = registry()
SIGNER = Identity.from_seed(bytes([7]) * 32)
ORIGIN = SIGNER.peer_id
RELAYS = [Identity.from_seed(bytes([20 + i]) * 32).peer_id for i in range(8)]
BURST = 3


def _service() -> GossipService:
    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=time.time,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=REG.__contains__,
    )
    # a rate so low that no token comes back while the test runs
    return GossipService(None, pipeline, SWARM, announce_rate_per_s=1e-6, announce_burst=BURST)


def _announces(n: int) -> list[bytes]:
    """`n` distinct messages the signer really signed (task-set manifests at rising versions)."""
    m = builtin_manifest(SIGNER.public)
    return [wire.seal(SIGNER, wire.TASK_SET, msgspec.structs.replace(m, version=2 + i), swarm=SWARM) for i in range(n)]


def _charged(s: GossipService, peer: str) -> float:
    """Every penalty `peer` was ever charged (it neither decays nor heals)."""
    rec = s.pipeline.scores.record(peer)
    return rec.charged if rec is not None else 0.0


def test_copies_of_one_message_relayed_by_many_peers_take_one_token() -> None:
    s = _service()
    msgs = _announces(BURST)

    async def main() -> list[bool]:
        verdicts: list[bool] = []

        async def one(forwarder: str, data: bytes) -> None:
            verdicts.append(await s._validate_announce(forwarder, ORIGIN, data))

        async with trio.open_nursery() as n:  # concurrent copies, as py-libp2p validates them
            for fwd in [ORIGIN, *RELAYS]:
                n.start_soon(one, fwd, msgs[0])
        for data in msgs[1:]:  # the burst's other tokens are still there for distinct messages
            verdicts.append(await s._validate_announce(ORIGIN, ORIGIN, data))
        return verdicts

    assert trio.run(main) == [True] * (1 + len(RELAYS) + BURST - 1)
    assert _charged(s, ORIGIN) == 0.0
    assert not s.stats.dropped


def test_the_signer_sending_over_its_rate_itself_is_charged() -> None:
    s = _service()
    msgs = _announces(BURST + 2)
    verdicts = [trio.run(s._validate_announce, ORIGIN, ORIGIN, d) for d in msgs]
    assert verdicts == [True] * BURST + [False, False]
    assert _charged(s, ORIGIN) == 2.0
    assert s.stats.dropped["announce_rate_limited"] == 2
    # a copy of a refused message counts once: it is refused again, not charged again
    before = _charged(s, ORIGIN)
    assert trio.run(s._validate_announce, ORIGIN, ORIGIN, msgs[-1]) is False
    assert _charged(s, ORIGIN) == before


def test_an_over_rate_message_relayed_by_another_peer_is_dropped_and_charged_to_no_one() -> None:
    s = _service()
    msgs = _announces(BURST + 3)
    verdicts = [trio.run(s._validate_announce, RELAYS[i % len(RELAYS)], ORIGIN, d) for i, d in enumerate(msgs)]
    assert verdicts == [True] * BURST + [False] * 3
    assert _charged(s, ORIGIN) == 0.0
    assert all(_charged(s, r) == 0.0 for r in RELAYS)
    assert s.stats.dropped["announce_rate_limited"] == 3


def _node_announce(ident: Identity, addrs: int = 16) -> bytes:
    body = wire.NodeAnnounce(
        v=wire.FORMAT_VERSION,
        peer_id=ident.peer_id,
        seq=1,
        created_ms=wire.now_ms(),
        hardware="cpu",
        gen_tokens_per_s=0.0,
        rollout_latency_s=0.0,
        upload_bytes_per_s=0.0,
        memory_bytes=0,
        roles=["trainer"],
        lineages_followed=[],
        publish_batches_per_s=0.0,
        addrs=[f"/ip4/10.0.{i}.1/tcp/4001/" + "x" * 200 for i in range(addrs)],
    )
    return wire.seal(ident, wire.NODE_ANNOUNCE, body, swarm=SWARM)


def test_fresh_keys_announcing_once_share_one_node_wide_admission_rate() -> None:
    """Each fresh key's first announce passes its own per-key bucket, so 1,000 keys announcing once through
    one relay all got in (each a peer-table row and a stored announce, relayed on to every node). Keys not
    heard before (envelope signers) share one node-wide bucket: the flood is refused past it (counted,
    charged to no one) and not relayed, while a key already heard and a key announcing itself on its own
    connection still pass."""
    from murmur.gossip.ratelimit import NEW_KEYS_BURST, NEW_KEYS_PER_S

    s = _service()
    relay = RELAYS[0]
    known, direct = Identity.from_seed(b"\x61" * 32), Identity.from_seed(b"\x62" * 32)
    flood = [_node_announce(Identity.from_seed(i.to_bytes(4, "big") * 8)) for i in range(1000)]
    origins = [peer_id_from_public(wire.decode_envelope(d, swarm=SWARM).signer) for d in flood]

    async def main() -> tuple[list[bool], bool, bool, float]:
        assert await s._validate_announce(relay, known.peer_id, _node_announce(known, 1))  # heard before the flood
        t0 = time.monotonic()
        verdicts = [await s._validate_announce(relay, o, d) for o, d in zip(origins, flood)]
        elapsed = time.monotonic() - t0
        again = _node_announce(known, 2)
        return (
            verdicts,
            await s._validate_announce(relay, known.peer_id, again),
            await s._validate_announce(direct.peer_id, direct.peer_id, _node_announce(direct, 1)),
            elapsed,
        )

    verdicts, known_ok, direct_ok, elapsed = trio.run(main)
    admitted = sum(verdicts)
    assert admitted <= NEW_KEYS_BURST - 1 + NEW_KEYS_PER_S * elapsed + 1, (admitted, elapsed)
    assert s.stats.dropped["announce_new_key_rate"] == len(flood) - admitted == s.new_keys.refused
    assert known_ok and direct_ok
    assert _charged(s, relay) == 0.0 and all(_charged(s, o) == 0.0 for o in origins[:50])
    # the key admitted is the envelope's signer: one pubsub author (on its own connection, with no rate of
    # its own to speak of) carrying announces signed by fresh keys is held to the same node-wide rate
    pipeline = Pipeline(
        PipelineConfig(swarm=SWARM, max_staleness=4),
        clock=time.time,
        resolve_task=REG.resolve,
        reward=score,
        head_version=lambda lineage: 0,
        task_set_trusted=REG.__contains__,
    )
    wide = GossipService(None, pipeline, SWARM, announce_rate_per_s=1e6, announce_burst=10**6)

    async def carried() -> tuple[int, float]:
        t0 = time.monotonic()
        n = sum([await wide._validate_announce(relay, relay, d) for d in flood])
        return n, time.monotonic() - t0

    admitted, elapsed = trio.run(carried)
    assert admitted <= NEW_KEYS_BURST + NEW_KEYS_PER_S * elapsed, (admitted, elapsed)
    assert wide.new_keys.refused == len(flood) - admitted
