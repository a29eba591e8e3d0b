"""Trainer-side rollouts and their conversion to and from `gossip.wire.Rollout`.

On the wire, behaviour log-probs are little-endian float32 bytes and the
policy version of each token is a list of (first token index, version)
segments, because a partial rollout may be continued under newer versions.
A rollout from a model with a different tokenizer (hash mismatch) is
re-tokenised locally from its text; its own log-probs then only survive as a
length-normalised mean, which is all the HACPO sequence ratio needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from murmur.gossip.errors import DecodeError
from murmur.gossip.wire import Rollout, SamplingParams, TaskRef, now_ms
from murmur.training.engine import Sampling
from murmur.training.tasks import Task


@dataclass
class RolloutRec:
    ref: TaskRef
    task: Task
    prompt_ids: list[int]
    ids: list[int]
    text: str
    logprobs: list[float]
    token_versions: list[tuple[int, int]]  # (first token index, version) segments
    version: int  # version at the first completion token
    lineage: bytes
    tokenizer_hash: bytes
    sampling: Sampling
    reward: float = 0.0
    finished: bool = True
    created_ms: int = field(default_factory=now_ms)
    # another model's sample (another lineage, or re-tokenised from another tokenizer): trained with the
    # HACPO loss, whose weight rests on nothing the producer claims (its log-probs are not re-scorable)
    foreign: bool = False
    source: bytes = b""  # HACPO's capability key: `capability_key` of its producer and lineage
    # the shared prompt schedule's round this answers (training/schedule.py; 0: drawn freely). Received ones
    # passed the receiver's pipeline, which refuses a claim for a task that is not a prompt of its round.
    schedule_round: int = 0

    def versions_per_token(self) -> list[int]:
        return expand_versions(self.token_versions, len(self.ids), self.version)


def capability_key(producer: bytes, lineage: bytes) -> bytes:
    """HACPO's capability key of a received sample: the key that signed its batch and the lineage it claims
    (the lineage alone where the caller does not know the producer). Per key, so that a fresh key starts
    with no record and a key that claims a strong lineage does not inherit that lineage's record."""
    return bytes(producer) + bytes(lineage)


def expand_versions(segments: list[tuple[int, int]], n: int, first: int) -> list[int]:
    """Per-token versions from (index, version) segments; tokens before the first segment get `first`."""
    out = [first] * n
    for k, (idx, ver) in enumerate(segments):
        end = segments[k + 1][0] if k + 1 < len(segments) else n
        for i in range(idx, min(end, n)):
            out[i] = ver
    return out


def logprobs_to_bytes(lps: list[float]) -> bytes:
    return np.asarray(lps, dtype="<f4").tobytes()


def logprobs_from_bytes(data: bytes) -> list[float]:
    if len(data) % 4:
        raise DecodeError(f"logprob bytes length {len(data)} is not a multiple of 4")
    return np.frombuffer(data, dtype="<f4").astype(np.float64).tolist()


def to_wire(r: RolloutRec) -> Rollout:
    s = r.sampling
    return Rollout(
        task=r.ref,
        lineage=r.lineage,
        version=r.version,
        completion_ids=list(r.ids),
        text=r.text,
        tokenizer_hash=r.tokenizer_hash,
        logprobs=logprobs_to_bytes(r.logprobs),
        token_versions=[(int(i), int(v)) for i, v in r.token_versions],
        sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens),
        reward=float(r.reward),
        created_ms=r.created_ms,
        schedule_round=int(r.schedule_round),
    )


def from_wire(
    w: Rollout,
    task: Task,
    prompt_ids: list[int],
    tokenizer_hash: bytes,
    encode: Callable[[str], Iterable[int]],
    eos_id: int | None = None,
    max_tokens: int | None = None,
    producer: bytes = b"",
) -> RolloutRec:
    """A received rollout for local training; re-tokenised when its tokenizer differs from ours.

    `finished` says whether the producer's completion ended with its EOS (else it was cut at its
    `max_new_tokens`). With our tokenizer the last id shows it (given `eos_id`); with another the text
    has no EOS, so a completion shorter than the producer's token cap stopped on its own, and one that
    reached the cap counts as cut (a finished one of exactly that length is lost, never a cut one
    trained as finished). A re-tokenised text longer than `max_tokens` of ours is cut there and counts
    as cut: the receiver's token budget bounds its work, whatever the producer's budget was. `producer` is
    the key that signed its batch (its capability key's first half)."""
    lps = logprobs_from_bytes(w.logprobs)
    if len(lps) != len(w.completion_ids):
        raise DecodeError(f"rollout has {len(lps)} log-probs for {len(w.completion_ids)} tokens")
    sampling = Sampling(
        temperature=w.sampling.temperature, top_p=w.sampling.top_p, max_new_tokens=w.sampling.max_new_tokens
    )
    rec = RolloutRec(
        ref=w.task,
        task=task,
        prompt_ids=list(prompt_ids),
        ids=list(w.completion_ids),
        text=w.text,
        logprobs=lps,
        token_versions=[(int(i), int(v)) for i, v in w.token_versions],
        version=int(w.version),
        lineage=bytes(w.lineage),
        tokenizer_hash=bytes(w.tokenizer_hash),
        sampling=sampling,
        reward=float(w.reward),
        created_ms=int(w.created_ms),
        source=capability_key(producer, w.lineage),
        schedule_round=int(w.schedule_round),
    )
    ids = w.completion_ids
    if bytes(w.tokenizer_hash) == tokenizer_hash:
        rec.finished = bool(ids) and eos_id is not None and ids[-1] == eos_id
    else:
        rec.finished = 0 < len(ids) < w.sampling.max_new_tokens
        rec.ids = list(encode(w.text))
        if max_tokens is not None and len(rec.ids) > max_tokens:
            rec.ids, rec.finished = rec.ids[:max_tokens], False
        rec.logprobs = []
        rec.token_versions = []
        rec.tokenizer_hash = tokenizer_hash
        rec.foreign = True  # whatever lineage it names: its ids and log-probs are not ours
    return rec
