"""The token check (training/tokencheck.py): a rollout's ids against its text, in the pipeline's `TokenCheck`
and the worker's `consistent`; murmur-tiny's real tokenizer and engine, plain calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from murmur.gossip import wire
from murmur.gossip.validation import Reason
from murmur.training import tokencheck
from tests import samples


@pytest.fixture(scope="module")
def tiny() -> tokencheck.TokenCheck:
    check = tokencheck.for_model("murmur-tiny")
    assert check is not None
    return check


@pytest.fixture(scope="module")
def engine():
    from murmur.training.tiny import new_tiny_engine

    return new_tiny_engine()


def rollout(
    check: tokencheck.TokenCheck, text: str, ids: list[int] | None = None, tokenizer_hash: bytes | None = None
) -> wire.Rollout:
    """A rollout whose `text` is `text` and whose ids are what `check`'s tokenizer makes of it (or `ids`), as
    received: decoded from its bytes, so its fields are equal to the check's, never the same objects."""
    ids = check.tokenizer.encode(text, add_special_tokens=False) if ids is None else ids
    r = msgspec.structs.replace(
        samples.rollout(n_tokens=len(ids)),
        completion_ids=ids,
        text=text,
        tokenizer_hash=check.hash if tokenizer_hash is None else tokenizer_hash,
    )
    return msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=wire.Rollout)


# ------------------------------------------------------------ the pipeline's check (TokenCheck)


def test_ids_that_decode_to_the_text_pass_and_others_are_a_text_mismatch(tiny) -> None:
    assert tiny(rollout(tiny, "<answer>12</answer>")) is None
    reason, detail = tiny(rollout(tiny, "<answer>12</answer>", ids=tiny.tokenizer.encode("<answer>13</answer>")))
    assert reason is Reason.TEXT_MISMATCH and "text (19 chars)" in detail and "its 19 ids" in detail
    assert (
        tiny(rollout(tiny, "<answer>13</answer>", ids=tiny.tokenizer.encode("<answer>12</answer>")))[0]
        is Reason.TEXT_MISMATCH
    )  # decoding to an earlier text as well as to a later one
    # the same ids under another tokenizer's name: judged on the text alone, the ids never used here
    for other in (b"\x00" * 32, b"\xff" * 32):  # names sorting before and after ours
        assert tiny(rollout(tiny, "<answer>12</answer>", ids=[10**6], tokenizer_hash=other)) is None


def test_the_vocabulary_bound_is_checked_before_decoding(tiny) -> None:
    """Ids the tokenizer decodes to nothing still crash the model's embedding lookup: an id at the bound is
    rejected even though its (empty) decoding matches the text; the last id inside it passes."""
    assert tiny.vocab == len(tiny.tokenizer)
    last = tiny.vocab - 1
    assert tiny(rollout(tiny, tiny.decode([last]), ids=[last])) is None
    assert tiny.decode([tiny.vocab]) == ""
    reason, detail = tiny(rollout(tiny, "", ids=[tiny.vocab]))
    assert reason is Reason.BAD_TOKENS and detail == f"token id {tiny.vocab} outside the vocabulary of {tiny.vocab}"
    assert tiny(rollout(tiny, "", ids=[])) is None  # an empty completion has no id to bound


def test_the_models_vocabulary_when_known_bounds_the_ids_not_the_tokenizers() -> None:
    """A model's embedding may have fewer rows than its tokenizer has ids (or more): `vocab` is the bound."""
    from murmur.training.tokenizer import build_tokenizer

    small = tokencheck.TokenCheck(build_tokenizer(), vocab=40)
    assert small.vocab == 40
    reason, _ = small(rollout(small, "~", ids=small.tokenizer.encode("~")))  # id 97, inside the tokenizer
    assert reason is Reason.BAD_TOKENS
    assert small(rollout(small, "+", ids=small.tokenizer.encode("+"))) is None  # id 14
    assert tokencheck.TokenCheck(build_tokenizer(), vocab=None).vocab == len(build_tokenizer())


# ------------------------------------------------------------ the check for `[training] model` (for_model)


def save_tokenizer(path, config: str | None) -> None:
    from murmur.training.tokenizer import build_tokenizer

    build_tokenizer().save_pretrained(path)
    if config is not None:
        (path / "config.json").write_text(config)


def test_a_model_directory_checks_against_its_config_vocab_size(tmp_path) -> None:
    save_tokenizer(tmp_path, json.dumps({"model_type": "qwen2", "vocab_size": 120}))
    check = tokencheck.for_model(str(tmp_path))
    assert check is not None and check.vocab == 120
    assert check(rollout(check, "", ids=[119])) is None  # a padded embedding row: no model crash
    assert check(rollout(check, "", ids=[120]))[0] is Reason.BAD_TOKENS


