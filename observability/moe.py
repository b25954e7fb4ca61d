"""One call per MoE layer dispatch for the expert router: stragglers, metrics, spans.

The router times each expert call itself (``time.time_ns()`` around the awaited Ray call),
and after the dispatch's calls have all returned hands them to ``DispatchRecorder.record``,
inside the layer's ``specmoe.moe.dispatch`` span. Expert-call spans are emitted after the
fact (``emit_span``) because the straggler flag needs every latency of the dispatch.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from observability import semconv as sc
from observability._safe import safe
from observability.metrics import EngineMetrics
from observability.spans import emit_span, set_attributes
from observability.stragglers import LatencyTracker, StragglerDetector

logger = logging.getLogger("observability")


@dataclass(slots=True)
class ExpertCall:
    """One expert call of a dispatch as the router saw it.

    Attributes:
        expert: expert id within the layer.
        num_tokens: tokens sent to the expert.
        start_ns: ``time.time_ns()`` just before the call was sent.
        end_ns: ``time.time_ns()`` when its result (or error) came back.
        replica: Ray actor id (or any replica key) that served it.
        compute_time_ms: time the actor spent computing, as it reported (ms); the rest of the
            round trip is recorded as queue time (queueing + transfer + (de)serialisation).
        error: exception type name if the call failed (excluded from straggler detection).
    """

    expert: int
    num_tokens: int
    start_ns: int
    end_ns: int
    replica: str | None = None
    compute_time_ms: float | None = None
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        """Round trip as seen by the router, milliseconds."""
        return max(0, self.end_ns - self.start_ns) / 1e6


class DispatchRecorder:
    """Bundles a ``StragglerDetector``, optional ``EngineMetrics`` and ``LatencyTracker``.

    Args:
        detector: straggler rule; default ``StragglerDetector()`` (3x median, 5 ms floor).
        metrics: verifier's ``EngineMetrics``; None records no metrics.
        tracker: per-replica EWMA latency, updated with every successful call; None skips it.
        emit_spans: emit one ``specmoe.expert.call`` span per call (children of the current
            span, i.e. the dispatch span when called inside it).
    """

    def __init__(self, detector: StragglerDetector | None = None, metrics: EngineMetrics | None = None,
                 tracker: LatencyTracker | None = None, *, emit_spans: bool = True) -> None:
        self.detector = detector if detector is not None else StragglerDetector()
        self.metrics = metrics
        self.tracker = tracker
        self.emit_spans = emit_spans

    @safe
    def record(self, layer: int, calls: Sequence[ExpertCall], *, num_experts: int | None = None) -> list[bool]:
        """Record one layer dispatch; returns the straggler flag of each call (same order).

        ``num_experts``: experts in the layer, for the load-imbalance mean (default: the
        experts called). Never raises; on an internal error returns None (logged).
        """
        keys: list[Hashable] = [c.expert for c in calls]
        if len(set(keys)) != len(keys):  # an expert split across replicas: one key per call
            keys = [(c.expert, c.replica if c.replica is not None else i) for i, c in enumerate(calls)]
        ok = {k: c.latency_ms for k, c in zip(keys, calls, strict=True) if c.error is None}
        flagged = self.detector.flag(ok, layer=layer)
        flags = [k in flagged for k in keys]

        tokens: dict[int, int] = {}
        for c in calls:
            tokens[c.expert] = tokens.get(c.expert, 0) + c.num_tokens
        if self.metrics is not None:
            self.metrics.record_dispatch(layer, tokens, num_experts)
        for c, straggler in zip(calls, flags, strict=True):
            if self.metrics is not None and c.error is None:
                self.metrics.record_expert_call(layer, c.expert, c.num_tokens, c.latency_ms / 1e3, straggler)
            if self.tracker is not None and c.error is None and c.replica is not None:
                self.tracker.update(c.replica, c.latency_ms)
            if self.emit_spans:
                emit_span(sc.SPAN_EXPERT_CALL, c.start_ns, c.end_ns, _call_attributes(layer, c, straggler),
                          kind=SpanKind.CLIENT, error=c.error)
        set_attributes(trace.get_current_span(), {sc.MOE_NUM_STRAGGLERS: sum(flags)})
        return flags


def _call_attributes(layer: int, c: ExpertCall, straggler: bool) -> dict[str, object]:
    queue_ms = None
    if c.compute_time_ms is not None:
        queue_ms = max(0.0, c.latency_ms - c.compute_time_ms)
    return {
        sc.MOE_LAYER: layer,
        sc.EXPERT_ID: c.expert,
        sc.EXPERT_REPLICA: c.replica,
        sc.EXPERT_NUM_TOKENS: c.num_tokens,
        sc.EXPERT_COMPUTE_TIME_MS: c.compute_time_ms,
        sc.EXPERT_QUEUE_TIME_MS: queue_ms,
        sc.EXPERT_STRAGGLER: straggler,
    }
