"""Session setup and the test tiers.

Tiers (markers declared in pyproject.toml):

* CPU (default, ``make test``): everything not marked ``gpu``; ``addopts`` deselects ``gpu``.
* ``slow``: tests that need the session's Ray Serve app (the ``served`` fixture) or another live
  server; marked automatically here, so ``pytest -m "not slow"`` is the quick tier.
* ``gpu`` (``pytest -m gpu`` / ``make test-gpu``): the engine, the Triton kernels at realistic
  shapes and one HTTP request, on CUDA; skipped with the reason shown where no CUDA device exists.
  In this tier the kernel tests' Triton interpreter (tests/kernels/conftest.py) stays off, so the
  kernels compile for the device.
"""

import os

import pytest
import torch

# Tests are small; one thread keeps them predictable on a 2-core machine shared with Ray workers.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.helpers.tiny_checkpoints import ARCHITECTURES, make_checkpoint  # noqa: E402

NO_CUDA = "no CUDA device here: the gpu tier (pytest -m gpu) runs on a machine with one"


def gpu_tier_selected(markexpr: str) -> bool:
    """Whether ``-m`` selects the gpu tier (``gpu``, ``gpu and ...``; not ``not gpu``)."""
    expr = " ".join(markexpr.split())
    return "gpu" in expr.split() and "not gpu" not in expr


def pytest_configure(config: pytest.Config) -> None:
    if gpu_tier_selected(config.option.markexpr or ""):
        os.environ["SPECMOE_GPU_TIER"] = "1"  # read by tests/kernels/conftest.py before it imports


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if "served" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{arch: (path, transformers reference model)} for every supported architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ARCHITECTURES}
