"""Trace context crosses a real process boundary (a spawned process, like a Ray worker)."""

import multiprocessing
import os

from opentelemetry.trace import SpanKind

from observability import flush_tracing, inject_context, start_span
from observability import semconv as sc
from tests.observability._child_process import child_main


def test_child_span_in_spawned_process_has_remote_parent(traced):
    with start_span(sc.SPAN_MOE_DISPATCH, kind=SpanKind.CLIENT, attributes={sc.MOE_LAYER: 0}):
        carrier = inject_context()
    assert flush_tracing(5.0)

    proc = multiprocessing.get_context("spawn").Process(target=child_main, args=(traced.endpoint, carrier))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0

    spans = {s.name: s for s in traced.wait_for_spans(2, timeout_s=10)}
    parent, child = spans[sc.SPAN_MOE_DISPATCH], spans[sc.SPAN_EXPERT_COMPUTE]
    assert child.trace_id == parent.trace_id
    assert child.parent_span_id == parent.span_id
    assert child.attributes == {"specmoe.expert.id": 3}
    assert parent.resource["process.pid"] == os.getpid()
    assert child.resource["process.pid"] == proc.pid != os.getpid()
    assert child.resource["specmoe.process.role"] == "expert"
    assert child.resource["service.instance.id"] != parent.resource["service.instance.id"]
