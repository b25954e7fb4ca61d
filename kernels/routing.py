"""Top-k MoE routing: router logits -> expert choice, weights and the dispatch permutation.

The torch reference below is the CPU path and the ground truth for the Triton kernel in
``kernels/routing_triton.py``. It follows the routing of the Hugging Face reference
implementations (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``):
float32 softmax over all experts, top-k, optional renormalisation of the k weights to sum to 1.
"""

from __future__ import annotations

import torch

from kernels.checks import RoutingResult, check_routing_args

__all__ = ["RoutingResult", "topk_routing", "topk_routing_reference"]


def topk_routing_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutingResult:
    """Reference top-k routing.

    Args:
        router_logits: ``(num_tokens, num_experts)`` bf16/fp16/fp32 gate outputs.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        renormalize: divide the k weights by their sum (Mixtral always; Qwen MoE when
            ``norm_topk_prob``).

    Raises:
        ValueError: if the logits are not 2-D or ``top_k`` is out of range.
    """
    check_routing_args(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    # A stable descending sort keeps equal probabilities in index order, so ties go to the lower
    # expert index deterministically (torch.topk leaves tie order unspecified).
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    topk_weights = sorted_probs[:, :top_k].contiguous()
    topk_ids = sorted_ids[:, :top_k].contiguous()
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    flat_ids = topk_ids.reshape(-1)
    expert_counts = torch.bincount(flat_ids, minlength=num_experts)  # int64 (no weights given)
    sorted_slots = torch.sort(flat_ids, stable=True).indices
    return RoutingResult(topk_weights, topk_ids, expert_counts, sorted_slots)


def topk_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutingResult:
    """Dispatch: Triton on CUDA when enabled (see :mod:`kernels.dispatch`), the reference elsewhere."""
    from kernels.dispatch import use_triton

    if use_triton(router_logits):
        from kernels.routing_triton import topk_routing_triton

        return topk_routing_triton(router_logits, top_k, renormalize)
    return topk_routing_reference(router_logits, top_k, renormalize)
