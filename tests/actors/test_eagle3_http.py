"""EAGLE-3 on the Ray path, through HTTP: a tiny random target with a tiny random head, served by
``serve_app.py`` in its own process (draft actor over the compiled graph / actor calls), answers
exactly what plain greedy decoding in-process gives."""

from __future__ import annotations

import re

import httpx
import pytest

from benchmarks.serving.server_process import embedded_config, free_port, serve_process
from engine import LLM
from engine.sampling_params import SamplingParams
from tests.helpers.tiny_checkpoints import make_eagle3_head

pytestmark = pytest.mark.slow
PROMPTS = ["def f(x):", "import os\nfor i in", "ab" * 20]


def test_greedy_over_http_with_an_eagle3_head_equals_plain_greedy(tiny_checkpoints, tmp_path):
    target = str(tiny_checkpoints["mixtral"][0])
    make_eagle3_head(tmp_path / "head", seed=6)
    config = embedded_config(free_port())
    config["model_name"] = "tiny"
    config["engine"].update(model=target, draft_model=str(tmp_path / "head"), speculative_method="eagle3",
                            num_speculative_tokens=3, speculative_policy="fixed")
    config["experts"]["experts_per_actor"] = 2
    plain = LLM(target).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    with serve_process(config, tmp_path / "serve.yaml") as (_, url, _log):
        for prompt, ref in zip(PROMPTS, plain):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        metrics = httpx.get(url + "/metrics", timeout=30).text
    drafted = re.search(r"^specmoe:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)", metrics, re.M)
    assert drafted and float(drafted.group(1)) > 0
