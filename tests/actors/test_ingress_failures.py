"""The ingress's answers when the verifier is slow, gone or shutting down (a test double, no Ray):
504 past request_timeout_s, 503 + Retry-After (never 500) while the verifier is gone, in-band
error chunks for streams already started."""

import asyncio
import json
import time

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request
from ray.exceptions import ActorDiedError

from actors.config import ServeConfig
from actors.ingress import IngressServer
from actors.stream_items import error_item, unavailable_item
from engine.errors import QueueFull
from engine.request_ranges import RequestError
from engine.slo import DeadlineUnattainable
from tests.actors.conftest import DRAFT, MODEL_NAME, TARGET

BODY = {"model": MODEL_NAME, "prompt": "import os\n", "max_tokens": 8}


def _step(text: str, token: int = 5, num_tokens: int = 1, finish: str | None = None) -> dict:
    item = {"type": "step", "finished": finish is not None, "choices": [
        {"index": 0, "new_text": text, "new_token_ids": [token], "finish_reason": finish, "stop_reason": None,
         "new_logprobs": None, "num_tokens": num_tokens}]}
    if finish:
        item["usage"] = {"prompt_tokens": 99, "completion_tokens": num_tokens}
    return item


class FakeStream:
    """A verifier stream: ``items`` (each after ``delay_s``), then ``then``: None (end), "hang" or
    an exception to raise."""

    def __init__(self, items: list[dict], delay_s: float = 0.0, then=None) -> None:
        self.items, self.delay_s, self.then = list(items), delay_s, then
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.items:
            await asyncio.sleep(self.delay_s)
            return self.items.pop(0)
        if self.then == "hang":
            await asyncio.sleep(3600)
        if isinstance(self.then, BaseException):
            raise self.then
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeVerifier:
    """``generate.remote`` returns the next scripted stream (recording its arguments), else one that
    never answers (a Serve handle queues requests while no replica is up); ``stats.remote`` fails
    while ``down``."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.calls: list[tuple] = []
        self.down = self.starting = False
        self.generate = type("G", (), {"remote": lambda _, *a: self._generate(a)})()
        self.stats = type("S", (), {"remote": lambda _: self._stats()})()

    def _generate(self, args: tuple) -> FakeStream:
        self.calls.append(args)
        return self.streams.pop(0) if self.streams else FakeStream([], then="hang")

    async def _stats(self) -> dict:
        if self.down:
            raise ActorDiedError()
        if self.starting:  # no replica yet: Serve's handle queues the call
            await asyncio.Event().wait()
        return {}


def _server(verifier: FakeVerifier, request_timeout_s: float = 600.0) -> IngressServer:
    config = msgspec.convert({"model_name": MODEL_NAME, "engine": {"model": TARGET, "draft_model": DRAFT},
                              "request_timeout_s": request_timeout_s}, ServeConfig)
    server = IngressServer(config, verifier)
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    app.get("/health")(server.health)
    return server, app


def _run(app: FastAPI, requests: list[dict]) -> list[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            out = []
            for body in requests:
                out.append(await client.post("/v1/completions", json=body))
            return out
    return asyncio.run(go())


def _sse_events(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.timeout(60)
def test_a_request_the_verifier_refuses_gets_400_naming_the_field():
    # e.g. an unknown slo_class: only the verifier's scheduler knows the classes
    verifier = FakeVerifier()
    refusal = RequestError("'slo_class' must be one of ['batch'], got 'gold'", param="slo_class")
    verifier.streams = [FakeStream([error_item(refusal)]), FakeStream([error_item(refusal)])]
    _, app = _server(verifier)
    for r in _run(app, [BODY, {**BODY, "stream": True}]):
        assert r.status_code == 400
        assert r.json()["error"] == {"message": str(refusal), "type": "invalid_request_error", "param": "slo_class",
                                     "code": None}


@pytest.mark.timeout(60)
def test_request_past_its_timeout_gets_504_and_its_stream_is_cancelled():
    verifier = FakeVerifier()
    stalled = FakeStream([{"type": "accepted"}, _step("a")], then="hang")
    stalled_sse = FakeStream([{"type": "accepted"}, _step("a")], then="hang")
    verifier.streams = [stalled, stalled_sse]
    _, app = _server(verifier, request_timeout_s=0.5)
    plain, streamed = _run(app, [BODY, {**BODY, "stream": True}])
    assert plain.status_code == 504
    assert plain.json()["error"]["type"] == "timeout" and "0.5 s" in plain.json()["error"]["message"]
    assert stalled.cancelled  # the verifier aborts the request: its KV slots are freed
    events = _sse_events(streamed.text)
    assert streamed.status_code == 200 and events[0]["choices"][0]["text"] == "a"
    assert "usage" not in events[0]  # no stream_options.include_usage: no usage field (OpenAI's)
    assert events[-2]["error"]["code"] == 504 and events[-1] == "[DONE]"
    assert stalled_sse.cancelled


@pytest.mark.timeout(60)
def test_a_dead_verifier_gives_503_with_retry_after_until_it_is_back():
    verifier = FakeVerifier()
    dies_before = FakeStream([], then=ActorDiedError())
    dies_during = FakeStream([{"type": "accepted"}, _step("a")], then=ActorDiedError())
    verifier.streams = [dies_before]  # its resubmission waits for a replica: none comes (single replica)
    server, app = _server(verifier)
    verifier.down = True

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            first = await client.post("/v1/completions", json=BODY)
            while_down = await client.post("/v1/completions", json=BODY)
            health_down = await client.get("/health")
            verifier.down = False
            for _ in range(100):  # the probe asks every 0.5 s
                if server._probe is None:
                    break
                await asyncio.sleep(0.05)
            verifier.streams = [dies_during]
            streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
            return first, while_down, health_down, streamed

    first, while_down, health_down, streamed = asyncio.run(go())
    assert (first.status_code, first.headers["retry-after"]) == (503, "5")
    assert first.json()["error"]["type"] == "server_overloaded" and "ActorDiedError" in first.json()["error"]["message"]
    assert (while_down.status_code, while_down.headers["retry-after"]) == (503, "5")
    assert health_down.status_code == 503
    assert len(verifier.calls) == 4  # each failed request tried one resubmission, never accepted
    events = _sse_events(streamed.text)
    assert events[-2]["error"]["code"] == 503 and events[-1] == "[DONE]"


@pytest.mark.timeout(60)
def test_health_answers_503_promptly_while_the_verifier_is_starting(monkeypatch):
    """A new user's `curl -m 2 /health` during start-up hung: the ingress waited on the verifier for
    up to its start timeout (300 s). It answers 503 + Retry-After after HEALTH_TIMEOUT_S, then 200."""
    from actors import ingress

    monkeypatch.setattr(ingress, "HEALTH_TIMEOUT_S", 0.2)
    verifier = FakeVerifier()
    verifier.starting = True
    _, app = _server(verifier)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            t0 = time.monotonic()
            starting = await client.get("/health")
            waited_s = time.monotonic() - t0
            verifier.starting = False
            return starting, waited_s, await client.get("/health")

    starting, waited_s, ready = asyncio.run(go())
    assert (starting.status_code, starting.headers["retry-after"]) == (503, "5") and 0.2 <= waited_s < 2
    assert "not answering within 0.2 s" in starting.json()["error"]["message"]
    assert ready.status_code == 200


@pytest.mark.timeout(60)
def test_a_verifier_refusal_is_a_503_whose_code_and_metric_say_why():
    verifier = FakeVerifier()
    refusals = [QueueFull("the waiting queue is full"), DeadlineUnattainable("the TTFT budget cannot be met")]
    verifier.streams = [FakeStream([error_item(e)]) for e in refusals] + [FakeStream([unavailable_item("stopping")])]
    server, app = _server(verifier)
    responses = [_run(app, [BODY])[0] for _ in range(3)]
    assert [(r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) for r in responses] == [
        (503, "1", "queue_full"), (503, "1", "ttft_unattainable"), (503, "1", None)]
    counts = {reason: server.metrics.registry.get_sample_value(
        "specmoe:request_refused_total", {"model_name": MODEL_NAME, "reason": reason})
        for reason in ("queue_full", "ttft_unattainable", "unavailable")}
    assert counts == {"queue_full": 1, "ttft_unattainable": 1, "unavailable": 1}


@pytest.mark.timeout(60)
def test_a_client_leaving_before_its_first_token_is_counted_as_an_aborted_request():
    """Found by a client trial: requests whose client left before the verifier's first items (a
    long prompt still queued or prefilling) were in no metric at all."""
    verifier = FakeVerifier()
    queued = FakeStream([], then="hang")  # never admitted while the client waits
    verifier.streams = [queued]
    server, app = _server(verifier)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            request = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": True}))
            while not verifier.calls:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            request.cancel()  # the client disconnects
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(go())
    assert queued.cancelled  # the verifier aborts it
    count = server.metrics.registry.get_sample_value(
        "specmoe:request_success_total", {"model_name": MODEL_NAME, "finished_reason": "abort"})
    assert count == 1


@pytest.mark.timeout(60)
def test_a_draining_verifier_ends_streams_with_503_chunks_and_refuses_with_503():
    verifier = FakeVerifier()
    verifier.streams = [FakeStream([{"type": "accepted"}, _step("a"), unavailable_item("shutting down")]),
                        FakeStream([unavailable_item("shutting down")])]
    _, app = _server(verifier)
    streamed, refused = _run(app, [{**BODY, "stream": True}, BODY])
    events = _sse_events(streamed.text)
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["a"]
    assert events[-2]["error"] == {"message": "shutting down", "type": "server_overloaded", "param": None,
                                   "code": 503}
    assert events[-1] == "[DONE]"
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")


@pytest.mark.timeout(60)
def test_a_replica_dying_mid_stream_fails_over_with_prompt_plus_emitted_tokens():
    verifier = FakeVerifier()
    dies = FakeStream([{"type": "accepted"}, _step("a", 11), _step("b", 12, 2)], then=ActorDiedError())
    survivor = FakeStream([{"type": "accepted"}, _step("c", 13, 1), _step("d", 14, 2, finish="length")])
    verifier.streams = [dies, survivor]
    server, app = _server(verifier)
    body = {**BODY, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    (streamed,) = _run(app, [body])
    events = _sse_events(streamed.text)
    texts = [e["choices"][0]["text"] for e in events if e != "[DONE]" and e.get("choices")]
    assert texts == ["a", "b", "c", "d"] and events[-1] == "[DONE]"  # no duplicate, no gap
    assert events[-2]["usage"]["completion_tokens"] == 4
    assert all("usage" in e and e["usage"] is None for e in events[:-2])  # OpenAI's null before the last
    assert events[-2]["usage"]["prompt_tokens"] == len(verifier.calls[0][0])
    (ids, params, text, *_), (ids2, params2, text2, *_) = verifier.calls
    assert ids2 == ids + [11, 12] and params2["max_tokens"] == 2 and params["max_tokens"] == 4
    assert text is not None and text2 is None
    assert dies.cancelled and server._probe is None  # failed over: nothing marks the verifier gone


@pytest.mark.timeout(120)
def test_health_answers_while_a_long_prompt_is_tokenised():
    """A new user's 3.8 MB prompt (under the 4 MB body limit) held the ingress's event loop for its
    2.9 s of tokenising (``Tokenizer.encode`` keeps the GIL), and `/health` waited behind it. (Such a
    prompt is now refused before tokenising: the bound is switched off here, as for a tokenizer
    that allows none.)"""
    server, app = _server(FakeVerifier())
    server.max_chars_per_token = None
    prompt = "def f(x):\n    return x * 2  # double\n" * 80_000  # ~3 MB, far past the context window

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            t0 = time.monotonic()
            long = asyncio.create_task(client.post("/v1/completions", json={**BODY, "prompt": prompt}))
            health_s = []
            while not long.done():
                t = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health_s.append(time.monotonic() - t)
                await asyncio.sleep(0.05)
            return await long, time.monotonic() - t0, health_s

    refused, long_s, health_s = asyncio.run(go())
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert long_s > 0.5 and len(health_s) >= 3, "the prompt was tokenised too fast to overlap the probes"
    assert max(health_s) < long_s / 4, (max(health_s), long_s)


def test_the_context_window_error_says_when_max_tokens_is_the_default():
    _, app = _server(FakeVerifier())
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    unset, explicit = _run(app, [{**body, "prompt": [5] * 1015}, {**BODY, "prompt": [5] * 1015, "max_tokens": 16}])
    assert unset.status_code == explicit.status_code == 400
    assert unset.json()["error"]["message"] == ("prompt (1015 tokens) + max_tokens (16, the default when the "
                                                "request sets none) exceeds the context window of 1024 tokens")
    assert explicit.json()["error"]["message"] == ("prompt (1015 tokens) + max_tokens (16) exceeds the context "
                                                   "window of 1024 tokens")
    assert unset.json()["error"]["param"] == "max_tokens"


def test_a_prompt_too_long_for_any_tokenisation_is_refused_before_tokenising(monkeypatch):
    from actors import ingress

    def no_tokenising(*_):
        raise AssertionError("tokenised")

    server, app = _server(FakeVerifier())
    monkeypatch.setattr(ingress, "encode_text", no_tokenising)
    chars = server.max_chars_per_token * server.max_model_len  # at least max_model_len tokens
    (refused,) = _run(app, [{**BODY, "prompt": "x" * chars}])
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": f"the prompt has at least 1024 tokens ({chars} characters); this model's context window is "
                   "1024 tokens", "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}


def test_a_choice_the_engine_failed_is_a_500_and_in_a_stream_an_error_chunk_after_it():
    # The engine fails a sequence it cannot go on with (a step that sampled no token): the item
    # ends with finish_reason "error". A non-streamed request was a 500 already; a stream ended
    # with that chunk and [DONE], no error object for the client to read.
    verifier = FakeVerifier()
    failed = [{"type": "accepted"}, _step("x", finish="error")]
    verifier.streams = [FakeStream(list(failed)), FakeStream(list(failed))]
    _, app = _server(verifier)
    plain, streamed = _run(app, [BODY, dict(BODY, stream=True)])
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "internal_error"
    assert plain.json()["error"]["message"].startswith("the engine failed this request")
    assert streamed.status_code == 200
    events = _sse_events(streamed.text)
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "error"
    assert events[-2]["error"]["type"] == "internal_error"
    assert "the engine failed this request" in events[-2]["error"]["message"]
