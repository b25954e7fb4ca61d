"""Bad input gets the right 4xx, load gets 503, disconnects and dead actors lose nothing."""

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import ray

from engine import SamplingParams
from engine.loader import load_tokenizer
from tests.actors.conftest import MODEL_NAME, TARGET

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_PROMPT = {"model": MODEL_NAME, "prompt": "import os\n", "max_tokens": 4}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_INPUTS = [
    (C, b"{not json", 400), (C, b"[1, 2]", 400), (C, {"model": 5, "prompt": "x"}, 400), (C, {"model": MODEL_NAME}, 400),
    (C, {**OK_PROMPT, "prompt": 3}, 400), (C, {**OK_PROMPT, "prompt": ""}, 400), (C, {**OK_PROMPT, "prompt": []}, 400),
    (C, {**OK_PROMPT, "prompt": [99999]}, 400), (C, {**OK_PROMPT, "prompt": [5, -1]}, 400),
    (C, {**OK_PROMPT, "prompt": "x " * 3000}, 400), (C, {**OK_PROMPT, "max_tokens": 0}, 400),
    (C, {**OK_PROMPT, "max_tokens": -5}, 400), (C, {**OK_PROMPT, "max_tokens": 100000}, 400),
    (C, {**OK_PROMPT, "max_tokens": "ten"}, 400), (C, {**OK_PROMPT, "temperature": -0.1}, 400),
    (C, {**OK_PROMPT, "temperature": 2.5}, 400), (C, {**OK_PROMPT, "top_p": 0}, 400),
    (C, {**OK_PROMPT, "top_p": 1.5}, 400), (C, {**OK_PROMPT, "top_k": -2}, 400), (C, {**OK_PROMPT, "n": 0}, 400),
    (C, {**OK_PROMPT, "n": 9}, 400), (C, {**OK_PROMPT, "logprobs": 6}, 400), (C, {**OK_PROMPT, "logprobs": -1}, 400),
    (C, {**OK_PROMPT, "model": "gpt-4"}, 404), (C, {**OK_PROMPT, "stop": [""]}, 400),
    (C, {**OK_PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400), (C, {**OK_PROMPT, "num_speculative_tokens": 17}, 400),
    (C, {**OK_PROMPT, "prompt": ["a", 5]}, 400), (C, {**OK_PROMPT, "stream": "yes"}, 400),
    (C, {**OK_PROMPT, "seed": "abc"}, 400), (C, {**OK_PROMPT, "stop_token_ids": [-1]}, 400),
    (C, {**OK_PROMPT, "ignore_eos": "maybe"}, 400), (CHAT, {**OK_CHAT, "messages": []}, 400),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400), (CHAT, {"model": MODEL_NAME}, 400),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 6}, 400),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    (CHAT, {**OK_CHAT, "model": "other"}, 404), (CHAT, {**OK_CHAT, "max_completion_tokens": 0}, 400),
    (C, {**OK_PROMPT, "top_k": 2**64 - 1}, 400), (C, {**OK_PROMPT, "seed": 2**64}, 400),
    (C, {**OK_PROMPT, "seed": -(2**63) - 1}, 400), (C, {**OK_PROMPT, "stop_token_ids": [2**40]}, 400),
    (C, {**OK_PROMPT, "prompt": [1.5, 2]}, 400), (C, {**OK_PROMPT, "logit_bias": {"5": 10}}, 400),
    (C, {**OK_PROMPT, "suffix": "x"}, 400), (C, {**OK_PROMPT, "presence_penalty": 0.5}, 400),
    (C, {**OK_PROMPT, "best_of": 3}, 400), (C, {**OK_PROMPT, "n": 2, "best_of": 1}, 400), (CHAT, {**OK_CHAT, "tools": [{"type": "function"}]}, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "json_object"}}, 400),
    ("/v1/embeddings", {"model": MODEL_NAME, "input": "x"}, 404),
    (C, b"{" + b" " * (5 * 1024 * 1024) + b"}", 413),
    # Nested deeper than the JSON decoder recurses (was a bare 500).
    (C, b'{"model": "stdlib-moe", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    # Above the server's num_speculative_tokens (4 here), its maximum.
    (C, {**OK_PROMPT, "num_speculative_tokens": 5}, 400), (C, {**OK_PROMPT, "stop_token_ids": [99999]}, 400),
]


