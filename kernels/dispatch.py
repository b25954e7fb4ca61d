"""One switch that decides whether an op runs its Triton kernel or its torch reference.

Triton runs on CUDA tensors unless disabled with ``SPECMOE_TRITON=0`` or :func:`set_triton_enabled`.
``SPECMOE_TRITON=interpret`` forces the kernels on CPU tensors too (requires ``TRITON_INTERPRET=1``
set before triton is imported); tests use it to check kernels against references.
"""

from __future__ import annotations

import os

import torch

_enabled: bool | None = None


def set_triton_enabled(enabled: bool | None) -> None:
    """Override the environment: True/False, or None to follow ``SPECMOE_TRITON`` again."""
    global _enabled
    _enabled = enabled


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether kernels should run Triton for ``tensor``'s device."""
    mode = os.environ.get("SPECMOE_TRITON", "1").lower()
    if _enabled is False or mode in ("0", "false", "off"):
        return False
    if mode == "interpret":
        return True
    return tensor.is_cuda
