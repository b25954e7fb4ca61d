"""Triton rejection sampling for speculative decoding: the twin of
:func:`kernels.rejection.rejection_sample_reference`.

Algorithm: the modified rejection sampling of Leviathan et al. 2023 (Algorithm 1) / Chen et al.
2023 (Algorithm 2), with the greedy special case; see :mod:`kernels.rejection` for the rules. Given
the same uniforms the output equals the reference's token for token: the acceptance ratio uses
IEEE round-to-nearest division (``tl.math.div_rn``) exactly like torch, and the inverse CDF is
accumulated in float64 like the reference's ``cumsum``, so the two can only disagree when a
threshold falls within float64 rounding (~1e-16 relative) of a CDF step.

Two launches:

1. ``_greedy_argmax_kernel``, grid ``(B, K + 1)``: ``argmax target_probs[b, j]`` (ties to the lower
   id) for greedy rows and the positions ``j <= n`` the verification can reach. The argmax of all
   positions is computed up front, in parallel, because which one is needed depends on the others.
2. ``_verify_kernel``, grid ``(B,)``: the accepted prefix from the draft ids (greedy) or from
   ``p(x) / q(x)`` against the uniforms (sampling), then for sampling rows the recovered or bonus
   token by two passes over the vocabulary: totals first (the threshold ``u * total`` needs them),
   then a chunked float64 prefix sum that stops at the first chunk that crosses the threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import PLACEHOLDER_TOKEN_ID, check_rejection_args


@triton.jit
def _greedy_argmax_kernel(
    target_ptr,  # (B, K + 1, V) float32
    num_draft_ptr,  # (B,) int64
    greedy_ptr,  # (B,) int32
    argmax_ptr,  # (B, K + 1) int64 out; entries of sampling rows and positions > n untouched
    V,
    stride_tb,
    stride_tk,
    K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    if tl.load(greedy_ptr + b) == 0:
        return
    if j > tl.load(num_draft_ptr + b):
        return
    row = target_ptr + b.to(tl.int64) * stride_tb + j.to(tl.int64) * stride_tk
    lanes = tl.arange(0, BLOCK_V)
    # Per-lane running maximum; a strict > keeps each lane's earliest index on ties, so the lowest
    # index among lanes holding the global maximum is the first maximum overall (torch.argmax).
    best = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros((BLOCK_V,), dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + lanes
        vals = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        better = vals > best
        best = tl.where(better, vals, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    tl.store(argmax_ptr + b * K1 + j, idx.to(tl.int64))


@triton.jit
def _residual_chunk(p_row, q_row, offs, V, rejected, HAS_DRAFT: tl.constexpr):
    """One vocabulary chunk of ``p`` and of ``max(0, p - q)`` (``p`` itself at the bonus position)."""
    p = tl.load(p_row + offs, mask=offs < V, other=0.0)
    if HAS_DRAFT:
        q = tl.load(q_row + offs, mask=tl.where(rejected, offs < V, False), other=0.0)
        r = tl.where(rejected, tl.maximum(p - q, 0.0), p)
    else:
        r = p
    return p, r


@triton.jit
def _sample_stop_token(p_row, q_row, V, rejected, u, HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse-CDF sample of the residual (or of ``p`` when the residual has no mass); returns the
    first index whose float64 cumulative sum exceeds ``u * total``, else the last positive index,
    else -1 (no positive entry, reference: PLACEHOLDER_TOKEN_ID)."""
    lanes = tl.arange(0, BLOCK_V)
    # Pass 1: totals and last positive index of both candidate distributions.
    tot_r = tl.zeros((), dtype=tl.float64)
    tot_p = tl.zeros((), dtype=tl.float64)
    last_r = tl.full((), -1, dtype=tl.int32)
    last_p = tl.full((), -1, dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + lanes
        p, r = _residual_chunk(p_row, q_row, offs, V, rejected, HAS_DRAFT)
        tot_r += tl.sum(r.to(tl.float64), axis=0)
        tot_p += tl.sum(p.to(tl.float64), axis=0)
        last_r = tl.maximum(last_r, tl.max(tl.where(r > 0, offs, -1), axis=0))
        last_p = tl.maximum(last_p, tl.max(tl.where(p > 0, offs, -1), axis=0))
    # A non-negative residual sums to > 0 iff one entry is > 0: the reference's fallback test.
    use_r = last_r >= 0
    total = tl.where(use_r, tot_r, tot_p)
    last = tl.where(use_r, last_r, last_p)
    threshold = u.to(tl.float64) * total

    # Pass 2: the carry is built with the same tl.sum calls as the total, so the final carry equals
    # the total bit for bit and a threshold below it is always crossed.
    carry = tl.zeros((), dtype=tl.float64)
    found = tl.full((), -1, dtype=tl.int32)
    v0 = 0
    while (found < 0) & (v0 < V):
        offs = v0 + lanes
        p, r = _residual_chunk(p_row, q_row, offs, V, rejected, HAS_DRAFT)
        d = tl.where(use_r, r, p).to(tl.float64)
        cdf = carry + tl.cumsum(d, axis=0)
        # d > 0: a zero-probability token is never chosen, whatever the scan's rounding.
        hit = (cdf > threshold) & (d > 0) & (offs < V)
        found = tl.min(tl.where(hit, offs, V), axis=0)
        found = tl.where(found < V, found, -1)
        carry += tl.sum(d, axis=0)
        v0 += BLOCK_V
    return tl.where(found >= 0, found, last)


@triton.jit
def _verify_kernel(
    draft_ids_ptr,  # (B, K) int64
    num_draft_ptr,  # (B,) int64
    draft_probs_ptr,  # (B, K, V) float32; unused unless HAS_DRAFT
    target_ptr,  # (B, K + 1, V) float32
    argmax_ptr,  # (B, K + 1) int64 from _greedy_argmax_kernel
    accept_u_ptr,  # (B, K) float32
    sample_u_ptr,  # (B, K + 1) float32
    greedy_ptr,  # (B,) int32
    out_ptr,  # (B, K + 1) int64 out
    num_accepted_ptr,  # (B,) int64 out
    V,
    stride_db,
    stride_dk,
    stride_tb,
    stride_tk,
    K: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Vector-and-scalar masks are written tl.where(scalar, vector, False): Triton 3.9's interpreter
    # rejects the mask that `vector & scalar` produces.
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    n = tl.load(num_draft_ptr + b).to(tl.int32)
    is_greedy = tl.load(greedy_ptr + b) != 0
    is_sampling = tl.load(greedy_ptr + b) == 0
    pos = tl.arange(0, BLOCK_K)
    in_draft = (pos < n) & (pos < K)
    draft = tl.load(draft_ids_ptr + b * K + pos, mask=in_draft, other=0)
    # Padding ids may be negative; like the reference, compare and index with them clamped at 0.
    safe = tl.maximum(draft, 0)

    target_max = tl.load(argmax_ptr + b * (K + 1) + pos, mask=tl.where(is_greedy, in_draft, False), other=-1)
    accept = safe == target_max
    if HAS_DRAFT:
        sampled = tl.where(is_sampling, in_draft, False)
        p_x = tl.load(target_ptr + b64 * stride_tb + pos * stride_tk + safe, mask=sampled, other=0.0)
        q_x = tl.load(draft_probs_ptr + b64 * stride_db + pos * stride_dk + safe, mask=sampled, other=0.0)
        u = tl.load(accept_u_ptr + b * K + pos, mask=sampled, other=1.0)
        ratio = tl.math.div_rn(p_x, tl.where(q_x > 0, q_x, 1.0))
        accept = tl.where(is_greedy, accept, (q_x <= 0) | (u < ratio))
    accept = accept & in_draft
    # Accepted drafts form a prefix: count the positions before the first non-accepted one.
    rejects_before = tl.cumsum((~accept).to(tl.int32), axis=0)
    num_acc = tl.sum(((rejects_before == 0) & in_draft).to(tl.int32), axis=0)
    stop = num_acc

    token = tl.load(argmax_ptr + b * (K + 1) + stop, mask=is_greedy, other=0)
    if HAS_DRAFT:
        if is_sampling:
            p_row = target_ptr + b64 * stride_tb + stop.to(tl.int64) * stride_tk
            # At the bonus position (stop == n) there is no draft distribution; the clamp keeps
            # the pointer in bounds and `rejected` masks every load through it.
            q_row = draft_probs_ptr + b64 * stride_db + tl.minimum(stop, K - 1).to(tl.int64) * stride_dk
            u_stop = tl.load(sample_u_ptr + b * (K + 1) + stop)
            token = _sample_stop_token(p_row, q_row, V, stop < n, u_stop, HAS_DRAFT, BLOCK_V).to(tl.int64)
    token = tl.where(token >= 0, token, PLACEHOLDER)

    opos = tl.arange(0, BLOCK_K * 2)  # covers K + 1 positions
    kept = tl.load(draft_ids_ptr + b * K + opos, mask=opos < num_acc, other=PLACEHOLDER)
    row = tl.where(opos == stop, token, kept)
    tl.store(out_ptr + b * (K + 1) + opos, row, mask=opos < K + 1)
    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    greedy: torch.Tensor,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling on a Triton device; same contract as :func:`rejection_sample_reference`.

    Args:
        draft_token_ids: ``(B, K)`` int64.
        num_draft_tokens: ``(B,)`` int64 in ``[0, K]``.
        draft_probs: ``(B, K, V)`` float32, or None only when every row is greedy.
        target_probs: ``(B, K + 1, V)`` float32.
        accept_uniforms: ``(B, K)`` float32 in ``[0, 1)``.
        sample_uniforms: ``(B, K + 1)`` float32 in ``[0, 1)``.
        greedy: ``(B,)`` bool.
        block_v: vocabulary chunk (power of two); default picks one. Tests use a small one to
            exercise the multi-chunk path with a small vocabulary.

    Returns:
        ``output_token_ids`` ``(B, K + 1)`` int64 padded with ``PLACEHOLDER_TOKEN_ID`` and
        ``num_accepted`` ``(B,)`` int64, equal to the reference's for the same uniforms.

    Raises:
        ValueError: as :func:`kernels.checks.check_rejection_args` (the reference's checks plus
            float32 probabilities; with ``draft_probs`` None they read ``greedy`` on the host).
    """
    check_rejection_args(draft_token_ids, num_draft_tokens, draft_probs, target_probs, accept_uniforms,
                         sample_uniforms, greedy, triton=True)  # fmt: skip
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    device = target_probs.device
    output = torch.empty((batch, k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return output, num_accepted
    # The vocabulary axis must be unit-stride for the chunked loads; batch/position axes may stride.
    target = target_probs if target_probs.stride(2) == 1 else target_probs.contiguous()
    has_draft = draft_probs is not None
    drafts_p = target  # dummy pointer when there are no draft probabilities
    if has_draft:
        drafts_p = draft_probs if draft_probs.stride(2) == 1 else draft_probs.contiguous()
    ids = draft_token_ids.to(torch.int64).contiguous()
    n = num_draft_tokens.to(device=device, dtype=torch.int64).contiguous()
    greedy_i = greedy.to(device=device, dtype=torch.int32).contiguous()
    acc_u = accept_uniforms.to(torch.float32).contiguous()
    smp_u = sample_uniforms.to(torch.float32).contiguous()
    argmax = torch.zeros((batch, k + 1), dtype=torch.int64, device=device)

    block_v = block_v or min(4096, triton.next_power_of_2(vocab))
    _greedy_argmax_kernel[(batch, k + 1)](
        target, n, greedy_i, argmax, vocab, target.stride(0), target.stride(1),
        K1=k + 1, BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    _verify_kernel[(batch,)](
        ids, n, drafts_p, target, argmax, acc_u, smp_u, greedy_i, output, num_accepted, vocab,
        drafts_p.stride(0), drafts_p.stride(1),
        target.stride(0), target.stride(1),
        K=k, HAS_DRAFT=has_draft, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_K=triton.next_power_of_2(max(k, 1)), BLOCK_V=min(block_v, 2048), num_warps=8,
    )  # fmt: skip
    return output, num_accepted