def _post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def test_bad_inputs_get_openai_errors_while_a_stream_runs_intact(served, reference_llm):
    url = served[0]
    prompt = "def merge_sorted(a, b):\n"
    expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + C, json=body, timeout=300) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        statuses = []
        for path, bad, status in BAD_INPUTS:
            r = _post(url, path, bad)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            statuses.append((r.status_code, status))
        rest = [line for line in lines if line.startswith("data: ")]
    assert len(BAD_INPUTS) >= 30
    assert [s for s, _ in statuses] == [s for _, s in statuses]
    assert rest[-1] == "data: [DONE]"
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in [first] + rest[:-1] if json.loads(x[6:])["choices"])
    assert text == expected.outputs[0].text
    assert _post(url, C, {**OK_PROMPT, "unknown_field": 1}).status_code == 200  # unknown fields are ignored
    body = json.dumps(OK_PROMPT).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d's default; a wrong one
        r = httpx.post(url + C, content=body, headers={"Content-Type": content_type}, timeout=60)
        assert r.status_code == 415 and content_type in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json", ""):  # "": none sent
        r = httpx.post(url + C, content=body, headers={"Content-Type": content_type} if content_type else {}, timeout=60)
        assert r.status_code == 200, (content_type, r.text)
    # vLLM's conveniences: no model means the served one; tools that tool_choice "none" turns off
    no_model = _post(url, C, {k: v for k, v in OK_PROMPT.items() if k != "model"})
    assert no_model.status_code == 200 and no_model.json()["model"] == MODEL_NAME
    tools_off = _post(url, CHAT, {**OK_CHAT, "tool_choice": "none", "tools": [{"type": "function"}]})
    assert tools_off.status_code == 200 and tools_off.json()["choices"][0]["message"]["role"] == "assistant"
    big_seed = _post(url, C, {**OK_PROMPT, "seed": 2**63 - 1, "n": 2, "temperature": 1.0})
    assert big_seed.status_code == 200 and len(big_seed.json()["choices"]) == 2  # per-sequence seeds wrap
    wrong_method = httpx.get(url + C)
    assert wrong_method.status_code == 405 and set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}
    out_of_vocab = _post(url, C, {**OK_PROMPT, "prompt": [5, 99999]})
    assert out_of_vocab.json()["error"]["param"] == "prompt"
    too_many_drafts = _post(url, C, {**OK_PROMPT, "num_speculative_tokens": 5}).json()["error"]
    assert too_many_drafts["param"] == "num_speculative_tokens" and "at most 4" in too_many_drafts["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.head(url + "/health").status_code == 200


def test_a_stalled_request_body_gets_408_within_body_timeout_s(served):
    """A client that sends the headers and part of its body, then nothing (slowloris), is answered
    408 in OpenAI's shape once ``body_timeout_s`` passes, instead of holding an ingress slot for as
    long as it keeps the connection open (260 such clients stopped the server, /health included)."""
    url, config, _ = served
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 75\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=config.body_timeout_s + 30) as s:
        s.sendall(head + b'{"model": "')
        start, reply = time.monotonic(), b""
        while b'"code"' not in reply and (chunk := s.recv(65536)):
            reply += chunk
        waited_s = time.monotonic() - start
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"408", reply[:300]
    err = json.loads(rest[rest.index(b"{"):rest.rindex(b"}") + 1])["error"]
    assert err["type"] == "timeout" and "body_timeout_s" in err["message"]
    assert config.body_timeout_s - 0.5 <= waited_s < config.body_timeout_s + 15
    assert _post(url, C, OK_PROMPT).status_code == 200


def test_models_list_and_retrieve_as_openai_clients_do(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    model = client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "specmoe")
    assert 0 < time.time() - model.created < 3600  # a real start time, not 0 (1970)
    missing = httpx.get(url + "/v1/models/gpt-4")
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": f"The model 'gpt-4' does not exist (serving '{MODEL_NAME}')",
                                       "type": "not_found_error", "param": "model", "code": "model_not_found"}


def _engine_stats(handle) -> dict:
    return handle.stats.remote().result(timeout_s=30)


