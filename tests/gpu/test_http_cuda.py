"""One HTTP request end to end on CUDA: ingress -> verifier -> expert and draft actors, each with
a GPU share, all on the device; the answer equals the in-process CPU engine's."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.config import ServeConfig
from engine import LLM, SamplingParams
from tests.actors.conftest import DRAFT, MODEL_NAME, TARGET, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]


def test_one_completion_over_http_on_cuda():
    import serve_app

    gpu_share = {"num_gpus": 0.1}
    config = msgspec.convert({
        "model_name": MODEL_NAME,
        "engine": {"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 4, "device": "cuda",
                   "scheduler": {"max_num_seqs": 4, "max_waiting": 4}},
        "experts": {"experts_per_actor": 4, "call_timeout_s": 60.0, **gpu_share},
        "verifier": gpu_share, "draft": gpu_share,
        "http": {"host": "127.0.0.1", "port": free_port()},
    }, ServeConfig)
    prompt = "def merge_sorted(a, b):\n"
    want = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=4).generate(
        prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    url = serve_app.start(config)
    try:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["completion_tokens"] == 32
        metrics = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text)
        expert_tokens = sum(s.value for f in metrics if f.name == "specmoe:expert_tokens"
                            for s in f.samples if s.name == "specmoe:expert_tokens_total")
        assert expert_tokens > 0  # the experts ran (in their GPU actors) for this request
    finally:
        serve_app.stop()