@pytest.mark.parametrize("config", [None, "{not json", json.dumps({"vocab_size": 0}), json.dumps({})])
def test_without_a_usable_vocab_size_the_tokenizers_size_bounds_the_ids(tmp_path, config) -> None:
    save_tokenizer(tmp_path, config)
    check = tokencheck.for_model(str(tmp_path))
    assert check is not None and check.vocab == 98


def test_no_tokenizer_on_this_machine_means_no_check(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 120}))
    assert tokencheck.for_model(str(tmp_path)) is None
    assert tokencheck.for_model(str(tmp_path / "absent")) is None
    for name in ("a-model", "qwen-model"):  # names that sort before and after murmur-tiny's are not it
        assert tokencheck.for_model(name) is None


# ------------------------------------------------------------ the worker's check (consistent) and the engine's decoding
# (last: only these build a model)


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
    for name in (b"\x00" * 32, b"\xff" * 32):
        other = rollout(tiny, "<answer>12</answer>", ids=[10**6], tokenizer_hash=name)
        assert tokencheck.consistent(other, engine)  # another tokenizer: its text is re-tokenised, ids unused


def test_the_worker_check_bounds_ids_by_the_engines_vocabulary(tiny, engine) -> None:
    """Ids past the embedding decode to nothing, so only the bound stops them before the model call."""
    assert tokencheck.consistent(rollout(tiny, tiny.decode([engine.vocab - 1]), ids=[engine.vocab - 1]), engine)
    assert not tokencheck.consistent(rollout(tiny, "", ids=[engine.vocab]), engine)
    assert not tokencheck.consistent(rollout(tiny, "", ids=[engine.vocab + 5]), engine)
    for text, other in (("12", "13"), ("13", "12")):  # decoding to any other text, before or after it
        assert not tokencheck.consistent(rollout(tiny, text, ids=tiny.tokenizer.encode(other)), engine)
    assert tokencheck.consistent(rollout(tiny, "", ids=[]), engine)
    assert tokencheck.consistent(rollout(tiny, "<answer>1</answer>", ids=[10**6]), None)  # no model: no call follows


def test_decoding_drops_eos_and_specials_as_the_engine_does(tiny, engine) -> None:
    """An honest completion ends in EOS (the engine keeps it in the ids, not in the text)."""
    ids = tiny.tokenizer.encode("<answer>7</answer>") + [tiny.eos_id]
    assert tiny(rollout(tiny, "<answer>7</answer>", ids=ids)) is None
    with_specials = [0, *tiny.tokenizer.encode("a"), 1, 2, *tiny.tokenizer.encode("b"), 1]
    assert tiny.decode(with_specials) == engine.decode(with_specials) == "ab"


def wordpiece_tokenizer():
    """A BERT-style tokenizer, built here: transformers cleans up its decoded spaces, its backend does not; its
    special tokens come after the others (as Qwen's do), so EOS has the largest id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    tok = Tokenizer(
        models.WordPiece(
            vocab={t: i for i, t in enumerate([chr(c) for c in range(33, 127)] + specials)}, unk_token="<unk>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", clean_up_tokenization_spaces=True
    )


def test_a_tokenizer_that_cleans_up_spaces_is_checked_with_its_full_decode(engine) -> None:
    """With clean-up on, only transformers' full decode is the engine's ("1 , 2 ." decodes to "1, 2.")."""
    from murmur.training.engine_hf import HFEngine

    tok = wordpiece_tokenizer()
    check = tokencheck.TokenCheck(tok)
    ids = [tok.pad_token_id, *tok.encode("1 , 2 .", add_special_tokens=False), tok.eos_token_id]
    assert tok.eos_token_id > max(ids[1:-1])
    assert check.decode(ids) == HFEngine(engine.model, tok).decode(ids) == "1, 2."
    assert check(rollout(check, "1, 2.", ids=ids)) is None
    assert check(rollout(check, "1 , 2 .", ids=ids))[0] is Reason.TEXT_MISMATCH


def test_the_node_process_checks_tokens_without_torch(tiny_model) -> None:
    """What a node process loads of its model (the token checks, the engine check, the model plan) imports no
    torch: only its worker pays for torch, at start and in memory."""
    code = (
        "import sys\n"
        "import murmur.node.shell.runtime\n"
        "from murmur.node.worker import modelplan\n"
        "from murmur.node.worker import main as worker\n"
        "from murmur.training import tokencheck\n"
        "m = sys.argv[1]\n"
        "assert tokencheck.for_model(m) is not None and tokencheck.for_model('murmur-tiny') is not None\n"
        "worker.engine_check({'engine': 'transformers', 'model': m})\n"
        "modelplan.plan(m, 4096)\n"
        "print(sorted(x for x in ('torch', 'murmur.training.engine_hf', 'murmur.training.tiny') if x in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(root),
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
