"""Run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` decides between compiling and interpreting when a kernel module is imported, from
``TRITON_INTERPRET``; so the variable is set here, at conftest import, before any test module
imports ``kernels.*_triton``. If an earlier test directory already imported a kernel module
without it, that module is reloaded so its kernels are re-decorated for the interpreter.

Not in the gpu tier (``pytest -m gpu`` sets ``SPECMOE_GPU_TIER``, see tests/conftest.py): there the
kernels must compile for CUDA, and these interpreter tests are deselected anyway.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest  # noqa: E402

if os.environ.get("SPECMOE_GPU_TIER") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("kernels.routing_triton", "kernels.expert_ffn_triton", "kernels.rejection_triton"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture
def triton_dispatch(monkeypatch):
    """Make the public dispatch functions (kernels.routing.topk_routing, ...) take the Triton
    branch on CPU tensors."""
    monkeypatch.setenv("SPECMOE_TRITON", "interpret")
    from kernels.dispatch import set_triton_enabled

    set_triton_enabled(None)
    yield
    set_triton_enabled(None)

