"""Comparison tolerances shared by the kernel tests."""

from __future__ import annotations

import torch


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tolerances per dtype: float32 atol = rtol = 1e-5; bf16/fp16 rtol 2e-2 with an absolute floor
    of 2e-2 times the largest reference magnitude (elements that cancel to near zero in a 16-bit
    matmul carry an error relative to the operands, not to themselves)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        scale = float(expected.float().abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale + 1e-6)
