"""Resident-set policy of an offloading expert store: which (layer, expert) weights stay loaded.

An entry is one expert of one MoE layer (the unit that is loaded and evicted). The policy is
LRFU (Lee et al., "LRFU: a spectrum of policies that subsumes LRU and LFU", IEEE ToC 2001): each
entry's combined recency and frequency is ``CRF(t) = sum_i 2^(-decay * (t - t_i))`` over its past
uses ``t_i`` (``t`` counts uses), so ``decay = 0`` is LFU and large ``decay`` is LRU. The victim is
the evictable entry with the lowest CRF, where evictable means: loaded, not in use (reference count
zero), not pinned (the ``num_pinned`` resident entries with the most uses since they were loaded:
the hot experts, whatever the decay), and preferably not a prefetch still waiting for its first
use (evicting one of those wastes the prefetch; only a demand load may do it).

Layers run in a fixed cyclic order (every forward pass goes 0, 1, ..., L-1), so with
``layer_order`` the victim is first taken from the layer whose next run is furthest away (the one
that just ran), LRFU choosing within it: Belady's MIN (evict the entry needed furthest in the
future; Belady 1966) with the layer order as the oracle. Plain LRU is the worst case of a cyclic
pattern larger than the cache (it evicts exactly the layer needed next). With two micro-batches
(two-batch overlap) every layer runs twice in a row (A0, B0, A1, B1, ...): the store marks each
layer call (:meth:`ExpertCache.begin_call`), and while the running layer has calls to come (as
many as its previous run had) its entries count as needed next, not furthest, and its prefetches
do not expire yet (the store also holds back the run's hints until its last call). Without that, prefetches issued after A's call evicted the experts B's call
of the same layer needed a moment later (replaying a batch-8 decode's routing with half the
experts resident: 5074 loads against 1837 without prefetch).

This class is bookkeeping only (no tensors, no threads): :class:`engine.expert_offload.OffloadedExpertStore`
owns the weights and the lock around every call here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

Key = tuple[int, int]  # (layer, expert)


class Lookup(Enum):
    """What :meth:`ExpertCache.acquire` found."""

    HIT = "hit"  # loaded: use it now
    PENDING = "pending"  # a load is in flight: wait for it
    MISS = "miss"  # absent: a slot is reserved, the caller loads it and calls ``fill``
    FULL = "full"  # absent and no room (every entry in use, pinned or loading): retry after a load


@dataclass
class CacheStats:
    """Counters of one cache (``stall_s``: seconds callers waited for loads).

    ``hits + misses`` is the number of demand uses; a use of an entry whose prefetch had not finished
    is a miss (and a used prefetch). ``prefetches_wasted``: prefetched entries not used by the run
    of their layer that followed (or evicted or failed before it).
    """

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0
    stall_s: float = 0.0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def minus(self, other: CacheStats) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def hit_rate(self) -> float | None:
        uses = self.hits + self.misses
        return self.hits / uses if uses else None


@dataclass
class _Entry:
    value: Any = None
    ready: bool = False
    refs: int = 0  # uses in progress (never evicted while > 0)
    crf: float = 0.0  # LRFU value at time ``last``
    last: int = 0
    uses: int = 0  # demand uses since loaded (pinning)
    prefetched: bool = False  # loaded by a prefetch and not used yet


class ExpertCache:
    """At most ``capacity`` entries (resident or loading).

    Args:
        capacity: resident entries (experts x layers) allowed.
        num_pinned: the hottest entries (most uses while resident) are never evicted.
        decay: LRFU's lambda per use (see module docstring).
        on_evict: called with each key that leaves (evicted or discarded), e.g. to free its memory.
        layer_order: the MoE layers in forward order: victims come first from the layer whose next
            run is furthest away (see module docstring); None: LRFU alone.

    Raises:
        ValueError: ``capacity < 1``, ``num_pinned < 0`` or ``num_pinned >= capacity``.
    """

    def __init__(self, capacity: int, num_pinned: int = 0, decay: float = 0.001,
                 on_evict: Callable[[Key], None] | None = None, layer_order: list[int] | None = None) -> None:
        if capacity < 1 or not 0 <= num_pinned < capacity:
            raise ValueError(f"capacity must be >= 1 and 0 <= num_pinned < capacity, got {capacity}, {num_pinned}")
        self.capacity, self.num_pinned, self.decay = capacity, num_pinned, decay
        self.stats = CacheStats()
        self.on_evict = on_evict or (lambda key: None)
        self._entries: dict[Key, _Entry] = {}
        self._clock = 0
        self._position = {layer: i for i, layer in enumerate(layer_order or [])}
        self._current = 0  # position of the layer of the latest use
        self._run_layer: int | None = None  # the layer of the latest call (begin_call) ...
        self._run_calls = 0  # ... its calls so far in this run of consecutive calls
        self._run_length = 1  # calls in the previous run (2 with two micro-batches)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def resident(self) -> list[Key]:
        """Keys whose weights are loaded."""
        return [k for k, e in self._entries.items() if e.ready]

    def value(self, key: Key) -> Any:
        return self._entries[key].value

    def in_use(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.refs > 0

    def begin_call(self, layer: int) -> None:
        """A call of ``layer`` begins (before acquiring its entries): consecutive calls of one
        layer are one run (its micro-batches), whose length predicts the next run's."""
        if layer == self._run_layer:
            self._run_calls += 1
        else:
            if self._run_layer is not None:
                self._run_length = self._run_calls
            self._run_layer, self._run_calls = layer, 1
        self._current = self._position.get(layer, 0)

    def run_continues(self) -> bool:
        """Whether the latest call's layer has more calls to come in this run (micro-batches)."""
        return self._run_calls < self._run_length

    def acquire(self, key: Key) -> Lookup:
        """A demand use of ``key``: counted, scored, and held (no eviction) until :meth:`release`.

        On MISS the entry is inserted as loading (evicting if full): the caller loads it and calls
        :meth:`fill` (or :meth:`discard`); a concurrent use meanwhile gets PENDING. FULL: nothing
        changed or counted (no room until a load in flight finishes).
        """
        self._current = self._position.get(key[0], 0)
        entry = self._entries.get(key)
        lookup = Lookup.HIT if entry is not None and entry.ready else Lookup.PENDING
        if entry is None:
            if len(self._entries) >= self.capacity and not self._evict(allow_prefetched=True):
                return Lookup.FULL
            entry = self._entries[key] = _Entry()
            lookup = Lookup.MISS
        self._touch(entry)
        entry.refs += 1
        entry.uses += 1
        if entry.prefetched:
            entry.prefetched = False
            self.stats.prefetches_used += 1
        if lookup is Lookup.HIT:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return lookup

    def release(self, key: Key) -> None:
        """End a use from :meth:`acquire` (a discarded entry has none left)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs -= 1

    def reserve_prefetch(self, key: Key) -> bool:
        """Reserve a slot for a prefetch of ``key`` (the caller loads it, then :meth:`fill`).

        Returns False when ``key`` is already present or loading, or when the only way to make room
        would evict an entry in use, a pinned one, another unused prefetch, or one of the same layer
        (the prefetches of a layer come together: they must not evict each other's layer-mates).
        """
        if key in self._entries:
            return False
        if len(self._entries) >= self.capacity and not self._evict(allow_prefetched=False, keep_layer=key[0]):
            return False
        self._entries[key] = _Entry(prefetched=True)
        self.stats.prefetches += 1
        return True

    def expire_prefetches(self, layer: int) -> None:
        """``layer`` is running now: its prefetches not used by this run were mispredictions and
        lose their protection (counted as wasted; call after acquiring the run's entries). Not
        before the run's last call (:meth:`begin_call`): another micro-batch may use them."""
        if layer == self._run_layer and self.run_continues():
            return
        for key, entry in self._entries.items():
            if key[0] == layer and entry.prefetched:
                entry.prefetched = False
                self.stats.prefetches_wasted += 1

    def fill(self, key: Key, value: Any) -> None:
        """The load of ``key`` finished: its weights are ``value``."""
        entry = self._entries[key]
        entry.value, entry.ready = value, True
        self.stats.loads += 1

    def discard(self, key: Key) -> None:
        """A load of ``key`` failed: forget the entry, uses included (a later use loads it again)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.stats.prefetches_wasted += entry.prefetched
            self.on_evict(key)

    def _touch(self, entry: _Entry) -> None:
        self._clock += 1
        entry.crf = 1.0 + self._crf_now(entry)
        entry.last = self._clock

    def _distance(self, layer: int) -> int:
        """Layer runs until ``layer`` runs again, in the cyclic layer order: 1 for the next one,
        ``L`` for the running one (its entries not in use now are needed next pass), or 0 while
        its run has calls to come (another micro-batch needs them next); 0 without an order."""
        n = len(self._position)
        if n and layer == self._run_layer and self.run_continues():
            return 0
        return (self._position[layer] - self._current - 1) % n + 1 if n else 0

    def _crf_now(self, entry: _Entry) -> float:
        return entry.crf * 2.0 ** (-self.decay * (self._clock - entry.last))

    def _evict(self, allow_prefetched: bool, keep_layer: int | None = None) -> bool:
        """Drop the best victim (never one of ``keep_layer``); False when there is none.

        The victim is the least of ``(prefetched, -distance, CRF, key)`` over the entries that may
        go. One pass, each layer's distance worked out once: every load of an offloading actor
        evicts, and the rule as one sort over all entries cost ~28 us a load (the bundled model's
        loads take ~26 us)."""
        pinned = self._pinned() if self.num_pinned else ()
        distance: dict[int, int] = {}
        best = None
        for k, e in self._entries.items():
            if (not e.ready or e.refs or k[0] == keep_layer or (e.prefetched and not allow_prefetched)
                    or k in pinned):
                continue
            d = distance.get(k[0])
            if d is None:
                d = distance[k[0]] = self._distance(k[0])
            rank = (e.prefetched, -d, self._crf_now(e), k)
            if best is None or rank < best:
                best = rank
        if best is None:
            return False
        prefetched, key = best[0], best[3]
        del self._entries[key]
        self.stats.evictions += 1
        self.stats.prefetches_wasted += prefetched
        self.on_evict(key)
        return True

    def _pinned(self) -> set[Key]:
        """The ``num_pinned`` ready entries with the most uses (ties: the earlier inserted)."""
        ready = [(k, e) for k, e in self._entries.items() if e.ready]
        return {k for k, _ in sorted(ready, key=lambda ke: -ke[1].uses)[:self.num_pinned]}
