"""Completion logprobs carry OpenAI's text_offset, streamed or not; a stream of n choices says
each one's finish once."""

from actors.responses import ResponseBuilder


class _Tokenizer:
    """Token id -> text: ids 0..25 are letters, 26 is two characters."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("xy" if i == 26 else chr(ord("a") + i) for i in ids)


def _choice(ids: list[int], finished: bool = False, index: int = 0) -> dict:
    return {"index": index, "new_text": _Tokenizer().decode(ids), "new_token_ids": ids,
            "finish_reason": "length" if finished else None, "stop_reason": None, "num_tokens": 0,
            "new_logprobs": [{"token_id": i, "logprob": -0.5, "top": {i: -0.5}} for i in ids]}


def _item(ids: list[int], finished: bool = False) -> dict:
    return {"type": "step", "finished": finished, "choices": [_choice(ids, finished)]}


def _without_role_chunks(chunks: list[dict]) -> list[dict]:
    return [c for c in chunks if "role" not in c["choices"][0].get("delta", {})]


def test_a_chat_choice_announces_its_role_in_a_first_chunk_of_its_own():
    """As OpenAI and vLLM stream it: ``{"role": "assistant", "content": ""}`` first, then content
    deltas without the role (a new user found the role and the first text in one chunk)."""
    builder = ResponseBuilder("chat", "m", "chatcmpl-1", 2, _Tokenizer(), want_logprobs=False)
    chunks = builder.add({"type": "step", "finished": False, "choices": [_choice([0], index=0), _choice([1], index=1)]})
    chunks += builder.add({"type": "step", "finished": True, "choices": [_choice([2], True, 0), _choice([3], True, 1)]})
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas == [(0, {"role": "assistant", "content": ""}, None), (0, {"content": "a"}, None),
                      (1, {"role": "assistant", "content": ""}, None), (1, {"content": "b"}, None),
                      (0, {"content": "c"}, "length"), (1, {"content": "d"}, "length")]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)


def test_text_offsets_are_running_character_offsets_in_streams_and_final_bodies():
    builder = ResponseBuilder("completion", "m", "cmpl-1", 1, _Tokenizer(), want_logprobs=True)
    chunks = builder.add(_item([0, 26])) + builder.add(_item([1, 2], finished=True))
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0, 1], [3, 4]]
    final = builder.final()["choices"][0]
    assert final["text"] == "axybc"
    assert final["logprobs"]["tokens"] == ["a", "xy", "b", "c"]
    assert final["logprobs"]["text_offset"] == [0, 1, 3, 4]


def test_streamed_text_offsets_go_on_from_the_tokens_while_a_stop_strings_partial_match_holds_text_back():
    """The engine holds back text that may begin a stop string while its tokens already go out:
    step 2 has tokens b, xy but only the text b; step 3 releases xy with c. The streamed offsets
    are the final body's, not offsets into the text streamed so far (which gave [1, 2] and [2])."""
    builder = ResponseBuilder("completion", "m", "cmpl-4", 1, _Tokenizer(), want_logprobs=True)
    held, released = _item([1, 26]), _item([2], finished=True)
    held["choices"][0]["new_text"], released["choices"][0]["new_text"] = "b", "xyc"
    chunks = builder.add(_item([0])) + builder.add(held) + builder.add(released)
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1, 2], [4]]
    final = builder.final()["choices"][0]
    assert (final["text"], final["logprobs"]["text_offset"]) == ("abxyc", [0, 1, 2, 4])


def test_a_finished_choice_of_an_n_stream_gets_one_finish_chunk_while_the_others_go_on():
    """The engine reports every choice each step, finished ones again with no tokens: choice 0
    finishes in step 1, choice 1 in step 3."""
    for kind in ("completion", "chat"):
        builder = ResponseBuilder(kind, "m", "cmpl-2", 2, _Tokenizer(), want_logprobs=False)
        steps = [[_choice([0], True, 0), _choice([1], False, 1)],
                 [_choice([], True, 0), _choice([2], False, 1)],
                 [_choice([], True, 0), _choice([3], True, 1)]]
        chunks = [c for i, choices in enumerate(steps)
                  for c in _without_role_chunks(builder.add({"type": "step", "finished": i == 2, "choices": choices}))]
        seen = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks]
        assert seen == [(0, "length"), (1, None), (1, None), (1, "length")], kind
        assert [c["finish_reason"] for c in builder.final()["choices"]] == ["length", "length"]


