"""The pool of verified swarm rollouts the trainer samples from (sans-IO, bounded).

Indexed by task, lineage and version. When full, the rollout whose version
lags its lineage's newest pooled version the most is evicted first (ties: the
oldest arrival), because stale rollouts are the least useful to a trainer.
Every accepted batch is recorded in the store's ledger with its signed bytes,
so `reload()` after a restart loses none of them.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gossip import wire
from gossip.validation import rollout_id
from gossip.errors import DecodeError


@dataclass
class PoolEntry:
    rid: bytes
    rollout: wire.Rollout
    producer: bytes
    arrival: int


def task_key(ref: wire.TaskRef) -> tuple[bytes, str, int]:
    return (bytes(ref.task_set), ref.generator, ref.seed)


class RolloutPool:
    def __init__(self, max_rollouts: int = 20_000, store: object | None = None) -> None:
        if max_rollouts < 1:
            raise ValueError("pool needs room for at least one rollout")
        self.max_rollouts = max_rollouts
        self.store = store
        self._entries: dict[bytes, PoolEntry] = {}
        self._by_task: dict[tuple, set[bytes]] = {}
        self._by_lineage: dict[bytes, list[tuple[int, int, bytes]]] = {}  # heap (version, arrival, rid), lazy
        self._lineage_max: dict[bytes, int] = {}
        self._arrival = itertools.count()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: bytes) -> bool:
        return rid in self._entries

    # ------------------------------------------------------------ insert
    def add_batch(self, batch: wire.RolloutBatch, data: bytes | None = None, from_peer: str = "",
                  record: bool = True) -> int:
        """Add a verified batch; record it in the ledger (with `data`, its signed bytes). Returns rollouts added."""
        added = []
        for r in batch.rollouts:
            rid = rollout_id(r)
            if rid in self._entries:
                continue
            self._insert(PoolEntry(rid, r, bytes(batch.producer), next(self._arrival)))
            added.append((rid, r))
        if record and self.store is not None and added:
            self.store.record_rollouts(
                dict(rollout_id=rid, direction="received", status="accepted", producer=bytes(batch.producer),
                     from_peer=from_peer, lineage=bytes(r.lineage), version=r.version, task_set=bytes(r.task.task_set),
                     generator=r.task.generator, task_seed=r.task.seed, reward=r.reward, tokens=len(r.completion_ids),
                     payload=data if i == 0 else None)
                for i, (rid, r) in enumerate(added))
        return len(added)

    def _insert(self, e: PoolEntry) -> None:
        r = e.rollout
        self._entries[e.rid] = e
        self._by_task.setdefault(task_key(r.task), set()).add(e.rid)
        heapq.heappush(self._by_lineage.setdefault(bytes(r.lineage), []), (r.version, e.arrival, e.rid))
        lin = bytes(r.lineage)
        self._lineage_max[lin] = max(self._lineage_max.get(lin, r.version), r.version)
        while len(self._entries) > self.max_rollouts:
            self._evict_one()

    def _evict_one(self) -> None:
        best: tuple[int, int, bytes] | None = None
        best_lin = b""
        for lin, heap in self._by_lineage.items():
            while heap and heap[0][2] not in self._entries:
                heapq.heappop(heap)
            if not heap:
                continue
            version, arrival, _ = heap[0]
            key = (-(self._lineage_max[lin] - version), arrival)
            if best is None or key < best[:2]:
                best = (key[0], key[1], lin)
                best_lin = lin
        if best is None:
            return
        _, _, rid = heapq.heappop(self._by_lineage[best_lin])
        self._remove(rid)
        self.evicted += 1

    def _remove(self, rid: bytes) -> None:
        e = self._entries.pop(rid, None)
        if e is None:
            return
        k = task_key(e.rollout.task)
        s = self._by_task.get(k)
        if s is not None:
            s.discard(rid)
            if not s:
                del self._by_task[k]

    # ------------------------------------------------------------ query
    def sample(self, n: int, task_refs: Iterable[wire.TaskRef] | None = None, lineage: bytes | None = None,
               min_version: int | None = None, exclude_producer: bytes | None = None,
               rng: random.Random | None = None, consume: bool = True) -> list[wire.Rollout]:
        """Up to `n` rollouts matching every filter, uniformly at random; `consume` removes them (each used once)."""
        return [e.rollout for e in self.sample_entries(n, task_refs, lineage, min_version, exclude_producer, rng, consume)]

    def sample_entries(self, n: int, task_refs: Iterable[wire.TaskRef] | None = None, lineage: bytes | None = None,
                       min_version: int | None = None, exclude_producer: bytes | None = None,
                       rng: random.Random | None = None, consume: bool = True) -> list[PoolEntry]:
        if n <= 0:
            return []
        rng = rng or random.Random()
        if task_refs is not None:
            ids = [rid for ref in task_refs for rid in self._by_task.get(task_key(ref), ())]
            ids = list(dict.fromkeys(ids))
        elif lineage is not None:
            ids = [rid for _, _, rid in self._by_lineage.get(bytes(lineage), ()) if rid in self._entries]
        else:
            ids = list(self._entries)
        ids.sort(key=lambda rid: self._entries[rid].arrival)  # deterministic order before rng
        out = []
        for rid in ids:
            e = self._entries[rid]
            r = e.rollout
            if lineage is not None and bytes(r.lineage) != bytes(lineage):
                continue
            if min_version is not None and r.version < min_version:
                continue
            if exclude_producer is not None and e.producer == bytes(exclude_producer):
                continue
            out.append(e)
        picked = rng.sample(out, min(n, len(out)))
        if consume:
            for e in picked:
                self._remove(e.rid)
        return picked

    def stats(self) -> dict[str, int]:
        return dict(rollouts=len(self._entries), tasks=len(self._by_task), lineages=len(self._by_lineage),
                    evicted=self.evicted)

    # ------------------------------------------------------------ restart
    def reload(self, limit: int = 1_000_000, on_batch: Callable[[bytes], None] | None = None) -> int:
        """Refill from the ledger's accepted signed batches (newest kept when over capacity).

        `on_batch(signed bytes)` is called per batch: pass `Pipeline.remember` so replays are duplicates."""
        if self.store is None:
            return 0
        n = 0
        for _, payload in self.store.accepted_payloads(0, limit):
            try:
                env, batch = wire.open_envelope(payload, wire.ROLLOUT_BATCH)
            except DecodeError:
                continue  # a corrupt row must not stop the node from starting
            n += self.add_batch(batch, record=False)
            if on_batch is not None:
                on_batch(payload)
        return n
