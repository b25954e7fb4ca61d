"""Triton top-k MoE routing: the fused twin of :func:`kernels.routing.topk_routing_reference`.

Two launches:

1. ``_topk_softmax_kernel`` (one program per ``BLOCK_T`` tokens): router logits -> float32 softmax
   -> top-k by repeated arg-max (ties to the lower expert index; a chosen expert is masked out, so
   none repeats) -> optional renormalisation. Same math as the Hugging Face Mixtral/Qwen MoE
   routers that the reference follows.
2. ``_group_by_expert_kernel`` (one program per expert): a stable counting sort of the flat
   assignments. Program ``e`` scans all ``num_tokens * top_k`` expert ids once, counting ids below
   ``e`` (its output offset) and ranking its own ids with a running prefix sum (their order within
   the expert), so no program waits on another and there is no host synchronisation.

Selection uses the softmax probabilities, not the logits, so that logits whose probabilities round
(or underflow) to the same float32 value tie exactly as in the reference's stable sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import RoutingResult, check_routing_args


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # (num_tokens, num_experts) bf16/fp16/fp32
    weights_ptr,  # (num_tokens, TOP_K) float32 out
    ids_ptr,  # (num_tokens, TOP_K) int64 out
    num_tokens,
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_ok = tokens < num_tokens
    expert_ok = experts < num_experts
    tile_ok = token_ok[:, None] & expert_ok[None, :]
    ptrs = logits_ptr + tokens[:, None].to(tl.int64) * stride_lt + experts[None, :] * stride_le
    x = tl.load(ptrs, mask=tile_ok, other=float("-inf")).to(tl.float32)

    # Softmax in float32 with the max subtracted, as torch.softmax does. Rows past num_tokens are
    # all -inf; zero them so they produce no NaN (they are never stored anyway).
    x = tl.where(token_ok[:, None], x, 0.0)
    row_max = tl.max(x, axis=1)
    e = tl.exp(x - row_max[:, None])
    e = tl.where(expert_ok[None, :], e, 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]

    # Padding lanes get -1 (below any probability) so they are never chosen; each pick is set to
    # -1 as well, which is what guarantees k distinct experts when k <= num_experts.
    work = tl.where(expert_ok[None, :], probs, -1.0)
    slot = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(work, axis=1)
        # Lowest index among the lanes equal to the maximum: the tie-break of a stable sort.
        is_best = work == best[:, None]
        best_idx = tl.min(tl.where(is_best, experts[None, :], BLOCK_E), axis=1)
        top_w = tl.where(slot[None, :] == k, best[:, None], top_w)
        top_i = tl.where(slot[None, :] == k, best_idx[:, None], top_i)
        work = tl.where(experts[None, :] == best_idx[:, None], -1.0, work)

    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]

    out_off = tokens[:, None].to(tl.int64) * TOP_K + slot[None, :]
    out_ok = token_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + out_off, top_w, mask=out_ok)
    tl.store(ids_ptr + out_off, top_i.to(tl.int64), mask=out_ok)


@triton.jit
def _group_by_expert_kernel(
    ids_ptr,  # (num_assignments,) int64 flat expert ids
    counts_ptr,  # (num_experts,) int64 out
    slots_ptr,  # (num_assignments,) int64 out: the stable grouping permutation
    num_assignments,
    BLOCK: tl.constexpr,
):
    expert = tl.program_id(0)
    # Pass 1: where this expert's group starts (assignments to lower experts) and its size.
    below = 0
    mine = 0
    for start in range(0, num_assignments, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=expert + 1)
        below += tl.sum((ids < expert).to(tl.int32), axis=0)
        mine += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, mine.to(tl.int64))
    # Pass 2: scatter this expert's flat indices in token order. The ids are re-read rather than
    # kept, since they are at most a few hundred KiB and sit in L2 after pass 1.
    seen = 0
    scan_end = tl.where(mine > 0, num_assignments, 0)  # experts with no tokens skip pass 2
    for start in range(0, scan_end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=expert + 1)
        hit = (ids == expert).to(tl.int32)
        dest = below + seen + tl.cumsum(hit, axis=0) - 1
        tl.store(slots_ptr + dest.to(tl.int64), offs.to(tl.int64), mask=hit != 0)
        seen += tl.sum(hit, axis=0)


def topk_routing_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutingResult:
    """Fused top-k routing; same contract and results as :func:`kernels.routing.topk_routing_reference`.

    Args:
        router_logits: ``(num_tokens, num_experts)`` bf16/fp16/fp32 gate outputs on a Triton device
            (CUDA, or CPU under ``TRITON_INTERPRET=1``). Any strides.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        renormalize: divide the k weights by their sum.

    Returns:
        :class:`~kernels.checks.RoutingResult`: float32 weights ``(num_tokens, top_k)``, int64 ids
        ``(num_tokens, top_k)``, int64 counts ``(num_experts,)`` and the int64 stable grouping
        permutation ``(num_tokens * top_k,)``. Ids, counts and permutation equal the reference's
        exactly; weights agree to float32 rounding.

    Raises:
        ValueError: if the logits are not 2-D, not floating point, or ``top_k`` is out of range.
    """
    check_routing_args(router_logits, top_k, triton=True)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    counts = torch.zeros((num_experts,), dtype=torch.int64, device=device)
    slots = torch.empty((num_tokens * top_k,), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return RoutingResult(weights, ids, counts, slots)

    block_e = triton.next_power_of_2(num_experts)
    # Keep the (tokens x experts) tile at most 2K elements: 64 rows per program for 8 experts, 16
    # for 128. At 4K elements the 128-expert, top-8 kernel spilled registers (sm_90, 4 warps).
    block_t = max(1, min(64, 2048 // block_e, triton.next_power_of_2(num_tokens)))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        router_logits.stride(1),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )
    num_assignments = num_tokens * top_k
    _group_by_expert_kernel[(num_experts,)](
        ids,
        counts,
        slots,
        num_assignments,
        BLOCK=min(1024, max(16, triton.next_power_of_2(num_assignments))),
        num_warps=4,
    )
    return RoutingResult(weights, ids, counts, slots)
