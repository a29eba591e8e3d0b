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
arithmetic of a pure function is not repeated. A signature the simulated
nodes make themselves (`SigningIdentity`) enters the signature memo as valid
when it is made: an ed25519 signature always verifies against the key that
made it, so only signatures made elsewhere or altered on the way (an
adversary's flipped bytes) run the real check. A real node verifies a given
batch once per process as well (its `seen` cache makes the second copy a
`duplicate`). `tests/test_sim_virtual.py` runs a scenario with and without
the memo and asserts identical summaries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from murmur.gossip import wire
from murmur.gossip.errors import SignatureError
from murmur.gossip.identity import Identity, verify
from murmur.gossip.validation import Pending, Pipeline

_MISSING = object()


class Memo(OrderedDict):
    """A dict bounded to `limit` entries and, given a clock, to entries put in the last `horizon_s` seconds,
    oldest first out. A gossiped batch reaches its receivers within seconds of being sealed, so the
    per-message tables need only the messages still in flight: their size follows the swarm's message
    rate, not the run's length. A miss only repeats the pure computation."""

    def __init__(self, limit: int, clock: Callable[[], float] | None = None, horizon_s: float = 0.0) -> None:
        super().__init__()
        self.limit = limit
        self.clock = clock if horizon_s > 0 else None
        self.horizon_s = horizon_s
        self._born: deque[float] = deque()  # put times, in the dict's order (keys are put once)
        self.hits = 0
        self.misses = 0

    def put(self, key: Any, value: Any) -> None:
        if key in self:
            self[key] = value
            return
        if self.clock is not None:
            now = self.clock()
            old = now - self.horizon_s
            born = self._born
            while born and (born[0] < old or len(self) >= self.limit):
                born.popleft()
                self.popitem(last=False)
            born.append(now)
        elif len(self) >= self.limit:
            self.popitem(last=False)
        self[key] = value


class SharedVerification:
    """The memo tables of one simulation (one process), and the hooks that use them."""

    def __init__(
        self,
        resolve_task: Callable[[wire.TaskRef], Any],
        reward: Callable[[Any, str], float],
        limit: int = 1_000_000,
        clock: Callable[[], float] | None = None,
        horizon_s: float = 5.0,
    ) -> None:
        self._resolve = resolve_task
        self._reward = reward
        # per-message tables keep what is in flight (decoded batches are large: a table of them as long as
        # the run would hold most of the simulator's memory); task and reward tables are small per entry and bounded by count
        self.signatures = Memo(limit, clock, horizon_s)
        self.failures = Memo(limit, clock, horizon_s)  # batch content id -> the verify stage's outcome (None = passed)
        self.bodies = Memo(limit, clock, horizon_s)  # (kind, signer, body bytes) -> decoded body (read-only here)
        self.rewards = Memo(limit // 4)
        self.tasks = Memo(limit // 8)

    def signer(self, ident: Identity) -> Identity:
        """`ident`, telling this memo what it signs (see `SigningIdentity`)."""
        return SigningIdentity(ident.private, self)

    def signed(self, public: bytes, signature: bytes, message: bytes) -> None:
        """A signature this process just made with the key of `public`: it verifies (ed25519 signing is
        deterministic and a key's own signature always checks), so no receiver needs to run the check."""
        self.signatures.put(hashlib.blake2b(public + signature + message, digest_size=32).digest(), True)

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
        return hit

    def decode_body(self, env: wire.Envelope) -> Any:
        """`wire.decode_body` once per distinct (kind, signer, body); failures are not memoised (they re-raise)."""
        key = (env.kind, env.signer, env.body)
        hit = self.bodies.get(key)
        if hit is None:
            self.bodies.misses += 1
            hit = _real_decode_body(env)
            self.bodies.put(key, hit)
        else:
            self.bodies.hits += 1
        return hit

    def verify_envelope(self, env: wire.Envelope) -> None:
        """`gossip.wire.verify_envelope` with the ed25519 check memoised per distinct signature."""
        if not self.verify_signature(env.signer, env.sig, wire.signing_domain(env.kind, env.v, env.swarm) + env.body):
            raise SignatureError(f"{env.kind} signature does not verify for its signer")

    def stats(self) -> dict[str, int]:
        return {
            "signature_checks": self.signatures.misses,
            "signature_memo_hits": self.signatures.hits,
            "batch_verifications": self.failures.misses,
            "batch_verify_memo_hits": self.failures.hits,
            "body_decodes": self.bodies.misses,
            "body_memo_hits": self.bodies.hits,
        }


@dataclass(frozen=True)
class SigningIdentity(Identity):
    """A simulated node's key that tells the per-process memo what it signs, so the ed25519 check of an
    honest signature is answered from the memo; a signature made elsewhere or altered on the way is a
    different memo key and is checked for real."""

    memo: SharedVerification | None = field(default=None, compare=False, repr=False)

    def sign(self, message: bytes) -> bytes:
        sig = super().sign(message)
        if self.memo is not None:
            self.memo.signed(self.public, sig, message)
        return sig


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
            p.failure = hit
        return p
