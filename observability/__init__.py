"""specmoe observability: tracing (OTLP/HTTP), W3C context across Ray hops, straggler
detection and Prometheus metrics. See observability/README.md for how to wire it.

Nothing here raises into request code; engine/ never imports this package.
"""

from opentelemetry.trace import SpanKind

from observability import semconv
from observability.exposition import CONTENT_TYPE, render
from observability.metrics import EngineMetrics, RequestMetrics, RequestTracker
from observability.spans import (
    add_event,
    emit_span,
    extract_context,
    inject_context,
    link_from_carrier,
    record_error,
    set_attributes,
    start_span,
)
from observability.stragglers import StragglerDetector
from observability.tracing import (
    TracingConfig,
    export_stats,
    flush_tracing,
    get_tracer,
    is_enabled,
    otel_env_vars,
    setup_tracing,
    shutdown_tracing,
)

__all__ = [
    "CONTENT_TYPE", "SpanKind", "EngineMetrics", "RequestMetrics",
    "RequestTracker", "StragglerDetector", "TracingConfig", "add_event", "emit_span", "export_stats",
    "extract_context", "flush_tracing", "get_tracer", "inject_context", "is_enabled", "link_from_carrier",
    "otel_env_vars", "record_error", "render", "semconv", "set_attributes", "setup_tracing", "shutdown_tracing",
    "start_span",
]
