"""Completion logprobs streamed and not: the same tokens at the same ``text_offset`` values, also
when a stop string's partial match holds text back mid-stream. The ingress over an in-process
EngineLoop (no Ray)."""

import msgspec
import pytest

from engine.args import EngineArgs
from engine.llm import build_engine
from tests.actors.conftest import DRAFT, TARGET
from tests.actors.test_ingress_batched import GREEDY, _app, _events, _post
from tests.helpers.local_verifier import LocalVerifier


@pytest.fixture(scope="module")
def app():
    engine = build_engine(msgspec.convert({"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 3},
                                          EngineArgs))
    return _app(LocalVerifier(engine))[1]


@pytest.mark.timeout(300)
def test_streamed_text_offsets_equal_the_non_streamed_ones_when_a_stop_string_holds_text_back(app):
    """Greedy ``def fibonacci(n):`` writes ``... a string of a string.\\n\\n    The string is a string,
    ...``: the stop string ``string,`` partially matches each ``string`` (held back until the next
    token does not continue it) and matches at the third."""
    body = {**GREEDY, "prompt": "def fibonacci(n):", "max_tokens": 24, "logprobs": 0, "stop": ["string,"]}
    whole, streamed = _post(app, body, {**body, "stream": True})
    final = whole.json()["choices"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", "string,")
    assert final["text"] == '\n    """Return a string of a string.\n\n    The string is a '
    chunks = [e["choices"][0] for e in _events(streamed.text)[:-1]]
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == final["logprobs"]["tokens"]
    # text was held back: some chunk's text is shorter than its tokens' (the case under test)
    assert any(len(c["text"]) < len("".join(c["logprobs"]["tokens"])) for c in chunks)
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == final["logprobs"]["text_offset"]
    assert final["logprobs"]["text_offset"] == [0, 4, 8, 14, 16, 23, 26, 28, 35, 36, 41, 45, 52, 55, 57, 64]
