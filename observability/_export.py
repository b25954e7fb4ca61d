"""Export plumbing that keeps a slow or dead collector away from requests.

* ``GuardedExporter`` wraps the OTLP exporter: it never raises, drops batches outright once a
  shutdown deadline has passed, and can abort an export in progress (interrupting its retry
  back-off) so ``shutdown_tracing`` returns within its bound.
* ``RateLimitFilter`` keeps the SDK's per-batch and per-span warnings ("Queue full, dropping
  Span", "Failed to export spans batch") to one line per message per interval: with the
  collector down they would otherwise flood the logs and cost time on the request thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger("observability")

# Loggers of the SDK and the OTLP/HTTP exporter that log once per failed batch or dropped span.
NOISY_LOGGERS = (
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http",
)


class RateLimitFilter(logging.Filter):
    """Lets a given (logger, message template) through at most once per ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, object], float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return False
            if len(self._last) > 1000:  # unbounded templates are unlikely; bound memory anyway
                self._last.clear()
            self._last[key] = now
        return True


_filter: RateLimitFilter | None = None


def install_log_rate_limit(interval_s: float = 60.0) -> None:
    """Attach one shared ``RateLimitFilter`` to the noisy OTel loggers (idempotent)."""
    global _filter
    if _filter is not None:
        _filter.interval_s = interval_s
        return
    _filter = RateLimitFilter(interval_s)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_filter)


class GuardedExporter(SpanExporter):
    """Never-raising wrapper around a real span exporter, with a drop-after deadline.

    Runs only on the BatchSpanProcessor's worker thread (or a shutdown helper thread), never on
    a request thread. Counters are approximate (no lock) and for diagnostics only.
    """

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self._drop_after: float | None = None  # time.monotonic() deadline; None = no deadline
        self._inner_shut = False
        self._lock = threading.Lock()
        self.exported_spans = 0
        self.failed_spans = 0
        self.dropped_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._drop_after is not None and time.monotonic() >= self._drop_after:
            self.dropped_spans += len(spans)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the worker thread's loop
            logger.warning("span export raised; batch dropped", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported_spans += len(spans)
        else:
            self.failed_spans += len(spans)
        return result

    def drop_after(self, deadline_monotonic: float) -> None:
        """Batches whose export starts after ``deadline_monotonic`` are dropped without I/O."""
        self._drop_after = deadline_monotonic

    def abort(self) -> None:
        """Stop all export work now: later batches drop, an in-flight retry back-off ends."""
        self._drop_after = time.monotonic()
        self._shutdown_inner()

    def _shutdown_inner(self) -> None:
        with self._lock:
            if self._inner_shut:
                return
            self._inner_shut = True
        try:
            self.inner.shutdown()
        except Exception:
            logger.debug("span exporter shutdown raised", exc_info=True)

    def shutdown(self) -> None:
        self._shutdown_inner()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
