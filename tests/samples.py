"""Valid example messages of every kind, shared by tests that mutate or replay them."""

from __future__ import annotations

import struct

from murmur.gossip import wire
from murmur.gossip.identity import Identity


def rollout(task_set: bytes = b"\x01" * 32, seed: int = 7, n_tokens: int = 8, reward: float = 1.0) -> wire.Rollout:
    return wire.Rollout(
        task=wire.TaskRef(task_set=task_set, generator="add", seed=seed),
        lineage=b"\x02" * 32,
        version=3,
        completion_ids=list(range(n_tokens)),
        text="12",
        tokenizer_hash=b"\x03" * 32,
        logprobs=struct.pack(f"<{n_tokens}f", *([-0.5] * n_tokens)),
        token_versions=[(0, 3)],
        sampling=wire.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16),
        reward=reward,
        created_ms=1_700_000_000_000,
    )


def bodies(ident: Identity) -> dict[str, object]:
    return {
        wire.ROLLOUT_BATCH: wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm="test",
            producer=ident.public,
            seq=1,
            created_ms=1,
            rollouts=[rollout(), rollout(seed=8)],
        ),
        wire.TASK_SET: wire.TaskSetManifest(
            v=wire.FORMAT_VERSION,
            name="arith",
            version=1,
            coordinator=ident.public,
            created_ms=1,
            verifier="exact",
            tolerance=0.0,
            generators=[
                wire.GeneratorSpec(
                    name="add", generator="arithmetic", config={"digits": 2}, seed_start=0, seed_end=1000
                )
            ],
        ),
        wire.PATCH_MANIFEST: wire.PatchManifest(
            v=wire.FORMAT_VERSION,
            lineage=b"\x04" * 32,
            lineage_name="main",
            base_model_hash=b"\x05" * 32,
            publisher=ident.public,
            base_version=1,
            target_version=2,
            base_hash=b"\x06" * 16,
            target_hash=b"\x07" * 16,
            codec="sparse-v1",
            total_bytes=300,
            chunk_bytes=256,
            chunks=[wire.ChunkRef(b"\x08" * 32, 256), wire.ChunkRef(b"\x09" * 32, 44)],
            created_ms=1,
        ),
        wire.NODE_ANNOUNCE: wire.NodeAnnounce(
            v=wire.FORMAT_VERSION,
            peer_id=ident.peer_id,
            seq=1,
            created_ms=1,
            hardware="cpu",
            gen_tokens_per_s=500.0,
            rollout_latency_s=0.5,
            upload_bytes_per_s=1e6,
            memory_bytes=2**30,
            roles=["trainer"],
            lineages_followed=[],
        ),
    }


class Clock:
    """A settable wall clock for the validation pipeline: starts at now, moves only when a test moves it."""

    def __init__(self) -> None:
        self.t = wire.now_ms() / 1000.0

    def __call__(self) -> float:
        return self.t
