"""A dead, slow or failing collector never slows the request path, and shutdown stays bounded."""

import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from observability import TracingConfig, export_stats, setup_tracing, shutdown_tracing, start_span
from observability import semconv as sc
from observability.otlp_receiver import OtlpReceiver, unused_port

# Generous for a loaded 2-core CI box, yet below one export timeout (2 s): an export on the
# caller's thread would blow it. The thread check below is the exact assertion.
REQUEST_PATH_BOUND_S = 1.0
SHUTDOWN_SLACK_S = 0.4


@pytest.fixture
def export_threads(monkeypatch):
    """Thread idents every OTLP export ran on."""
    threads: list[int] = []
    original = OTLPSpanExporter.export

    def export(self, spans):
        threads.append(threading.get_ident())
        return original(self, spans)

    monkeypatch.setattr(OTLPSpanExporter, "export", export)
    return threads


def _request_path(n: int) -> float:
    """n expert-call-shaped spans, as a request thread would make them; returns seconds."""
    t0 = time.perf_counter()
    for i in range(n):
        with start_span(sc.SPAN_EXPERT_CALL, attributes={sc.MOE_LAYER: i % 4, sc.EXPERT_ID: i % 8,
                                                         sc.EXPERT_NUM_TOKENS: 3, sc.EXPERT_STRAGGLER: False}):
            pass
    return time.perf_counter() - t0


@pytest.mark.parametrize("collector", ["unreachable", "slow", "503"])
def test_request_path_never_waits_for_collector(collector, export_threads):
    rx = None
    if collector == "unreachable":
        endpoint = f"http://127.0.0.1:{unused_port()}"
    else:
        rx = OtlpReceiver(delay_s=3.0) if collector == "slow" else OtlpReceiver(status_code=503)
        endpoint = rx.start().endpoint
    try:
        cfg = TracingConfig(endpoint=endpoint, export_timeout_s=2.0, max_queue_size=256, schedule_delay_ms=10)
        assert setup_tracing("verifier", cfg, set_global=False)
        elapsed = _request_path(1000)  # 4x the queue: the worker is woken and exports mid-loop
        time.sleep(0.2)  # let the worker reach the collector
        t0 = time.monotonic()
        shutdown_tracing(1.0)
        shutdown_s = time.monotonic() - t0
    finally:
        shutdown_tracing(0.1)
        if rx is not None:
            rx.stop()
    assert elapsed < REQUEST_PATH_BOUND_S, f"1000 spans took {elapsed:.3f} s"
    assert export_threads, "the worker never tried to export"
    assert threading.get_ident() not in export_threads
    assert shutdown_s < 1.0 + SHUTDOWN_SLACK_S
    if rx is not None:
        assert rx.num_requests >= 1 and not rx.spans


def test_shutdown_bounded_with_full_queue_and_dead_collector(export_threads):
    endpoint = f"http://127.0.0.1:{unused_port()}"
    # Nothing is exported before shutdown: every queued batch is left for shutdown to deal with.
    cfg = TracingConfig(endpoint=endpoint, export_timeout_s=2.0, max_queue_size=4096, schedule_delay_ms=60_000)
    assert setup_tracing("ingress", cfg, set_global=False)
    _request_path(3000)
    t0 = time.monotonic()
    shutdown_tracing(1.0)
    assert time.monotonic() - t0 < 1.0 + SHUTDOWN_SLACK_S
    assert threading.get_ident() not in export_threads


def test_failed_exports_are_counted_and_tracing_recovers(export_threads):
    with OtlpReceiver(status_code=503) as rx:
        cfg = TracingConfig(endpoint=rx.endpoint, export_timeout_s=0.5, schedule_delay_ms=10)
        assert setup_tracing("draft", cfg, set_global=False)
        _request_path(10)
        deadline = time.monotonic() + 5
        while export_stats()["failed"] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert export_stats()["failed"] >= 10
        rx.status_code = 200  # the collector comes back: later spans get through
        _request_path(5)
        assert len(rx.wait_for_spans(5, timeout_s=5)) == 5
        assert shutdown_tracing(2.0)
