"""Per-process tracing setup: OTLP/HTTP export that can never block or fail a request.

Each process (ingress, verifier replica, draft replica, expert actor) calls
``setup_tracing(role)`` once; Ray propagates nothing by itself, so the ``OTEL_*`` variables must
reach workers through the deployment's / actor's ``runtime_env={"env_vars": {...}}``.

Safety properties (tested in tests/observability/test_tracing.py):

* Nothing is exported unless an endpoint is configured; otherwise the tracer is a no-op.
* Ending a span only appends to a bounded in-memory deque (the BatchSpanProcessor queue); when
  it is full the oldest span is dropped. Export runs on the processor's worker thread, one
  request per batch with a short timeout (``export_timeout_s``).
* ``shutdown_tracing(timeout_s)`` returns within ``timeout_s`` even if the collector is down or
  hangs, and it is what runs at interpreter exit (the SDK's own 30 s exit hook is disabled).
* Public functions catch their own errors, log, and carry on.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from observability import semconv as sc
from observability._export import GuardedExporter, install_log_rate_limit

logger = logging.getLogger("observability")

TRACES_PATH = "/v1/traces"


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Tracing section of the YAML config. ``None`` fields fall back to the standard env vars.

    Attributes:
        enabled: master switch; ``OTEL_SDK_DISABLED=true`` also disables.
        endpoint: OTLP/HTTP collector, either the base URL (``http://host:4318``, ``/v1/traces``
            is appended) or the full traces URL. ``None``: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
            (used as is), else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else no export.
        sampler_ratio: fraction of new traces sampled, 0..1 (parent-based: a remote parent's
            decision wins). ``None``: ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``.
        export_timeout_s: per export request (all retries included), seconds.
        max_queue_size: spans buffered per process before new ones are dropped.
        schedule_delay_ms: how often the worker exports a partial batch, milliseconds.
        service_instance_id: ``service.instance.id`` resource attribute; default a random UUID.
    """

    enabled: bool = True
    endpoint: str | None = None
    sampler_ratio: float | None = None
    export_timeout_s: float = 2.0
    max_queue_size: int = 2048
    schedule_delay_ms: float = 500.0
    service_instance_id: str | None = None

    def __post_init__(self) -> None:
        if self.sampler_ratio is not None and not 0.0 <= self.sampler_ratio <= 1.0:
            raise ValueError(f"tracing.sampler_ratio must be in [0, 1], got {self.sampler_ratio}")
        if not self.export_timeout_s > 0:
            raise ValueError(f"tracing.export_timeout_s must be > 0, got {self.export_timeout_s}")
        if self.max_queue_size < 1:
            raise ValueError(f"tracing.max_queue_size must be >= 1, got {self.max_queue_size}")
        if not self.schedule_delay_ms > 0:
            raise ValueError(f"tracing.schedule_delay_ms must be > 0, got {self.schedule_delay_ms}")


@dataclass
class _State:
    enabled: bool
    role: str
    tracer: trace.Tracer
    provider: TracerProvider | None = None
    exporter: GuardedExporter | None = None
    endpoint: str | None = None


_NOOP_TRACER = trace.NoOpTracer()
_state: _State | None = None
_lock = threading.Lock()
_atexit_registered = False


def resolve_endpoint(config: TracingConfig | None) -> str | None:
    """Full OTLP/HTTP traces URL from ``config`` or the env vars, or ``None`` (no export)."""
    if config is not None and config.endpoint:
        base = config.endpoint.strip().rstrip("/")
        return base if base.endswith(TRACES_PATH) else base + TRACES_PATH
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + TRACES_PATH if base else None


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


TRACES_EXPORTERS = ("otlp", "console", "none")


def traces_exporter() -> str:
    """``$OTEL_TRACES_EXPORTER`` as the OTel SDK reads it: ``otlp`` (the default: to the
    endpoint), ``console`` (every span printed to the process's stdout: Ray's worker logs, no
    collector needed) or ``none``; anything else is ``none``, with a warning."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    if kind not in TRACES_EXPORTERS:
        logger.warning("OTEL_TRACES_EXPORTER=%r is not one of %s; tracing disabled", kind, TRACES_EXPORTERS)
        return "none"
    return kind


def _installed_version() -> str:
    """The installed package's version (pyproject.toml's), or ``dev`` where the sources run
    uninstalled (a Serve ``working_dir``), as vLLM falls back when it has no version file."""
    try:
        return version("specmoe")
    except PackageNotFoundError:
        return "dev"


SERVICE_VERSION = _installed_version()
"""specmoe's version: OTel's ``service.version`` of every span, ``GET /version`` and the app's."""


def _resource(role: str, config: TracingConfig) -> Resource:
    return Resource.create({
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or sc.SERVICE_NAME,
        "service.version": SERVICE_VERSION,
        "service.instance.id": config.service_instance_id or str(uuid.uuid4()),
        sc.RESOURCE_PROCESS_ROLE: role,
        "process.pid": os.getpid(),
        "process.runtime.name": platform.python_implementation().lower(),
        "process.runtime.version": platform.python_version(),
        "host.name": socket.gethostname(),
    })


