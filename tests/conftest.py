import os

import pytest
import torch

# Tests are small; one thread keeps them predictable on a 2-core machine shared with Ray workers.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.helpers.tiny_checkpoints import ARCHITECTURES, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{arch: (path, transformers reference model)} for every supported architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ARCHITECTURES}
