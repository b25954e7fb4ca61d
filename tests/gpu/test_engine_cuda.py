"""The engine on CUDA: greedy and sampled output (logprobs included, in one batch) equal the CPU
engine's for the same seeds (the request generators and uniforms live on the host), and the
routing, expert FFN and rejection kernels run as Triton."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TARGET, DRAFT = "checkpoints/stdlib-moe-target", "checkpoints/stdlib-draft"
PROMPTS = ["def add(a, b):\n", "import os\n\n\ndef walk(root):\n", "class Stack:\n    def __init__(self):\n"]


def _run(device: str) -> list:
    llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=4, device=device)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)]
    return llm.generate(PROMPTS, params)


def test_engine_on_cuda_equals_the_cpu_engine_and_runs_the_kernels(kernel_calls):
    cpu = _run("cpu")
    calls_on_cpu = dict(kernel_calls)
    gpu = _run("cuda")
    assert calls_on_cpu == {}  # CPU tensors take the references
    for g, c in zip(gpu, cpu):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        assert g.outputs[0].text == c.outputs[0].text
    for g, c in zip(gpu[1:], cpu[1:]):
        lp_gpu = torch.tensor([t.logprob for t in g.outputs[0].logprobs])
        lp_cpu = torch.tensor([t.logprob for t in c.outputs[0].logprobs])
        torch.testing.assert_close(lp_gpu, lp_cpu, rtol=1e-4, atol=1e-4)
        assert all(len(t.top) == len(c.outputs[0].logprobs[0].top) for t in g.outputs[0].logprobs)
    assert kernel_calls["topk_routing_triton"] > 0 and kernel_calls["expert_ffn_triton"] > 0
    assert kernel_calls["rejection_sample_triton"] > 0  # the sampled request's verification steps


def test_cuda_decoding_never_builds_cudnn_attention_plans():
    # cuDNN's SDPA would build an execution plan for each new key length, i.e. every decode step.
    llm = LLM(TARGET, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not [n for n in names if "cudnn" in n and "attention" in n]
