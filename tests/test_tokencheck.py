"""The token check (training/tokencheck.py): a rollout's ids against its text, in the pipeline's `TokenCheck`
and the worker's `consistent`; murmur-tiny's real tokenizer and engine, plain calls."""

from __future__ import annotations

import msgspec
import pytest

from gossip import wire
from tests import samples
from training import tokencheck


@pytest.fixture(scope="module")
def tiny() -> tokencheck.TokenCheck:
    check = tokencheck.for_model("murmur-tiny")
    assert check is not None
    return check


@pytest.fixture(scope="module")
def engine():
    from training.tiny import new_tiny_engine

    return new_tiny_engine()


def rollout(check: tokencheck.TokenCheck, text: str, ids: list[int] | None = None,
            tokenizer_hash: bytes | None = None) -> wire.Rollout:
    """A rollout whose `text` is `text` and whose ids are what `check`'s tokenizer makes of it (or `ids`)."""
    ids = check.tokenizer.encode(text, add_special_tokens=False) if ids is None else ids
    return msgspec.structs.replace(samples.rollout(n_tokens=len(ids)), completion_ids=ids, text=text,
                                   tokenizer_hash=check.hash if tokenizer_hash is None else tokenizer_hash)


def test_tiny_check_is_the_engines_tokenizer(tiny, engine, tmp_path) -> None:
    """The check's hash and decoding are the worker's (built in memory or reloaded from disk)."""
    from transformers import AutoTokenizer

    assert engine.tokenizer_hash == tiny.hash and engine.vocab == tiny.vocab
    engine.tokenizer.save_pretrained(tmp_path)
    reloaded = tokencheck.TokenCheck(AutoTokenizer.from_pretrained(tmp_path))
    assert reloaded.hash == tiny.hash
    ids = [(i * 37) % tiny.vocab for i in range(300)]
    assert tiny.decode(ids) == engine.decode(ids)


def test_worker_check_before_training(tiny, engine) -> None:
    assert tokencheck.consistent(rollout(tiny, "<answer>12</answer>"), engine)
    assert not tokencheck.consistent(rollout(tiny, "<answer>12</answer>", ids=[10, 11]), engine)
    assert not tokencheck.consistent(rollout(tiny, "<answer>12</answer>", ids=[engine.vocab + 5]), engine)
    other = rollout(tiny, "<answer>12</answer>", ids=[10**6], tokenizer_hash=b"\x01" * 32)
    assert tokencheck.consistent(other, engine)  # another tokenizer: its text is re-tokenised, ids unused
