"""SequenceOutputState: incremental text, held-back characters/stop prefixes, and every finish rule
landing at every position of a speculative run of tokens. Uses a real byte-level BPE tokenizer
trained here, small enough that multi-byte characters are split across tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import SequenceOutputState
from engine.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 日本語 😀 the quick brown fox jumps over the lazy dog. Ça va? naïve café — über "
    "straße. 東京 is big! 🎉🎉",
    "hello world, hello again; the fox and the dog went to the market to buy apples and pears.",
]
MULTIBYTE = "héllo wörld 日本語 😀 über 東京 🎉 café"
ASCII = "the fox and the dog went to the market"
EOS = 0
RUN = 5  # tokens appended at once, like K = 4 accepted drafts plus a bonus token
PREFIX = 4  # tokens appended one by one before the run


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.token_to_id("<eos>") == EOS
    return tokenizer


def make(tok, prompt="", **params) -> SequenceOutputState:
    params.setdefault("max_tokens", 1000)
    return SequenceOutputState(tok, SamplingParams(**params), (EOS,), tok.encode(prompt).ids if prompt else [])


def feed(state, chunks) -> list[str]:
    """Append each chunk; return the deltas (and check the bookkeeping every time)."""
    deltas, before = [], state.text
    for chunk in chunks:
        result = state.append(chunk)
        deltas.append(result.text_delta)
        assert result.finish_reason == state.finish_reason
        assert before + "".join(deltas) == state.text
    return deltas


def split_run(ids: list[int]) -> list[list[int]]:
    """PREFIX single tokens, then one run of RUN tokens."""
    return [[t] for t in ids[:PREFIX]] + [ids[PREFIX:PREFIX + RUN]]


def test_tokenizer_splits_multibyte_characters(tok):
    ids = tok.encode(MULTIBYTE).ids
    assert tok.decode(ids) == MULTIBYTE
    assert any("\ufffd" in tok.decode([t]) for t in ids), "no character is split across tokens"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_deltas_are_valid_and_concatenate_to_decode(tok, chunk):
    ids = tok.encode(MULTIBYTE).ids
    state = make(tok, prompt="say: ")
    deltas = feed(state, [ids[i:i + chunk] for i in range(0, len(ids), chunk)])
    assert all("\ufffd" not in d for d in deltas)
    assert state.text == MULTIBYTE == tok.decode(ids)
    assert state.finish_reason is None and state.token_ids == ids
    if chunk == 1:
        assert "" in deltas  # a split character was held back for a step


@pytest.mark.parametrize("pos", range(RUN))
def test_eos_inside_run(tok, pos):
    ids = tok.encode(ASCII).ids
    ids[PREFIX + pos] = EOS
    state = make(tok)
    deltas = feed(state, split_run(ids))
    kept = PREFIX + pos + 1
    assert state.append([]).num_kept == 0
    assert state.token_ids == ids[:kept]
    assert (state.finish_reason, state.stop_reason) == ("stop", None)
    assert state.text == "".join(deltas) == tok.decode(ids[:kept - 1])


def test_run_result_reports_num_kept(tok):
    ids = tok.encode(ASCII).ids
    state = make(tok)
    result = state.append(ids[:2] + [EOS] + ids[2:6])
    assert result.num_kept == 3 and result.finish_reason == "stop"
    assert result.text_delta == tok.decode(ids[:2])
    assert state.append(ids[6:8]) == (0, "stop", "")  # finished: nothing more is kept


@pytest.mark.parametrize("pos", range(RUN))
def test_stop_token_id_inside_run(tok, pos):
    ids = tok.encode(ASCII).ids
    stop_id = tok.encode("?").ids[0]
    assert stop_id not in ids
    ids[PREFIX + pos] = stop_id
    state = make(tok, stop_token_ids=[stop_id])
    deltas = feed(state, split_run(ids))
    kept = PREFIX + pos + 1
    assert state.token_ids == ids[:kept]
    assert (state.finish_reason, state.stop_reason) == ("stop", stop_id)
    assert state.text == "".join(deltas) == tok.decode(ids[:kept - 1])


@pytest.mark.parametrize("pos", range(RUN))
def test_max_tokens_inside_run(tok, pos):
    ids = tok.encode(ASCII).ids
    kept = PREFIX + pos + 1
    state = make(tok, max_tokens=kept)
    deltas = feed(state, split_run(ids))
    assert state.token_ids == ids[:kept]
    assert (state.finish_reason, state.stop_reason) == ("length", None)
    assert state.text == "".join(deltas) == tok.decode(ids[:kept])


@pytest.mark.parametrize("pos", range(RUN))
def test_stop_string_inside_run(tok, pos):
    ids = tok.encode(ASCII).ids
    kept = PREFIX + pos + 1
    text = tok.decode(ids[:kept])
    assert len(text) > len(tok.decode(ids[:kept - 1])), "token adds no text"
    # The shortest suffix of the text so far that occurs nowhere earlier completes exactly here.
    stop = next(text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    state = make(tok, stop=[stop])
    deltas = feed(state, split_run(ids))
    assert state.token_ids == ids[:kept]
    assert (state.finish_reason, state.stop_reason) == ("stop", stop)
    assert state.text == "".join(deltas) == text[: len(text) - len(stop)]


@pytest.mark.parametrize("chunks", ["one run", "one by one"])
def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_after_it(tok, chunks):
    ids = tok.encode(ASCII).ids
    text = tok.decode(ids)
    start = text.index("mark")  # "market": the token completing "mark" carries text after it
    state = make(tok, stop=["mark"], include_stop_str_in_output=True)
    deltas = feed(state, [ids] if chunks == "one run" else [[t] for t in ids])
    assert (state.finish_reason, state.stop_reason) == ("stop", "mark")
    assert state.text == "".join(deltas) == text[: start + len("mark")]
    assert make(tok, stop=["mark"]).append(ids).text_delta == text[:start]  # the default leaves it out


@pytest.mark.parametrize("pos", [0, RUN - 1])
def test_include_stop_str_in_output_keeps_a_stop_tokens_text(tok, pos):
    """vLLM drops a stop token's text by default and keeps it with include_stop_str_in_output."""
    ids = tok.encode(ASCII).ids
    stop_id = ids[PREFIX + pos]
    kept = ids[:ids.index(stop_id) + 1]  # the stop id's first occurrence ends the sequence
    state = make(tok, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    deltas = feed(state, split_run(ids))
    assert (state.token_ids, state.finish_reason, state.stop_reason) == (kept, "stop", stop_id)
    assert state.text == "".join(deltas) == tok.decode(kept)
    assert len(tok.decode(kept)) > len(tok.decode(kept[:-1]))  # the token has text to keep
    assert make(tok, stop_token_ids=[stop_id]).append(ids).text_delta == tok.decode(kept[:-1])

def test_stop_string_spanning_two_tokens_is_held_back_then_cut(tok):
    ids = tok.encode(ASCII).ids
    pieces = [tok.decode([t]) for t in ids]
    i = next(i for i in range(1, len(ids) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-1] + pieces[i + 1][:2]
    before = tok.decode(ids[:i + 1])
    assert before.find(stop) < 0 and tok.decode(ids).find(stop) == len(before) - 1
    state = make(tok, stop=[stop])
    deltas = feed(state, [[t] for t in ids[:i + 1]])
    assert state.text == before[:-1]  # the possible start of the stop string is not released
    result = state.append(ids[i + 1:])
    assert result.num_kept == 1 and state.stop_reason == stop
    assert state.text == "".join(deltas) + result.text_delta == before[:-1]


def test_held_back_prefix_is_flushed_when_disproven_and_at_finish(tok):
    ids = tok.encode(ASCII).ids
    last = tok.decode(ids[:3])[-1]
    state = make(tok, stop=[last + "\u2603"], max_tokens=5)  # a stop string that never completes
    feed(state, [[t] for t in ids[:3]])
    assert state.text == tok.decode(ids[:3])[:-1]
    feed(state, [[ids[3]]])
    assert state.text == tok.decode(ids[:4])  # disproven: released with the next text
    # Ending in a held-back prefix: released at finish.
    stop = tok.decode(ids[:5])[-1] + "\u2603"
    state = make(tok, stop=[stop], max_tokens=5)
    feed(state, [ids[:5]])
    assert state.finish_reason == "length" and state.text == tok.decode(ids[:5])


def test_earliest_completed_stop_string_wins_regardless_of_chunking(tok):
    ids = tok.encode(ASCII).ids
    text = tok.decode(ids)
    start = text.index("market")
    for chunks in ([ids], [[t] for t in ids]):
        state = make(tok, stop=["market", "ark"])
        feed(state, chunks)
        assert state.stop_reason == "ark" and state.text == text[: start + 1]


def test_stop_string_at_the_first_token(tok):
    ids = tok.encode(ASCII).ids
    state = make(tok, stop=[tok.decode(ids[:1])])
    assert state.append(ids) == (1, "stop", "")
    assert state.text == ""


def test_max_tokens_inside_split_character_flushes_replacement(tok):
    ids = tok.encode(MULTIBYTE).ids
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    state = make(tok, max_tokens=cut)
    feed(state, [[t] for t in ids])
    assert state.finish_reason == "length"
    assert state.text == tok.decode(ids[:cut])  # what the kept tokens decode to, U+FFFD included


def test_ignore_eos_keeps_going_and_eos_adds_no_text(tok):
    ids = tok.encode(ASCII).ids
    tokens = ids[:3] + [EOS] + ids[3:6]
    state = make(tok, ignore_eos=True, max_tokens=len(tokens))
    feed(state, [tokens[:2], tokens[2:5], tokens[5:]])
    assert state.token_ids == tokens and state.finish_reason == "length"
    assert state.text == tok.decode(ids[:6])


def test_prompt_ending_mid_character_does_not_misalign_output(tok):
    ids = tok.encode("😀 hello").ids
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    state = SequenceOutputState(tok, SamplingParams(max_tokens=100), (EOS,), ids[:split])
    feed(state, [[t] for t in ids[split:]])
    assert state.text == tok.decode(ids[split:])


def test_decoding_window_stays_small(tok):
    lengths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join([MULTIBYTE, ASCII] * 6)).ids
    state = SequenceOutputState(Counting(), SamplingParams(max_tokens=1000), (EOS,), ids[:10])
    feed(state, [[t] for t in ids])
    assert state.text == tok.decode(ids)
    assert len(ids) > 100 and max(lengths) <= 12


def _reference(tok, ids, stops, stop_ids, max_tokens):
    """Non-incremental rules: full decode after every token. Returns (kept, text, reason, stop)."""
    for n in range(1, len(ids) + 1):
        if ids[n - 1] == EOS or ids[n - 1] in stop_ids:
            return n, tok.decode(ids[:n - 1]), "stop", None if ids[n - 1] == EOS else ids[n - 1]
        text = tok.decode(ids[:n])
        hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        if hits:
            _, neg_len, stop = min(hits)
            return n, text[: min(hits)[0] + neg_len], "stop", stop
        if n == max_tokens:
            return n, text, "length", None
    return len(ids), tok.decode(ids), None, None


def test_random_runs_match_non_incremental_reference(tok):
    import random

    rng = random.Random(0)
    base = tok.encode(" ".join([MULTIBYTE, ASCII, MULTIBYTE])).ids
    full_text = tok.decode(base)
    stop_id = tok.encode("?").ids[0]
    # Start at character boundaries so that U+FFFD can only come from a character cut at the end.
    starts = [i for i in range(len(base) // 2) if not tok.decode(base[i:]).startswith("\ufffd")]
    for _ in range(300):
        ids = base[rng.choice(starts):][: rng.randrange(1, 40)]
        if rng.random() < 0.3:
            ids[rng.randrange(len(ids))] = rng.choice([EOS, stop_id])
        stops = []
        for _ in range(rng.randrange(3)):
            at = rng.randrange(len(full_text))
            stops.append(full_text[at: at + rng.randrange(1, 5)])
        if rng.random() < 0.3:
            stops.append("zz\u2603")
        max_tokens = rng.randrange(1, 45)
        state = make(tok, prompt=rng.choice(["", "tell me: ", "日本"]), stop=stops, stop_token_ids=[stop_id],
                     max_tokens=max_tokens)
        chunks, i = [], 0
        while i < len(ids):
            step = rng.randrange(1, 6)
            chunks.append(ids[i:i + step])
            i += step
        feed(state, chunks)
        kept, text, reason, stop = _reference(tok, ids, stops, {stop_id}, max_tokens)
        assert state.token_ids == ids[:kept] and state.finish_reason == reason
        assert state.stop_reason == stop
        if reason is not None:
            assert state.text == text
        else:
            assert text.startswith(state.text)
        # A cut character (U+FFFD, as decode() shows it) can only be flushed at the end, at finish.
        assert "\ufffd" not in (state.text.rstrip("\ufffd") if reason else state.text)
