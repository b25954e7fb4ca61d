"""Ray actor holding some experts of every MoE layer: a thin shim over :class:`ExpertStore`."""

from __future__ import annotations

import os
import time

import numpy as np
import ray

from actors.wire import from_bytes, from_wire, to_bytes, to_wire


class ExpertWorker:
    """Computes the expert FFN for token groups of the experts it holds.

    Args:
        checkpoint: target checkpoint directory; only this actor's experts are read, lazily.
        expert_ids: experts held (sorted), the same for every MoE layer.
        dtype, device: weight/activation dtype and device.
        torch_threads: torch intra-op threads (1 on CPU, so actors share cores fairly).
        tracing: :class:`observability.TracingConfig` as builtins (None: environment only).
    """

    def __init__(self, checkpoint: str, expert_ids: list[int], dtype: str = "float32", device: str = "cpu",
                 torch_threads: int = 1, tracing: dict | None = None) -> None:
        import torch

        from engine.checkpoint import CheckpointReader
        from engine.config import load_model_config
        from engine.loader import resolve_dtype
        from engine.model import ExpertStore

        torch.set_num_threads(torch_threads)
        self.dtype = resolve_dtype(dtype)
        self.device = device
        config = load_model_config(checkpoint)
        self.store = ExpertStore(CheckpointReader(checkpoint), config, expert_ids, self.dtype, device)
        self.expert_ids = self.store.expert_ids
        # Guest replicas (actors.replication): other groups' experts, refcounted by their hosts.
        self.guests: dict[tuple[int, ...], tuple[ExpertStore, int]] = {}
        self.delay_s = 0.0
        self.num_calls = 0
        self.actor_id = _actor_id()
        self._setup_tracing(tracing)

    def _setup_tracing(self, tracing: dict | None) -> None:
        import msgspec

        from observability import TracingConfig, setup_tracing

        setup_tracing("expert", msgspec.convert(tracing, TracingConfig) if tracing else None)

    def forward(self, layer: int, counts: list[int], hidden: np.ndarray, weights: np.ndarray,
                sent_time_s: float, carrier: dict | None = None,
                experts: list[int] | None = None) -> tuple[np.ndarray, dict]:
        """Run held experts on grouped rows (the ``actor_calls`` transport: one Ray call).

        Args:
            layer: MoE layer index.
            counts: rows per held expert, in ``expert_ids`` order.
            hidden: ``(rows, hidden_size)`` rows grouped by expert (wire format of the dtype).
            weights: ``(rows,)`` float32 routing weights applied to the outputs.
            sent_time_s: caller's ``time.time()`` when sending (queue time = start - sent).
            carrier: W3C trace context of the caller's call span.
            experts: a guest group held via :meth:`host_experts` (``counts`` in its order); None:
                this actor's own experts.

        Returns:
            ``(rows, hidden_size)`` weighted expert outputs (wire format), and timings: ``queue_ms``,
            ``compute_ms``, ``start_s`` (this actor's ``time.time()``), ``actor_id``.
        """
        import torch

        start = time.time()
        x = from_wire(hidden, self.dtype, self.device)
        w = torch.from_numpy(np.array(weights, copy=True)).to(self.device)
        return self._compute(layer, counts, x, w, start, sent_time_s, carrier, to_wire, experts)

    def forward_graph(self, request: tuple, index: int) -> tuple[bytes, dict] | None:
        """This actor's part of one compiled-graph execution (the ``compiled_graph`` transport).

        Args:
            request: ``(layer, calls, sent_time_s)`` shared by every actor of the graph; ``calls[index]``
                is None (nothing for this actor this layer) or ``(counts, hidden, weights, carrier[, experts])``
                with ``hidden`` the bytes of ``(sum(counts), hidden_size)`` rows and ``weights`` the
                bytes of ``(sum(counts),)`` float32 (:func:`actors.wire.to_bytes`). ``layer`` None is
                the warm-up execution after compiling.
            index: this actor's position in the graph (bound at compile time).

        Returns:
            The output rows as bytes and the timings of :meth:`forward`, or None when there was
            nothing to do.
        """
        import torch

        start = time.time()
        layer, calls, sent_time_s = request
        call = calls[index] if layer is not None else None
        if call is None:
            return None
        counts, hidden, weights, carrier, *experts = call
        rows = sum(counts)
        x = from_bytes(hidden, (rows, self.store.config.hidden_size), self.dtype, self.device)
        w = from_bytes(weights, (rows,), torch.float32, self.device)
        return self._compute(layer, counts, x, w, start, sent_time_s, carrier, to_bytes, *experts)

    def _compute(self, layer: int, counts: list[int], x, w, start: float, sent_time_s: float,
                 carrier: dict | None, encode, experts: list[int] | None = None) -> tuple:
        import torch

        queue_ms = max(0.0, (start - sent_time_s) * 1e3)
        if self.delay_s:  # artificial straggler, for tests and demos
            time.sleep(self.delay_s)
        store = self.store if experts is None else self.guests[tuple(experts)][0]
        out = store.forward(layer, x, torch.tensor(counts, dtype=torch.int64), w)
        result = encode(out)  # the host copy for the wire is part of the compute time
        compute_ms = (time.time() - start) * 1e3
        self.num_calls += 1
        timing = {"queue_ms": queue_ms, "compute_ms": compute_ms, "actor_id": self.actor_id, "start_s": start}
        self._trace(layer, counts, timing, carrier)
        return result, timing

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
            store, refs = ExpertStore(self.store._reader, self.store.config, key, self.dtype, self.device), 0
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
        """Load every held weight now (rather than on first call); returns parameters held."""
        self.store.load_all()
        return sum(w.numel() for layer in self.store.config.moe.sparse_layers for w in self.store.weights(layer))

    def info(self) -> dict:
        return {"expert_ids": self.expert_ids, "pid": os.getpid(), "num_calls": self.num_calls,
                "actor_id": self.actor_id, "node_id": ray.get_runtime_context().get_node_id()}


def _actor_id() -> str:
    try:
        return ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
    except Exception:
        return f"pid-{os.getpid()}"


ExpertActor = ray.remote(ExpertWorker)
