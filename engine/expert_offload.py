"""An expert store with a resident budget: experts load on demand or ahead of need (prefetch).

:class:`OffloadedExpertStore` computes like :class:`engine.model.ExpertStore` (same rows in, same
rows out, bit for bit: each expert's rows go through the same :func:`kernels.expert_ffn.expert_ffn`)
but keeps at most a budget of (layer, expert) weights resident; the rest live in a slower tier:

* CPU: a memory-mapped spill file of the held experts in the checkpoint dtype (bf16), in the
  slots' layout, written from the checkpoint at start (:class:`engine.expert_tiers.SpillFileTier`):
  a load converts them to the compute dtype (pages not in the page cache are read from disk then).
* CUDA: pinned host memory in the checkpoint dtype (:class:`engine.expert_tiers.PinnedHostTier`):
  a load is an asynchronous host-to-device copy plus the dtype conversion on a side CUDA stream;
  the compute stream waits on the load's event, so no host sync.

Prefetches (:meth:`OffloadedExpertStore.prefetch`, fed by :class:`engine.expert_predictor.PreGatePredictor`'s
hints) run on one loader thread, overlapping the caller's compute and the verifier's next
attention; which entries stay resident is :class:`engine.expert_cache.ExpertCache`'s policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.expert_cache import CacheStats, ExpertCache, Key, Lookup
from engine.expert_tiers import PinnedHostTier, SimulatedLinkTier, SpillFileTier
from engine.model.moe import expert_entry_bytes, expert_shapes
from engine.model.names import expert_names
from kernels.expert_ffn import expert_ffn, linear_layout

log = logging.getLogger(__name__)

# on_load(layer, expert, start_s, end_s, prefetch, trace): one finished load (time.time() seconds);
# ``trace`` is what the forward or prefetch call that caused it passed (e.g. a trace carrier).
LoadHook = Callable[[int, int, float, float, bool, Any], None]


class OffloadedExpertStore:
    """Some experts of every MoE layer, at most ``capacity`` (layer, expert) entries resident.

    The resident weights are one preallocated slot pool per projection (``(capacity, I, H)``,
    ``(capacity, I, H)``, ``(capacity, H, I)`` in the compute dtype, on ``device``): a load writes an
    expert into a free slot, an eviction frees it, and a layer runs as one ``expert_ffn`` call over
    the pool with its rows reordered by slot (so the byte budget is exact and the CUDA kernel applies).

    Args:
        reader, config, expert_ids, dtype, device: as :class:`engine.model.ExpertStore`.
        max_resident: resident entries (experts x layers); or ``max_resident_bytes``: a byte budget
            of resident weights (compute dtype), converted to entries.
        num_pinned: hottest entries never evicted (:class:`ExpertCache`).
        prefetch: False ignores :meth:`prefetch` hints (demand loads only).
        simulated_link_gbps: labelled simulation (:class:`SimulatedLinkTier`): every load takes at
            least one expert's checkpoint bytes at this many GB/s (None: the real tier only).
        on_load: called after every load (spans); must not raise.

    Raises:
        ValueError: no budget, or one smaller than one layer's held experts plus ``num_pinned``
            (a layer's experts must fit at once).
    """

    def __init__(self, reader: CheckpointReader, config: ModelConfig, expert_ids: Iterable[int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 max_resident: int | None = None, max_resident_bytes: int | None = None, num_pinned: int = 0,
                 prefetch: bool = True, simulated_link_gbps: float | None = None,
                 on_load: LoadHook | None = None) -> None:
        self.config, self.expert_ids = config, sorted(expert_ids)
        shapes = expert_shapes(config)
        self.entry_bytes = expert_entry_bytes(config, dtype)
        capacity = max_resident if max_resident is not None else (
            max_resident_bytes // self.entry_bytes if max_resident_bytes is not None else None)
        if capacity is None or capacity < len(self.expert_ids) + num_pinned:
            raise ValueError(f"resident budget of {capacity} experts (of {self.entry_bytes} bytes) is below one "
                             f"layer's {len(self.expert_ids)} held experts plus {num_pinned} pinned")
        self.cache = ExpertCache(capacity, num_pinned, on_evict=self._free_slot,
                                 layer_order=list(config.moe.sparse_layers))
        self.pool = [linear_layout(torch.empty((capacity, *s), dtype=dtype, device=device)) for s in shapes]
        self.prefetch_enabled, self.on_load = prefetch, on_load
        cuda = torch.device(device).type == "cuda"
        self.tier = PinnedHostTier(reader, config, self.expert_ids, device) if cuda else SpillFileTier(reader, config, self.expert_ids)
        if simulated_link_gbps is not None:
            first = reader.get(expert_names(config, config.moe.sparse_layers[0], self.expert_ids[0])[0])
            disk_bytes = expert_entry_bytes(config, first.dtype)  # in the checkpoint's dtype
            self.tier = SimulatedLinkTier(self.tier, disk_bytes, simulated_link_gbps * 1e9)
        self._held = set(self.expert_ids)
        self._lock = threading.Lock()  # every cache and slot update; loads run outside it
        self._forward_lock = threading.Lock()  # one layer in use at a time, so one always fits
        self._slots: dict[Key, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._loading: dict[Key, threading.Event] = {}  # reserved, not loaded yet
        self._claimed: set[Key] = set()  # loads under way
        self._failed: dict[Key, BaseException] = {}
        self._deferred: dict[int, set[int]] = {}  # next layer -> hinted experts of this run's calls
        self._reported = CacheStats()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="expert-prefetch")

    def load_all(self) -> None:
        """Nothing to load up front: entries load on first use (the slow tier is ready)."""

    def forward(self, layer: int, hidden: torch.Tensor, expert_counts: torch.Tensor, weights: torch.Tensor | None,
                prefetch: tuple[int, list[int]] | None = None, trace: Any = None) -> torch.Tensor:
        """Run the held experts on rows grouped in ``expert_ids`` order (as ``ExpertStore.forward``).

        Args:
            hidden: ``(rows, hidden_size)``; expert_counts: ``(len(expert_ids),)`` int64;
            weights: optional ``(rows,)`` float32 routing weights applied to the outputs.
            prefetch: ``(layer, expert_ids)`` predicted next: loaded in the background once this
                layer's compute is done and its entries released, so they are the first victims,
                as a demand miss of the next layer would choose (Belady with the cyclic layer
                order: the layer that just ran is needed furthest ahead). Issued before the
                compute, the loads could evict only older layers' entries, and every layer's
                experts were reloaded every pass (1639 loads against 947 without prefetch,
                replaying a k = 6 decode's routing with half the experts resident; 1175 now).
            trace: passed to ``on_load`` for the loads this call causes.

        Raises:
            CheckpointError: a needed expert cannot be read (names the tensor).
        """
        counts = expert_counts.tolist()
        keys = [(layer, e) for e, c in zip(self.expert_ids, counts) if c]
        with self._forward_lock:
            with self._lock:
                self.cache.begin_call(layer)
            lookups = self._acquire_all(keys)
            with self._lock:
                self.cache.expire_prefetches(layer)
            try:
                self._await(keys, lookups, trace)
                with self._lock:
                    slots = [self._slots[k] for k in keys]
                    events = [self.cache.value(k) for k in keys]
                out = self._compute(hidden, [c for c in counts if c], slots, events, weights)
            finally:
                with self._lock:
                    for k in keys:
                        self.cache.release(k)
            if prefetch is not None:
                self._prefetch_after_run(layer, *prefetch, trace=trace)
            return out

    def _prefetch_after_run(self, layer: int, next_layer: int, experts: list[int], trace: Any) -> None:
        """Prefetch at the last call of ``layer``'s run (micro-batches: every call's hints
        together). Issued after the first micro-batch, the loads could not evict the layer still
        to run a second time, so they evicted everything else: with a budget of two layers' experts,
        layers ``l`` and ``l + 1`` filled it and every pass reloaded all experts (2800 loads against
        1827 without prefetch, replaying a batch-8 decode's routing; 1935 now)."""
        with self._lock:
            pending = self._deferred.setdefault(next_layer, set())
            pending.update(experts)
            if self.cache.run_continues():
                return
            del self._deferred[next_layer]
        self.prefetch(next_layer, sorted(pending), trace=trace)

    def prefetch(self, layer: int, experts: Iterable[int], trace: Any = None) -> int:
        """Start background loads of the held ones of ``experts`` in ``layer``; returns how many
        were started (not already resident or loading, and room without evicting anything needed)."""
        if not self.prefetch_enabled:
            return 0
        keys = [(layer, e) for e in experts if e in self._held]
        with self._lock:
            started = [k for k in keys if self.cache.reserve_prefetch(k)]
            for k in started:
                self._take_slot(k)
        for k in started:
            self._loader.submit(self._load, k, True, trace)
        return len(started)

    def take_stats(self) -> CacheStats:
        """Counters since the previous call (the actor reports them with each answer)."""
        with self._lock:
            now = CacheStats(**self.cache.stats.as_dict())
            delta, self._reported = now.minus(self._reported), now
        return delta

    def snapshot(self) -> dict:
        """The counters since start (:class:`CacheStats` fields) and ``resident``: sorted keys."""
        with self._lock:
            return {**self.cache.stats.as_dict(), "resident": sorted(self.cache.resident())}

    def drain(self) -> None:
        """Wait until every prefetch started so far has landed (warm-up, tests)."""
        self._loader.submit(lambda: None).result()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    def _acquire_all(self, keys: list[Key]) -> list[Lookup]:
        """``_acquire`` every key of one layer call, the resident ones first: a miss may then
        evict only entries this call does not use (acquired in the given order, a miss could
        evict a layer-mate needed a moment later, which the cyclic layer order rates the
        furthest-needed victim; replaying a k = 6 decode's routing with half the experts
        resident, that doubled the loads: 1419 against 947, Belady's optimum 873)."""
        with self._lock:
            order = sorted(range(len(keys)), key=lambda i: keys[i] not in self.cache)
        found: dict[int, Lookup] = {}
        for i in order:
            found[i] = self._acquire(keys[i], [keys[j] for j, lk in found.items() if lk is Lookup.MISS])
        return [found[i] for i in range(len(keys))]

    def _acquire(self, key: Key, mine: list[Key]) -> Lookup:
        """``cache.acquire``; when full (slots held by prefetches in flight), wait for one to land
        (not for ``mine``: this call's own misses, which load only after every acquire)."""
        while True:
            with self._lock:
                lookup = self.cache.acquire(key)
                if lookup is Lookup.MISS:
                    self._take_slot(key)
                if lookup is not Lookup.FULL:
                    return lookup
                pending = next((e for k, e in self._loading.items() if k not in mine), None)
            if pending is None:  # cannot happen while one layer's experts fit (checked at init)
                raise RuntimeError(f"expert cache full with nothing loading (capacity {self.cache.capacity})")
            pending.wait()

    def _take_slot(self, key: Key) -> None:
        self._slots[key] = self._free.pop()
        self._loading[key] = threading.Event()

    def _free_slot(self, key: Key) -> None:
        self._free.append(self._slots.pop(key))

    def _await(self, keys: list[Key], lookups: list[Lookup], trace: Any) -> None:
        """Load this call's misses here, wait for its in-flight prefetches; the time is stall."""
        if all(lookup is Lookup.HIT for lookup in lookups):
            return
        start = time.perf_counter()
        try:
            for k, lookup in zip(keys, lookups):
                if lookup is Lookup.MISS:
                    self._load(k, False, trace)
                elif lookup is Lookup.PENDING:
                    self._load(k, True, trace)  # the loader thread may not have reached it yet
                    self._wait(k)  # done, or under way on the loader thread (raises its error)
        finally:
            with self._lock:
                self.cache.stats.stall_s += time.perf_counter() - start

    def _wait(self, key: Key) -> None:
        with self._lock:
            event = self._loading.get(key)
        if event is not None:
            event.wait()
        with self._lock:
            error = self._failed.get(key)
        if error is not None:
            raise error

    def _load(self, key: Key, prefetch: bool, trace: Any) -> bool:
        """Load ``key`` from the slow tier into its slot, unless another thread has started it
        (a caller needing a prefetch the loader thread has not reached loads it itself); returns
        whether this call loaded it."""
        start = time.time()
        with self._lock:
            if key in self._claimed or key not in self._loading:
                return False
            self._claimed.add(key)
            slot = self._slots[key]
        try:
            done = self.tier.load(*key, [p[slot] for p in self.pool])
        except BaseException as e:
            with self._lock:
                self.cache.discard(key)
                self._failed[key] = e
                self._claimed.discard(key)
                self._loading.pop(key).set()
            if prefetch:  # the use that needed it raises the error
                log.warning("prefetch of layer %d expert %d failed: %s", key[0], key[1], e)
                return True
            raise
        with self._lock:
            self.cache.fill(key, done)
            self._failed.pop(key, None)
            self._claimed.discard(key)
            self._loading.pop(key).set()
        if self.on_load is not None:
            try:
                self.on_load(key[0], key[1], start, time.time(), prefetch, trace)
            except Exception:
                log.debug("on_load hook failed", exc_info=True)
        return True

    def _compute(self, hidden: torch.Tensor, counts: list[int], slots: list[int], events: list,
                 weights: torch.Tensor | None) -> torch.Tensor:
        """One ``expert_ffn`` over the pool's slots from the lowest to the highest this call uses,
        its rows regrouped in slot order (unless they are in it already) and put back.

        Over that span, not the whole pool: on CPU the grouped GEMMs run one GEMM per slot, empty
        ones included, so ``expert_ffn`` takes them only when at least half the slots are used
        (``kernels.expert_ffn._grouped``); over the whole pool a layer's call nearly always fell
        back to three GEMMs per used expert (bundled model, 7 rows: 352 against 212 us a call
        with every entry resident).

        Args:
            counts: rows of each used expert (> 0), in ``hidden``'s order; slots: their slots;
            events: their load events (CUDA; None on CPU).
        """
        for event in events:
            if event is not None:
                torch.cuda.current_stream(hidden.device).wait_event(event)
        lo = min(slots)
        span = [0] * (max(slots) + 1 - lo)
        for slot, count in zip(slots, counts):
            span[slot - lo] = count
        pool = [p[lo:lo + len(span)] for p in self.pool]
        span_counts = torch.tensor(span, dtype=torch.int64)
        if all(a < b for a, b in zip(slots, slots[1:])):  # the rows are in slot order already
            return expert_ffn(hidden, span_counts, *pool, weights)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        order = sorted(range(len(slots)), key=slots.__getitem__)
        index = torch.tensor([r for j in order for r in range(starts[j], starts[j] + counts[j])],
                             dtype=torch.int64, device=hidden.device)
        out_by_slot = expert_ffn(hidden[index], span_counts, *pool, None if weights is None else weights[index])
        out = torch.empty_like(hidden)
        out[index] = out_by_slot
        return out
