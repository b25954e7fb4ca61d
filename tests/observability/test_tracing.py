"""Tracing over real OTLP/HTTP: attributes, events, links, resource, in-process propagation,
configuration from env vars, and exception safety."""

import os

import pytest
from opentelemetry.trace import SpanKind

from observability import (
    TracingConfig,
    add_event,
    emit_span,
    extract_context,
    flush_tracing,
    inject_context,
    is_enabled,
    link_from_carrier,
    set_attributes,
    setup_tracing,
    shutdown_tracing,
    start_span,
)
from observability import (
    semconv as sc,
)
from observability.tracing import resolve_endpoint

ENV_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
            "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_TRACES_EXPORTER")


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_span_exported_with_attributes_events_and_resource(traced):
    attrs = sc.gen_ai_request_attributes(sc.GEN_AI_OPERATION_TEXT_COMPLETION, "tiny-moe", max_tokens=16,
                                         temperature=0.7, top_p=None)
    with start_span(sc.http_span_name("POST", "/v1/completions"), kind=SpanKind.SERVER,
                    attributes={sc.HTTP_REQUEST_METHOD: "POST", sc.HTTP_ROUTE: "/v1/completions"}) as http:
        with start_span(sc.gen_ai_span_name("text_completion", "tiny-moe"), attributes=attrs) as g:
            add_event(g, sc.EVENT_FIRST_TOKEN, {sc.EVENT_TTFT_S: 0.012})
            set_attributes(g, sc.gen_ai_response_attributes(
                response_id="cmpl-1", finish_reasons=["length"], input_tokens=5, output_tokens=16))
        set_attributes(http, {sc.HTTP_RESPONSE_STATUS_CODE: 200})
    assert flush_tracing(5.0)
    spans = {s.name: s for s in traced.wait_for_spans(2)}
    assert not traced.errors
    g, http = spans["text_completion tiny-moe"], spans["POST /v1/completions"]
    assert g.parent_span_id == http.span_id and g.trace_id == http.trace_id
    assert http.parent_span_id == "" and http.kind == 2  # SPAN_KIND_SERVER
    assert g.attributes == {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "specmoe",
        "gen_ai.request.model": "tiny-moe", "gen_ai.request.max_tokens": 16, "gen_ai.request.temperature": 0.7,
        "gen_ai.response.id": "cmpl-1", "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 16,
    }
    assert g.events == [("specmoe.first_token", {"specmoe.ttft_s": 0.012})]
    assert http.attributes["http.response.status_code"] == 200
    assert g.resource["service.name"] == "specmoe"
    assert g.resource["specmoe.process.role"] == "test"
    assert g.resource["process.pid"] == os.getpid()
    assert g.resource["service.instance.id"]


def test_carrier_parenting_links_and_after_the_fact_spans(traced):
    with start_span("request-a") as a:
        carrier_a = inject_context()
    assert set(carrier_a) >= {"traceparent"}
    # A different "process": the step span is a root with a link to the request; children by carrier.
    with start_span(sc.SPAN_ENGINE_STEP, context=extract_context({}),
                    links=[link_from_carrier(carrier_a, {sc.REQUEST_ID: "a"}), link_from_carrier({})]):
        step_carrier = inject_context()
    with start_span(sc.SPAN_DRAFT_FORWARD, carrier={k.title(): v for k, v in step_carrier.items()},
                    kind=SpanKind.SERVER):
        pass
    emit_span(sc.SPAN_EXPERT_CALL, 1_000, 2_000, {sc.EXPERT_ID: 1, sc.EXPERT_REPLICA: None},
              carrier=step_carrier, error="TimeoutError")
    assert flush_tracing(5.0)
    spans = {s.name: s for s in traced.wait_for_spans(4)}
    step, fwd, call = spans[sc.SPAN_ENGINE_STEP], spans[sc.SPAN_DRAFT_FORWARD], spans[sc.SPAN_EXPERT_CALL]
    req = spans["request-a"]
    assert step.parent_span_id == "" and step.trace_id != req.trace_id
    assert step.links == [(req.trace_id, req.span_id, {"specmoe.request.id": "a"})]
    assert (fwd.trace_id, fwd.parent_span_id) == (step.trace_id, step.span_id)  # header keys any case
    assert (call.trace_id, call.parent_span_id) == (step.trace_id, step.span_id)
    assert (call.start_time_ns, call.end_time_ns) == (1_000, 2_000)
    assert call.attributes == {"specmoe.expert.id": 1, "error.type": "TimeoutError"}
    assert call.status_code == 2  # STATUS_CODE_ERROR
    assert a.get_span_context().span_id == int(req.span_id, 16)


def test_body_exception_recorded_and_reraised(traced):
    with pytest.raises(KeyError):
        with start_span(sc.SPAN_VERIFY):
            raise KeyError("boom")
    assert flush_tracing(5.0)
    (span,) = traced.wait_for_spans(1)
    assert span.status_code == 2 and span.attributes["error.type"] == "KeyError"
    assert [e[0] for e in span.events] == ["exception"]


