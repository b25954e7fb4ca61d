"""Serving benchmark load generator and client: dataset sampling, request bodies, SSE parsing,
failure reasons, Poisson arrivals and time limits (against the scripted stub where timing matters)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.serving.client import RequestOptions, build_payload, chunk_text, error_reason, sse_data
from benchmarks.serving.dataset import Prompt, load_prompts, sample_prompts
from benchmarks.serving.loadgen import LoadShape, poisson_arrival_offsets_s
from tests.benchmarks.helpers import TOL_S, assert_client_saw, run, served, write_prompts

# ---------------------------------------------------------------------------------------------
# Dataset, payloads, SSE parsing, arrivals
# ---------------------------------------------------------------------------------------------


def test_dataset_loading_override_and_deterministic_sampling(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", ["alpha", "beta", "gamma"], max_tokens=16)
    rows = load_prompts(path)
    assert [(p.id, p.prompt, p.max_tokens, p.num_prompt_tokens) for p in rows] == [
        ("alpha-0", "alpha", 16, 11),
        ("beta-1", "beta", 17, 7),
        ("gamma-2", "gamma", 18, 5),
    ]
    assert {p.max_tokens for p in load_prompts(path, max_tokens_override=64)} == {64}
    picked = sample_prompts(rows, 7, seed=3)
    assert picked == sample_prompts(rows, 7, seed=3)
    assert sorted(p.id for p in picked[:3]) == sorted(p.id for p in rows)  # all used before repeats
    assert sample_prompts(rows, 4, seed=None) == rows + rows[:1]


def test_payloads():
    prompt = Prompt("p", "hello", max_tokens=32)
    path, body = build_payload(prompt, RequestOptions())
    assert path == "/v1/completions"
    assert body == {
        "prompt": "hello",
        "max_tokens": 32,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    path, body = build_payload(
        prompt, RequestOptions(endpoint="chat", model="m", ignore_eos=True, temperature=0.7)
    )
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert (body["model"], body["ignore_eos"], body["temperature"]) == ("m", True, 0.7)


def test_sse_and_error_parsing():
    assert sse_data("data: [DONE]") == "[DONE]"
    assert sse_data('data:{"a":1}') == '{"a":1}'
    assert sse_data(": keep-alive") is None and sse_data("") is None
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert error_reason(400, b'{"error": {"message": "too long", "code": 400}}') == "HTTP 400: too long"
    assert error_reason(503, b"overloaded") == "HTTP 503: overloaded"


def test_poisson_arrivals_seeded():
    offsets = poisson_arrival_offsets_s(20000, rate_per_s=4.0, seed=1)
    assert offsets[0] == 0.0 and offsets == poisson_arrival_offsets_s(20000, 4.0, seed=1)
    assert offsets != poisson_arrival_offsets_s(20000, 4.0, seed=2)
    gaps = np.diff(offsets)
    assert (gaps > 0).all()
    assert abs(gaps.mean() - 0.25) < 0.01  # mean gap 1/rate (std error ~0.0018 at n=20000)
    assert abs(gaps.std() - 0.25) < 0.01  # exponential: std == mean


def test_chat_role_chunk_is_not_the_first_token(stub):
    result = run(stub, ["beta"], LoadShape(concurrency=1), endpoint="chat", ignore_eos=True)
    (r,) = result.results
    assert r.success and r.output_tokens == 3
    assert len(r.chunk_offsets_s) == 3
    assert_client_saw(r, served(stub, "beta"))
    assert stub.config.requests[0]["messages"] == [{"role": "user", "content": "beta"}]
    assert stub.config.requests[0]["ignore_eos"] is True


def test_failure_reasons_stream_error_malformed_truncation_timeout(stub):
    keys = ["broken", "garbage", "truncated", "stall", "gamma"]
    result = run(stub, keys, LoadShape(concurrency=5), request_timeout_s=0.4)
    errors = {r.prompt_id: r.error for r in result.results}
    assert errors == {
        "broken": "stream error: scripted mid-stream failure",
        "garbage": "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        "truncated": "stream ended without [DONE]",
        "stall": "timeout after 0.4 s",
        "gamma": None,
    }
    assert result.metrics.failed == 4 and result.metrics.completed == 1
    assert result.metrics.failure_reasons["timeout after 0.4 s"] == 1


class _DispatchClock:
    """The load generator's clock and sleep, virtual: time moves only when the dispatcher sleeps,
    so a request's recorded start is when the dispatcher sent it, whatever the machine's timer
    lateness (on a loaded 2-core VM a real wake-up once came 31 ms late). The stub server runs in
    its own thread on the real clock."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def perf_counter(self) -> float:
        return self.now_s

    async def sleep(self, delay_s: float) -> None:
        for _ in range(3):  # the send tasks created so far run up to their first await: they record their start
            await asyncio.sleep(0)
        self.now_s += max(0.0, delay_s)


def test_poisson_arrivals_follow_the_seeded_schedule(stub, monkeypatch):
    from benchmarks.serving import loadgen

    clock = _DispatchClock()
    monkeypatch.setattr(loadgen, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(loadgen, "asyncio", SimpleNamespace(sleep=clock.sleep, create_task=asyncio.create_task,
                                                            gather=asyncio.gather, Semaphore=asyncio.Semaphore))
    shape = LoadShape(concurrency=None, request_rate_per_s=10.0, seed=7)
    result = run(stub, ["gamma"] * 5, shape)
    expected = poisson_arrival_offsets_s(5, 10.0, seed=7)
    assert [r.start_s for r in result.results] == pytest.approx(expected, abs=1e-9)
    assert sorted(expected) == expected and len(set(expected)) == 5
    assert result.metrics.completed == 5


def test_time_limit_stops_dispatch(stub):
    # gamma takes ~100 ms: sends at ~0, ~0.1, ~0.2 s; the 4th would start at ~0.3 s > 0.25 s.
    result = run(stub, ["gamma"] * 10, LoadShape(concurrency=1, time_limit_s=0.25))
    assert len(result.results) == 3 and result.not_sent == 7
    # The run lasts as long as its three requests did, back to back (~0.3 s on a quiet machine).
    assert result.metrics.duration_s == pytest.approx(sum(r.e2e_s for r in result.results), abs=2 * TOL_S)


def test_run_options_are_kept(stub):
    result = run(stub, ["gamma"], LoadShape(concurrency=1), model="explicit")
    assert result.options == replace(RequestOptions(), model="explicit")
    assert stub.config.requests[0]["model"] == "explicit"
