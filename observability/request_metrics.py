"""Ingress-side request metrics and the per-request tracker a streaming handler drives.

All ``t`` arguments are ``time.monotonic()`` seconds taken in the ingress process (default:
now); durations measured in another process (queue time in the verifier) are passed as
durations, never as timestamps, since clocks of different processes/nodes don't compare.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from observability._safe import safe

logger = logging.getLogger("observability")

P = "specmoe:"
# 1 ms .. 60 s, denser where interactive latencies sit (10 ms .. 1 s).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)


FINISH_REASONS = ("stop", "length", "abort", "error")
"""Finish reasons a request can end with (``error``: the server failed it); their
``request_success_total`` series exist at zero from the start, so a dashboard's ``rate()`` has two
samples as soon as the first request of a kind finishes (Prometheus' advice for known label sets)."""
REFUSAL_REASONS = ("queue_full", "ttft_unattainable", "unavailable")
"""Why a request was refused (``request_refused_total{reason}``, also at zero from the start): the
engine's QueueFull / DeadlineUnattainable codes; ``unavailable``: the model server is restarting,
gone or stopping."""


class RequestMetrics:
    """Latency histograms, token and finish counters, in-flight gauges of one model's requests.

    Args:
        model_name: value of the ``model_name`` label.
        registry: where to register; default a new private ``CollectorRegistry``.
        include_state_gauges: export ``num_requests_running`` (first token received, not
            finished) and ``num_requests_waiting`` (tracked, no first token yet) as seen by the
            ingress, maintained by ``RequestTracker``.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 include_state_gauges: bool = True) -> None:
        self.model_name = model_name
        self.include_state_gauges = include_state_gauges
        self.registry = registry if registry is not None else CollectorRegistry()
        try:
            self._build(self.registry)
        except Exception:  # e.g. registered twice in one registry: keep working, unserved
            logger.error("RequestMetrics: registering failed; using a private registry", exc_info=True)
            self.registry = CollectorRegistry()
            self._build(self.registry)

    def _build(self, r: CollectorRegistry) -> None:
        m, name = ["model_name"], self.model_name

        def hist(metric: str, doc: str) -> Histogram:
            return Histogram(P + metric, doc, m, buckets=LATENCY_BUCKETS_S, registry=r).labels(name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token, seconds.")
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between streamed chunks divided by the chunk's tokens, per token, seconds.")
        self.tpot = hist("time_per_output_token_seconds",
                         "(finish - first token) / (output tokens - 1), per request, seconds.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, seconds.")
        self.queue = hist("request_queue_time_seconds", "Time waiting in the engine queue, seconds.")
        self._success = Counter(P + "request_success_total", "Finished requests by finish reason.",
                                m + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._success.labels(name, reason)
        # Load shedding is not a failure of the request: a dashboard tells it from errors, and its
        # near-instant answers stay out of the latency histograms.
        self._refused = Counter(P + "request_refused_total",
                                "Requests refused with HTTP 503 before any output (a full queue, a TTFT "
                                "budget that cannot be met, a restarting or stopping server: the reason "
                                "label); not finished requests and not in the latency histograms.",
                                m + ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self._refused.labels(name, reason)
        self.prompt_tokens = Counter(P + "prompt_tokens_total",
                                     "Prompt tokens of finished requests (an aborted one once it produced a token).",
                                     m, registry=r).labels(name)
        self.generation_tokens = Counter(P + "generation_tokens_total", "Output tokens generated.",
                                         m, registry=r).labels(name)
        self.running = self.waiting = None
        if self.include_state_gauges:
            self.running = Gauge(P + "num_requests_running", "Requests streaming at the ingress.",
                                 m, registry=r).labels(name)
            self.waiting = Gauge(P + "num_requests_waiting", "Requests at the ingress without a first token.",
                                 m, registry=r).labels(name)

    def track(self, arrival_time: float | None = None) -> RequestTracker:
        """Start tracking one request (counts it as waiting). ``arrival_time``: monotonic s."""
        return RequestTracker(self, time.monotonic() if arrival_time is None else arrival_time)

    @safe
    def observe_finished(self, reason: str, prompt_tokens: int, output_tokens: int, *, e2e_s: float,
                         ttft_s: float | None = None, queue_time_s: float | None = None) -> None:
        """One-shot recording of a finished request (non-streaming path), durations in s."""
        self._success.labels(self.model_name, reason or "unknown").inc()
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, output_tokens))
        self.e2e.observe(max(0.0, e2e_s))
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
            if output_tokens > 1:
                self.tpot.observe(max(0.0, e2e_s - ttft_s) / (output_tokens - 1))
        if queue_time_s is not None:
            self.queue.observe(max(0.0, queue_time_s))

    @safe
    def set_state(self, running: int, waiting: int) -> None:
        """Override the in-flight gauges (if the ingress keeps its own counts)."""
        if self.running is not None and self.waiting is not None:
            self.running.set(running)
            self.waiting.set(waiting)


class RequestTracker:
    """Per-request state for a streaming handler; one instance per request, one task at a time.

    Call ``on_tokens(n)`` for every chunk streamed (the first chunk also records TTFT, unless
    ``on_first_token`` was called before), then ``on_finish`` exactly once (later calls are
    ignored; call it on abort/error too, with reason ``"abort"``/``"error"``).

    Per-token latency of speculative chunks: a chunk of n tokens arriving ``gap`` seconds after
    the previous chunk adds n observations of ``gap / n`` to ``inter_token_latency_seconds``;
    the first chunk adds none.
    """

    def __init__(self, metrics: RequestMetrics, arrival_time: float) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0  # tokens already added to generation_tokens_total
        self.finished = False
        self._state = None  # the gauge this request currently counts in
        self._move_to(metrics.waiting)

    def _move_to(self, gauge) -> None:
        if self._state is not None:
            self._state.dec()
        if gauge is not None:
            gauge.inc()
        self._state = gauge

    @safe
    def on_queue_time(self, queue_time_s: float) -> None:
        """Time the request waited in the engine queue (a duration measured by the verifier)."""
        self.metrics.queue.observe(max(0.0, queue_time_s))

    @safe
    def on_first_token(self, t: float | None = None) -> None:
        """Record TTFT (idempotent); moves the request from waiting to running."""
        if self.first_token_time is not None or self.finished:
            return
        t = time.monotonic() if t is None else t
        self.first_token_time = self.last_token_time = t
        self.metrics.ttft.observe(max(0.0, t - self.arrival_time))
        self._move_to(self.metrics.running)

    @safe
    def on_tokens(self, n: int, t: float | None = None) -> None:
        """A chunk of ``n`` new output tokens was streamed at ``t``."""
        if n <= 0 or self.finished:
            return
        t = time.monotonic() if t is None else t
        if self.first_token_time is None:
            self.on_first_token(t)
        elif self.num_tokens > 0:  # not the chunk that carried the first token
            per_token = max(0.0, t - (self.last_token_time or t)) / n
            for _ in range(n):
                self.metrics.itl.observe(per_token)
        self.last_token_time = t
        self.num_tokens += n
        self.metrics.generation_tokens.inc(n)

    def _close(self) -> bool:
        """Leave the in-flight gauges once; False if the request was already closed."""
        if self.finished:
            return False
        self.finished = True
        self._move_to(None)
        return True

    @safe
    def on_refused(self, reason: str | None = None) -> None:
        """The request was refused (HTTP 503) before any output, for ``reason`` (one of
        :data:`REFUSAL_REASONS`; anything else counts as ``unavailable``): counted apart from finished ones."""
        if self._close():
            self.metrics._refused.labels(self.metrics.model_name,
                                         reason if reason in REFUSAL_REASONS else "unavailable").inc()

    @safe
    def on_finish(self, reason: str, prompt_tokens: int, output_tokens: int, t: float | None = None,
                  queue_time_s: float | None = None) -> None:
        """The request finished (or was aborted) at ``t``; token counts are the final totals."""
        if not self._close():
            return
        t = time.monotonic() if t is None else t
        m = self.metrics
        m._success.labels(m.model_name, reason or "unknown").inc()
        m.prompt_tokens.inc(max(0, prompt_tokens))
        if output_tokens > self.num_tokens:  # tokens never reported through on_tokens
            m.generation_tokens.inc(output_tokens - self.num_tokens)
        m.e2e.observe(max(0.0, t - self.arrival_time))
        if self.first_token_time is not None and output_tokens > 1:
            m.tpot.observe(max(0.0, t - self.first_token_time) / (output_tokens - 1))
        if queue_time_s is not None:
            m.queue.observe(max(0.0, queue_time_s))
