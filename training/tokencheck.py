"""What is learned is what was verified: a rollout's token ids against its text.

A trainer learns from a received rollout's `completion_ids` when the rollout
names the trainer's own tokenizer (`tokenizer_hash`), and re-tokenises its
`text` otherwise (training.rollouts.from_wire). The reward is recomputed from
the text, so for a rollout that names our tokenizer the ids must be inside
the model's vocabulary and decode to exactly that text; both are checked
before any model call, by the receiver's validation pipeline (`TokenCheck`,
the lineage's tokenizer, loaded locally) and again by the worker
(`consistent`) before it trains on or spot-checks a rollout. A rollout that
names another tokenizer is judged on its text alone, which is all a trainer
uses of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from murmur.gossip import wire
from murmur.gossip.validation import Reason
from murmur.training.engine import tokenizer_hash_from_json


class TokenCheck:
    """The pipeline's `check_tokens`: one tokenizer (the node's own model's)."""

    def __init__(self, tokenizer: Any, vocab: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.hash = tokenizer_hash_from_json(tokenizer.backend_tokenizer.to_str())
        # The model's embedding rows (config.json vocab_size) when known: ids past them crash a lookup.
        self.vocab = int(vocab) if vocab else len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        # Without clean-up, transformers' decode is the backend's decode behind per-id type
        # checks that cost more than the decoding; with it, only the full call is exact.
        self._backend = (
            None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else tokenizer.backend_tokenizer
        )

    def decode(self, ids: list[int]) -> str:
        """Exactly what training.engine_hf.HFEngine.decode makes of `ids` (the producer's text)."""
        if self.eos_id in ids:
            ids = [i for i in ids if i != self.eos_id]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, r: wire.Rollout) -> tuple[Reason, str] | None:
        if bytes(r.tokenizer_hash) != self.hash:
            return None  # ids of another tokenizer are never used here: the text is re-tokenised
        ids = r.completion_ids
        if ids and max(ids) >= self.vocab:
            return Reason.BAD_TOKENS, f"token id {max(ids)} outside the vocabulary of {self.vocab}"
        try:
            text = self.decode(ids)
        except Exception as e:  # an id the tokenizer cannot map: not a text it ever produced
            return Reason.BAD_TOKENS, f"ids do not decode: {type(e).__name__}"
        if text != r.text:
            return Reason.TEXT_MISMATCH, f"text ({len(r.text)} chars) is not what its {len(ids)} ids decode to"
        return None


def for_model(model: str) -> TokenCheck | None:
    """The check for `[training] model`: murmur-tiny's built-in tokenizer, or a local model directory's.
    None when the model's tokenizer is not on this machine (then no rollout's ids are checked here,
    and docs/security.md says so)."""
    from murmur.training.tokenizer import TINY_NAME, build_tokenizer

    if model == TINY_NAME:
        return TokenCheck(build_tokenizer())
    path = Path(model).expanduser()
    if not (path / "tokenizer.json").is_file():
        return None
    from murmur.training.tokenizer import load_tokenizer

    # Loaded exactly as the engine loads it, so `hash` is the one honest producers put in their rollouts.
    tok = load_tokenizer(path)
    vocab = None
    try:
        vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size") or 0) or None
    except (OSError, ValueError):
        pass
    return TokenCheck(tok, vocab)


def consistent(r: wire.Rollout, engine: Any) -> bool:
    """The worker's cheap check before it trains on or spot-checks `r` with `engine` (None: no
    model is loaded, so no model call can follow)."""
    if engine is None or bytes(r.tokenizer_hash) != engine.tokenizer_hash:
        return True
    vocab = getattr(engine, "vocab", None)
    ids = list(r.completion_ids)
    if ids and vocab is not None and max(ids) >= vocab:
        return False
    try:
        return engine.decode(ids) == r.text
    except Exception:
        return False
