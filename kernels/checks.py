"""Argument checks and result types shared by each kernel's torch reference and its Triton twin.

One implementation per rule: ``kernels/routing.py``, ``kernels/rejection.py`` and
``kernels/expert_ffn.py`` (references + dispatch) and their ``*_triton.py`` twins all import from
here, and this module imports only torch, so no kernel module imports another's private names and
there is no import cycle between a reference and its twin.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PLACEHOLDER_TOKEN_ID = -1
"""Pads ``output_token_ids`` past the emitted tokens; negative, so it can never index an embedding."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation dtypes the Triton kernels accept."""


class RoutingResult(NamedTuple):
    """Output of top-k routing (:func:`kernels.routing.topk_routing` and its Triton twin).

    Attributes:
        topk_weights: ``(num_tokens, top_k)`` float32 routing weights, descending per token.
        topk_ids: ``(num_tokens, top_k)`` int64 expert ids; ties go to the lower expert index and no
            expert appears twice in a row.
        expert_counts: ``(num_experts,)`` int64 number of (token, slot) assignments per expert.
        sorted_slots: ``(num_tokens * top_k,)`` int64 permutation of flat assignment indices
            ``token * top_k + slot`` that groups assignments by expert id (ascending), token order
            kept within an expert. ``topk_ids.flatten()[sorted_slots]`` is sorted.
    """

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_counts: torch.Tensor
    sorted_slots: torch.Tensor


# ---------------------------------------------------------------------------------------- routing
def check_routing_args(router_logits: torch.Tensor, top_k: int, *, triton: bool = False) -> None:
    """Validate top-k routing inputs.

    Args:
        router_logits: ``(num_tokens, num_experts)`` gate outputs.
        top_k: experts per token.
        triton: also require a dtype the Triton kernel loads (fp32/fp16/bf16).

    Raises:
        ValueError: logits not 2-D, ``top_k`` outside ``[1, num_experts]``, or (``triton``) a dtype
            outside :data:`FLOAT_DTYPES`.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (num_tokens, num_experts), got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if triton and router_logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"router_logits must be fp32/fp16/bf16, got {router_logits.dtype}")


# ------------------------------------------------------------------------------------- expert FFN
def check_ffn_args(
    hidden: torch.Tensor,
    expert_counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    routing_weights: torch.Tensor | None,
    *,
    triton: bool = False,
    host_counts: list[int] | None = None,
) -> None:
    """Validate grouped expert-FFN inputs (shapes as in :func:`kernels.expert_ffn.expert_ffn_reference`).

    The sum of ``expert_counts`` is checked only when the counts are on the host: summing device
    counts would cost a host synchronisation per layer, and neither implementation touches rows
    outside ``[0, num_rows)`` whatever the counts say.

    Args:
        triton: also check what the Triton kernel needs: one shared fp32/fp16/bf16 dtype, equal
            gate/up strides, and strides small enough for 32-bit in-tile offsets.
        host_counts: ``expert_counts`` already copied to the host (the reference loops over them),
            so the sum is checked on that list instead of with another tensor op.

    Raises:
        ValueError: naming the inconsistent shape, count, dtype or stride.
    """
    if hidden.dim() != 2 or w_gate.dim() != 3:
        raise ValueError(f"hidden must be (num_rows, hidden_size) and weights 3-D, got {tuple(hidden.shape)}, "
                         f"{tuple(w_gate.shape)}")
    num_local, inter, hsize = w_gate.shape
    if w_up.shape != w_gate.shape or w_down.shape != (num_local, hsize, inter):
        raise ValueError(
            f"expert weights disagree: gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, down {tuple(w_down.shape)}"
        )
    if hidden.shape[1] != hsize:
        raise ValueError(f"hidden size {hidden.shape[1]} != expert hidden size {hsize}")
    if expert_counts.shape != (num_local,):
        raise ValueError(f"expert_counts must be ({num_local},), got {tuple(expert_counts.shape)}")
    if host_counts is not None:
        if sum(host_counts) != hidden.shape[0]:
            raise ValueError(f"expert_counts {host_counts} must sum to {hidden.shape[0]}")
    elif not expert_counts.is_cuda and int(expert_counts.sum()) != hidden.shape[0]:
        raise ValueError(f"expert_counts {expert_counts.tolist()} must sum to {hidden.shape[0]}")
    if routing_weights is not None and routing_weights.shape != (hidden.shape[0],):
        raise ValueError(f"routing_weights must be ({hidden.shape[0]},), got {tuple(routing_weights.shape)}")
    if not triton:
        return
    if hidden.dtype not in FLOAT_DTYPES or any(w.dtype != hidden.dtype for w in (w_gate, w_up, w_down)):
        raise ValueError(
            f"hidden and weights must share one of fp32/fp16/bf16, got {hidden.dtype}, "
            f"{w_gate.dtype}, {w_up.dtype}, {w_down.dtype}"
        )
    if w_up.stride() != w_gate.stride():
        raise ValueError("w_gate and w_up must have the same strides (one pointer offset serves both)")
    # In-tile offsets are 32-bit (stride x at most 128 elements); only the per-tile bases are 64-bit.
    inner = [*hidden.stride(), *w_gate.stride()[1:], *w_down.stride()[1:]]
    if max(inner) * 128 >= 2**31:
        raise ValueError(f"strides {inner} too large for 32-bit in-tile offsets; pass contiguous tensors")


# -------------------------------------------------------------------------------------- rejection
def check_rejection_args(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    greedy: torch.Tensor,
    *,
    triton: bool = False,
) -> None:
    """Validate rejection-sampling inputs (shapes as in :func:`kernels.rejection.rejection_sample_reference`).

    With ``draft_probs`` None this reads ``greedy`` on the host (all rows must be greedy).

    Args:
        triton: also require float32 probabilities (what the Triton kernel loads).

    Raises:
        ValueError: naming the tensor with the wrong shape, a None ``draft_probs`` beside sampled
            rows, or (``triton``) non-float32 probabilities.
    """
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be (B, K), got {tuple(draft_token_ids.shape)}")
    batch, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be (B, K + 1, V) = ({batch}, {k + 1}, V), "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    expected = {
        "num_draft_tokens": (num_draft_tokens, (batch,)),
        "accept_uniforms": (accept_uniforms, (batch, k)),
        "sample_uniforms": (sample_uniforms, (batch, k + 1)),
        "greedy": (greedy, (batch,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (batch, k, vocab))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if draft_probs is None and not bool(greedy.all()):
        raise ValueError("draft_probs may be None only when every row is greedy")
    if triton and (target_probs.dtype != torch.float32 or (draft_probs is not None
                                                           and draft_probs.dtype != torch.float32)):
        raise ValueError("target_probs and draft_probs must be float32")