def test_stop_reason_is_reported_as_vllm_does_streamed_and_final():
    """vLLM's stop_reason: the stop string (or stop token id) that ended a choice, in its finish
    chunk and the final body; None while it runs and for EOS or length."""
    for kind in ("completion", "chat"):
        builder = ResponseBuilder(kind, "m", "cmpl-3", 2, _Tokenizer(), want_logprobs=False)
        running, stopped, eos = _choice([0], False, 0), _choice([1], True, 1), _choice([2], True, 0)
        stopped.update(finish_reason="stop", stop_reason="\n\n")
        eos.update(finish_reason="stop", stop_reason=None)
        chunks = _without_role_chunks(builder.add({"type": "step", "finished": False, "choices": [running, stopped]}))
        again = {**stopped, "new_token_ids": [], "new_text": "", "new_logprobs": []}  # finished: repeated, no tokens
        chunks += _without_role_chunks(builder.add({"type": "step", "finished": True, "choices": [eos, again]}))
        seen = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"])
                for c in chunks]
        assert seen == [(0, None, None), (1, "stop", "\n\n"), (0, "stop", None)], kind
        assert [(c["finish_reason"], c["stop_reason"]) for c in builder.final()["choices"]] == \
            [("stop", None), ("stop", "\n\n")], kind


def test_logprob_tokens_show_special_tokens_by_name():
    """The end-of-text token's logprob entry reads ``<|endoftext|>`` (vLLM), not an empty string
    that a real empty token or another special token would collide with."""
    from pathlib import Path

    from actors.responses import chat_logprobs, completion_logprobs
    from engine.loader import load_tokenizer
    from tests.actors.conftest import TARGET

    tokenizer, _ = load_tokenizer(Path(TARGET))
    eos = tokenizer.token_to_id("<|endoftext|>")
    newline = tokenizer.encode("\n").ids[-1]
    items = [{"token_id": eos, "logprob": -4.0, "top": {newline: -0.5, eos: -4.0}}]
    legacy, _ = completion_logprobs(items, tokenizer)
    assert legacy["tokens"] == ["<|endoftext|>"]
    assert legacy["top_logprobs"] == [{"\n": -0.5, "<|endoftext|>": -4.0}]
    chat = chat_logprobs(items, tokenizer)["content"][0]
    assert chat["token"] == "<|endoftext|>" and chat["bytes"] == list(b"<|endoftext|>")


def test_tokens_that_are_parts_of_a_character_keep_their_own_bytes_and_names():
    """Found by a client trial: such tokens all decode to U+FFFD, so chat ``bytes`` were
    EF BF BD for every one (a split character could not be put together again) and the completions
    ``top_logprobs``, keyed by name, kept one of five alternatives, with the least likely value."""
    from pathlib import Path

    from actors.responses import chat_logprobs, completion_logprobs
    from engine.loader import load_tokenizer
    from tests.actors.conftest import TARGET

    tokenizer, _ = load_tokenizer(Path(TARGET))
    text = "é中😀 ü"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text)  # characters split over several tokens
    top = {t: -1.0 - j for j, t in enumerate(ids[:5])}
    items = [{"token_id": t, "logprob": -0.5, "top": top} for t in ids]
    chat = chat_logprobs(items, tokenizer)["content"]
    assert b"".join(bytes(c["bytes"]) for c in chat).decode() == text
    assert [a["bytes"] for a in chat[0]["top_logprobs"]] == [list(bytes(c["bytes"])) for c in chat[:5]]
    assert chat[0]["token"] == "bytes:\\xc3" and chat[-1]["token"] == "bytes:\\xbc"
    assert [c["token"] for c in chat if not c["token"].startswith("bytes:")] == [" "]
    legacy, end = completion_logprobs(items, tokenizer, initial_offset=7)
    assert len(legacy["top_logprobs"][0]) == len(set(ids[:5]))  # five alternatives, five entries
    assert legacy["tokens"] == [c["token"] for c in chat]
    # text offsets still count each token's decoded text (one U+FFFD for a part), as vLLM does
    assert legacy["text_offset"] == list(range(7, 7 + len(ids))) and end == 7 + len(ids)
