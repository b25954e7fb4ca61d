"""The slow tiers of an :class:`engine.expert_offload.OffloadedExpertStore`: where experts that are
not resident live, and how one is loaded into a resident slot.

* :class:`SpillFileTier` (CPU): a memory-mapped spill file in the slots' layout.
* :class:`PinnedHostTier` (CUDA): pinned host memory, copied on a side CUDA stream.
* :class:`SimulatedLinkTier`: either of them behind a simulated slower link.
"""

from __future__ import annotations

import math
import tempfile
import time

import torch

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.model.moe import expert_shapes
from engine.model.names import expert_names


class SpillFileTier:
    """The slow tier of a CPU store: the held experts in the checkpoint dtype (bf16), laid out as
    the resident slots are (:func:`kernels.expert_ffn.linear_layout`: column-major on CPU), in a
    memory-mapped spill file written once when the store starts.

    Why not the checkpoint's own mapping: it is row-major (``(out, in)``), and a load from it
    converts and transposes in one strided ``copy_``: ~60 us per expert of the bundled model against
    ~8 us for the same conversion between equal layouts (2-core EPYC VM, docs/EXPERTS.md), and at
    concurrency 1 the loads cost the expert actor as much CPU as the experts' compute. The spill
    file is an unlinked temporary file (``tempfile``'s directory) mapped with ``torch.from_file``:
    like the checkpoint's mapping, its pages are the kernel's page cache, not the process's memory,
    and it is gone when the process ends. Disk: the held experts' bytes in the checkpoint dtype.
    """

    def __init__(self, reader: CheckpointReader, config: ModelConfig, expert_ids: list[int]) -> None:
        shapes = expert_shapes(config)
        keys = [(layer, e) for layer in config.moe.sparse_layers for e in expert_ids]
        dtype = reader.view(expert_names(config, *keys[0])[0], shapes[0]).dtype
        numel = sum(math.prod(shape) for shape in shapes)
        with tempfile.NamedTemporaryFile(prefix="specmoe-expert-tier-") as f:
            f.truncate(len(keys) * numel * dtype.itemsize)
            flat = torch.from_file(f.name, shared=True, size=len(keys) * numel, dtype=dtype)
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        offset = 0
        for key in keys:
            views = []
            for name, (rows, cols) in zip(expert_names(config, *key), shapes):
                # (out, in) with column-major strides: the layout linear_layout gives the slots
                view = flat[offset:offset + rows * cols].view(cols, rows).t()
                view.copy_(reader.view(name, (rows, cols)))
                views.append(view)
                offset += rows * cols
            self._views[key] = views

    def load(self, layer: int, expert: int, dst: list[torch.Tensor]) -> None:
        """Convert one expert into ``dst`` (one same-layout ``copy_`` per tensor)."""
        for d, t in zip(dst, self._views[(layer, expert)]):
            d.copy_(t)
        return None


class PinnedHostTier:
    """The slow tier of a CUDA store: every held expert in pinned host memory, checkpoint dtype.

    A load is an asynchronous ``copy_`` (host -> device, with the dtype cast) on a side stream,
    after the compute stream's queued work (which may still read the slot being overwritten); the
    returned event orders the compute after the load.
    """

    def __init__(self, reader: CheckpointReader, config: ModelConfig, expert_ids: list[int], device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        shapes = expert_shapes(config)
        self.host = {(layer, e): [reader.get(n, s).pin_memory() for n, s in zip(expert_names(config, layer, e), shapes)]
                     for layer in config.moe.sparse_layers for e in expert_ids}

    def load(self, layer: int, expert: int, dst: list[torch.Tensor]):
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            for d, t in zip(dst, self.host[(layer, expert)]):
                d.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event


class SimulatedLinkTier:
    """A labelled simulation: ``inner``'s load, then a sleep until ``nbytes / bytes_per_s`` seconds
    have passed since it started, i.e. a slower link than this machine has (a PCIe or NVMe
    transfer of a larger model's expert). Sleeping models a DMA copy: it holds no CPU and no GIL.
    ``nbytes``: one expert in the checkpoint dtype (what such a link would carry)."""

    def __init__(self, inner: SpillFileTier | PinnedHostTier, nbytes: int, bytes_per_s: float) -> None:
        self.inner, self.seconds = inner, nbytes / bytes_per_s

    def load(self, layer: int, expert: int, dst: list[torch.Tensor]):
        start = time.perf_counter()
        done = self.inner.load(layer, expert, dst)
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - start)))
        return done