def setup_tracing(role: str, config: TracingConfig | None = None, *, set_global: bool = True) -> bool:
    """Configure tracing for this process once; later calls return the first call's result.

    Args:
        role: process role, exported as resource attribute ``specmoe.process.role``.
        config: the YAML ``tracing`` section; ``None`` = defaults + env vars.
        set_global: also install the provider as the OTel global one if none is set yet, so
            third-party instrumentation exports through it. specmoe's own helpers never use the
            global provider (it can be set only once per process, which tests need to avoid).

    Returns:
        True if spans will be exported, False if tracing is a no-op (no endpoint, disabled, or
        setup failed). Never raises.
    """
    global _state
    with _lock:
        if _state is not None:
            return _state.enabled
        try:
            _state = _build_state(role, config or TracingConfig(), set_global)
        except Exception:
            logger.warning("tracing setup failed; tracing disabled in this process", exc_info=True)
            _state = _State(enabled=False, role=role, tracer=_NOOP_TRACER)
        return _state.enabled


def _build_state(role: str, config: TracingConfig, set_global: bool) -> _State:
    endpoint, kind = resolve_endpoint(config), traces_exporter()
    if not config.enabled or _sdk_disabled() or kind == "none" or (kind == "otlp" and endpoint is None):
        logger.info("tracing disabled for %s (enabled=%s, exporter=%s, endpoint=%s)", role, config.enabled, kind,
                    endpoint)
        return _State(enabled=False, role=role, tracer=_NOOP_TRACER)

    install_log_rate_limit()
    sampler = None  # None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG
    if config.sampler_ratio is not None:
        sampler = ParentBased(TraceIdRatioBased(config.sampler_ratio))
    provider = TracerProvider(resource=_resource(role, config), sampler=sampler, shutdown_on_exit=False)
    exporter = GuardedExporter(_span_exporter(kind, endpoint, config.export_timeout_s))
    provider.add_span_processor(BatchSpanProcessor(
        exporter,
        max_queue_size=config.max_queue_size,
        schedule_delay_millis=config.schedule_delay_ms,
        max_export_batch_size=min(512, config.max_queue_size),
    ))
    if set_global and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    _register_atexit()
    logger.info("tracing enabled for %s -> %s", role, endpoint if kind == "otlp" else kind)
    return _State(enabled=True, role=role, tracer=provider.get_tracer("specmoe", SERVICE_VERSION),
                  provider=provider, exporter=exporter, endpoint=endpoint)


def _span_exporter(kind: str, endpoint: str | None, timeout_s: float):
    """The SDK exporter of ``kind`` (``otlp`` to ``endpoint``, or ``console``)."""
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stdout)  # today's stdout (the SDK's default is import time's)
    # Imported here so processes that never trace don't pay for the exporter's imports.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown_tracing, 2.0)
        _atexit_registered = True


def otel_env_vars() -> dict[str, str]:
    """This process's ``OTEL_*`` variables, for ``runtime_env={"env_vars": otel_env_vars()}`` of
    Ray deployments and actors (Ray workers don't inherit the driver's environment)."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


def is_enabled() -> bool:
    """Whether spans of this process are exported."""
    st = _state
    return st is not None and st.enabled


def get_tracer() -> trace.Tracer:
    """specmoe's tracer (a no-op tracer before setup or when disabled)."""
    st = _state
    return st.tracer if st is not None else _NOOP_TRACER


def export_stats() -> dict[str, int]:
    """Spans exported / failed / dropped-at-shutdown by this process since setup (diagnostics)."""
    st = _state
    ex = st.exporter if st is not None else None
    if ex is None:
        return {"exported": 0, "failed": 0, "dropped": 0}
    return {"exported": ex.exported_spans, "failed": ex.failed_spans, "dropped": ex.dropped_spans}


def _run_bounded(fn, timeout_s: float, name: str) -> bool:
    """Run ``fn`` on a daemon helper thread; True if it finished within ``timeout_s``."""
    t = threading.Thread(target=fn, name=name, daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    return not t.is_alive()


def flush_tracing(timeout_s: float = 2.0) -> bool:
    """Export everything queued so far, waiting at most ``timeout_s`` seconds.

    The export runs on a helper thread (the SDK's force_flush would run it on the caller's
    thread and ignore its timeout). Returns True if the flush finished in time. Never raises.
    """
    st = _state
    if st is None or st.provider is None:
        return True
    try:
        return _run_bounded(st.provider.force_flush, timeout_s, "specmoe-otel-flush")
    except Exception:
        logger.warning("tracing flush failed", exc_info=True)
        return False


def shutdown_tracing(timeout_s: float = 2.0) -> bool:
    """Flush and stop tracing within ``timeout_s`` seconds, whatever the collector does.

    Queued spans still unsent at ~90% of the bound are dropped and an in-flight export's retry
    back-off is aborted. Afterwards ``setup_tracing`` may be called again. Returns True if
    everything was flushed and stopped in time. Never raises.
    """
    global _state
    with _lock:
        st, _state = _state, None
    if st is None or st.provider is None or st.exporter is None:
        return True
    try:
        start = time.monotonic()
        deadline = start + max(0.0, timeout_s)
        st.exporter.drop_after(start + 0.8 * max(0.0, timeout_s))
        t = threading.Thread(target=st.provider.shutdown, name="specmoe-otel-shutdown", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no new threads during interpreter finalization: drop, then stop
            st.exporter.abort()
            st.provider.shutdown()
            return False
        t.join(max(0.0, start + 0.9 * timeout_s - time.monotonic()))
        if t.is_alive():
            st.exporter.abort()
            t.join(max(0.0, deadline - time.monotonic()))
        return not t.is_alive()
    except Exception:
        logger.warning("tracing shutdown failed", exc_info=True)
        return False
