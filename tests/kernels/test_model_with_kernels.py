"""The model emits the same tokens with Triton kernels (interpreter) as with references, through
the production dispatch path (spied: the kernels really run)."""

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import dispatch

KERNELS = [("kernels.routing_triton", "topk_routing_triton"), ("kernels.expert_ffn_triton", "expert_ffn_triton"),
           ("kernels.rejection_triton", "rejection_sample_triton")]


@pytest.mark.parametrize("temperature, expected_kernels", [
    # Greedy verification needs only the target argmax (kernels.rejection.greedy_verify).
    (0.0, {"topk_routing_triton", "expert_ffn_triton"}),
    (0.8, {"topk_routing_triton", "expert_ffn_triton", "rejection_sample_triton"}),
], ids=["greedy", "sampled"])
def test_tiny_moe_tokens_match_with_kernels_on(tiny_checkpoints, monkeypatch, temperature, expected_kernels):
    path, _ = tiny_checkpoints["qwen3_moe"]
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9)]
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=11)
    llm = LLM(str(path), draft_model=str(path), num_speculative_tokens=2, max_num_seqs=2)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv("SPECMOE_TRITON", "interpret")
    dispatch.set_triton_enabled(None)
    calls = []
    for module, name in KERNELS:
        mod = __import__(module, fromlist=[name])
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k))[1])
    with_kernels = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_kernels == reference
    assert set(calls) == expected_kernels
