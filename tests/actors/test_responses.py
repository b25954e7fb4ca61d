"""Completion logprobs carry OpenAI's text_offset, streamed or not."""

from actors.responses import ResponseBuilder


class _Tokenizer:
    """Token id -> text: ids 0..25 are letters, 26 is two characters."""

    def decode(self, ids: list[int]) -> str:
        return "".join("xy" if i == 26 else chr(ord("a") + i) for i in ids)


def _item(ids: list[int], finished: bool = False) -> dict:
    return {"type": "step", "finished": finished, "choices": [{
        "index": 0, "new_text": _Tokenizer().decode(ids), "new_token_ids": ids,
        "finish_reason": "length" if finished else None, "stop_reason": None, "num_tokens": 0,
        "new_logprobs": [{"token_id": i, "logprob": -0.5, "top": {i: -0.5}} for i in ids]}]}


def test_text_offsets_are_running_character_offsets_in_streams_and_final_bodies():
    builder = ResponseBuilder("completion", "m", "cmpl-1", 1, _Tokenizer(), want_logprobs=True)
    chunks = builder.add(_item([0, 26])) + builder.add(_item([1, 2], finished=True))
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0, 1], [3, 4]]
    final = builder.final()["choices"][0]
    assert final["text"] == "axybc"
    assert final["logprobs"]["tokens"] == ["a", "xy", "b", "c"]
    assert final["logprobs"]["text_offset"] == [0, 1, 3, 4]
