"""A completion request with a batch of prompts is one HTTP server span with one gen_ai span per
prompt (each prompt is an engine request with a carrier of its own)."""

import time

from actors.telemetry import RequestTelemetry
from observability import flush_tracing


def test_each_prompt_has_a_gen_ai_span_in_the_one_http_span(traced):
    first = RequestTelemetry(None, "/v1/completions", {}, "text_completion", "m", arrival_s=time.monotonic())
    others = [first.for_another_prompt() for _ in range(2)]
    carriers = [t.trace.carrier()["traceparent"] for t in [first, *others]]
    assert len(set(carriers)) == 3  # the verifier links each engine request to its own span
    for tel in [*others, first]:
        tel.finish(200, "cmpl-1")
    assert flush_tracing(5.0)
    spans = traced.wait_for_spans(4)
    http = [s for s in spans if s.name == "POST /v1/completions"]
    gen_ai = [s for s in spans if s.name == "text_completion m"]
    assert len(http) == 1 and len(gen_ai) == 3
    assert {(s.trace_id, s.parent_span_id) for s in gen_ai} == {(http[0].trace_id, http[0].span_id)}
    assert sorted(c.split("-")[2] for c in carriers) == sorted(s.span_id for s in gen_ai)
