"""Triton grouped SwiGLU expert FFN: the twin of :func:`kernels.expert_ffn.expert_ffn_reference`.

All local experts run in one grouped launch per matmul (two launches in all):

1. ``_gate_up_kernel``: ``act = silu(x @ w_gate[e].T) * (x @ w_up[e].T)``, both products sharing
   the loaded ``x`` tile, written as ``(num_rows, intermediate_size)`` in the activation dtype.
2. ``_down_kernel``: ``out = (act @ w_down[e].T) * routing_weight``.

Rows arrive grouped by expert (``expert_counts`` gives the group sizes). Each expert's rows are cut
into ``BLOCK_M`` row tiles; tile ``t`` of the launch belongs to the expert whose cumulative tile
count first exceeds ``t``. Every program recomputes that lookup from ``expert_counts`` in
registers (a cumulative sum over at most a few hundred experts), so the launch needs no
device-to-host copy of the counts: the grid is sized by the upper bound
``cdiv(num_rows, BLOCK_M) + num_experts`` and programs past the last real tile return at once.

Tiling, masking and the grouped ("super-row") program order that keeps weight tiles in L2 follow
the Triton matrix-multiplication tutorial. Rounding mirrors the reference: matmuls accumulate in
float32 and round to the activation dtype, then SiLU, the product and the routing scale each round
to the activation dtype as the separate torch ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_ffn_args

_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """Round float32 ``x`` to the nearest-even ``DTYPE`` value, returned as float32.

    bf16 is rounded by bit arithmetic rather than ``x.to(tl.bfloat16)`` because Triton 3.9's
    interpreter truncates that cast (the GPU rounds to nearest even); doing it by hand keeps the
    tested path and the GPU path identical. The final store's cast is then exact on both.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b``. Under the CPU interpreter (``UPCAST_DOT``) the operands are widened to
    float32 first: Triton 3.9's interpreter multiplies bf16 bit patterns as integers. The products of
    16-bit floats are exact in float32, so this is the same sum the tensor cores form."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _tile_to_expert(tile, counts_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Map a row-tile index to (expert, first row of the tile, end of the expert's rows).

    ``expert == num_experts`` means the tile is past the last real one.
    """
    e_idx = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < num_experts, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)  # exclusive end of each expert's tile range
    rows_end = tl.cumsum(counts, axis=0)
    expert = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
    this = e_idx == expert
    first_tile = tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0)
    row_end = tl.sum(tl.where(this, rows_end, 0), axis=0)
    row_begin = tl.sum(tl.where(this, rows_end - counts, 0), axis=0)
    row_start = row_begin + (tile - first_tile) * BLOCK_M
    return expert, row_start, row_end


@triton.jit
def _grouped_pids(num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """Tutorial program order: walk GROUP_M row tiles down one column strip before moving right,
    so a weight (column) tile is reused from L2 by consecutive programs."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = min(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr,  # (num_rows, K) activations
    wg_ptr,  # (E, N, K) gate weights
    wu_ptr,  # (E, N, K) up weights
    act_ptr,  # (num_rows, N) out: silu(gate) * up
    counts_ptr,  # (E,) int64 rows per expert
    num_experts,
    N,  # intermediate size
    K,  # hidden size
    num_tiles_m,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    ACT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_pids(num_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, row_start, row_end = _tile_to_expert(pid_m, counts_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    # 64-bit scalar base pointers for the tile plus 32-bit in-tile offsets: tensors of 64-bit
    # pointers cost two registers per element and made the (16 x 128 x 64) tiles spill.
    m_idx = tl.arange(0, BLOCK_M)
    n_idx = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = (row_start + m_idx) < row_end
    col_ok = (pid_n * BLOCK_N + n_idx) < N
    x_base = x_ptr + row_start.to(tl.int64) * stride_xm
    x_off = m_idx[:, None] * stride_xm + ks[None, :] * stride_xk
    # Weights are (out, in) on disk; reading them as (in, out) tiles gives x @ W.T directly.
    w_shift = expert.to(tl.int64) * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    wg_base = wg_ptr + w_shift
    wu_base = wu_ptr + w_shift
    w_off = n_idx[None, :] * stride_wn + ks[:, None] * stride_wk
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_base + x_off, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(wg_base + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        wu = tl.load(wu_base + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = _mma(x, wg, acc_g, DOT_PRECISION, UPCAST_DOT)
        acc_u = _mma(x, wu, acc_u, DOT_PRECISION, UPCAST_DOT)
        x_base += BLOCK_K * stride_xk
        wg_base += BLOCK_K * stride_wk
        wu_base += BLOCK_K * stride_wk
    # Round at the same points as F.linear -> F.silu -> mul in the activation dtype.
    gate = _round_to(acc_g, ACT_DTYPE)
    up = _round_to(acc_u, ACT_DTYPE)
    silu = _round_to(gate / (1.0 + tl.exp(-gate)), ACT_DTYPE)
    act = _round_to(silu * up, ACT_DTYPE).to(ACT_DTYPE)
    a_base = act_ptr + row_start.to(tl.int64) * stride_am + (pid_n * BLOCK_N).to(tl.int64) * stride_an
    a_off = m_idx[:, None] * stride_am + n_idx[None, :] * stride_an
    tl.store(a_base + a_off, act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # (num_rows, K) silu(gate) * up
    wd_ptr,  # (E, N, K) down weights
    out_ptr,  # (num_rows, N) out
    rw_ptr,  # (num_rows,) float32 routing weights, unused unless HAS_ROUTING_WEIGHTS
    counts_ptr,  # (E,) int64 rows per expert
    num_experts,
    N,  # hidden size
    K,  # intermediate size
    num_tiles_m,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_ROUTING_WEIGHTS: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_pids(num_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, row_start, row_end = _tile_to_expert(pid_m, counts_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    m_idx = tl.arange(0, BLOCK_M)
    n_idx = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = (row_start + m_idx) < row_end
    col_ok = (pid_n * BLOCK_N + n_idx) < N
    a_base = act_ptr + row_start.to(tl.int64) * stride_am
    a_off = m_idx[:, None] * stride_am + ks[None, :] * stride_ak
    w_base = wd_ptr + expert.to(tl.int64) * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    w_off = n_idx[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_base + a_off, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _mma(a, w, acc, DOT_PRECISION, UPCAST_DOT)
        a_base += BLOCK_K * stride_ak
        w_base += BLOCK_K * stride_wk
    y = _round_to(acc, ACT_DTYPE)
    if HAS_ROUTING_WEIGHTS:
        # The reference casts the float32 weight to the activation dtype before multiplying.
        rw = _round_to(tl.load(rw_ptr + row_start + m_idx, mask=row_ok, other=0.0), ACT_DTYPE)
        y = _round_to(y * rw[:, None], ACT_DTYPE)
    o_base = out_ptr + row_start.to(tl.int64) * stride_om + (pid_n * BLOCK_N).to(tl.int64) * stride_on
    o_off = m_idx[:, None] * stride_om + n_idx[None, :] * stride_on
    tl.store(o_base + o_off, y.to(ACT_DTYPE), mask=row_ok[:, None] & col_ok[None, :])


# BLOCK_M -> (gate/up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K), all with 8 warps. Not tuned on a
# GPU (none was available when this was written): chosen as the largest bf16 tiles that compiled
# for sm_90 without register spills (gate/up holds two float32 accumulators, hence its narrower
# tiles). benchmarks/kernels.py is the place to tune them.
_TILES = {16: (64, 128, 64, 128), 32: (64, 64, 64, 128), 64: (64, 64, 128, 64), 128: (64, 32, 128, 64)}


def _block_m(num_rows: int, num_experts: int) -> int:
    """Row-tile height from the average rows per expert: 16 (tl.dot's minimum) for decode, where a
    taller tile would be mostly padding, up to 128 for prefill."""
    per_expert = num_rows / max(1, num_experts)
    for block in (16, 32, 64):
        if per_expert <= block:
            return block
    return 128


def expert_ffn_triton(
    hidden: torch.Tensor,
    expert_counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    routing_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped SwiGLU over all local experts; same contract as :func:`expert_ffn_reference`.

    Args:
        hidden: ``(num_rows, hidden_size)`` fp32/fp16/bf16 rows grouped by local expert.
        expert_counts: ``(num_local_experts,)`` integer rows per expert, summing to ``num_rows``
            (zeros allowed; checked only when on the CPU, see :func:`kernels.checks.check_ffn_args`).
        w_gate, w_up: ``(num_local_experts, intermediate_size, hidden_size)``, ``hidden.dtype``.
        w_down: ``(num_local_experts, hidden_size, intermediate_size)``, ``hidden.dtype``.
        routing_weights: optional ``(num_rows,)`` float32 per-row output scale.

    Returns:
        ``(num_rows, hidden_size)`` in ``hidden.dtype``.

    Raises:
        ValueError: on inconsistent shapes, dtypes or (host-side) counts.
    """
    check_ffn_args(hidden, expert_counts, w_gate, w_up, w_down, routing_weights, triton=True)
    num_rows, hsize = hidden.shape
    num_experts, inter, _ = w_gate.shape
    out = torch.empty_like(hidden)
    if num_rows == 0 or num_experts == 0:
        return out
    act = torch.empty((num_rows, inter), dtype=hidden.dtype, device=hidden.device)
    act_dtype = _TORCH_TO_TL[hidden.dtype]
    # Plain fp32 reference matmuls do not use TF32, so neither may the kernel.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    block_m = _block_m(num_rows, num_experts)
    # No expert can add more than one partial tile, hence this bound on the real tile count.
    num_tiles_m = min(num_rows, triton.cdiv(num_rows, block_m) + num_experts)
    block_e = triton.next_power_of_2(num_experts)
    counts = expert_counts.to(device=hidden.device)
    gu_n, gu_k, down_n, down_k = _TILES[block_m]
    if hidden.dtype == torch.float32:  # twice the bytes per element: halve the K tiles
        gu_k, down_k = gu_k // 2, down_k // 2
    common = dict(UPCAST_DOT=not hidden.is_cuda, BLOCK_M=block_m, BLOCK_E=block_e, GROUP_M=8, num_warps=8, num_stages=3)

    _gate_up_kernel[(num_tiles_m * triton.cdiv(inter, gu_n),)](
        hidden, w_gate, w_up, act, counts,
        num_experts, inter, hsize, num_tiles_m,
        hidden.stride(0), hidden.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        act.stride(0), act.stride(1),
        ACT_DTYPE=act_dtype, DOT_PRECISION=precision, BLOCK_N=gu_n, BLOCK_K=gu_k, **common,
    )  # fmt: skip

    if routing_weights is not None:
        rw = routing_weights.to(device=hidden.device, dtype=torch.float32).contiguous()
    else:
        rw = out  # dummy pointer, never read when HAS_ROUTING_WEIGHTS is False
    _down_kernel[(num_tiles_m * triton.cdiv(hsize, down_n),)](
        act, w_down, out, rw, counts,
        num_experts, hsize, inter, num_tiles_m,
        act.stride(0), act.stride(1),
        w_down.stride(0), w_down.stride(1), w_down.stride(2),
        out.stride(0), out.stride(1),
        HAS_ROUTING_WEIGHTS=routing_weights is not None, ACT_DTYPE=act_dtype, DOT_PRECISION=precision,
        BLOCK_N=down_n, BLOCK_K=down_k, **common,
    )  # fmt: skip
    return out
