"""Per-process memo of the pure parts of rollout verification, shared by every simulated node.

Why this is faithful. In the virtual simulator thousands of nodes live in one
process, and one gossiped batch reaches `degree` receivers, each of which runs
its own `gossip.validation.Pipeline`. The pipeline's stages split into:
- pure functions of the message bytes: the ed25519 signature check
  (`gossip.identity.verify(public, sig, message)`) and the `verify` stage
  (task regeneration + reward recomputation from the decoded batch, through
  the injected `resolve_task` / `reward`, which are the very same objects for
  every simulated node: the built-in task set and `training.verifiers.score`);
- per-node state: blacklist/graylist and scores, rate limits, the `seen`
  and `(producer, seq)` replay caches, freshness on the clock, the staleness
  bound at commit.

Only the first kind is memoised here, keyed by its complete input (a 32-byte
BLAKE2b digest of public key + signature + signed bytes; the batch's content
id, itself the BLAKE2b of the exact envelope bytes; the task and completion
text for rewards). Every receiver still runs every stage of its own pipeline
in order, so the order of checks, the reason it reports, its penalties, bans,
replay and rate-limit state are exactly what it would decide alone; only the
arithmetic of a pure function is not repeated. A real node verifies a given
batch once per process as well (its `seen` cache makes the second copy a
`duplicate`). `tests/test_sim_virtual.py` runs a scenario with and without
the memo and asserts identical summaries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gossip import wire
from gossip.validation import Pending, Pipeline
from gossip.errors import SignatureError
from gossip.identity import verify

_MISSING = object()


class _Memo(OrderedDict):
    """A dict bounded to `limit` entries, oldest first out (a gossiped batch reaches its receivers within
    seconds of being sealed, so insertion order is a good enough recency order)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.hits = 0
        self.misses = 0

    def put(self, key: Any, value: Any) -> None:
        if len(self) >= self.limit:
            self.popitem(last=False)
        self[key] = value


class SharedVerification:
    """The memo tables of one simulation (one process), and the hooks that use them."""

    def __init__(self, resolve_task: Callable[[wire.TaskRef], Any], reward: Callable[[Any, str], float],
                 limit: int = 1_000_000) -> None:
        self._resolve = resolve_task
        self._reward = reward
        self.signatures = _Memo(limit)
        self.failures = _Memo(limit)  # batch content id -> the verify stage's outcome (None = passed)
        self.rewards = _Memo(limit)
        self.tasks = _Memo(limit // 4)
        self.bodies = _Memo(limit // 20)  # (kind, signer, body bytes) -> decoded body (read-only in the simulator)

    def verify_signature(self, public: bytes, signature: bytes, message: bytes) -> bool:
        key = hashlib.blake2b(public + signature + message, digest_size=32).digest()
        hit = self.signatures.get(key)
        if hit is not None:
            self.signatures.hits += 1
            return hit
        self.signatures.misses += 1
        ok = _real_verify(public, signature, message)
        self.signatures.put(key, ok)
        return ok

    def resolve_task(self, ref: wire.TaskRef) -> Any:
        """Memoised task regeneration (failures are not memoised: they raise every time, as they should)."""
        key = (ref.task_set, ref.generator, ref.seed)
        hit = self.tasks.get(key)
        if hit is None:
            hit = self._resolve(ref)
            self.tasks.put(key, hit)
        return hit

    def reward(self, task: Any, text: str) -> float:
        key = (task, text)  # tasks are frozen msgspec Structs: hashable by value
        hit = self.rewards.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._reward(task, text)
            self.rewards.put(key, hit)
        return hit  # type: ignore[return-value]

    def decode_body(self, env: wire.Envelope) -> Any:
        """`wire.decode_body` once per distinct (kind, signer, body); failures are not memoised (they re-raise)."""
        key = (env.kind, env.signer, env.body)
        hit = self.bodies.get(key)
        if hit is None:
            hit = _real_decode_body(env)
            self.bodies.put(key, hit)
        return hit

    def verify_envelope(self, env: wire.Envelope) -> None:
        """`gossip.wire.verify_envelope` with the ed25519 check memoised per distinct signature."""
        if not self.verify_signature(env.signer, env.sig, wire.signing_domain(env.kind, env.v, env.swarm) + env.body):
            raise SignatureError(f"{env.kind} signature does not verify for its signer")

    def stats(self) -> dict[str, int]:
        return {"signature_checks": self.signatures.misses, "signature_memo_hits": self.signatures.hits,
                "batch_verifications": self.failures.misses, "batch_verify_memo_hits": self.failures.hits}


_real_verify = verify
_real_decode_body = wire.decode_body


class SimPipeline(Pipeline):
    """A node's own pipeline whose pure `verify` stage reads the per-process memo first."""

    def __init__(self, *args: Any, shared: SharedVerification, **kwargs: Any) -> None:
        super().__init__(*args, verify_envelope=shared.verify_envelope, decode_body=shared.decode_body, **kwargs)
        self.shared = shared

    def verify(self, p: Pending) -> Pending:
        memo = self.shared.failures
        hit = memo.get(p.msg_id, _MISSING)
        if hit is _MISSING:
            memo.misses += 1
            super().verify(p)
            memo.put(p.msg_id, p.failure)
        else:
            memo.hits += 1
            p.failure = hit  # type: ignore[assignment]
        return p
