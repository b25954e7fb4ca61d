"""Grouped SwiGLU expert FFN for the experts one process holds.

Reference (CPU path, ground truth for ``kernels/expert_ffn_triton.py``) of the expert MLP in the
Hugging Face Mixtral/Qwen MoE implementations: ``down(silu(gate(x)) * up(x))``, weights in the
on-disk ``(out_features, in_features)`` layout (Mixtral: w1 = gate, w3 = up, w2 = down).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.checks import check_ffn_args


def linear_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``(..., out, in)``, the on-disk layout; shape and values unchanged) stored the way
    ``F.linear`` runs fastest on its device.

    On CPU a column-major copy: ``F.linear(x, w)`` multiplies by ``w.T``, which is then a contiguous
    ``(in, out)`` matrix, and MKL's plain GEMM is about 1.5-3x faster than its transposed-operand path
    at the few-row shapes of decoding (measured on this model's 128/256-wide layers and its 4096-row
    LM head). Elsewhere (CUDA) the weight is returned as it is.
    """
    if weight.device.type != "cpu" or weight.dim() < 2:
        return weight
    return weight.transpose(-1, -2).contiguous().transpose(-1, -2)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; weights ``(out, in)``."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _grouped_mm_layout_ok(*tensors: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these operands: 16-byte aligned, every non-unit stride a
    multiple of 16 bytes."""
    return all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
               for t in tensors)


def expert_ffn_reference(
    hidden: torch.Tensor,
    expert_counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    routing_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply each local expert to its contiguous group of rows.

    Args:
        hidden: ``(num_rows, hidden_size)`` rows grouped by local expert (expert 0's rows first).
        expert_counts: ``(num_local_experts,)`` int64 rows per expert; sums to ``num_rows``
            (zeros allowed).
        w_gate: ``(num_local_experts, intermediate_size, hidden_size)``.
        w_up: ``(num_local_experts, intermediate_size, hidden_size)``.
        w_down: ``(num_local_experts, hidden_size, intermediate_size)``.
        routing_weights: optional ``(num_rows,)`` float32 per-row scale applied to the output.

    Returns:
        ``(num_rows, hidden_size)`` in ``hidden.dtype``.

    Raises:
        ValueError: on inconsistent shapes or (host-side) counts, see :func:`kernels.checks.check_ffn_args`.
    """
    counts = expert_counts.tolist()
    check_ffn_args(hidden, expert_counts, w_gate, w_up, w_down, routing_weights, host_counts=counts)
    ffn = grouped_swiglu if _grouped(hidden, counts, w_gate, w_up, w_down) else looped_swiglu
    out = ffn(hidden, counts, w_gate, w_up, w_down)
    if routing_weights is not None:
        # Scale in the activation dtype after casting, as the HF reference does (elementwise, so
        # the same values as scaling each expert's rows on its own).
        weights = routing_weights if routing_weights.dtype == out.dtype else routing_weights.to(out.dtype)
        out = out * weights[:, None]
    return out


def grouped_swiglu(hidden: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU of its rows as three ``F.grouped_mm`` calls (arguments as
    :func:`expert_ffn_reference`'s, ``counts`` on the host); each group is exactly ``F.linear``
    of its rows, and the one ``F.silu`` is bit-identical per group where :func:`_grouped` allows it."""
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    gate, up = (F.grouped_mm(hidden, w.mT, offs=ends) for w in (w_gate, w_up))
    return F.grouped_mm(F.silu(gate) * up, w_down.mT, offs=ends)


def looped_swiglu(hidden: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """Each used expert's :func:`swiglu` of its rows in turn (arguments as :func:`grouped_swiglu`'s)."""
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            outs.append(swiglu(hidden[start : start + count], w_gate[e], w_up[e], w_down[e]))
            start += count
    return torch.cat(outs) if len(outs) > 1 else outs[0] if outs else torch.empty_like(hidden)


# ATen's vectorised elementwise loop runs a contiguous tensor in blocks of two SIMD vectors (32
# floats with AVX-512) and its remainder through the scalar function, whose exp can differ from the
# vector one by an ulp: F.silu over all rows at once gives a group the same bits as over its rows
# alone only if no group boundary falls inside a block, i.e. the intermediate size is a multiple of
# the block (64 covers every x86 and Arm width). Seen on an AVX-512 EPYC with an intermediate size
# of 40: grouped and per-expert results differed in the last bits.
_SILU_BLOCK = 64

# CPU ``grouped_mm`` computes each GEMM over every group's rows at once: gate and up activations
# of ``rows x intermediate`` each, where the per-expert loop's working set is one group's. With the
# bundled 256-wide experts in float32 (AMD EPYC VM, 512 KiB L2 a core; benchmarks/expert_ffn_cpu.py)
# the grouped GEMMs won by 9-27 % a call up to 384 rows, took 1.7-1.8x the loop's time at
# 1024-1800 rows, and went either way at 512-640 rows from run to run. Bounded here, a whole prefill of 512 / 900
# tokens (1024 / 1800 rows a layer) ran 1.24-1.29x / 1.08-1.12x as fast with one torch thread (an
# expert actor's), 0.99-1.25x / 1.08-1.21x with two; shorter ones alike within 3 %.
_GROUPED_MAX_ACTIVATION_BYTES = 512 * 1024


def _grouped(hidden: torch.Tensor, counts: list[int], *weights: torch.Tensor) -> bool:
    """Whether the experts run as ``F.grouped_mm`` calls (the same bits as one SwiGLU per expert).

    On a small model every op is mostly dispatch cost, so three grouped GEMMs beat three GEMMs and
    two elementwise ops per used expert; but CPU ``grouped_mm`` runs one GEMM per group, empty ones
    included, so only when at least half the experts are used, and only while one activation fits
    ``_GROUPED_MAX_ACTIVATION_BYTES`` (a long prefill's rows run faster expert by expert). CPU only
    (``grouped_mm`` on GPUs is for bf16 on recent ones, and CUDA takes the Triton kernel), for
    operands it takes, and for an intermediate size that keeps the one ``F.silu`` over all groups
    bit-identical (``_SILU_BLOCK``).
    """
    used = sum(1 for c in counts if c)
    activation_bytes = hidden.shape[0] * weights[0].shape[-2] * hidden.element_size()
    return (hidden.device.type == "cpu" and 2 * used >= len(counts)
            and activation_bytes <= _GROUPED_MAX_ACTIVATION_BYTES
            and weights[0].shape[-2] % _SILU_BLOCK == 0
            and _grouped_mm_layout_ok(hidden, *(w.mT for w in weights)))


def expert_ffn(hidden, expert_counts, w_gate, w_up, w_down, routing_weights=None) -> torch.Tensor:
    """Dispatch: Triton on CUDA when enabled (see :mod:`kernels.dispatch`), the reference elsewhere."""
    from kernels.dispatch import use_triton

    if use_triton(hidden):
        from kernels.expert_ffn_triton import expert_ffn_triton

        return expert_ffn_triton(hidden, expert_counts, w_gate, w_up, w_down, routing_weights)
    return expert_ffn_reference(hidden, expert_counts, w_gate, w_up, w_down, routing_weights)
