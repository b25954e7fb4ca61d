"""Expert offload on CUDA: the pinned-host tier (async copies on a side stream, the compute stream
waiting on each load's event) gives the rows of the resident CUDA store, with half the entries
resident and each layer's prefetches issued right after its compute is queued (their loads
overwrite slots that compute may still read: the side stream waits for the compute stream)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.expert_offload import OffloadedExpertStore, PinnedHostTier
from engine.model import ExpertStore

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TARGET = "checkpoints/stdlib-moe-target"


def test_pinned_host_offload_equals_the_resident_cuda_store():
    config = load_model_config(TARGET)
    layers = list(config.moe.sparse_layers)
    full = ExpertStore(CheckpointReader(TARGET), config, device="cuda")
    store = OffloadedExpertStore(CheckpointReader(TARGET), config, range(8), device="cuda",
                                 max_resident=8 * len(layers) // 2)
    assert isinstance(store.tier, PinnedHostTier)
    assert all(t.is_pinned() for ts in store.tier.host.values() for t in ts)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(16):
            layer = layers[step % len(layers)]
            counts = torch.randint(0, 5, (8,), generator=gen)
            counts[step % 8] += 1
            rows = torch.randn(int(counts.sum()), config.hidden_size, generator=gen).cuda()
            weights = torch.rand(int(counts.sum()), generator=gen).cuda()
            hint = (layers[(step + 1) % len(layers)], list(range(8)))
            out = store.forward(layer, rows, counts, weights, prefetch=hint)
            torch.testing.assert_close(out, full.forward(layer, rows, counts, weights), rtol=1e-5, atol=1e-5)
        store.drain()
    finally:
        store.close()
    stats = store.snapshot()
    assert stats["prefetches"] > 0 and stats["hits"] > 0
