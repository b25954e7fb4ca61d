"""Batched prompts in POST /v1/completions (a list of strings or of token-id lists), as OpenAI and
vLLM take them: each prompt its own engine request, choices indexed ``prompt * n + j``, usage
summed; streamed chunks interleaved, each with its choice index. The ingress over an in-process
EngineLoop (no Ray), compared with the same ingress answering each prompt alone."""

import asyncio
import json

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request

from actors.config import ServeConfig
from actors.ingress import IngressServer
from actors.stream_items import error_item, unavailable_item
from engine.args import EngineArgs
from engine.llm import build_engine
from engine.request_ranges import RequestError
from tests.actors.conftest import DRAFT, MODEL_NAME, TARGET
from tests.actors.test_ingress_failures import FakeStream, FakeVerifier, _step
from tests.helpers.local_verifier import LocalVerifier

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n"]
TOKEN_PROMPTS = [[100, 5, 17, 42, 9], [7, 300, 12], [64, 65, 66, 67]]  # a batch of token-id lists
GREEDY = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _app(verifier) -> tuple[IngressServer, FastAPI]:
    engine = {"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 3}
    server = IngressServer(msgspec.convert({"model_name": MODEL_NAME, "engine": engine}, ServeConfig), verifier)
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    return server, app


@pytest.fixture(scope="module")
def engine():
    return build_engine(msgspec.convert({"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 3},
                                        EngineArgs))


@pytest.fixture
def local(engine) -> tuple[IngressServer, FastAPI, LocalVerifier]:
    verifier = LocalVerifier(engine)
    return (*_app(verifier), verifier)


def _post(app: FastAPI, *bodies: dict) -> list[httpx.Response]:
    """The requests, one after the other, in one event loop."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.post("/v1/completions", json=body, timeout=120) for body in bodies]

    return asyncio.run(run())


def _events(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS], ids=["strings", "token_ids"])
def test_a_batch_answers_each_prompt_as_alone_with_choices_indexed_prompt_times_n_plus_j(local, prompts):
    server, app, verifier = local
    alone = _post(app, *({**GREEDY, "prompt": p} for p in prompts))
    assert [r.status_code for r in alone] == [200] * 3
    verifier.calls.clear()
    batch, = _post(app, {**GREEDY, "prompt": prompts, "n": 2})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3, 4, 5]
    want = [r.json()["choices"][0]["text"] for r in alone]
    assert all(want) and len(set(want)) == 3  # three different real texts
    assert [c["text"] for c in body["choices"]] == [want[0], want[0], want[1], want[1], want[2], want[2]]
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 6
    usage = [r.json()["usage"] for r in alone]
    prompt_tokens = sum(u["prompt_tokens"] for u in usage)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3 * 2 * 6,
                             "total_tokens": prompt_tokens + 36}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    # one engine request per prompt, each with the request's n and its own request id
    assert [c[1]["n"] for c in verifier.calls] == [2, 2, 2]
    if prompts is TOKEN_PROMPTS:  # token ids go as they are, with no text
        assert [(c[0], c[2]) for c in verifier.calls] == [(p, None) for p in prompts]
    else:
        assert [c[2] for c in verifier.calls] == prompts
    assert [c[3] for c in verifier.calls] == [f"{body['id']}-{i}" for i in range(3)]
    # each prompt is an engine request in the metrics too (vLLM counts them so)
    finished = server.metrics.registry.get_sample_value(
        "specmoe:request_success_total", {"model_name": MODEL_NAME, "finished_reason": "length"})
    assert finished == 3 + 3


@pytest.mark.timeout(300)
def test_a_streamed_batch_interleaves_its_prompts_chunks_and_sends_one_usage_chunk(local):
    _, app, _ = local
    body = {**GREEDY, "prompt": PROMPTS[:2], "n": 2, "seed": 1}
    whole, streamed = _post(app, body, {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks, (usage_chunk,) = events[:-2], events[-2:-1]
    assert all(len(c["choices"]) == 1 for c in chunks) and usage_chunk["choices"] == []
    texts = {}
    for c in chunks:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {c["index"]: c["text"] for c in whole.json()["choices"]}
    assert usage_chunk["usage"] == whole.json()["usage"]
    order = [c["choices"][0]["index"] // 2 for c in chunks]  # each chunk's prompt
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), order  # prompt 1 before prompt 0 ended
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 4  # each choice finishes once


def test_a_prompt_too_long_fails_the_whole_batch_before_anything_is_submitted(local):
    _, app, verifier = local
    too_long = [5] * 1020
    r, = _post(app, {**GREEDY, "prompt": [[7, 8], [9], too_long]})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "prompt[2]: prompt (1020 tokens) + max_tokens (6) exceeds the context window of 1024 tokens",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}
    r, = _post(app, {**GREEDY, "prompt": [[5, 6], [5, 70000]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert r.json()["error"]["message"].startswith("prompt[1]: prompt token ids [70000] are outside")
    r, = _post(app, {**GREEDY, "prompt": ["import os\n", {"a": 1}]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt[1]")
    assert verifier.calls == []


@pytest.mark.timeout(60)
def test_one_prompt_refused_by_the_verifier_fails_the_whole_request_and_cancels_the_others():
    verifier = FakeVerifier()
    refusal = RequestError("'slo_class' must be one of ['batch'], got 'gold'", param="slo_class")
    admitted = FakeStream([{"type": "accepted"}, _step("a")], then="hang")
    verifier.streams = [admitted, FakeStream([error_item(refusal)])]
    _, app = _app(verifier)
    r, = _post(app, {**GREEDY, "prompt": ["a", "b"], "stream": True})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": str(refusal), "type": "invalid_request_error", "param": "slo_class",
                                 "code": None}
    assert admitted.cancelled and len(verifier.calls) == 2


@pytest.mark.timeout(60)
def test_a_prompt_failing_mid_stream_ends_the_batch_in_band_and_cancels_the_others():
    verifier = FakeVerifier()
    going_on = FakeStream([{"type": "accepted"}, _step("a")], then="hang")
    failing = FakeStream([{"type": "accepted"}, _step("b"), unavailable_item("shutting down")], delay_s=0.05)
    verifier.streams = [going_on, failing]
    _, app = _app(verifier)
    r, = _post(app, {**GREEDY, "prompt": ["a", "b"], "stream": True})
    events = _events(r.text)
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-2]] == [(0, "a"), (1, "b")]
    assert events[-2]["error"] == {"message": "shutting down", "type": "server_overloaded", "param": None,
                                   "code": 503}
    assert events[-1] == "[DONE]" and going_on.cancelled and failing.cancelled


@pytest.mark.timeout(60)
def test_a_batch_past_its_timeout_gets_504_and_every_prompt_is_cancelled():
    verifier = FakeVerifier()
    done = FakeStream([{"type": "accepted"}, _step("a", finish="length")])
    stalled = FakeStream([{"type": "accepted"}, _step("b")], then="hang")
    verifier.streams = [done, stalled]
    config = msgspec.convert({"model_name": MODEL_NAME, "engine": {"model": TARGET, "draft_model": DRAFT},
                              "request_timeout_s": 0.5}, ServeConfig)
    server = IngressServer(config, verifier)
    app = FastAPI()
    app.post("/v1/completions")(server.completions)
    r, = _post(app, {**GREEDY, "prompt": ["a", "b"]})
    assert r.status_code == 504 and "request_timeout_s = 0.5 s" in r.json()["error"]["message"]
    assert done.cancelled and stalled.cancelled


@pytest.mark.timeout(60)
def test_a_batch_larger_than_the_server_can_hold_is_a_400_before_anything_is_tokenized_or_submitted():
    verifier = FakeVerifier()
    engine = {"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 3,
              "scheduler": {"max_num_seqs": 2, "max_waiting": 3}}
    server = IngressServer(msgspec.convert({"model_name": MODEL_NAME, "engine": engine}, ServeConfig), verifier)
    app = FastAPI()
    app.post("/v1/completions")(server.completions)
    r_batch, r_n = _post(app, {**GREEDY, "prompt": ["a", "b", "c"], "n": 2}, {**GREEDY, "prompt": "a", "n": 6})
    assert (r_batch.status_code, r_batch.json()["error"]["param"]) == (400, "prompt")
    assert r_batch.json()["error"]["message"].startswith(
        "3 prompts x n = 2 is 6 sequences, more than the 5 the server can hold at once")
    assert (r_n.status_code, r_n.json()["error"]["param"]) == (400, "n")
    assert r_n.json()["error"]["message"].startswith("n = 6 is 6 sequences, more than the 5")
    assert verifier.calls == []


@pytest.mark.timeout(60)
def test_a_one_prompt_batch_names_its_element_as_longer_batches_do():
    """``["..."]`` and ``[[ids]]`` are batches: a bad element is ``prompt[0]`` (the message starting
    ``prompt[0]: ``), as element 1 of a longer batch is ``prompt[1]``; a plain prompt stays ``prompt``."""
    verifier = FakeVerifier()
    _, app = _app(verifier)
    chars, vocab, window, plain_vocab = _post(app, *({**GREEDY, "prompt": p} for p in (
        ["x" * 20000], [[1, 70000]], [[5] * 1020], [1, 70000])))
    assert (chars.status_code, chars.json()["error"]) == (400, {
        "message": "prompt[0]: the prompt has 10000 tokens; this model's context window is 1024 tokens",
        "type": "invalid_request_error", "param": "prompt[0]", "code": "context_length_exceeded"})
    assert (vocab.status_code, vocab.json()["error"]["param"]) == (400, "prompt[0]")
    assert vocab.json()["error"]["message"] == "prompt[0]: prompt token ids [70000] are outside the vocabulary [0, 4096)"
    assert (window.status_code, window.json()["error"]["param"]) == (400, "max_tokens")
    assert window.json()["error"]["message"].startswith("prompt[0]: prompt (1020 tokens) + max_tokens (6) exceeds")
    assert (plain_vocab.status_code, plain_vocab.json()["error"]) == (400, {
        "message": "prompt token ids [70000] are outside the vocabulary [0, 4096)",
        "type": "invalid_request_error", "param": "prompt", "code": None})
    assert verifier.calls == []


@pytest.mark.timeout(60)
def test_a_batch_mixing_strings_and_token_id_lists_is_a_400_naming_prompt():
    """vLLM takes a list of strings or a list of token-id lists, never both in one batch."""
    verifier = FakeVerifier()
    _, app = _app(verifier)
    responses = _post(app, *({**GREEDY, "prompt": p} for p in (["ok", [1, 2]], [[1, 2], "ok", "no"])))
    for r in responses:
        assert (r.status_code, r.json()["error"]) == (400, {
            "message": "'prompt' must be a list of strings or a list of token-id lists, not a mix of both",
            "type": "invalid_request_error", "param": "prompt", "code": None})
    assert verifier.calls == []
