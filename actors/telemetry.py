"""Tracing and metrics hooks of the verifier: engine steps and expert dispatches.

Span tree of one request (processes in brackets)::

    POST /v1/completions [ingress] > text_completion <model> [ingress]
      > specmoe.engine.step [verifier]   parent: the oldest request in the batch; links: all of them
          > specmoe.draft.propose [verifier] > specmoe.draft.forward [draft]
          > specmoe.target.forward [verifier] > specmoe.moe.dispatch (per layer)
              > specmoe.expert.call [verifier, one per actor call; straggler flag, hedge events]
                  > specmoe.expert.compute [expert actor]
          > specmoe.verify [verifier]

Every hook swallows its own errors: telemetry never raises into a request.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from opentelemetry import trace

from engine.observer import PHASE_DRAFT, PHASE_TARGET, PHASE_VERIFY
from observability import (
    EngineMetrics,
    RequestMetrics,
    SpanKind,
    StragglerDetector,
    extract_context,
    get_tracer,
    inject_context,
    is_enabled,
    link_from_carrier,
    set_attributes,
    start_span,
)
from observability import semconv as sc

log = logging.getLogger(__name__)
PHASE_SPANS = {PHASE_DRAFT: sc.SPAN_DRAFT_PROPOSE, PHASE_TARGET: sc.SPAN_TARGET_FORWARD, PHASE_VERIFY: sc.SPAN_VERIFY}


class VerifierTelemetry:
    """The engine's :class:`StepObserver`: a span per step and per phase.

    ``carriers`` maps request id -> W3C carrier of the request's gen_ai span (set by the verifier).
    """

    def __init__(self) -> None:
        self.carriers: dict[str, dict] = {}

    @contextmanager
    def step(self, request_ids: list[str]):
        carriers = [self.carriers.get(r) for r in request_ids]
        parent = next((c for c in carriers if c), None)
        links = [link_from_carrier(c, {sc.REQUEST_ID: r}) for r, c in zip(request_ids, carriers) if c]
        with start_span(sc.SPAN_ENGINE_STEP, carrier=parent, links=links) as span:
            yield lambda stats: set_attributes(span, sc.step_attributes(stats))

    def phase(self, name: str):
        kind = SpanKind.CLIENT if name == PHASE_DRAFT else SpanKind.INTERNAL
        return start_span(PHASE_SPANS.get(name, f"specmoe.{name}"), kind=kind)


class RouterTelemetry:
    """Expert-router hooks: dispatch and call spans, straggler flags, per-expert metrics.

    Call spans start when the call is sent (so the actor's span can be their child) and end,
    with their recorded end time, once the whole dispatch is back and stragglers are known.
    """

    def __init__(self, metrics: EngineMetrics | None, detector: StragglerDetector) -> None:
        self.metrics, self.detector = metrics, detector

    def current_carrier(self) -> dict | None:
        """The caller's context (the target-forward span), captured on the engine thread."""
        return inject_context() if is_enabled() else None

    def begin_dispatch(self, layer: int, num_tokens: int, records: list, parent: dict | None):
        if not is_enabled():
            return None
        try:
            parent_ctx = extract_context(parent)
            span = get_tracer().start_span(sc.SPAN_MOE_DISPATCH, context=parent_ctx, attributes={
                sc.MOE_LAYER: layer, sc.MOE_NUM_TOKENS: num_tokens, sc.MOE_NUM_EXPERTS_HIT: len(records)})
            return span, trace.set_span_in_context(span, parent_ctx)
        except Exception:
            log.debug("dispatch span failed", exc_info=True)
            return None

    def call_carrier(self, dispatch, record) -> dict | None:
        if dispatch is None:
            return None
        try:
            record.span = get_tracer().start_span(sc.SPAN_EXPERT_CALL, context=dispatch[1], kind=SpanKind.CLIENT)
            return inject_context(trace.set_span_in_context(record.span, dispatch[1]))
        except Exception:
            log.debug("call span failed", exc_info=True)
            return None

    def abandon_call(self, record, reason: str) -> None:
        """End the span of a call that failed or will be re-sent (each attempt has its own span)."""
        try:
            if record.span is not None:
                record.span.set_attributes({sc.EXPERT_ERROR: reason, sc.EXPERT_ATTEMPTS: record.attempts,
                                            sc.EXPERT_TRANSPORT: record.transport})
                record.span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
                record.span.end()
        except Exception:
            log.debug("call span failed", exc_info=True)
        record.span = None

    def hedge_call(self, record, from_replica: str, to_replica: str, waited_ms: float) -> None:
        """A hedge was sent for ``record``: counted per (layer, expert) and an event on its span."""
        try:
            if self.metrics is not None:
                for expert, count in zip(record.expert_ids, record.counts):
                    if count:
                        self.metrics.record_hedge(record.layer, expert)
            if record.span is not None:
                record.span.add_event(sc.EVENT_EXPERT_HEDGE, {sc.EVENT_HEDGE_FROM: from_replica,
                                                              sc.EVENT_HEDGE_TO: to_replica,
                                                              sc.EVENT_HEDGE_WAITED_MS: waited_ms})
        except Exception:
            log.debug("hedge telemetry failed", exc_info=True)

    def end_dispatch(self, dispatch, layer: int, expert_counts: list[int], records: list,
                     error: str | None = None) -> None:
        """Close a dispatch: call spans, straggler flags and metrics; on ``error`` (the dispatch
        failed) the unfinished call spans and the dispatch span end with an error status."""
        try:
            if error is not None:
                for r in records:
                    self.abandon_call(r, error)
                if dispatch is not None:
                    dispatch[0].set_status(trace.Status(trace.StatusCode.ERROR, error))
                    dispatch[0].end()
                return
            flagged = self.detector.flag({r.group: r.latency_ms for r in records}, layer=layer)
            for r in records:
                self._record_call(layer, r, r.group in flagged)
            if self.metrics is not None:
                self.metrics.record_dispatch(layer, expert_counts)
            if dispatch is not None:
                dispatch[0].set_attribute(sc.MOE_NUM_STRAGGLERS, len(flagged))
                dispatch[0].end()
        except Exception:
            log.debug("dispatch telemetry failed", exc_info=True)

    def _record_call(self, layer: int, r, straggler: bool) -> None:
        if self.metrics is not None:
            if "cache" in r.timing:  # an offloading actor's cache counters since its last answer
                self.metrics.record_expert_cache(r.timing["cache"])
            for expert, count in zip(r.expert_ids, r.counts):
                if count:
                    self.metrics.record_expert_call(layer, expert, count, r.latency_ms / 1e3, straggler)
        if r.span is None:
            return
        compute_ms = r.timing.get("compute_ms", 0.0)
        r.span.set_attributes({
            sc.MOE_LAYER: layer, sc.EXPERT_ID: ",".join(str(e) for e in r.expert_ids),
            sc.EXPERT_REPLICA: r.timing.get("actor_id", r.replica), sc.EXPERT_NUM_TOKENS: r.rows,
            sc.EXPERT_QUEUE_TIME_MS: max(0.0, r.latency_ms - compute_ms), sc.EXPERT_COMPUTE_TIME_MS: compute_ms,
            sc.EXPERT_STRAGGLER: straggler, sc.EXPERT_ATTEMPTS: r.attempts, sc.EXPERT_TRANSPORT: r.transport,
            sc.EXPERT_HEDGES: r.hedges, sc.EXPERT_HEDGE_WON: r.hedge_won})
        r.span.end(end_time=int(r.done_s * 1e9))


class RequestTrace:
    """The HTTP server span and the gen_ai span of one request, open for its whole life
    (a streaming response outlives the handler that starts it, so these are ended by hand).

    ``joins``: the trace of another prompt of the same HTTP request (a completion request with a
    batch of prompts): this one's gen_ai span is a child of that one's HTTP span, which only
    ``joins`` ends.
    """

    def __init__(self, route: str, headers: dict, operation: str, model: str,
                 joins: RequestTrace | None = None) -> None:
        self.http = self.gen_ai = None
        self.context = self.http_context = None
        if not is_enabled():
            return
        try:
            tracer = get_tracer()
            if joins is not None:
                http_ctx = joins.http_context
            else:
                parent = extract_context(headers)  # an incoming traceparent, if the client sent one
                self.http = tracer.start_span(sc.http_span_name("POST", route), context=parent, kind=SpanKind.SERVER,
                                              attributes={sc.HTTP_REQUEST_METHOD: "POST", sc.HTTP_ROUTE: route})
                http_ctx = self.http_context = trace.set_span_in_context(self.http, parent)
            self.gen_ai = tracer.start_span(sc.gen_ai_span_name(operation, model), context=http_ctx,
                                            kind=SpanKind.CLIENT)
            self.context = trace.set_span_in_context(self.gen_ai, http_ctx)
        except Exception:
            log.debug("request spans failed", exc_info=True)

    def carrier(self) -> dict | None:
        """W3C context of the gen_ai span, sent to the verifier with the request."""
        return inject_context(self.context) if self.context is not None else None

    def request(self, attributes: dict) -> None:
        if self.gen_ai is not None:
            set_attributes(self.gen_ai, attributes)

    def first_token(self, ttft_s: float) -> None:
        if self.gen_ai is not None:
            self.gen_ai.add_event(sc.EVENT_FIRST_TOKEN, {sc.EVENT_TTFT_S: ttft_s})

    def end(self, status: int, response_attributes: dict | None = None, reasons: list | None = None) -> None:
        try:
            if self.gen_ai is not None:
                set_attributes(self.gen_ai, response_attributes or {})
                self.gen_ai.add_event(sc.EVENT_FINISH, {sc.EVENT_FINISH_REASON: ",".join(str(r) for r in reasons or [])})
                self.gen_ai.end()
            if self.http is not None:
                self.http.set_attribute(sc.HTTP_RESPONSE_STATUS_CODE, status)
                if status >= 500:
                    self.http.set_status(trace.Status(trace.StatusCode.ERROR))
                self.http.end()
        except Exception:
            log.debug("ending request spans failed", exc_info=True)
        self.http = self.gen_ai = None


class RequestTelemetry:
    """Metrics (TTFT, ITL, TPOT, e2e, queue time, tokens) and spans of one HTTP request."""

    def __init__(self, metrics: RequestMetrics | None, route: str, headers: dict, operation: str, model: str,
                 arrival_s: float, joins: RequestTelemetry | None = None) -> None:
        self.trace = RequestTrace(route, headers, operation, model, joins.trace if joins is not None else None)
        self._args = (metrics, route, headers, operation, model, arrival_s)
        self.tracker = metrics.track(arrival_s) if metrics is not None else None
        self.arrival_s = arrival_s
        self.usage: dict | None = None
        self.prompt_tokens = 0  # the prompt's length, as the ingress tokenized it (set by the ingress)
        self.queue_time_s: float | None = None
        self.reasons: dict[int, str] = {}
        self.num_tokens = 0
        self.done = False

    def for_another_prompt(self) -> RequestTelemetry:
        """The telemetry of another prompt of this HTTP request: metrics of its own (each prompt is
        an engine request, as vLLM counts them) and a gen_ai span in this request's HTTP span."""
        return RequestTelemetry(*self._args, joins=self)

    def on_item(self, item: dict) -> None:
        """One verifier stream item (see ``actors/stream_items.py``); a merged one's steps are
        recorded at the times they were emitted (``steps``: ``[[age_s, tokens], ...]``, see
        :func:`actors.stream_items.ship`)."""
        try:
            import time

            now_s = time.monotonic()
            for age_s, n in item["steps"]:
                if not n:
                    continue
                if self.num_tokens == 0:
                    self.trace.first_token(now_s - age_s - self.arrival_s)
                self.num_tokens += n
                if self.tracker is not None:
                    self.tracker.on_tokens(n, now_s - age_s)
            for c in item["choices"]:
                if c["finish_reason"] is not None:
                    self.reasons[c["index"]] = c["finish_reason"]
            if item.get("usage"):
                self.usage, self.queue_time_s = item["usage"], item.get("queue_time_s")
        except Exception:
            log.debug("request telemetry failed", exc_info=True)

    def finish(self, status: int, response_id: str, reason_if_unfinished: str = "abort",
               refusal: str | None = None) -> None:
        """Close the request's metrics and spans exactly once (also on abort and errors);
        ``refusal``: a 503's error code (``queue_full``, ``ttft_unattainable``; else unavailable)."""
        if self.done:
            return
        self.done = True
        reasons = [self.reasons[i] for i in sorted(self.reasons)] or [reason_if_unfinished]
        # Without the final usage (the client left): the prompt counts once it produced a token.
        prompt = self.usage["prompt_tokens"] if self.usage else self.prompt_tokens if self.num_tokens else 0
        output = self.usage["completion_tokens"] if self.usage else self.num_tokens
        if self.tracker is not None and status < 400:
            self.tracker.on_finish(reasons[0] if self.usage else reason_if_unfinished, prompt, output,
                                   queue_time_s=self.queue_time_s)
        elif self.tracker is not None and status == 503 and not self.num_tokens:
            self.tracker.on_refused(refusal)  # load shed or unavailable: not a failed request
        elif self.tracker is not None and status >= 500:
            self.tracker.on_finish("error", 0, 0)  # refused requests (4xx) are not finished requests
        self.trace.end(status, sc.gen_ai_response_attributes(
            response_id=response_id, finish_reasons=reasons, input_tokens=prompt if self.usage else None,
            output_tokens=output if self.usage else None), reasons)


class Telemetries(list):
    """The :class:`RequestTelemetry` of each prompt of one HTTP request (the first one owns the
    HTTP span, so it is finished last)."""

    def __init__(self, tels: list[RequestTelemetry], response_id: str) -> None:
        super().__init__(tels)
        self.response_id = response_id

    def finish(self, status: int, refusal: str | None = None) -> None:
        for tel in reversed(self):
            tel.finish(status, self.response_id, refusal=refusal)
