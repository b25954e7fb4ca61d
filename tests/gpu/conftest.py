"""The GPU tier (``pytest -m gpu``): fixtures that count which kernels really ran.

Every test here is marked ``gpu`` and skipped with a reason where no CUDA device exists
(tests/conftest.py). The Triton interpreter must be off, or the "CUDA" kernels would be emulated.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest


@pytest.fixture(autouse=True)
def _compiled_triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 in the gpu tier: run `pytest -m gpu` (tests/conftest.py keeps it off)")
    if os.environ.get("SPECMOE_TRITON", "1").lower() in ("0", "false", "off"):
        pytest.fail("SPECMOE_TRITON disables the kernels the gpu tier checks")


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Counts calls of each Triton entry point reached through the production dispatch
    (``kernels.routing.topk_routing`` etc. import their twin at call time, so wrapping the twin's
    module attribute sees every call)."""
    from kernels import expert_ffn_triton, rejection_triton, routing_triton

    calls: Counter = Counter()
    for module, name in ((routing_triton, "topk_routing_triton"), (expert_ffn_triton, "expert_ffn_triton"),
                         (rejection_triton, "rejection_sample_triton")):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls
