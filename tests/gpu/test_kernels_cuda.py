"""Triton kernels on CUDA at Mixtral-8x7B shapes (hidden 4096, intermediate 14336, 8 experts,
top-2, 1-512 tokens) against their torch references, through the production dispatch."""

from __future__ import annotations

import pytest
import torch

from engine.model.moe import dispatch
from kernels.expert_ffn import expert_ffn, expert_ffn_reference
from kernels.rejection import rejection_sample, rejection_sample_reference
from kernels.routing import topk_routing, topk_routing_reference
from tests.kernels.inputs import make_batch, make_inputs
from tests.kernels.tolerances import assert_close_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
TOKENS = [1, 3, 17, 128, 333, 512]  # decode to prefill, odd sizes included


@pytest.fixture(scope="module")
def weights() -> dict[torch.dtype, tuple[torch.Tensor, ...]]:
    """Mixtral-shaped expert weights per dtype on CUDA (bf16: ~2.8 GB, fp16 the same)."""
    out = {}
    for seed, dtype in enumerate((torch.bfloat16, torch.float16)):
        _, _, wg, wu, wd, _ = make_inputs([0] * EXPERTS, HIDDEN, INTER, dtype, seed=seed, device="cuda")
        out[dtype] = (wg, wu, wd)
    return out


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_routing_and_expert_ffn_match_the_references(weights, kernel_calls, tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(tokens, EXPERTS, generator=gen, device="cuda").to(dtype)
    routing = topk_routing(logits, TOP_K, renormalize=True)
    want = topk_routing_reference(logits, TOP_K, renormalize=True)
    for name in ("topk_ids", "expert_counts", "sorted_slots"):
        assert torch.equal(getattr(routing, name), getattr(want, name)), name
    torch.testing.assert_close(routing.topk_weights, want.topk_weights, rtol=1e-6, atol=1e-6)

    plan = dispatch(hidden, routing)
    wg, wu, wd = weights[dtype]
    got = expert_ffn(plan.hidden, plan.expert_counts, wg, wu, wd, plan.weights)
    ref = expert_ffn_reference(plan.hidden, plan.expert_counts, wg, wu, wd, plan.weights)
    assert got.is_cuda and got.shape == (tokens * TOP_K, HIDDEN)
    assert_close_dtype(got, ref)
    assert kernel_calls == {"topk_routing_triton": 1, "expert_ffn_triton": 1}  # both went to Triton


def test_expert_ffn_float32_uses_ieee_precision(kernel_calls):
    x, c, wg, wu, wd, rw = make_inputs([5, 0, 40, 1, 0, 0, 17, 2], HIDDEN, INTER, torch.float32, seed=9,
                                       device="cuda")
    c = c.cuda()  # device counts: the shape check stays, the sum check (a host sync) is skipped
    got, ref = expert_ffn(x, c, wg, wu, wd, rw), expert_ffn_reference(x, c, wg, wu, wd, rw)
    # fp32 rounding of a 14336-long reduction grows with sqrt(K) (~4e-6 here); TF32 would be ~1e-3.
    torch.testing.assert_close(got, ref, rtol=5e-5, atol=5e-5)
    assert kernel_calls["expert_ffn_triton"] == 1


@pytest.mark.parametrize(("batch", "k", "vocab"), [(1, 4, 32000), (7, 5, 32000), (64, 4, 32000), (33, 1, 151936)])
def test_rejection_sampling_equals_the_reference(kernel_calls, batch, k, vocab):
    args = make_batch(batch, k, vocab, seed=batch + k, device="cuda")
    out, num = rejection_sample(*args)
    want_out, want_num = rejection_sample_reference(*args)
    assert out.is_cuda and torch.equal(num, want_num) and torch.equal(out, want_out)
    greedy_only = make_batch(batch, k, vocab, seed=1, greedy_frac=1.0, device="cuda")
    greedy_only[2] = None  # all-greedy: no draft probabilities at all
    out, num = rejection_sample(*greedy_only)
    want_out, want_num = rejection_sample_reference(*greedy_only)
    assert torch.equal(num, want_num) and torch.equal(out, want_out)
    assert kernel_calls["rejection_sample_triton"] == 2
