"""Triton grouped SwiGLU expert FFN (interpreter) against the torch reference.

Tolerances (see tolerances.assert_close_dtype): float32 atol = rtol = 1e-5; bf16/fp16 rtol 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from kernels import expert_ffn
from kernels.expert_ffn import expert_ffn_reference
from kernels.expert_ffn_triton import expert_ffn_triton
from tests.kernels.inputs import make_inputs
from tests.kernels.tolerances import assert_close_dtype

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows per local expert, hidden, intermediate): empty experts, one expert with every row, sizes
# that are not multiples of any block, and one expert with more than one 128-row tile.
CASES = [
    ([0, 5, 0, 2], 24, 40),
    ([7], 72, 100),
    ([0, 0, 33], 100, 24),
    ([1, 1, 1, 40, 0], 24, 72),
    ([129, 0, 0], 24, 40),
    ([3, 150], 24, 24),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype):
    counts, hidden, inter = case
    x, c, wg, wu, wd, rw = make_inputs(counts, hidden, inter, dtype, seed=sum(counts) + hidden)
    assert_close_dtype(expert_ffn_triton(x, c, wg, wu, wd), expert_ffn_reference(x, c, wg, wu, wd))
    assert_close_dtype(expert_ffn_triton(x, c, wg, wu, wd, rw), expert_ffn_reference(x, c, wg, wu, wd, rw))


def test_strided_weights_from_fused_gate_up():
    # Checkpoints often store gate and up as one (E, 2I, H) tensor; slicing it gives strided views.
    x, c, wg, wu, wd, rw = make_inputs([4, 0, 9], 72, 40, torch.bfloat16, seed=5)
    fused = torch.cat([wg, wu], dim=1)
    got = expert_ffn_triton(x, c, fused[:, :40], fused[:, 40:], wd, rw)
    assert_close_dtype(got, expert_ffn_reference(x, c, wg, wu, wd, rw))


def test_no_rows():
    x, c, wg, wu, wd, _ = make_inputs([0, 0], 24, 40, torch.float32, seed=6)
    assert expert_ffn_triton(x, c, wg, wu, wd).shape == (0, 24)


def test_rejects_counts_that_do_not_sum_to_rows():
    x, _, wg, wu, wd, _ = make_inputs([2, 3], 24, 40, torch.float32, seed=7)
    with pytest.raises(ValueError):
        expert_ffn_triton(x, torch.tensor([2, 2]), wg, wu, wd)


def test_dispatch_takes_triton_branch(triton_dispatch, monkeypatch):
    import kernels.expert_ffn_triton as ft

    calls = []
    original = ft.expert_ffn_triton
    monkeypatch.setattr(ft, "expert_ffn_triton", lambda *a: calls.append(1) or original(*a))
    x, c, wg, wu, wd, rw = make_inputs([3, 4], 24, 40, torch.float32, seed=8)
    got = expert_ffn.expert_ffn(x, c, wg, wu, wd, rw)
    assert calls
    assert_close_dtype(got, expert_ffn_reference(x, c, wg, wu, wd, rw))
