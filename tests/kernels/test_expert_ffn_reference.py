"""The CPU expert FFN reference and the weight layout the model's linears use on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.expert_ffn import (
    _GROUPED_MAX_ACTIVATION_BYTES,
    _grouped,
    expert_ffn_reference,
    linear_layout,
    swiglu,
)


def test_linear_layout_is_column_major_with_the_same_values():
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    laid = linear_layout(w)
    assert laid.shape == (256, 128) and laid.stride() == (1, 256)
    assert torch.equal(laid, w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    # F.linear over it is the plain GEMM with the transposed weight as a contiguous operand.
    assert torch.equal(F.linear(x, laid), torch.mm(x, w.t().contiguous()))
    stack = linear_layout(torch.randn(4, 40, 24))
    assert stack.shape == (4, 40, 24) and stack.stride() == (960, 1, 40)


def test_linear_layout_leaves_vectors_alone():
    v = torch.randn(128)
    assert linear_layout(v) is v


@pytest.mark.parametrize("inter", [40, 64])
@pytest.mark.parametrize("counts", [[0, 2, 0, 0, 0, 1], [3, 1, 2, 0, 4, 1]], ids=["few-experts", "most-experts"])
def test_reference_runs_each_used_expert_on_its_rows(counts, inter):
    # Few used experts loop over them, most take the grouped GEMMs where the intermediate size keeps
    # one F.silu over all rows bit-identical (a multiple of 64; 40 is not): each expert's own SwiGLU
    # of its rows, bit for bit, either way.
    g = torch.Generator().manual_seed(sum(counts) + inter)
    num, hidden = len(counts), 24
    wg, wu = (linear_layout(torch.randn(num, inter, hidden, generator=g)) for _ in range(2))
    wd = linear_layout(torch.randn(num, hidden, inter, generator=g))
    x = torch.randn(sum(counts), hidden, generator=g)
    rw = torch.rand(sum(counts), generator=g)
    assert _grouped(x, counts, wg, wu, wd) == (counts == [3, 1, 2, 0, 4, 1] and inter == 64)
    got = expert_ffn_reference(x, torch.tensor(counts), wg, wu, wd, rw)
    want, start = [], 0
    for e, n in enumerate(counts):
        if n:
            want.append(swiglu(x[start:start + n], wg[e], wu[e], wd[e]))
            start += n
    assert torch.equal(got, torch.cat(want) * rw[:, None])


def test_silu_split_on_block_boundaries_keeps_its_bits():
    # The premise of the grouped path: F.silu over all rows gives each group's rows the bits of F.silu
    # over that group alone when groups are whole multiples of 64 elements (ATen computes only a
    # tensor's remainder past its last two-vector block with the scalar function).
    x = torch.randn(64 * 37, generator=torch.Generator().manual_seed(5)) * 5
    whole = F.silu(x)
    for sizes in ([64] * 37, [128, 64, 1024, 192, 960], [64 * 36, 64]):
        assert torch.equal(torch.cat([F.silu(part) for part in x.split(sizes)]), whole)


def test_reference_without_grouped_mm_strides_gives_the_same_bits():
    # Rows with a 100-byte stride are not what F.grouped_mm takes: the per-expert loop runs instead.
    g = torch.Generator().manual_seed(3)
    counts = [2, 0, 3, 1]
    wg, wu = (linear_layout(torch.randn(4, 40, 24, generator=g)) for _ in range(2))
    wd = linear_layout(torch.randn(4, 24, 40, generator=g))
    wide = torch.randn(6, 25, generator=g)
    strided, packed = wide[:, :24], wide[:, :24].contiguous()
    assert strided.stride() == (25, 1)
    got = expert_ffn_reference(strided, torch.tensor(counts), wg, wu, wd)
    assert torch.equal(got, expert_ffn_reference(packed, torch.tensor(counts), wg, wu, wd))
    assert torch.equal(got[2:5], swiglu(packed[2:5], wg[2], wu[2], wd[2]))


def test_reference_runs_a_long_prefill_expert_by_expert_with_the_same_bits():
    # Past _GROUPED_MAX_ACTIVATION_BYTES of one activation the grouped GEMMs lose to the loop; the
    # bound is by bytes, so it moves with the intermediate size and the dtype.
    g = torch.Generator().manual_seed(7)
    inter, hidden = 64, 16
    wg, wu = (linear_layout(torch.randn(4, inter, hidden, generator=g)) for _ in range(2))
    wd = linear_layout(torch.randn(4, hidden, inter, generator=g))
    limit_rows = _GROUPED_MAX_ACTIVATION_BYTES // (inter * 4)
    for rows, grouped in ((limit_rows, True), (limit_rows + 1, False)):
        counts = [rows - 3 * (rows // 4)] + [rows // 4] * 3
        x = torch.randn(rows, hidden, generator=g)
        assert _grouped(x, counts, wg, wu, wd) is grouped
        assert _grouped(x.to(torch.float16), counts, wg, wu, wd) is True  # half the bytes a row
        got = expert_ffn_reference(x, torch.tensor(counts), wg, wu, wd)
        ends = [0, *torch.tensor(counts).cumsum(0).tolist()]
        want = torch.cat([swiglu(x[a:b], wg[e], wu[e], wd[e]) for e, (a, b) in enumerate(zip(ends, ends[1:]))])
        assert torch.equal(got, want)
