"""Tensor <-> numpy for actor payloads: numpy arrays pickle ~30% cheaper than torch tensors in Ray
(measured on this project's 2-core machine), and Ray stores large ones zero-copy."""

from __future__ import annotations

import numpy as np
import torch


def to_wire(t: torch.Tensor) -> np.ndarray:
    """CPU numpy view of ``t``; bfloat16 (no numpy dtype) travels as its int16 bit pattern."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def from_wire(a: np.ndarray, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse of :func:`to_wire` (copies, since Ray's zero-copy arrays are read-only)."""
    t = torch.from_numpy(np.array(a, copy=True))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device=device, dtype=dtype)
