"""Slot-based KV cache: one fixed-size row per running sequence, truncatable for rollback.

Speculative decoding writes k + 1 positions per step and keeps only the accepted ones; rollback is
just a shorter length, since positions beyond a sequence's length are never attended to and are
overwritten by the next write (see ``engine.model.layers.attention``'s causal mask).
"""

from __future__ import annotations

import heapq
import math

import torch

from engine.errors import ConfigError, SpecmoeError


class KVCacheFull(SpecmoeError):
    """No free slot, or a sequence would outgrow ``max_len``."""


class KVCache:
    """Keys and values of all layers for ``max_seqs`` sequences of up to ``max_len`` tokens.

    Attributes:
        k, v: ``(num_layers, max_seqs, num_kv_heads, max_len, head_dim)`` in ``dtype``.
        lengths: cached tokens per slot (host-side ints; the engine owns their meaning).
    """

    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, max_seqs, num_kv_heads, max_len, head_dim)
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as e:  # torch's allocator error names neither setting
            size_gib = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size() / 2**30
            raise ConfigError(f"max_model_len / max_num_seqs: the KV cache for {max_seqs} sequences of {max_len} "
                              f"tokens needs {size_gib:.1f} GiB on {device} and could not be allocated ({e}); "
                              f"lower max_model_len (default: the model's max_position_embeddings) or "
                              f"max_num_seqs") from e
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.lengths = [0] * max_seqs
        # A min-heap: the lowest free slot goes first, so sequences admitted together get
        # consecutive ascending slots again after earlier ones finished, and a batch's cache rows
        # stay a view (``ForwardBatch.slot_range``) instead of a gathered copy in every layer.
        self._free = list(range(max_seqs))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.max_seqs - len(self._free)

    def usage(self) -> float:
        """Fraction of cached token capacity in use, in [0, 1]."""
        return sum(self.lengths) / (self.max_seqs * self.max_len)

    def allocate(self) -> int:
        """Reserve a slot (length 0). Raises KVCacheFull when none is free."""
        if not self._free:
            raise KVCacheFull(f"all {self.max_seqs} KV cache slots are in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; freeing a free slot is an error (it would be handed out twice)."""
        if slot in self._free or not 0 <= slot < self.max_seqs:
            raise ValueError(f"KV slot {slot} is not allocated")
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def reserve(self, slot: int, new_length: int) -> None:
        """Record that ``slot`` will hold ``new_length`` tokens after the next forward."""
        if new_length > self.max_len:
            raise KVCacheFull(f"sequence needs {new_length} cached tokens, max_len is {self.max_len}")
        self.lengths[slot] = new_length

    def truncate(self, slot: int, length: int) -> None:
        """Roll a sequence back to its first ``length`` tokens."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length
