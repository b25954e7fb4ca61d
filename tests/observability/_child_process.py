"""Target of the spawned subprocess in test_propagation: one span from an injected carrier."""

from observability import TracingConfig, semconv, setup_tracing, shutdown_tracing, start_span


def child_main(endpoint: str, carrier: dict) -> None:
    assert setup_tracing("expert", TracingConfig(endpoint=endpoint, schedule_delay_ms=50), set_global=False)
    with start_span(semconv.SPAN_EXPERT_COMPUTE, carrier=carrier, attributes={semconv.EXPERT_ID: 3}):
        pass
    assert shutdown_tracing(10.0)
