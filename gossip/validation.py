"""The rollout verification pipeline: a sans-IO state machine, cheapest check first.

Stages (docs/gossip.md lists every reason and penalty):
  admit  (event loop, microseconds): graylist/blacklist -> size -> rate limit ->
         decode envelope -> signer == originator -> verdict cache -> signature ->
         body -> swarm -> freshness (TTL) -> replay (producer, seq) -> task set known
         -> schedule claims -> completion length -> staleness -> verification CPU share
  verify (thread: pure CPU, no shared state but a locked task cache):
         token ids against the tokenizer (vocabulary, text == decode(ids)),
         regenerate every task from its reference, recompute every reward
         (through an injected, time-limited verifier pool in a node)
  commit (event loop): staleness again (heads move during verify) -> accept

Who pays: a penalty lands only on a peer that provably committed the fault.
The gossip originator is authenticated by libp2p, so bytes whose envelope
signer is not the originator cost the originator (it published someone else's
bytes as its own) and are never cached by content: a relay cannot poison the
verdict of someone else's message. Every other cached verdict is a function of
bytes the signer signed, so replaying it costs only that signer. Rejections
that follow from this node's own view (unknown task set, stale version, a
rate limit the sender never announced) cost nothing.

`check()` runs all three in one call (tests, the simulator, benchmarks); the
I/O layer (`gossip.service`) runs `verify` in `trio.to_thread.run_sync`.
Dependencies are injected: a clock (unix seconds), a task resolver
(`TaskRef -> Task`, raising `TaskError`), a reward function
(`(task, completion_text) -> float`), a head-version oracle per lineage and,
optionally, a "task set known and trusted" predicate and the shared prompt
schedule (`ScheduleView`, `training.schedule.ScheduleBook` in a node).
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from murmur.gossip import wire
from murmur.gossip.cpubudget import CpuBudget
from murmur.gossip.errors import DecodeError, MurmurError, SignatureError, TaskError
from murmur.gossip.identity import peer_id_from_public
from murmur.gossip.ratelimit import AnnouncedRates, TokenBuckets
from murmur.gossip.replay import ReplayCache
from murmur.gossip.scoring import PeerScores, ScoreParams


class Reason(enum.Enum):
    ACCEPTED = "accepted"
    BLACKLISTED = "blacklisted"  # sender banned for proven forgery: dropped unread
    GRAYLISTED = "graylisted"  # sender's score below threshold: dropped unread
    RATE_LIMITED = "rate_limited"  # over the default per-peer bucket (no announcement known): no penalty
    OVER_ANNOUNCED_RATE = "over_announced_rate"  # above the rate the peer itself announced
    OVERSIZED = "oversized"  # over the kind's byte limit
    MALFORMED = "malformed"  # not a decodable envelope / rollout batch (garbage, bad fields)
    BAD_SIGNATURE = "bad_signature"  # envelope signature does not verify: forgery
    SIGNER_MISMATCH = "signer_mismatch"  # signed by a key other than the gossip originator's
    WRONG_SWARM = "wrong_swarm"
    EXPIRED = "expired"  # older than the replay TTL (or from the future): cannot be proven fresh
    DUPLICATE = "duplicate"  # exact bytes seen before: normal (late-joiner replays), no penalty
    REPLAY = "replay"  # (producer, seq) seen before with different content: equivocation
    UNKNOWN_TASK_SET = "unknown_task_set"  # task set not known or not trusted here
    BAD_TASK = "bad_task"  # task reference does not resolve in a known task set
    FORGED_REWARD = "forged_reward"  # recomputed reward differs from the claim: forgery
    BAD_TOKENS = "bad_tokens"  # completion ids outside the vocabulary of the tokenizer it names
    TEXT_MISMATCH = "text_mismatch"  # text is not what its completion ids decode to: forgery
    VERIFIER_TIMEOUT = "verifier_timeout"  # the answer verifier ran past its time limit
    VERIFIER_ERROR = "verifier_error"  # the answer verifier raised on this completion
    VERIFIER_UNAVAILABLE = "verifier_unavailable"  # our verifier could not run: dropped unjudged, no penalty
    STALE_VERSION = "stale_version"  # policy version beyond the staleness bound of its lineage
    BAD_NUMBER = "bad_number"  # a number out of its range (a non-finite or positive log-prob): forgery
    FUTURE_VERSION = "future_version"  # a version of this node's own lineage it never published
    UNKNOWN_VERSION = "unknown_version"  # beyond the head this node knows of another's lineage: no penalty
    TOO_LONG = "too_long"  # a completion longer than this node's own budget: no penalty (other settings)
    OVER_OWN_SAMPLING = "over_own_sampling"  # a completion longer than its own signed max_new_tokens
    CPU_BUDGET = "cpu_budget"  # the sender is over its share of this node's verification CPU: no penalty
    SCHEDULE_WINDOW = "schedule_window"  # a claimed schedule round outside this node's window: no penalty (our clock)
    MISSCHEDULED = "misscheduled"  # a task that is not a prompt of the schedule round it claims: provably false


# (penalty, ban): ban only for proven forgery. Reasons an honest peer can trigger because
# its view differs from ours (stale version, unknown task set, a rate it never announced)
# cost nothing: they are counted, never charged.
PENALTIES: dict[Reason, tuple[float, bool]] = {
    Reason.ACCEPTED: (0.0, False),
    Reason.BLACKLISTED: (0.0, False),
    Reason.GRAYLISTED: (0.0, False),
    Reason.RATE_LIMITED: (0.0, False),
    Reason.OVER_ANNOUNCED_RATE: (1.0, False),
    Reason.OVERSIZED: (10.0, False),
    Reason.MALFORMED: (10.0, False),
    Reason.BAD_SIGNATURE: (100.0, True),
    Reason.SIGNER_MISMATCH: (30.0, False),
    Reason.WRONG_SWARM: (5.0, False),
    Reason.EXPIRED: (0.0, False),
    Reason.DUPLICATE: (0.0, False),
    Reason.REPLAY: (20.0, False),
    Reason.UNKNOWN_TASK_SET: (0.0, False),
    Reason.BAD_TASK: (20.0, False),
    Reason.FORGED_REWARD: (100.0, True),
    Reason.BAD_TOKENS: (100.0, True),
    Reason.TEXT_MISMATCH: (100.0, True),
    Reason.VERIFIER_TIMEOUT: (20.0, False),
    Reason.VERIFIER_ERROR: (20.0, False),
    Reason.VERIFIER_UNAVAILABLE: (0.0, False),
    Reason.STALE_VERSION: (0.0, False),
    Reason.BAD_NUMBER: (100.0, True),
    # provably false (only this node publishes its lineage), yet not banned: a publisher that lost
    # its newest versions (a restored home) would see honest followers ahead of it
    Reason.FUTURE_VERSION: (50.0, False),
    Reason.UNKNOWN_VERSION: (0.0, False),
    Reason.TOO_LONG: (0.0, False),
    Reason.OVER_OWN_SAMPLING: (10.0, False),
    Reason.CPU_BUDGET: (0.0, False),
    Reason.SCHEDULE_WINDOW: (0.0, False),
    # provable from the task reference and the public schedule, as a reference that does not resolve is
    # (bad_task); not banned: a node running another schedule (a protocol change) would claim it honestly
    Reason.MISSCHEDULED: (20.0, False),
}

REWARD_TOLERANCE = 1e-6
MAX_FUTURE_S = 60.0  # clock skew allowed for created_ms
TASK_CACHE = 4096  # regenerated tasks: a group shares one, and batches are verified as they come


@dataclass
class PipelineConfig:
    swarm: str
    max_staleness: int = 4
    rate_per_s: float = 20.0
    burst: int = 40
    replay_entries: int = 100_000
    replay_ttl_s: float = 900.0
    score: ScoreParams = field(default_factory=ScoreParams)
    # completion tokens this node accepts per rollout: its own `training.max_new_tokens` in a node
    max_completion_tokens: int = wire.MAX_COMPLETION_TOKENS

    @classmethod
    def from_config(
        cls, swarm: str, gossip: Any, max_staleness: int, max_completion_tokens: int = wire.MAX_COMPLETION_TOKENS
    ) -> PipelineConfig:
        """From `node.config.GossipSection` (+ sync.max_staleness, training.max_new_tokens)."""
        return cls(
            swarm=swarm,
            max_staleness=max_staleness,
            max_completion_tokens=max_completion_tokens,
            rate_per_s=gossip.rate_limit_per_s,
            burst=gossip.rate_burst,
            replay_entries=gossip.replay_cache,
            replay_ttl_s=float(gossip.replay_ttl_s),
            score=ScoreParams(graylist_threshold=gossip.graylist_threshold, blacklist_s=float(gossip.blacklist_s)),
        )


@dataclass
class Verdict:
    reason: Reason
    origin: str
    data: bytes
    msg_id: bytes = b""  # content id of the envelope bytes
    batch: wire.RolloutBatch | None = None
    detail: str = ""
    newly_banned: bool = False

    @property
    def accepted(self) -> bool:
        return self.reason is Reason.ACCEPTED


@dataclass
class Pending:
    """A message past `admit`, awaiting `verify` (CPU) and `commit`."""

    origin: str
    data: bytes
    msg_id: bytes
    batch: wire.RolloutBatch
    failure: tuple[Reason, str] | None = None


def rollout_id(r: wire.Rollout) -> bytes:
    return wire.content_id(wire.encode(r))


def _task_key(ref: wire.TaskRef) -> tuple[bytes, str, int]:
    return (ref.task_set, ref.generator, ref.seed)


class ScheduleView(Protocol):
    """The shared prompt schedule as a receiver checks claims against it (`training.schedule.ScheduleBook`)."""

    def in_window(self, round_no: int, now_s: float) -> bool:
        """Whether a claim for `round_no` is inside this node's window at unix time `now_s`."""
        ...

    def scheduled(self, ref: wire.TaskRef, round_no: int) -> bool | None:
        """Whether `ref` is one of round `round_no`'s prompts of its task set (None: the set is not held here)."""
        ...