def _wait_idle(handle, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _engine_stats(handle)
        if (stats["num_running"], stats["num_waiting"], stats["kv_slots_used"]) == (0, 0, 0):
            return stats
        assert time.monotonic() < deadline, f"engine did not return to idle: {stats}"
        time.sleep(0.1)


def test_client_disconnect_frees_kv_slots(served):
    url, _, handle = served
    _wait_idle(handle)
    body = {"model": MODEL_NAME, "prompt": "class Parser:\n", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + C, json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            next(lines)
        assert _engine_stats(handle)["kv_slots_used"] == 1
    stats = _wait_idle(handle, timeout_s=10)
    assert stats["finished_by_reason"].get("abort", 0) >= 1


def test_sixteen_concurrent_streams_complete_correctly(served, reference_llm, heldout_prompts):
    prompts = [row["prompt"] for row in heldout_prompts[1::19][:16]]
    expected = [o.outputs[0].text for o in
                reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", served[0] + C, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    text += choices[0]["text"] if choices else ""
        return text

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    assert asyncio.run(run()) == expected


def test_backpressure_answers_503_with_retry_after(served):
    url, config, handle = served
    limit = config.engine.scheduler.max_num_seqs + config.engine.scheduler.max_waiting
    body = {"model": MODEL_NAME, "prompt": "import sys\n", "max_tokens": 800, "stream": True, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [client.stream("POST", url + C, json=body) for _ in range(limit + 8)]
            responses = []
            for s in streams:  # sequential sends: the first `limit` are admitted, the rest refused
                responses.append(await s.__aenter__())
            codes = [r.status_code for r in responses]
            retry = [r.headers.get("retry-after") for r in responses if r.status_code == 503]
            for s in streams:
                await s.__aexit__(None, None, None)  # disconnect every stream
            return codes, retry

    codes, retry = asyncio.run(run())
    assert codes.count(200) == limit and codes.count(503) == 8
    assert all(r is not None for r in retry)
    _wait_idle(handle, timeout_s=30)


def test_unattainable_ttft_budget_answers_503_with_retry_after_and_admitted_requests_finish(served):
    """Deadline refusal through HTTP: a request of the session app's ``instant`` class (1 us TTFT
    budget, never attainable once the cost model has seen a step) is refused at once with 503 +
    Retry-After in the OpenAI error shape while admitted requests run; they all finish whole."""
    url, config, handle = served
    body = {"model": MODEL_NAME, "prompt": "import sys\n", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    assert httpx.post(url + C, json=body, timeout=120).status_code == 200  # the cost model has seen steps
    before = _engine_stats(handle)["slo_attainment"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            admitted = [asyncio.create_task(client.post(url + C, json=body)) for _ in range(4)]
            while (await handle.stats.remote())["num_running"] == 0:
                await asyncio.sleep(0.01)  # the admitted requests are running
            refused = await client.post(url + C, json={**body, "slo_class": "instant", "stream": True})
            return refused, await asyncio.gather(*admitted)

    refused, admitted = asyncio.run(run())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "server_overloaded" and "'instant'" in error["message"] and "TTFT budget" in error["message"]
    assert error["code"] == "ttft_unattainable"
    assert [r.status_code for r in admitted] == [200] * 4
    assert [r.json()["usage"]["completion_tokens"] for r in admitted] == [24] * 4
    after = _wait_idle(handle)["slo_attainment"]
    assert after["interactive"][1] - before["interactive"][1] == 4  # every admitted request finished
    assert "instant" not in after  # the refused one never ran


def test_killing_an_expert_actor_mid_batch_changes_no_output(served, reference_llm, heldout_prompts):
    url, config, handle = served
    prompts = [row["prompt"] for row in heldout_prompts[5::23][:8]]
    expected = [o.outputs[0].text for o in reference_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
    names = handle.expert_actor_names.remote().result()
    retries_before = _engine_stats(handle)["expert_retries"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                        "ignore_eos": True}
                r = await client.post(url + C, json=body)
                return r.json()["choices"][0]["text"]

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            while (await handle.stats.remote())["num_running"] < len(prompts) // 2:
                await asyncio.sleep(0.02)  # wait until the batch is running
            ray.kill(ray.get_actor(names[0], namespace=config.experts.namespace))
            return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == expected
    assert _engine_stats(handle)["expert_retries"] > retries_before


def test_a_response_over_grpcs_default_4_mib_is_served(served):
    """Serve's proxy <- ingress gRPC refused a message over 4 MiB by default: a bare 500 (a fresh
    user's /tokenize of a 3 MB prompt, now a 400 past 4 context windows; a batch with logprobs
    likewise). Here a /detokenize of 200,000 ids whose text is 6.6 MB."""
    url, _, _ = served
    tokenizer, _ = load_tokenizer(Path(TARGET))
    long_token = max(range(1000), key=lambda t: len(tokenizer.decode([t], skip_special_tokens=False)))
    ids = [long_token] * 200_000
    r = httpx.post(url + "/detokenize", json={"model": MODEL_NAME, "tokens": ids}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 4 * 1024 * 1024
    assert r.json()["prompt"] == tokenizer.decode(ids, skip_special_tokens=False)
