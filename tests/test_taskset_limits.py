"""Task generation from a network-supplied configuration runs under the verifiers' limits (issue 26).

A trusted coordinator's task set names a reasoning-gym configuration; receiving it used to generate
tasks from it on the node's event loop, with no time or memory limit. Here a real signed set whose
configuration builds a ten-million-term problem is refused by a real verifier pool, and an honest
reasoning-gym set passes the same path.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from murmur.gossip.errors import MurmurError
from murmur.gossip.identity import Identity
from murmur.gossip.wire import TASK_SET, TaskRef, TaskSetManifest, content_id, decode_envelope, open_envelope, seal
from murmur.node.shell.tasksync import TaskSetGossip
from murmur.node.status import Drops
from murmur.node.store import open_store
from murmur.training.tasksets import TaskSetToml, manifest_from_toml, sign_task_set
from murmur.training.verifiers import VerifierPool

SWARM = "test"

COORD = Identity.from_seed(b"\x31" * 32)
NODE = Identity.from_seed(b"\x32" * 32)


def chain_set(terms: int, name: str) -> bytes:
    t = msgspec.convert(
        {
            "name": name,
            "verifier": "rg_score",
            "generators": [
                {
                    "name": "chain",
                    "generator": "rg:chain_sum",
                    "seed_end": 100,
                    "config": {"min_terms": terms, "max_terms": terms},
                }
            ],
        },
        TaskSetToml,
    )
    return sign_task_set(COORD, manifest_from_toml(t, name), swarm=SWARM)


def hostile_chain_set(terms: int, name: str) -> bytes:
    """A set signed without the coordinator's own generation check (which a hostile signer skips, and which
    would take the test tens of seconds on a ten-million-term configuration)."""
    small = decode_envelope(chain_set(4, name), swarm=SWARM)
    m = msgspec.msgpack.decode(small.body, type=TaskSetManifest)
    big = [msgspec.structs.replace(g, config={"min_terms": terms, "max_terms": terms}) for g in m.generators]
    return seal(COORD, TASK_SET, msgspec.structs.replace(m, generators=big), swarm=SWARM)


def _receive(tmp_path: Path, env: bytes, pool: VerifierPool) -> tuple[TaskSetGossip, Drops]:
    drops = Drops()
    g = TaskSetGossip(open_store(tmp_path), NODE.public, [COORD.public.hex()], drops, swarm=SWARM)
    g.pool = pool
    _, m = open_envelope(env, TASK_SET, swarm=SWARM)
    trio.run(g.on_task_set, "peer", m, env)
    return g, drops


def test_a_received_task_set_is_generated_under_the_verifiers_limits(tmp_path: Path) -> None:
    huge, honest = hostile_chain_set(10_000_000, "huge"), chain_set(4, "small")
    with VerifierPool() as pool:
        g, drops = _receive(tmp_path / "a", huge, pool)
        assert content_id(decode_envelope(huge, swarm=SWARM).body) not in g.registry
        assert drops.counts.get("task_set_refused") == 1
        g, drops = _receive(tmp_path / "b", honest, pool)  # the same path accepts an honest set
        tid = content_id(decode_envelope(honest, swarm=SWARM).body)
        assert tid in g.registry and not drops.counts
        # resolving a reference for verification goes through the pool as well
        task = g.registry.resolve(TaskRef(tid, "chain", 3), run=pool.call)
        assert task == g.registry.resolve(TaskRef(tid, "chain", 3))


def test_pool_calls_are_limited_in_cpu_and_memory() -> None:
    with VerifierPool(time_limit_s=0.5) as pool:
        with pytest.raises(MurmurError, match="verifier CPU"):
            pool.call(sum, range(10**10))
        with pytest.raises(MurmurError, match="MemoryError"):
            pool.call(bytearray, 4 * 2**30)
        assert pool.call(sum, range(10)) == 45  # the replaced worker serves the next call
