"""``compile=True`` (the layers' dense parts under torch.compile) computes what the eager model does.

This module sits at the top of ``tests/`` so that it runs after ``tests/kernels``, and imports
``torch._dynamo`` only inside its tests: importing dynamo imports triton, and the kernel tests need
triton first imported under ``TRITON_INTERPRET=1`` (see ``tests/kernels/conftest.py``).
"""

import pytest
import torch

from actors.config import ServeConfig
from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.loader import load_model
from engine.model import ForwardBatch
from engine.model.dense import DenseOps
from engine.model.layers import Rotary
from engine.yaml_config import load_yaml


def test_compiled_dense_parts_equal_eager_with_bias_and_qk_norm():
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    n, hidden, heads, kv_heads, head_dim = 5, 32, 4, 2, 8
    rows = (heads + 2 * kv_heads) * head_dim
    x, norm = torch.randn(n, hidden, generator=g), torch.rand(hidden, generator=g) + 0.5
    wqkv, bqkv = torch.randn(rows, hidden, generator=g) * 0.2, torch.randn(rows, generator=g)
    qk_norm = torch.rand(heads + kv_heads, head_dim, generator=g) + 0.5
    cos, sin = Rotary(head_dim, 10000.0).cos_sin(torch.tensor([0, 3, 4, 9, 17]), 18)
    wo, post_norm = torch.randn(hidden, heads * head_dim, generator=g) * 0.2, torch.rand(hidden, generator=g) + 0.5
    eager, compiled = DenseOps(compiled=False), DenseOps(compiled=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for qkn in (None, qk_norm):
        args = (x, norm, wqkv, bqkv, qkn, cos, sin, 1e-6, heads, kv_heads)
        for want, got in zip(eager.attention_inputs(*args), compiled.attention_inputs(*args), strict=True):
            assert want.shape == got.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        attn = eager.attention_inputs(*args)[0]
        for want, got in zip(eager.attention_output(attn, x, wo, None, post_norm, 1e-6),
                             compiled.attention_output(attn, x, wo, None, post_norm, 1e-6), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] > graphs_before  # really compiled, not eager twice


def test_compiled_model_logits_and_greedy_tokens_equal_eager(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_moe"]  # MoE layers and the per-head q/k norm
    eager, compiled = load_model(path).model, load_model(path, compile=True).model
    assert compiled.dense.compiled and not eager.dense.compiled
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4], [6, 6, 1]]
    logits = []
    for model in (eager, compiled):
        kv = model.new_kv_cache(3, 64)
        slots = [kv.allocate() for _ in prompts]
        prefill = model.forward(ForwardBatch.build(slots, prompts, [0] * 3, logits="all"), kv)
        verify = model.forward(ForwardBatch.build(slots, [[1, 2, 3]] * 3, [len(p) for p in prompts], "all"), kv)
        logits.append(torch.cat([prefill, verify]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), max_num_seqs=3).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(str(path), max_num_seqs=3, compile=True).generate(prompts, params)]
    assert got == want and all(len(t) == 12 for t in want)


def test_server_config_passes_the_compile_switch_to_the_engine_args(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model_name: m\nengine:\n  model: checkpoints/stdlib-moe-target\n")
    assert load_yaml(path, ServeConfig).engine.compile is False  # off unless asked for
    path.write_text("model_name: m\nengine:\n  model: checkpoints/stdlib-moe-target\n  compile: true\n")
    assert load_yaml(path, ServeConfig).engine.compile is True
    path.write_text("model_name: m\nengine:\n  model: checkpoints/stdlib-moe-target\n  compile: sometimes\n")
    with pytest.raises(ConfigError, match=r"engine\.compile"):
        load_yaml(path, ServeConfig)
