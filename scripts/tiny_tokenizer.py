"""Byte-level BPE tokenizer for the bundled model pair (``tokenizers`` library).

Byte-level pre-tokenization (no prefix space) + byte-level decoder, no normalizer, and all 256
byte symbols in the initial alphabet: every UTF-8 string maps to tokens and back EXACTLY
(``decode(encode(text)) == text``), which the serving engine relies on for streaming detokenization.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scripts.stdlib_corpus import EOT_TOKEN


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, show_progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE with ``EOT_TOKEN`` as special token id 0.

    Args:
        texts: training documents (one stdlib file each), iterated once in order.
        vocab_size: total vocabulary including the special token and the 256 byte symbols.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],  # first special token gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever <unk>
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(EOT_TOKEN) != 0:
        raise RuntimeError("special token did not get id 0")
    return tok


def assert_roundtrip(tok: Tokenizer, texts: Iterable[str]) -> int:
    """Raise if any text does not survive encode->decode byte-for-byte; return how many were checked."""
    n = 0
    for text in texts:
        ids = tok.encode(text).ids
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            raise AssertionError(f"tokenizer round-trip failed on a {len(text)}-char text")
        n += 1
    return n


def encode_documents(tok: Tokenizer, texts: Iterable[str]) -> Iterator[list[int]]:
    """Token ids per document, each followed by the end-of-text id 0 (document separator)."""
    for text in texts:
        yield tok.encode(text).ids + [0]


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by ``AutoTokenizer``.

    ``clean_up_tokenization_spaces`` is off because it rewrites spaces before punctuation, which
    would break the exact round-trip of source code.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
