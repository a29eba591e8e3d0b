"""Tokenizers and model names without torch: the node process checks rollouts' token ids and the engine's
support for the model, and only its worker loads the model itself.

murmur-tiny's name, architecture and built tokenizer, and a model directory's own tokenizer loaded exactly
as the engine loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

TINY_NAME: Final = "murmur-tiny"
TINY_ARCHS: Final = ["Qwen2ForCausalLM"]  # what build_model makes (an engine can check support before it exists)
SPECIALS: Final = ["<pad>", "<eos>", "<unk>"]
CHARS: Final = [chr(c) for c in range(32, 127)]


def build_tokenizer() -> Any:
    """A character tokenizer over printable ASCII: a BPE model with no merges, as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def load_tokenizer(p: Path) -> Any:
    """The directory's own tokenizer. A generic `tokenizer.json` (class TokenizersBackend /
    PreTrainedTokenizerFast) is loaded as is: AutoTokenizer would rebuild it as the model
    type's tokenizer class (e.g. byte-level BPE for qwen2), changing the tokenization. Only that
    fallback imports AutoTokenizer, which imports torch."""
    from transformers import PreTrainedTokenizerFast

    cls = ""
    try:
        cls = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class", "")
    except (OSError, ValueError):
        pass
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast") and (p / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(p, local_files_only=True)