def test_telemetry_errors_never_raise(traced):
    class Weird:
        def __str__(self):
            raise RuntimeError("no str")

    with start_span(sc.SPAN_VERIFY, carrier={"traceparent": "garbage"}, attributes={"x": Weird()},
                    links=[object()]) as span:  # bad link, unprintable attribute: logged, not raised
        set_attributes(span, {"y": Weird()})
        add_event(span, "e", {"z": Weird()})
    assert extract_context({"traceparent": 42}) is not None
    assert link_from_carrier({"traceparent": "00-bad"}) is None
    emit_span("late", "not-a-time", None)
    # The span itself survived its bad parts: exported, ended, with its event and no bad attributes.
    assert flush_tracing(5.0)
    [exported] = [s for s in traced.wait_for_spans(1) if s.name == sc.SPAN_VERIFY]
    assert exported.end_time_ns >= exported.start_time_ns > 0
    assert [name for name, _ in exported.events] == ["e"]
    assert "x" not in exported.attributes and "y" not in exported.attributes


def test_disabled_tracing_is_noop_but_passes_context_through(clean_env):
    assert setup_tracing("draft", TracingConfig(endpoint=None), set_global=False) is False
    assert not is_enabled()
    upstream = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with start_span(sc.SPAN_DRAFT_FORWARD, carrier=upstream) as span:
        assert not span.is_recording()
        assert inject_context()["traceparent"] == upstream["traceparent"]
    with start_span(sc.SPAN_VERIFY) as span:
        assert inject_context() == {}


def test_setup_is_idempotent_and_resettable(receiver, clean_env):
    assert setup_tracing("verifier", TracingConfig(endpoint=receiver.endpoint), set_global=False)
    assert setup_tracing("other", TracingConfig(enabled=False), set_global=False)  # first call wins
    assert shutdown_tracing(2.0)
    assert setup_tracing("other", TracingConfig(enabled=False), set_global=False) is False


def test_env_vars_configure_endpoint_sampler_and_disable(receiver, clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint + "/")
    assert resolve_endpoint(None) == receiver.endpoint + "/v1/traces"
    assert resolve_endpoint(TracingConfig(endpoint="http://c:4318/v1/traces")) == "http://c:4318/v1/traces"
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert setup_tracing("ingress", set_global=False)
    with start_span("unsampled") as span:
        assert not span.is_recording()
    assert shutdown_tracing(2.0)
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    assert setup_tracing("ingress", set_global=False)
    with start_span("sampled"):
        pass
    assert shutdown_tracing(5.0)
    assert [s.name for s in receiver.wait_for_spans(1)] == ["sampled"]
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert setup_tracing("ingress", set_global=False) is False


def test_otel_traces_exporter_none_console_and_unknown(receiver, clean_env, capsys):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")  # the standard switch: off despite an endpoint
    assert setup_tracing("ingress", set_global=False) is False
    assert shutdown_tracing(1.0)  # setup is once per process until shut down
    clean_env.setenv("OTEL_TRACES_EXPORTER", "zipkin")  # not one this server has: off, not an error
    assert setup_tracing("ingress", set_global=False) is False
    assert shutdown_tracing(1.0)
    clean_env.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")  # no collector needed
    assert setup_tracing("ingress", set_global=False)
    with start_span("printed span"):
        pass
    assert shutdown_tracing(5.0)
    assert '"name": "printed span"' in capsys.readouterr().out


def test_sampler_ratio_zero_respects_sampled_remote_parent(traced):
    shutdown_tracing(1.0)
    assert setup_tracing("t", TracingConfig(endpoint=traced.endpoint, sampler_ratio=0.0), set_global=False)
    with start_span("root") as root:
        assert not root.is_recording()
    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with start_span("child", carrier=parent) as child:
        assert child.is_recording()


def test_config_rejects_unknown_and_out_of_range_fields():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"endpoint": "x", "bogus": 1}, TracingConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sampler_ratio": 2.0}, TracingConfig)


def test_step_attributes_and_otel_env_vars(clean_env):
    from engine.observer import StepStats
    from observability import otel_env_vars

    stats = StepStats(batch_size=3, num_prefills=1, num_drafted=8, num_accepted=5, num_emitted=8, k=4,
                      duration_s=0.01, k_policy="adaptive", expected_tokens=7.5, predicted_step_s=0.012)
    assert sc.step_attributes(stats) == {
        "specmoe.step.batch_size": 3, "specmoe.step.num_prefills": 1, "specmoe.step.k": 4,
        "specmoe.step.num_drafted_tokens": 8, "specmoe.step.num_accepted_tokens": 5,
        "specmoe.step.num_emitted_tokens": 8, "specmoe.step.k_policy": "adaptive",
        "specmoe.step.expected_tokens": 7.5, "specmoe.step.predicted_duration_ms": 12.0,
    }
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert otel_env_vars()["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert all(k.startswith("OTEL_") for k in otel_env_vars())


def test_gzip_compressed_export_is_decoded(receiver, clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    assert setup_tracing("ingress", TracingConfig(endpoint=receiver.endpoint), set_global=False)
    with start_span("compressed", attributes={"k": "v"}):
        pass
    assert shutdown_tracing(5.0)
    (span,) = receiver.wait_for_spans(1)
    assert (span.name, span.attributes) == ("compressed", {"k": "v"}) and not receiver.errors
