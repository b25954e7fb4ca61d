"""Fewer items across the Serve hop: a non-streamed request gets its first tokens and then one
merged item; a streamed one's steps that queued up behind a busy consumer go as one item; the
merged items carry every step's timing, and the text, tokens and totals are unchanged."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from actors.engine_loop import EngineLoop
from actors.stream_items import ship
from actors.telemetry import RequestTelemetry
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.llm import build_engine
from tests.actors.conftest import DRAFT, TARGET

PARAMS = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, "logprobs": 1}
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n"]


def _step(text: str, ids: list[int], at_s: float, finish: str | None = None) -> dict:
    item = {"type": "step", "finished": finish is not None, "at_s": at_s,
            "choices": [{"index": 0, "new_text": text, "new_token_ids": ids, "finish_reason": finish,
                         "stop_reason": None, "new_logprobs": [{"token_id": t} for t in ids],
                         "num_tokens": 0}]}
    if finish:
        item["usage"] = {"prompt_tokens": 3, "completion_tokens": 5}
    return item


def test_merged_items_concatenate_and_keep_each_steps_age():
    items = [_step("a", [1], 10.0), _step("bc", [2, 3], 10.5), _step("de", [4, 5], 11.0, "length")]
    merged = ship(items, now_s=12.0)
    c = merged["choices"][0]
    assert (c["new_text"], c["new_token_ids"]) == ("abcde", [1, 2, 3, 4, 5])
    assert [lp["token_id"] for lp in c["new_logprobs"]] == [1, 2, 3, 4, 5]
    assert c["finish_reason"] == "length" and merged["finished"] and merged["usage"]["completion_tokens"] == 5
    assert merged["steps"] == [[2.0, 1], [1.5, 2], [1.0, 2]] and "at_s" not in merged
    alone = ship([_step("a", [1], 10.0)], now_s=12.0)  # e.g. held alone by stream batching
    assert alone["steps"] == [[2.0, 1]] and "at_s" not in alone


def test_telemetry_records_a_merged_items_steps_when_they_were_emitted():
    got = []

    class Tracker:
        def on_tokens(self, n, t):
            got.append((n, t))

    tel = RequestTelemetry(None, "/v1/completions", {}, "text_completion", "m", arrival_s=time.monotonic())
    tel.tracker = Tracker()
    now = time.monotonic()
    tel.on_item({"type": "step", "finished": False, "steps": [[0.3, 1], [0.2, 0], [0.1, 3]],
                 "choices": [{"index": 0, "new_token_ids": [1, 2, 3, 4], "finish_reason": None}]})
    assert [n for n, _ in got] == [1, 3] and tel.num_tokens == 4
    assert got[0][1] == pytest.approx(now - 0.3, abs=0.05) and got[1][1] == pytest.approx(now - 0.1, abs=0.05)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, msgspec.convert(PARAMS, SamplingParams))
    return llm.tokenizer, [o.outputs[0] for o in outs]


async def _collect(loop, ids, stream: bool, consumer_delay_s: float = 0.0) -> list[dict]:
    items = []
    async for item in loop.generate(ids, PARAMS, stream=stream):
        items.append(item)
        await asyncio.sleep(consumer_delay_s)  # a busy consumer: steps queue up behind it
    return items


@pytest.mark.parametrize("stream,delay_s", [(False, 0.0), (True, 0.05)])
def test_merged_streams_equal_the_offline_api(reference, stream, delay_s):
    tokenizer, want = reference
    engine = build_engine(EngineArgs(model=TARGET, draft_model=DRAFT, num_speculative_tokens=3))

    async def run():
        loop = EngineLoop(engine, ThreadPoolExecutor(1))
        ids = [tokenizer.encode(p).ids for p in PROMPTS]
        return await asyncio.gather(*[_collect(loop, i, stream, delay_s) for i in ids])

    steps_before = engine.num_steps
    results = asyncio.run(run())
    num_steps = engine.num_steps - steps_before
    for items, out in zip(results, want):
        steps = [i for i in items if i["type"] == "step"]
        got = [t for i in steps for c in i["choices"] for t in c["new_token_ids"]]
        assert got == list(out.token_ids)
        assert "".join(c["new_text"] for i in steps for c in i["choices"]) == out.text
        assert [lp["token_id"] for i in steps for c in i["choices"] for lp in c["new_logprobs"]] == list(out.token_ids)
        assert items[0]["type"] == "accepted" and steps[-1]["finished"] and steps[-1]["usage"]["completion_tokens"] == 24
        assert len(steps) < num_steps  # fewer items than engine steps
        if not stream:  # the first tokens alone (TTFT), then everything else in one item
            assert len(steps) == 2 and len(steps[0]["choices"][0]["new_token_ids"]) <= 4
            assert sum(n for _, n in steps[1]["steps"]) == 24 - len(steps[0]["choices"][0]["new_token_ids"])
            assert all(age >= 0 for age, _ in steps[1]["steps"])


async def _timed(loop, ids) -> list[tuple[float, dict]]:
    return [(time.monotonic(), item) async for item in loop.generate(ids, PARAMS, stream=True)]


@pytest.mark.parametrize("interval_s", [0.03, 30.0])
def test_stream_batching_spaces_items_and_never_holds_the_last(reference, interval_s):
    """With ``stream_batching_interval_s`` a streamed request's items after its first tokens are at
    least the interval apart and carry every step since the last, tokens unchanged; the finished
    item is never held (a 30 s interval: the first tokens, then one item when the request ends)."""
    tokenizer, want = reference
    engine = build_engine(EngineArgs(model=TARGET, draft_model=DRAFT, num_speculative_tokens=3))

    async def run():
        loop = EngineLoop(engine, ThreadPoolExecutor(1), stream_batching_interval_s=interval_s)
        return await asyncio.wait_for(_timed(loop, tokenizer.encode(PROMPTS[0]).ids), 20.0)

    steps_before = engine.num_steps
    timed = [(t, i) for t, i in asyncio.run(run()) if i["type"] == "step"]
    num_steps = engine.num_steps - steps_before
    items = [i for _, i in timed]
    assert [t for i in items for c in i["choices"] for t in c["new_token_ids"]] == list(want[0].token_ids)
    assert "".join(c["new_text"] for i in items for c in i["choices"]) == want[0].text
    assert items[-1]["finished"] and sum(1 for i in items if i["finished"]) == 1
    gaps_s = [b - a for (a, _), (b, _) in zip(timed[:-1], timed[1:-1])]  # the finished item may come early
    assert all(g >= interval_s * 0.95 for g in gaps_s), gaps_s
    if interval_s > 1:
        assert len(items) == 2 and len(items[0]["choices"][0]["new_token_ids"]) <= 4
    else:
        assert len(items) < num_steps
    # Every step's timing travels with its item, a lone held one's too (the ingress records ITL
    # per step at emission, not at arrival): emission times rise and none is after its arrival.
    assert all(sum(n for _, n in i["steps"]) == len(i["choices"][0]["new_token_ids"]) for i in items)
    emitted_s = [t - age for t, i in timed for age, _ in i["steps"]]
    assert emitted_s == sorted(emitted_s) and all(age >= 0 for i in items for age, _ in i["steps"])


@pytest.mark.parametrize(("status", "tokens", "refused", "errors"), [(503, 0, 1, 0), (500, 0, 0, 1), (503, 2, 0, 1)])
def test_telemetry_counts_a_503_before_any_output_as_refused_not_failed(status, tokens, refused, errors):
    from observability.request_metrics import RequestMetrics

    metrics = RequestMetrics("m")
    tel = RequestTelemetry(metrics, "/v1/completions", {}, "text_completion", "m", arrival_s=time.monotonic())
    if tokens:  # a stream that had started, then ended by a 503 (a stopping server): a failed request
        tel.on_item({"type": "step", "finished": False, "steps": [[0.0, 2]],
                     "choices": [{"index": 0, "new_token_ids": [1, 2], "finish_reason": None}]})
    tel.finish(status, "cmpl-1")
    r = metrics.registry
    assert r.get_sample_value("specmoe:request_refused_total", {"model_name": "m", "reason": "unavailable"}) == refused
    assert r.get_sample_value("specmoe:request_success_total",
                              {"model_name": "m", "finished_reason": "error"}) == errors


@pytest.mark.parametrize(("steps", "prompt_tokens"), [([[0.0, 2]], 17), ([], 0)])
def test_a_request_its_client_left_counts_its_prompt_once_it_produced_a_token(steps, prompt_tokens):
    # Its final usage never comes; prompt_tokens_total left its prompt out while
    # generation_tokens_total counted its tokens (a metrics audit, 2026-12-06).
    from observability import RequestMetrics

    metrics = RequestMetrics("m", include_state_gauges=False)
    tel = RequestTelemetry(metrics, "/v1/completions", {}, "text_completion", "m", arrival_s=time.monotonic())
    tel.prompt_tokens = 17  # as the ingress tokenized it
    tel.on_item({"type": "step", "finished": False, "steps": steps,
                 "choices": [{"index": 0, "new_token_ids": [1, 2][:len(steps) * 2], "finish_reason": None}]})
    tel.finish(200, "cmpl-1")  # the client left: finished as "abort"
    sample = metrics.registry.get_sample_value
    assert sample("specmoe:request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 1
    assert sample("specmoe:prompt_tokens_total", {"model_name": "m"}) == prompt_tokens
    assert sample("specmoe:generation_tokens_total", {"model_name": "m"}) == (2 if steps else 0)
