"""Ray actor holding some experts of every MoE layer: a thin shim over :class:`ExpertStore`."""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import ray

from actors.graph_park import GraphParking
from actors.wire import from_bytes, from_wire, to_bytes, to_wire


class ExpertWorker(GraphParking):
    """Computes the expert FFN for token groups of the experts it holds.

    Args:
        checkpoint: target checkpoint directory; only this actor's experts are read, lazily.
        expert_ids: experts held (sorted), the same for every MoE layer.
        dtype, device: weight/activation dtype and device.
        torch_threads: torch intra-op threads (1 on CPU, so actors share cores fairly).
        tracing: :class:`observability.TracingConfig` as builtins (None: environment only).
        offload: a resident budget (:meth:`actors.expert_config.ExpertPoolConfig.offload_settings`): the
            experts live in an :class:`engine.expert_offload.OffloadedExpertStore`; None: all resident.
    """

    def __init__(self, checkpoint: str, expert_ids: list[int], dtype: str = "float32", device: str = "cpu",
                 torch_threads: int = 1, tracing: dict | None = None, offload: dict | None = None) -> None:
        import torch

        from engine.checkpoint import CheckpointReader
        from engine.config import load_model_config
        from engine.loader import resolve_dtype

        super().__init__()
        torch.set_num_threads(torch_threads)
        self.dtype = resolve_dtype(dtype)
        self.device = device
        self._config, self._reader = load_model_config(checkpoint), CheckpointReader(checkpoint)
        self._held = expert_ids
        self._stores: dict = {}
        self.set_offload(offload)
        self.expert_ids = self.store.expert_ids
        # Guest replicas (actors.replication): other groups' experts, refcounted by their hosts.
        self.guests: dict[tuple[int, ...], tuple] = {}  # key -> (ExpertStore, refcount)
        self.delay_s = 0.0
        self.num_calls = 0
        # Computations in progress (both concurrency slots may compute): id -> time.monotonic() at start.
        self._computing: dict[int, float] = {}
        self._compute_ids = itertools.count()
        self.actor_id = _actor_id()
        self._setup_tracing(tracing)

    def set_offload(self, offload: dict | None) -> None:
        """Use the store for these settings (``ExpertPoolConfig.offload_settings()``; None: all
        resident). A store built before for the same settings comes back with its cache as it was
        (``benchmarks/offload.py`` interleaves variants on one live actor so). Call between calls."""
        key = None if offload is None else tuple(sorted(offload.items()))
        if key not in self._stores:
            if offload is None:
                from engine.model import ExpertStore

                store = ExpertStore(self._reader, self._config, self._held, self.dtype, self.device)
            else:
                from engine.expert_offload import OffloadedExpertStore

                store = OffloadedExpertStore(self._reader, self._config, self._held, self.dtype, self.device,
                                             **offload, on_load=_trace_load)
            self._stores[key] = store
        self.store, self.offload = self._stores[key], offload is not None

    def _setup_tracing(self, tracing: dict | None) -> None:
        import msgspec

        from observability import TracingConfig, setup_tracing

        setup_tracing("expert", msgspec.convert(tracing, TracingConfig) if tracing else None)

    def forward(self, layer: int, counts: list[int], hidden: np.ndarray, weights: np.ndarray,
                sent_time_s: float, carrier: dict | None = None,
                hint: list | None = None, experts: list[int] | None = None) -> list:
        """Run held experts on grouped rows (the ``actor_calls`` transport: one Ray call).

        Args:
            layer: MoE layer index.
            counts: rows per held expert, in ``expert_ids`` order.
            hidden: ``(rows, hidden_size)`` rows grouped by expert (wire format of the dtype).
            weights: ``(rows,)`` float32 routing weights applied to the outputs.
            sent_time_s: caller's ``time.time()`` when sending (queue time = start - sent).
            carrier: W3C trace context of the caller's call span.
            hint: ``[layer, expert_ids]`` predicted for the next MoE layer: prefetched (offload only).
            experts: a guest group held via :meth:`host_experts` (``counts`` in its order); None:
                this actor's own experts.

        Returns:
            ``[output, timings]``: the ``(rows, hidden_size)`` weighted expert outputs (wire
            format), and timings: ``queue_ms``, ``compute_ms``, ``start_s`` (this actor's
            ``time.time()``), ``actor_id``; with offload also ``cache``: the cache counters since
            the previous answer (:class:`engine.expert_cache.CacheStats` as a dict).
        """
        import torch

        start = time.time()
        x = from_wire(hidden, self.dtype, self.device)
        w = torch.from_numpy(np.array(weights, copy=True)).to(self.device)
        return self._compute(layer, counts, x, w, start, sent_time_s, carrier, hint, to_wire, experts)

    def forward_graph(self, request: list | str, index: int) -> list | None:
        """This actor's part of one compiled-graph execution (the ``compiled_graph`` transport).

        Args:
            request: ``[layer, calls, sent_time_s]`` shared by every actor of the graph; ``calls[index]``
                is None (nothing for this actor this layer) or ``[counts, hidden, weights, carrier, hint[, experts]]``
                with ``hidden`` the bytes of ``(sum(counts), hidden_size)`` rows and ``weights`` the
                bytes of ``(sum(counts),)`` float32 (:func:`actors.wire.to_bytes`). ``layer`` None is
                the warm-up execution after compiling; :data:`actors.graph_park.PARK` parks the
                actor until :meth:`wake_graph`.
            index: this actor's position in the graph (bound at compile time).

        Returns:
            ``[output rows as bytes, timings of :meth:`forward`]``, or None when there was nothing
            to do.
        """
        import torch

        start = time.time()
        if self._parked(request):
            return None
        layer, calls, sent_time_s = request
        call = calls[index] if layer is not None else None
        if call is None:
            return None
        counts, hidden, weights, carrier, hint, *experts = call
        rows = sum(counts)
        x = from_bytes(hidden, (rows, self.store.config.hidden_size), self.dtype, self.device)
        w = from_bytes(weights, (rows,), torch.float32, self.device)
        return self._compute(layer, counts, x, w, start, sent_time_s, carrier, hint, to_bytes, *experts)

    def _compute(self, layer: int, counts: list[int], x, w, start: float, sent_time_s: float,
                 carrier: dict | None, hint: list | None, encode,
                 experts: list[int] | None = None) -> list:
        key = next(self._compute_ids)
        self._computing[key] = time.monotonic()
        try:
            return self._compute_now(layer, counts, x, w, start, sent_time_s, carrier, hint, encode, experts)
        finally:
            del self._computing[key]

    def busy_s(self) -> float:
        """How long (s) the oldest computation in progress has been running; 0.0 when idle.

        Answered on the actor's second thread, so a caller can tell an actor stuck in its forward
        (a hung kernel or collective that released the GIL) from one that is slow to be reached."""
        now = time.monotonic()
        return now - min(list(self._computing.values()), default=now)  # list(): one atomic copy

    def _compute_now(self, layer: int, counts: list[int], x, w, start: float, sent_time_s: float,
                     carrier: dict | None, hint: list | None, encode,
                     experts: list[int] | None) -> list:
        import torch

        queue_ms = max(0.0, (start - sent_time_s) * 1e3)
        if self.delay_s:  # artificial straggler, for tests and demos
            time.sleep(self.delay_s)
        expert_counts = torch.tensor(counts, dtype=torch.int64)
        if experts is not None:  # a guest replica of another group: always resident
            out = self.guests[tuple(experts)][0].forward(layer, x, expert_counts, w)
        elif self.offload:
            out = self.store.forward(layer, x, expert_counts, w, prefetch=hint, trace=carrier)
        else:
            out = self.store.forward(layer, x, expert_counts, w)
        result = encode(out)  # the host copy for the wire is part of the compute time
        compute_ms = (time.time() - start) * 1e3
        self.num_calls += 1
        timing = {"queue_ms": queue_ms, "compute_ms": compute_ms, "actor_id": self.actor_id, "start_s": start}
        if self.offload:
            timing["cache"] = self.store.take_stats().as_dict()
        self._trace(layer, counts, timing, carrier)
        return [result, timing]  # a list: a graph channel pickles tuples (ExpertRouter._submit_graph)

    def _trace(self, layer: int, counts: list[int], timing: dict, carrier: dict | None) -> None:
        """The actor-side span of this call: a child of the router's call span."""
        if carrier is None:
            return
        from observability import SpanKind, emit_span
        from observability import semconv as sc

        start_ns = int(timing["start_s"] * 1e9)
        emit_span(sc.SPAN_EXPERT_COMPUTE, start_ns, start_ns + int(timing["compute_ms"] * 1e6), {
            sc.MOE_LAYER: layer, sc.EXPERT_ID: ",".join(str(e) for e, c in zip(self.expert_ids, counts) if c),
            sc.EXPERT_REPLICA: self.actor_id, sc.EXPERT_NUM_TOKENS: sum(counts),
            sc.EXPERT_QUEUE_TIME_MS: timing["queue_ms"], sc.EXPERT_COMPUTE_TIME_MS: timing["compute_ms"],
        }, carrier=carrier, kind=SpanKind.SERVER)

    def set_delay_ms(self, delay_ms: float) -> None:
        """Make every call sleep ``delay_ms`` first (a configured artificial straggler)."""
        self.delay_s = delay_ms / 1e3

    def host_experts(self, expert_ids: list[int]) -> None:
        """Also hold ``expert_ids`` (a guest replica of another group), loaded now; refcounted."""
        from engine.model import ExpertStore

        key = tuple(sorted(expert_ids))
        if key in self.guests:
            store, refs = self.guests[key]
        else:
            store, refs = ExpertStore(self._reader, self._config, key, self.dtype, self.device), 0
            store.load_all()
        self.guests[key] = (store, refs + 1)

    def drop_experts(self, expert_ids: list[int]) -> None:
        """Release one :meth:`host_experts` of ``expert_ids``; the weights go at the last one."""
        key = tuple(sorted(expert_ids))
        if key in self.guests:
            store, refs = self.guests.pop(key)
            if refs > 1:
                self.guests[key] = (store, refs - 1)

    def load(self) -> int:
        """Load every held weight now (rather than on first call; with offload nothing loads
        before use); returns parameters held (resident or not)."""
        import math

        from engine.model.moe import expert_shapes

        self.store.load_all()
        config = self.store.config
        per_expert = sum(math.prod(s) for s in expert_shapes(config))
        return per_expert * len(self.expert_ids) * len(config.moe.sparse_layers)

    def cache_stats(self) -> dict | None:
        """Offload only: the cache's counters since start, and the resident (layer, expert) keys."""
        return self.store.snapshot() if self.offload else None

    def info(self) -> dict:
        return {"expert_ids": self.expert_ids, "pid": os.getpid(), "num_calls": self.num_calls,
                "actor_id": self.actor_id, "node_id": ray.get_runtime_context().get_node_id()}


def _trace_load(layer: int, expert: int, start_s: float, end_s: float, prefetch: bool, carrier: dict | None) -> None:
    """The span of one expert load (slow tier -> resident), under the call that caused it."""
    if carrier is None:
        return
    from observability import emit_span
    from observability import semconv as sc

    emit_span(sc.SPAN_EXPERT_LOAD, int(start_s * 1e9), int(end_s * 1e9), {
        sc.MOE_LAYER: layer, sc.EXPERT_ID: str(expert), sc.EXPERT_LOAD_PREFETCH: prefetch}, carrier=carrier)


def _actor_id() -> str:
    try:
        return ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
    except Exception:
        return f"pid-{os.getpid()}"


ExpertActor = ray.remote(ExpertWorker)
