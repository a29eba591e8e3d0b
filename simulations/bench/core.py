"""`murmur bench core`: memory and time of many node cores (node.core.machine.NodeCore) in one process.

Each core is built as a simulator would build it, then hears the same swarm: `peers` trainers'
signed announces (one lineage each, with its demand) and one manifest per lineage, and takes one
timer tick (it chooses a lineage, announces, plans catch-up). Memory is what tracemalloc counts as
allocated by the cores and kept alive after they are built (the shared messages are built first and
not counted); time is wall time for building and feeding them.
"""

from __future__ import annotations

import hashlib
import time
import tracemalloc
from typing import Any

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.core import machine as C
from murmur.sync.ids import lineage_id

BASE = hashlib.blake2b(b"murmur bench core base model", digest_size=32).digest()
SWARM = "bench"


def _heard(peers: int) -> list[C.Event]:
    events: list[C.Event] = []
    for i in range(peers):
        ident = Identity.from_seed(hashlib.blake2b(f"bench-core/{i}".encode(), digest_size=32).digest())
        lid = lineage_id(ident.public, BASE, f"l{i}")
        d = wire.LineageDemand(
            lineage=lid, name=f"l{i}", head_version=3, rollouts_per_step=32, step_time_s=2.0, max_staleness=4
        )
        a = wire.NodeAnnounce(
            v=wire.FORMAT_VERSION,
            peer_id=ident.peer_id,
            seq=1,
            created_ms=1,
            hardware="cpu",
            gen_tokens_per_s=0.0,
            rollout_latency_s=0.0,
            upload_bytes_per_s=0.0,
            memory_bytes=0,
            roles=["trainer"],
            lineages_followed=[],
            owned=[d],
        )
        events.append(C.AnnounceHeard(ident.public, a, wire.seal(ident, wire.NODE_ANNOUNCE, a, swarm=SWARM)))
        m = wire.PatchManifest(
            v=wire.FORMAT_VERSION,
            lineage=lid,
            lineage_name=f"l{i}",
            base_model_hash=BASE,
            publisher=ident.public,
            base_version=3,
            target_version=4,
            base_hash=bytes(32),
            target_hash=bytes(32),
            codec="sparse-v1",
            total_bytes=1000,
            chunk_bytes=4096,
            chunks=[wire.ChunkRef(hash=bytes(32), size=1000)],
            created_ms=1,
        )
        events.append(C.ManifestHeard(m))
    return events


def run(cores: int = 2000, peers: int = 8) -> dict[str, Any]:
    events = _heard(peers)
    ready = C.FromWorker(pipe.Ready(base=BASE.hex(), version=0, model_bytes=1 << 20))
    settings = C.CoreSettings(swarm=SWARM, roles=("follower", "validator"))
    keys = [
        Identity.from_seed(hashlib.blake2b(f"bench-core-node/{i}".encode(), digest_size=32).digest())
        for i in range(cores)
    ]
    now, wall_ms = 1000.0, wire.now_ms()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    built = []
    actions = 0  # what the cores asked for (a bench carries nothing out: it measures the cores' state)
    for ident in keys:
        c = C.NodeCore(settings, ident, now)
        for ev in (ready, *events, C.Tick()):
            actions += len(c.handle(ev, now, wall_ms))
        built.append(c)
    seconds = time.perf_counter() - t0
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    serving = sum(1 for c in built if c.serving is not None)
    return {
        "cores": cores,
        "peers_heard": peers,
        "lineages_heard": peers,
        "serving": serving,
        "actions_per_core": round(actions / max(1, cores), 1),
        "bytes_per_core": used // max(1, cores),
        "total_mib": round(used / 2**20, 1),
        "seconds": round(seconds, 2),
        "cores_per_s": round(cores / seconds, 1) if seconds else None,
    }
