"""benchmarks/offload_cuda.py's passes on the CPU with the bundled target: every variant gives the
resident store's outputs, oracle hints are the next layer's routed experts, and the transfer
measure counts one entry's bytes."""

from __future__ import annotations

import torch

import benchmarks.offload_cuda as bench
from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.expert_offload import OffloadedExpertStore
from engine.model import ExpertStore

TARGET = "checkpoints/stdlib-moe-target"


def test_offloaded_passes_equal_the_resident_ones_and_hints_count_as_prefetches():
    config, reader = load_model_config(TARGET), CheckpointReader(TARGET)
    steps = bench.routed_steps(TARGET, steps=3, tokens=5, dtype=torch.float32, device="cpu")
    assert [len(s) for s in steps] == [len(config.moe.sparse_layers)] * 3
    _, want = bench.run_passes(ExpertStore(reader, config), steps, "cpu", hints=False)
    store = OffloadedExpertStore(reader, config, range(8), max_resident=16, prefetch=True)
    try:
        _, got = bench.run_passes(store, steps, "cpu", hints=True)
        store.drain()
        assert len(got) == len(want) == 3 * len(config.moe.sparse_layers)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert store.snapshot()["prefetches"] > 0
        rate = bench.transfer_gb_per_s(store, store.entry_bytes, loads=2, device="cpu")
        assert rate > 0
    finally:
        store.close()
