"""The cheap length check before tokenising (``max_chars_per_token``, ``check_prompt_chars``):
it must never refuse a prompt that fits, so the bound is checked against real tokenisations,
including the worst case (the longest token's text repeated)."""

import inspect
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from engine.loader import encode_text, load_tokenizer, max_chars_per_token
from engine.request_ranges import RequestError, check_prompt_chars
from tests.engine.bundled import TARGET


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(Path(TARGET))[0]


def _texts(tok: Tokenizer) -> list[str]:
    rng = random.Random(0)
    source = inspect.getsource(random)
    longest = max(range(tok.get_vocab_size()), key=lambda i: len(tok.decode([i]).encode()))
    alphabet = "aé日😀 \n\t{}_" + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(200))
    return ([source[i:i + n] for i, n in ((0, 5000), (777, 131), (4001, 17))]
            + ["".join(rng.choice(alphabet) for _ in range(n)) for n in (1, 63, 999)]
            + [tok.decode([longest]) * 97, tok.id_to_token(0) * 5])


def test_no_text_has_fewer_tokens_than_the_bound_says(tok):
    bound = max_chars_per_token(tok)
    assert bound is not None and bound > 1
    for text in _texts(tok):
        assert len(encode_text(tok, text)) >= -(-len(text) // bound), text[:40]


def test_a_prompt_at_the_bound_is_refused_and_one_below_it_is_not():
    check_prompt_chars(49 * 1023, 49, 1024)  # at least 1023 tokens: may fit, so not refused
    with pytest.raises(RequestError, match="at least 1024 tokens") as err:
        check_prompt_chars(49 * 1023 + 1, 49, 1024)
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
    check_prompt_chars(10**9, None, 1024)  # no bound: no check


def test_tokenizers_that_can_cover_any_span_with_one_token_get_no_bound(tok):
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))  # one [UNK] a word
    normalised = Tokenizer.from_str(tok.to_str())
    normalised.normalizer = normalizers.NFKC()
    split = Tokenizer.from_str(tok.to_str())
    split.pre_tokenizer = pre_tokenizers.Whitespace()  # not byte-level: unknown characters
    assert [max_chars_per_token(t) for t in (wordpiece, normalised, split)] == [None, None, None]