# What a verify stage may be given: per-rollout token checks and a batch scorer.
TokenCheck = Callable[[wire.Rollout], "tuple[Reason, str] | None"]
BatchReward = Callable[[list[tuple[Any, str]]], list[float]]


class VerifierTimeout(MurmurError):
    """A verifier call ran past its time limit (raised by a batch scorer)."""


class VerifierUnavailable(MurmurError):
    """This node could not run its verifier (it did not start, or the machine is overloaded):
    the batch is dropped unjudged, at no cost to its sender, and not cached."""


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        *,
        clock: Callable[[], float],
        resolve_task: Callable[[wire.TaskRef], Any],
        reward: Callable[[Any, str], float],
        head_version: Callable[[bytes], int | None],
        task_set_trusted: Callable[[bytes], bool] | None = None,
        own_lineage: Callable[[bytes], bool] | None = None,
        scores: PeerScores | None = None,
        verify_envelope: Callable[[wire.Envelope], None] = wire.verify_envelope,
        decode_body: Callable[[wire.Envelope], Any] = wire.decode_body,
        reward_batch: BatchReward | None = None,
        check_tokens: TokenCheck | None = None,
        schedule: ScheduleView | None = None,
    ) -> None:
        # verify_envelope/decode_body are injectable so a simulator of many nodes in one
        # process can share the pure, byte-determined work between them (simulations/vcache.py).
        self._verify_envelope = verify_envelope
        self._decode_body = decode_body
        self.config = config
        self.clock = clock
        self.resolve_task = resolve_task
        self.reward = reward
        # A node passes a time-limited pool (training.verifiers.VerifierPool.score_batch);
        # without one the rewards are computed inline (tests, simulator, benchmarks of the inline cost).
        self.reward_batch = reward_batch
        self.check_tokens = check_tokens
        self.head_version = head_version
        self.own_lineage = own_lineage
        self.task_set_trusted = task_set_trusted
        # the shared prompt schedule claims are checked against; without one no claim is accepted
        self.schedule = schedule
        self.scores = scores or PeerScores(config.score)
        self.buckets = TokenBuckets(config.rate_per_s, config.burst)
        self.announced_rates = AnnouncedRates(config.rate_per_s, config.burst)
        self.cpu = CpuBudget()  # verification CPU per peer and per node, as the I/O layer reports it (`spent`)
        # msg_id -> Reason; only bytes whose signer is their originator (or that name no
        # signer at all) are ever cached here, so every entry is a verdict on its signer.
        self.seen = ReplayCache(config.replay_entries, config.replay_ttl_s)
        self.seqs = ReplayCache(config.replay_entries, config.replay_ttl_s)  # (producer, seq) -> msg_id
        self._inflight: set[bytes] = set()
        self._tasks: OrderedDict[tuple, Any] = OrderedDict()
        self._tasks_lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.per_peer: dict[str, Counter[str]] = {}

    # ------------------------------------------------------------ public
    def check(self, data: bytes, origin: str, forwarder: str | None = None) -> Verdict:
        """All stages in one call (no I/O): what the simulator and unit tests drive."""
        step = self.admit(data, origin, forwarder)
        if isinstance(step, Verdict):
            return step
        self.verify(step)
        return self.commit(step)

    def remember(self, data: bytes) -> None:
        """Mark a batch as already accepted: our own publishes, and batches reloaded after a restart,
        so their echoes and late-joiner replays are duplicates, not work."""
        try:
            env = wire.decode_envelope(data, wire.ROLLOUT_BATCH, swarm=self.config.swarm)
            batch = wire.decode_body(env)
        except DecodeError:
            return
        assert isinstance(batch, wire.RolloutBatch)  # decode_envelope checked the kind
        now = self.clock()
        mid = wire.content_id(data)
        self.seen.put(mid, Reason.ACCEPTED, now)
        self.seqs.put((batch.producer, batch.seq), mid, now)

    mark_own = remember

    def announced(self, peer: str, announce: wire.NodeAnnounce) -> None:
        """A verified NodeAnnounce from `peer`: its own statement of how fast it produces
        bounds its bucket from now on (gossip.ratelimit.AnnouncedRates)."""
        if announce.peer_id == peer:
            self.announced_rates.update(peer, announce, self.clock())

    def admit(self, data: bytes, origin: str, forwarder: str | None = None) -> Pending | Verdict:
        now = self.clock()
        for who in (origin, forwarder):
            if who and self.scores.is_blacklisted(who, now):
                return self._reject(Reason.BLACKLISTED, origin, data, b"", None, f"{who} is banned")
            if who and self.scores.is_graylisted(who, now):
                return self._reject(Reason.GRAYLISTED, origin, data, b"", None, f"{who} is graylisted")
        if not isinstance(data, (bytes, bytearray)) or len(data) > wire.KIND_LIMITS[wire.ROLLOUT_BATCH]:
            return self._reject(
                Reason.OVERSIZED, origin, b"", b"", None, f"{len(data)} bytes > {wire.KIND_LIMITS[wire.ROLLOUT_BATCH]}"
            )
        data = bytes(data)
        mid = wire.content_id(data)
        limited = self._rate_limit(origin, data, mid, now)
        if limited is not None:
            return limited
        if mid in self._inflight:
            return self._reject(Reason.DUPLICATE, origin, data, mid, None, "already being verified")
        try:
            env = wire.decode_envelope(data, wire.ROLLOUT_BATCH, swarm=self.config.swarm)
        except wire.WrongSwarm as e:  # signed for another swarm: a replay across swarms
            return self._reject(Reason.WRONG_SWARM, origin, data, mid, None, str(e))
        except DecodeError as e:  # not cached: the same bytes fail here again before the cache is read
            return self._reject(Reason.MALFORMED, origin, data, mid, None, str(e))
        # Before any cache lookup: bytes signed by another key cost their originator, and are
        # never cached by content, so a relay cannot change the verdict on the signer's copy.
        signer = peer_id_from_public(env.signer)
        if origin and signer != origin:
            return self._reject(
                Reason.SIGNER_MISMATCH, origin, data, mid, None, "envelope signer is not the gossip originator"
            )
        prior = self.seen.get(mid, now)
        if prior is not None:
            if prior is Reason.ACCEPTED:
                return self._reject(Reason.DUPLICATE, origin, data, mid, None, "already accepted")
            return self._reject(prior, origin, data, mid, None, "same bytes rejected before")
        try:
            self._verify_envelope(env)
        except SignatureError as e:
            return self._reject(Reason.BAD_SIGNATURE, origin, data, mid, None, str(e), remember=True)
        try:
            batch = self._decode_body(env)
        except SignatureError as e:  # body's producer differs from the envelope signer it was signed by
            return self._reject(Reason.SIGNER_MISMATCH, origin, data, mid, None, str(e), remember=True)
        except wire.BadNumber as e:
            return self._reject(Reason.BAD_NUMBER, origin, data, mid, None, str(e), remember=True)
        except DecodeError as e:
            return self._reject(Reason.MALFORMED, origin, data, mid, None, str(e), remember=True)
        if batch.swarm != self.config.swarm:
            return self._reject(Reason.WRONG_SWARM, origin, data, mid, batch, f"swarm {batch.swarm!r}", remember=True)
        age_s = now - batch.created_ms / 1000.0
        if age_s > self.config.replay_ttl_s or age_s < -MAX_FUTURE_S:
            return self._reject(Reason.EXPIRED, origin, data, mid, batch, f"created {age_s:.0f} s ago")
        over = self._announced_limit(origin, data, batch, now)
        if over is not None:
            return over
        prev = self.seqs.get((batch.producer, batch.seq), now)
        if prev is not None and prev != mid:
            return self._reject(
                Reason.REPLAY,
                origin,
                data,
                mid,
                batch,
                f"seq {batch.seq} of this producer already seen with other content",
                remember=True,
            )
        if self.task_set_trusted is not None:
            for r in batch.rollouts:
                if not self.task_set_trusted(r.task.task_set):
                    return self._reject(
                        Reason.UNKNOWN_TASK_SET,
                        origin,
                        data,
                        mid,
                        batch,
                        f"task set {r.task.task_set.hex()[:16]} not known/trusted",
                    )
        claim = self._schedule_claims(batch, now)
        if claim is not None:
            reason, detail = claim
            return self._reject(reason, origin, data, mid, batch, detail, remember=reason is Reason.MISSCHEDULED)
        long = self._too_long(batch)
        if long is not None:
            return self._reject(long[0], origin, data, mid, batch, long[1], remember=True)
        stale = self._versions(batch)  # before the expensive stage; again at commit (heads move meanwhile)
        if stale is not None:
            reason, detail = stale
            return self._reject(reason, origin, data, mid, batch, detail, remember=reason is Reason.FUTURE_VERSION)
        busy = self.cpu.admit(origin, now) if origin else None
        if busy is not None:
            return self._reject(Reason.CPU_BUDGET, origin, data, mid, batch, busy)
        self._inflight.add(mid)
        return Pending(origin, data, mid, batch)

    def verify(self, p: Pending) -> Pending:
        """CPU-only stage, safe to run in a worker thread: check token ids, regenerate tasks,
        recompute rewards. Never raises: every failure is a named rejection in `p.failure`."""
        try:
            p.failure = self._verify(p.batch)
        except Exception as e:  # a bug or hostile input we did not foresee: named, charged, cached
            p.failure = (Reason.VERIFIER_ERROR, f"{type(e).__name__}: {str(e)[:200]}")
        return p

    def commit(self, p: Pending) -> Verdict:
        self._inflight.discard(p.msg_id)
        if p.failure is not None:
            reason, detail = p.failure
            return self._reject(
                reason,
                p.origin,
                p.data,
                p.msg_id,
                p.batch,
                detail,
                remember=reason not in (Reason.UNKNOWN_TASK_SET, Reason.VERIFIER_UNAVAILABLE),
            )
        stale = self._versions(p.batch)
        if stale is not None:
            reason, detail = stale
            return self._reject(
                reason, p.origin, p.data, p.msg_id, p.batch, detail, remember=reason is Reason.FUTURE_VERSION
            )
        now = self.clock()
        self.seen.put(p.msg_id, Reason.ACCEPTED, now)
        self.seqs.put((p.batch.producer, p.batch.seq), p.msg_id, now)
        self.scores.reward(p.origin, now)
        if p.origin:
            self.cpu.verified(p.origin, now)  # toward a verification share of its own
        self._count(Reason.ACCEPTED, p.origin)
        return Verdict(Reason.ACCEPTED, p.origin, p.data, p.msg_id, p.batch)

    def spent(self, p: Pending, cpu_s: float) -> None:
        """The I/O layer measured what verifying `p` cost (CPU-seconds, all processes): the sender's
        share and the node's budget pay for it (gossip.cpubudget)."""
        self.cpu.spend(p.origin, cpu_s, self.clock())

    def abandon(self, p: Pending) -> None:
        """The I/O layer was cancelled between stages: forget the in-flight mark."""
        self._inflight.discard(p.msg_id)

    # ------------------------------------------------------------ internals
    def _rate_limit(self, origin: str, data: bytes, mid: bytes, now: float) -> Verdict | None:
        """Before any decoding: a peer that announced no rate gets the default bucket, whose drops
        cost nothing (it never promised a rate). Copies of batches already here spend no tokens;
        a peer that announced its rate is held to it once its batch is decoded (`_announced_limit`)."""
        if not origin or mid in self._inflight or self.seen.get(mid, now) is Reason.ACCEPTED:
            return None  # a copy: the later stages name it (duplicate, or a relay's signer mismatch)
        if self.announced_rates.bucket(origin) is not None or self.buckets.take(origin, now):
            return None
        return self._reject(
            Reason.RATE_LIMITED, origin, data, b"", None, f"over {self.config.rate_per_s}/s (burst {self.config.burst})"
        )

    def _announced_limit(self, origin: str, data: bytes, batch: wire.RolloutBatch, now: float) -> Verdict | None:
        """A peer that announced its rate is held to it, and charged when above it. The bucket is spent
        at the batch's signed creation time, so only batches the producer made faster than it said
        are charged, however they queue on the way (a relay's backlog, this node's own busy loop); a
        batch older than the last one spent (out of order) falls to the default, uncharged bucket."""
        bucket = self.announced_rates.bucket(origin) if origin else None
        if bucket is None:
            return None
        made = batch.created_ms / 1000.0
        if made >= bucket.last:
            if bucket.take(min(made, now + MAX_FUTURE_S), 1.0):
                return None
            return self._reject(
                Reason.OVER_ANNOUNCED_RATE,
                origin,
                data,
                b"",
                batch,
                f"made faster than its announced {bucket.rate:.2f} batches/s (burst {bucket.burst:.0f})",
            )
        if self.buckets.take(origin, now):
            return None
        return self._reject(
            Reason.RATE_LIMITED,
            origin,
            data,
            b"",
            batch,
            f"out of order and over {self.config.rate_per_s}/s (burst {self.config.burst})",
        )

    def _schedule_claims(self, batch: wire.RolloutBatch, now: float) -> tuple[Reason, str] | None:
        """A rollout that claims a round of the shared prompt schedule (`schedule_round` > 0) must claim a round
        inside this node's window (else `schedule_window`, uncharged: the window is this node's clock) and answer
        one of that round's prompts (else `misscheduled`: the task reference and the public schedule prove it).
        Each claim costs a window test and a set lookup; a round's prompts are derived once, and only for rounds
        inside the window, so no claimed number makes this node derive more."""
        for i, r in enumerate(batch.rollouts):
            rnd = r.schedule_round
            if not rnd:
                continue
            if self.schedule is None or not self.schedule.in_window(rnd, now):
                return Reason.SCHEDULE_WINDOW, f"rollout {i}: schedule round {rnd} is outside this node's window"
            ok = self.schedule.scheduled(r.task, rnd)
            if ok is None:
                return Reason.UNKNOWN_TASK_SET, f"rollout {i}: task set {r.task.task_set.hex()[:16]} not held here"
            if not ok:
                return Reason.MISSCHEDULED, (
                    f"rollout {i}: {r.task.generator} seed {r.task.seed} is not a prompt "
                    f"of schedule round {rnd} of its task set"
                )
        return None

    def _too_long(self, batch: wire.RolloutBatch) -> tuple[Reason, str] | None:
        """Work in proportion: a completion longer than its own signed `max_new_tokens` is provably not
        what it claims; one longer than this node's budget costs more to verify and train on than this
        node's own, and is refused unverified at no charge (an honest node may sample longer)."""
        limit = self.config.max_completion_tokens
        for i, r in enumerate(batch.rollouts):
            n = len(r.completion_ids)
            if n > r.sampling.max_new_tokens:
                return (
                    Reason.OVER_OWN_SAMPLING,
                    f"rollout {i}: {n} tokens > its max_new_tokens {r.sampling.max_new_tokens}",
                )
            if n > limit:
                return Reason.TOO_LONG, f"rollout {i}: {n} tokens > this node's budget {limit}"
        return None

    def _versions(self, batch: wire.RolloutBatch) -> tuple[Reason, str] | None:
        """Judged against the publisher-signed head only: a claimed version never moves a head. The
        oldest and the newest version per lineage decide, so the head is asked once per lineage.

        A version above the head is never used: its tokens would escape the stale-token mask. Of
        this node's own lineage it is provably false (only this node publishes it, and it knows its
        head before any manifest leaves), so it is charged; of another's lineage the producer may
        hold a manifest that has not reached us yet, so it is refused uncharged."""
        span: dict[bytes, list[int]] = {}  # lineage -> [oldest, newest]; runs once per batch per stage
        for r in batch.rollouts:
            lo = top = r.version
            for _, v in r.token_versions:
                if v > top:
                    top = v
            s = span.get(r.lineage)
            if s is None:
                span[r.lineage] = [lo, top]
            else:
                if lo < s[0]:
                    s[0] = lo
                if top > s[1]:
                    s[1] = top
        for lineage, (oldest, newest) in span.items():
            head = self.head_version(lineage)
            if head is None:
                continue
            if newest > head:
                own = self.own_lineage is not None and self.own_lineage(lineage)
                return (
                    Reason.FUTURE_VERSION if own else Reason.UNKNOWN_VERSION,
                    f"version {newest} is beyond the {'published' if own else 'known'} head {head}",
                )
            if oldest + self.config.max_staleness < head:
                return Reason.STALE_VERSION, f"version {oldest} vs head {head} (bound {self.config.max_staleness})"
        return None

    def _verify(self, batch: wire.RolloutBatch) -> tuple[Reason, str] | None:
        if self.check_tokens is not None:
            for i, r in enumerate(batch.rollouts):
                bad = self.check_tokens(r)
                if bad is not None:
                    return bad[0], f"rollout {i}: {bad[1]}"
        tasks = []
        for i, r in enumerate(batch.rollouts):
            try:
                tasks.append(self._task(r.task))
            except TaskError as e:
                reason = Reason.UNKNOWN_TASK_SET if "unknown task set" in str(e).lower() else Reason.BAD_TASK
                return reason, f"rollout {i}: {e}"
        items = [(t, r.text) for t, r in zip(tasks, batch.rollouts)]
        try:
            if self.reward_batch is not None:
                got = self.reward_batch(items)
            else:
                got = [self.reward(t, text) for t, text in items]
        except VerifierTimeout as e:
            return Reason.VERIFIER_TIMEOUT, str(e)
        except VerifierUnavailable as e:
            return Reason.VERIFIER_UNAVAILABLE, str(e)
        except TaskError as e:
            return Reason.BAD_TASK, f"verifier: {e}"
        except MurmurError as e:
            return Reason.VERIFIER_ERROR, str(e)
        for i, (r, value) in enumerate(zip(batch.rollouts, got)):
            if not abs(float(value) - r.reward) <= REWARD_TOLERANCE:
                return Reason.FORGED_REWARD, f"rollout {i}: claims {r.reward}, recomputed {value}"
        return None

    def _task(self, ref: wire.TaskRef) -> Any:
        key = _task_key(ref)
        with self._tasks_lock:
            hit = self._tasks.get(key)
            if hit is not None:
                self._tasks.move_to_end(key)
                return hit
        task = self.resolve_task(ref)
        with self._tasks_lock:
            self._tasks[key] = task
            while len(self._tasks) > TASK_CACHE:
                self._tasks.popitem(last=False)
        return task

    def _count(self, reason: Reason, peer: str) -> None:
        self.counts[reason.value] += 1
        if peer:
            self.per_peer.setdefault(peer, Counter())[reason.value] += 1
            while len(self.per_peer) > self.scores.max_peers:  # bounded like the score table
                self.per_peer.pop(next(iter(self.per_peer)))

    def _reject(
        self,
        reason: Reason,
        origin: str,
        data: bytes,
        mid: bytes,
        batch: wire.RolloutBatch | None,
        detail: str,
        remember: bool = False,
    ) -> Verdict:
        now = self.clock()
        if remember and mid:
            self.seen.put(mid, reason, now)
        self._count(reason, origin)
        penalty, ban = PENALTIES[reason]
        newly = False
        if origin and (penalty or ban):
            newly = self.scores.penalise(origin, reason.value, penalty, now, ban=ban)
        return Verdict(reason, origin, data, mid, batch, detail, newly)
