"""Spans and W3C context propagation across Ray hops (handles and actor calls carry no context).

The caller puts ``inject_context()`` (a small ``dict[str, str]``) into the remote call's
arguments; the callee passes it as ``carrier=`` to ``start_span``. When this process does not
export, ``start_span`` still makes the remote context current, so a pass-through hop keeps the
trace connected for the processes after it.

All helpers are exception-safe: a telemetry error is logged and the request carries on. An
exception raised *by the code inside* ``with start_span(...)`` is recorded on the span and
re-raised unchanged.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from observability import semconv as sc
from observability import tracing

logger = logging.getLogger("observability")

Carrier = Mapping[str, str]


def clean_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes OTel accepts: ``None`` values dropped, numpy/torch scalars converted, other
    objects stringified, sequences made lists of primitives; a value that cannot be converted
    (its ``str`` raises) is dropped alone, so the rest of the span survives."""
    if not attributes:
        return None
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        try:
            if isinstance(value, (list, tuple)):
                out[key] = [_primitive(v) for v in value if v is not None]
            else:
                out[key] = _primitive(value)
        except Exception:
            logger.debug("attribute %s dropped", key, exc_info=True)
    return out


def _primitive(value: Any) -> str | bool | int | float:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


def inject_context(ctx: Context | None = None) -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` (plus baggage) of ``ctx`` (default: the current span)
    through the global propagator, as a plain dict to send along a Ray call. ``{}`` if none."""
    carrier: dict[str, str] = {}
    try:
        propagate.inject(carrier, context=ctx)
    except Exception:
        logger.debug("inject_context failed", exc_info=True)
    return carrier


def extract_context(carrier: Carrier | None) -> Context:
    """Context whose parent is the span described by ``carrier`` (keys matched
    case-insensitively, so raw HTTP headers work). ``None``: the current context; a carrier with
    no valid ``traceparent``: an empty context (spans started in it are roots)."""
    if carrier is None:
        return otel_context.get_current()
    try:
        return propagate.extract({str(k).lower(): v for k, v in carrier.items()})
    except Exception:
        logger.debug("extract_context failed", exc_info=True)
        return Context()


def link_from_carrier(carrier: Carrier | None, attributes: Mapping[str, Any] | None = None) -> Link | None:
    """A span link to the span in ``carrier`` (e.g. a step span linking each request it serves);
    ``None`` if the carrier holds no valid context."""
    try:
        span_ctx = trace.get_current_span(extract_context(carrier or {})).get_span_context()
        if not span_ctx.is_valid:
            return None
        return Link(span_ctx, clean_attributes(attributes))
    except Exception:
        logger.debug("link_from_carrier failed", exc_info=True)
        return None


def _parent(carrier: Carrier | None, context: Context | None) -> Context | None:
    if context is not None:
        return context
    return extract_context(carrier) if carrier is not None else None  # None: current context


def _begin(name: str, carrier: Carrier | None, context: Context | None, attributes: Mapping[str, Any] | None,
           links: Iterable[Link | None] | None, kind: SpanKind, start_time_ns: int | None) -> tuple[Span, object]:
    try:
        parent = _parent(carrier, context)
        if not tracing.is_enabled():
            # Pass the parent along unchanged (no new span id) so downstream hops stay connected.
            span = trace.NonRecordingSpan(trace.get_current_span(parent).get_span_context())
            if parent is None:
                return span, None  # already current; skip the attach
        else:
            span = tracing.get_tracer().start_span(
                name, context=parent, kind=kind, attributes=clean_attributes(attributes),
                links=[lk for lk in (links or ()) if isinstance(lk, Link)] or None, start_time=start_time_ns)
        return span, otel_context.attach(trace.set_span_in_context(span, parent))
    except Exception:
        logger.debug("start_span(%s) failed", name, exc_info=True)
        return trace.INVALID_SPAN, None


@contextmanager
def start_span(
    name: str,
    carrier: Carrier | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Iterable[Link | None] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    *,
    context: Context | None = None,
    start_time_ns: int | None = None,
) -> Iterator[Span]:
    """Start a span, make it current for the ``with`` body, end it on exit.

    Args:
        name: a ``semconv.SPAN_*`` constant (or an HTTP / GenAI name from its helpers).
        carrier: from ``inject_context()`` in the calling process; the span becomes a child of
            that remote span. ``None``: child of the current span.
        attributes: set at start (samplers see them); ``None`` values are skipped.
        links: e.g. ``link_from_carrier(c)`` for each request a step serves; ``None``s (and
            anything not a ``Link``) skipped.
        kind: SERVER for the callee side of a hop, CLIENT for the caller side.
        context: explicit parent context (wins over ``carrier``).
        start_time_ns: epoch nanoseconds (``time.time_ns()``); default now.

    Yields:
        The span (non-recording when tracing is off): set more attributes with
        ``set_attributes``. An exception from the body sets ERROR status and ``error.type``.
    """
    span, token = _begin(name, carrier, context, attributes, links, kind, start_time_ns)
    try:
        yield span
    except BaseException as exc:  # includes asyncio.CancelledError: a cancelled call is an error
        record_error(span, exc)
        raise
    finally:
        try:
            span.end()
            if token is not None:
                otel_context.detach(token)
        except Exception:
            logger.debug("ending span %s failed", name, exc_info=True)


def emit_span(
    name: str,
    start_time_ns: int,
    end_time_ns: int,
    attributes: Mapping[str, Any] | None = None,
    *,
    carrier: Carrier | None = None,
    context: Context | None = None,
    links: Iterable[Link | None] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    error: str | None = None,
) -> None:
    """Record an already finished operation as a span, e.g. expert calls after a dispatch's
    stragglers are known. Times are epoch nanoseconds (``time.time_ns()``). The parent is
    ``context``, else ``carrier``, else the current span. ``error``: sets ERROR status and
    ``error.type``."""
    if not tracing.is_enabled():
        return
    try:
        span = tracing.get_tracer().start_span(
            name, context=_parent(carrier, context), kind=kind, attributes=clean_attributes(attributes),
            links=[lk for lk in (links or ()) if isinstance(lk, Link)] or None, start_time=int(start_time_ns))
        if error is not None:
            span.set_attribute(sc.ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(int(end_time_ns), int(start_time_ns)))
    except Exception:
        logger.debug("emit_span(%s) failed", name, exc_info=True)


def set_attributes(span: Span, attributes: Mapping[str, Any] | None) -> None:
    """``span.set_attributes`` with ``None`` values skipped and odd types converted."""
    try:
        cleaned = clean_attributes(attributes)
        if cleaned and span.is_recording():
            span.set_attributes(cleaned)
    except Exception:
        logger.debug("set_attributes failed", exc_info=True)


def add_event(span: Span, name: str, attributes: Mapping[str, Any] | None = None,
              timestamp_ns: int | None = None) -> None:
    """``span.add_event`` (e.g. ``semconv.EVENT_FIRST_TOKEN``); ``timestamp_ns`` epoch ns."""
    try:
        if span.is_recording():
            span.add_event(name, clean_attributes(attributes), timestamp=timestamp_ns)
    except Exception:
        logger.debug("add_event(%s) failed", name, exc_info=True)


def record_error(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed with ``exc`` (ERROR status, ``error.type``, an exception event)."""
    try:
        if span.is_recording():
            span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256]))
            span.record_exception(exc)
    except Exception:
        logger.debug("record_error failed", exc_info=True)
