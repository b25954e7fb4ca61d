"""Triton top-k routing (interpreter) against the torch reference.

Ids, counts and the grouping permutation must be identical; weights (float32 either way) within
atol = rtol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from kernels import routing
from kernels.routing import topk_routing_reference
from kernels.routing_triton import topk_routing_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Every token count (1, 7, 33, 129), expert count (3, 8, 60) and top-k (1, 2, 8) appears.
SHAPES = [(1, 3, 1), (7, 8, 2), (33, 60, 8), (129, 8, 8), (129, 60, 2), (7, 3, 2), (33, 8, 1), (1, 60, 8)]


def assert_same_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    got = topk_routing_triton(logits, top_k, renormalize)
    want = topk_routing_reference(logits, top_k, renormalize)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.expert_counts, want.expert_counts)
    assert torch.equal(got.sorted_slots, want.sorted_slots)
    assert got.topk_weights.dtype == torch.float32
    torch.testing.assert_close(got.topk_weights, want.topk_weights, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_logits(shape, dtype):
    tokens, experts, top_k = shape
    gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + top_k)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    assert_same_routing(logits, top_k, renormalize=True)
    assert_same_routing(logits, top_k, renormalize=False)


def test_all_negative_logits():
    gen = torch.Generator().manual_seed(1)
    logits = -torch.rand(33, 8, generator=gen) * 10 - 1
    assert_same_routing(logits, 2, renormalize=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_equal_logits_pick_lowest_experts(dtype):
    logits = torch.full((7, 8), 0.25, dtype=dtype)
    got = topk_routing_triton(logits, 3, renormalize=False)
    assert got.topk_ids.tolist() == [[0, 1, 2]] * 7
    assert_same_routing(logits, 3, renormalize=True)


def test_many_exact_ties():
    # Logits drawn from {-2..2}: most rows have several equal maxima.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-2, 3, (129, 8), generator=gen).to(torch.bfloat16)
    assert_same_routing(logits, 8, renormalize=True)
    assert_same_routing(logits, 2, renormalize=False)


def test_underflowing_probabilities_tie_at_zero():
    # exp(-200) and exp(-300) underflow to 0 in float32: the reference ties them and takes the
    # lower index, even though expert 3's logit is larger. Selection must follow probabilities.
    logits = torch.tensor([[0.0, -300.0, -200.0, -150.0, -400.0]])
    got = topk_routing_triton(logits, 3, renormalize=False)
    assert got.topk_ids.tolist() == [[0, 1, 2]]
    assert_same_routing(logits, 3, renormalize=True)


def test_one_expert_gets_every_token_and_others_none():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 8, generator=gen)
    logits[:, 5] += 50.0
    got = topk_routing_triton(logits, 1, renormalize=True)
    assert got.expert_counts.tolist() == [0, 0, 0, 0, 0, 33, 0, 0]
    assert_same_routing(logits, 1, renormalize=True)
    assert_same_routing(logits, 2, renormalize=True)


def test_strided_logits_and_empty_batch():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 7, generator=gen).t()  # (7 tokens, 8 experts), non-contiguous
    assert_same_routing(logits, 2, renormalize=True)
    empty = topk_routing_triton(torch.empty(0, 8), 2, renormalize=True)
    assert empty.topk_ids.shape == (0, 2) and empty.expert_counts.tolist() == [0] * 8


def test_rejects_bad_top_k():
    with pytest.raises(ValueError):
        topk_routing_triton(torch.zeros(2, 3), 4, renormalize=True)


def test_dispatch_takes_triton_branch(triton_dispatch, monkeypatch):
    import kernels.routing_triton as rt

    calls = []
    original = rt.topk_routing_triton
    monkeypatch.setattr(rt, "topk_routing_triton", lambda *a: calls.append(1) or original(*a))
    logits = torch.randn(7, 8)
    got = routing.topk_routing(logits, 2, True)
    assert calls and torch.equal(got.topk_ids, topk_routing_reference(logits, 2, True).topk_ids)
