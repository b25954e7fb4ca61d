"""Fixtures: a live OTLP receiver and tracing pointed at it, torn down after every test.

setup_tracing keeps its own provider (set_global=False here), and shutdown_tracing clears it,
so each test gets a fresh, independent pipeline in the same pytest process.
"""

import pytest

from observability import TracingConfig, setup_tracing, shutdown_tracing
from observability.otlp_receiver import OtlpReceiver


@pytest.fixture(autouse=True)
def _no_tracing_leaks():
    shutdown_tracing(1.0)
    yield
    shutdown_tracing(1.0)


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture
def traced(receiver):
    """Tracing of this process exported to ``receiver`` (exports every 50 ms)."""
    assert setup_tracing("test", TracingConfig(endpoint=receiver.endpoint, schedule_delay_ms=50),
                         set_global=False)
    yield receiver
    shutdown_tracing(5.0)
