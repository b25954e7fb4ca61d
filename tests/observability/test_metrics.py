"""Prometheus metrics: exact counts after synthetic observations, and valid merged exposition."""

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from observability import CONTENT_TYPE, EngineMetrics, RequestMetrics, render

M = {"model_name": "tiny-moe"}
LOADGEN_NAMES = ("specmoe:spec_decode_num_drafts_total", "specmoe:spec_decode_num_draft_tokens_total",
                 "specmoe:spec_decode_num_accepted_tokens_total",
                 "specmoe:spec_decode_num_accepted_tokens_per_pos_total")


def value(registry, name, **labels):
    return registry.get_sample_value(name, {**M, **labels})


def test_streaming_tracker_exact_counts():
    rm = RequestMetrics("tiny-moe")
    r = rm.registry
    n = 20
    for i in range(n):
        tr = rm.track(arrival_time=100.0)
        assert value(r, "specmoe:num_requests_waiting") == 1
        tr.on_tokens(1, t=100.1)                 # first chunk: TTFT 0.1, no ITL
        assert value(r, "specmoe:num_requests_running") == 1
        assert value(r, "specmoe:num_requests_waiting") == 0
        tr.on_tokens(3, t=100.16)                # speculative chunk: 3 x 0.02 s
        tr.on_tokens(2, t=100.2)                 # 2 x 0.02 s
        tr.on_finish("length" if i % 2 else "stop", prompt_tokens=5, output_tokens=6, t=100.25,
                     queue_time_s=0.01)
        tr.on_finish("stop", 5, 6, t=200.0)      # a second finish is ignored
        tr.on_tokens(4, t=200.0)                 # as are tokens after it
    assert value(r, "specmoe:time_to_first_token_seconds_count") == n
    assert value(r, "specmoe:time_to_first_token_seconds_sum") == pytest.approx(0.1 * n)
    assert value(r, "specmoe:inter_token_latency_seconds_count") == 5 * n
    assert value(r, "specmoe:inter_token_latency_seconds_sum") == pytest.approx(0.1 * n)
    assert value(r, "specmoe:inter_token_latency_seconds_bucket", le="0.01") == 0
    assert value(r, "specmoe:inter_token_latency_seconds_bucket", le="0.04") == 5 * n
    assert value(r, "specmoe:time_per_output_token_seconds_sum") == pytest.approx(0.03 * n)
    assert value(r, "specmoe:e2e_request_latency_seconds_count") == n
    assert value(r, "specmoe:e2e_request_latency_seconds_sum") == pytest.approx(0.25 * n)
    assert value(r, "specmoe:request_queue_time_seconds_count") == n
    assert value(r, "specmoe:generation_tokens_total") == 6 * n
    assert value(r, "specmoe:prompt_tokens_total") == 5 * n
    assert value(r, "specmoe:request_success_total", finished_reason="stop") == n / 2
    assert value(r, "specmoe:request_success_total", finished_reason="length") == n / 2
    assert value(r, "specmoe:num_requests_running") == 0
    assert value(r, "specmoe:num_requests_waiting") == 0


def test_non_streaming_and_aborted_requests():
    rm = RequestMetrics("tiny-moe", include_state_gauges=False)
    r = rm.registry
    rm.observe_finished("stop", 7, 4, e2e_s=2.0, ttft_s=0.5, queue_time_s=0.25)
    tr = rm.track(arrival_time=0.0)
    tr.on_finish("abort", prompt_tokens=3, output_tokens=0, t=1.5)  # never got a token
    assert value(r, "specmoe:time_per_output_token_seconds_sum") == pytest.approx(0.5)  # (2 - 0.5) / 3
    assert value(r, "specmoe:time_to_first_token_seconds_count") == 1
    assert value(r, "specmoe:e2e_request_latency_seconds_count") == 2
    assert value(r, "specmoe:generation_tokens_total") == 4
    assert value(r, "specmoe:prompt_tokens_total") == 10
    assert value(r, "specmoe:request_success_total", finished_reason="abort") == 1
    assert value(r, "specmoe:num_requests_running") is None  # not exported


def test_engine_metrics_exact_counts():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    for _ in range(10):
        em.record_step(num_drafts=4, num_draft_tokens=12, num_accepted=7, accepted_per_position=[4, 2, 1])
    assert value(r, "specmoe:spec_decode_num_drafts_total") == 40
    assert value(r, "specmoe:spec_decode_num_draft_tokens_total") == 120
    assert value(r, "specmoe:spec_decode_num_accepted_tokens_total") == 70
    assert [value(r, "specmoe:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [40, 20, 10]

    em.set_engine_state(running=3, waiting=2, kv_usage=0.25)
    assert value(r, "specmoe:kv_cache_usage_perc") == 0.25
    assert value(r, "specmoe:num_requests_waiting") == 2

    assert em.record_dispatch(0, [6, 0, 2, 0]) == pytest.approx(3.0)  # max 6 / mean 2
    assert em.record_dispatch(0, {1: 4, 3: 4}, num_experts=8) == pytest.approx(4.0)
    assert em.record_dispatch(1, [0, 0]) is None
    assert value(r, "specmoe:moe_load_imbalance", layer="0") == pytest.approx(4.0)
    assert value(r, "specmoe:moe_dispatch_load_imbalance_count") == 2

    for i in range(30):
        em.record_expert_call(layer=2, expert=5, num_tokens=3, latency_s=0.004, straggler=i % 10 == 0)
    assert value(r, "specmoe:expert_tokens_total", layer="2", expert="5") == 90
    assert value(r, "specmoe:expert_call_latency_seconds_count", layer="2", expert="5") == 30
    assert value(r, "specmoe:expert_call_latency_seconds_bucket", layer="2", expert="5", le="0.005") == 30
    assert value(r, "specmoe:expert_stragglers_total", layer="2", expert="5") == 3


def test_sync_from_engine_turns_totals_into_deltas():
    em = EngineMetrics("tiny-moe", per_expert_latency=False)
    r = em.registry
    snap = {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 9, "accepted_per_position": [5, 3, 1],
            "num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "num_steps": 7}
    em.sync_from_engine(snap)
    em.sync_from_engine(snap)  # unchanged totals add nothing
    em.sync_from_engine({**snap, "num_drafts": 6, "num_draft_tokens": 19, "num_accepted_tokens": 13,
                         "accepted_per_position": [6, 4, 2, 1], "num_running": 0})
    assert value(r, "specmoe:spec_decode_num_drafts_total") == 6
    assert value(r, "specmoe:spec_decode_num_draft_tokens_total") == 19
    assert value(r, "specmoe:spec_decode_num_accepted_tokens_total") == 13
    assert [value(r, "specmoe:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(4)] == [6, 4, 2, 1]
    assert value(r, "specmoe:num_requests_running") == 0
    em.record_expert_call(1, 3, 2, 0.01)
    assert value(r, "specmoe:expert_call_latency_seconds_count", layer="1") == 1


def test_chosen_draft_lengths_and_off_steps_come_from_engine_totals():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    em.sync_from_engine({"draft_length_counts": [2, 0, 1], "num_spec_off_steps": 1})
    em.sync_from_engine({"draft_length_counts": [3, 0, 1, 0, 4], "num_spec_off_steps": 2})
    assert value(r, "specmoe:spec_decode_draft_length_count") == 8
    assert value(r, "specmoe:spec_decode_draft_length_sum") == 2 + 16
    assert value(r, "specmoe:spec_decode_draft_length_bucket", le="0.0") == 3
    assert value(r, "specmoe:spec_decode_draft_length_bucket", le="2.0") == 4
    assert value(r, "specmoe:spec_decode_off_steps_total") == 2


def test_pipelined_window_counters_follow_engine_totals():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    # exported at 0 before pipelined drafting ever ran (off by default), as Prometheus advises
    assert value(r, "specmoe:spec_decode_pipelined_windows_total", outcome="used") == 0
    assert value(r, "specmoe:spec_decode_pipelined_windows_total", outcome="discarded") == 0
    em.sync_from_engine({"pipelined_windows": {"used": 3, "discarded": 1}})
    em.sync_from_engine({"pipelined_windows": {"used": 3, "discarded": 1}})
    em.sync_from_engine({"pipelined_windows": {"used": 7, "discarded": 4}})
    assert value(r, "specmoe:spec_decode_pipelined_windows_total", outcome="used") == 7
    assert value(r, "specmoe:spec_decode_pipelined_windows_total", outcome="discarded") == 4


def test_slo_attainment_counters_follow_engine_totals():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    em.sync_from_engine({"slo_attainment": {"chat": [3, 4]}, "finished_by_reason": {"stop": 4}})
    em.sync_from_engine({"slo_attainment": {"chat": [5, 7], "batch": [1, 1]}, "finished_by_reason": {"stop": 8}})
    em.sync_from_engine({"slo_attainment": {"chat": [5, 7], "batch": [1, 1]}, "finished_by_reason": {"stop": 8}})
    assert value(r, "specmoe:slo_requests_total", slo_class="chat", met="true") == 5
    assert value(r, "specmoe:slo_requests_total", slo_class="chat", met="false") == 2
    assert value(r, "specmoe:slo_requests_total", slo_class="batch", met="true") == 1


def test_graph_event_counters_follow_the_routers_totals():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    em.sync_graph_events({"build": 1, "late": 0, "takeover": 0})
    em.sync_graph_events({"build": 2, "late": 1, "takeover": 1})
    assert value(r, "specmoe:expert_graph_events_total", event="build") == 2
    assert value(r, "specmoe:expert_graph_events_total", event="late") == 1
    assert value(r, "specmoe:expert_graph_events_total", event="takeover") == 1
    em.sync_graph_events({"build": 1, "late": 0, "takeover": 0})  # a new router: counts from zero again
    assert value(r, "specmoe:expert_graph_events_total", event="build") == 3
    assert value(r, "specmoe:expert_graph_events_total", event="late") == 1


def test_recording_never_raises_and_duplicate_registration_falls_back():
    em = EngineMetrics("tiny-moe")
    assert em.record_expert_call("x", None, "many", "slow") is None
    assert em.record_step(None, object(), 1) is None
    assert em.sync_from_engine({"num_drafts": "lots"}) is None
    # The refused calls recorded nothing half-way, and the metrics still work afterwards.
    assert value(em.registry, "specmoe:spec_decode_num_drafts_total") == 0
    assert value(em.registry, "specmoe:expert_tokens_total", layer="x", expert="None") is None
    em.record_step(2, 8, 5, [3, 2])
    assert value(em.registry, "specmoe:spec_decode_num_drafts_total") == 2
    assert value(em.registry, "specmoe:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    shared = CollectorRegistry()
    RequestMetrics("a", shared)
    second = RequestMetrics("a", shared)  # same names in one registry: logged, private registry
    assert second.registry is not shared
    second.track().on_tokens(1)
    assert value(second.registry, "specmoe:generation_tokens_total", model_name="a") == 1


def test_render_merges_sources_into_valid_text():
    rm, em = RequestMetrics("tiny-moe"), EngineMetrics("tiny-moe")
    rm.observe_finished("stop", 3, 2, e2e_s=0.5, ttft_s=0.1)
    rm.set_state(running=9, waiting=8)
    em.record_step(1, 3, 2, [1, 1, 0])
    em.set_engine_state(running=1, waiting=0, kv_usage=0.1)
    verifier_text = em.render()  # what the ingress fetches over the verifier's handle
    text = render(rm.registry, verifier_text, b"not prometheus {{{").decode()

    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    for name in LOADGEN_NAMES[:3]:
        assert samples[(name, (("model_name", "tiny-moe"),))] > 0
    assert samples[(LOADGEN_NAMES[3], (("model_name", "tiny-moe"), ("position", "1")))] == 1
    assert samples[("specmoe:num_requests_running", (("model_name", "tiny-moe"),))] == 9  # first source wins
    assert samples[("specmoe:time_to_first_token_seconds_count", (("model_name", "tiny-moe"),))] == 1
    type_lines = [ln for ln in text.splitlines() if ln.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))  # one HELP/TYPE block per family
    assert "_created" not in text
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_labelled_pages_of_several_replicas_keep_every_replicas_series():
    pages = []
    for drafts in (3, 5):  # two verifier replicas' engine metrics, same series names
        em = EngineMetrics("tiny-moe")
        em.record_step(drafts, 2 * drafts, drafts, [1, 0])
        pages.append(em.render())
    text = render((pages[0], {"replica": "verifier-a"}), (pages[1], {"replica": "verifier-b"})).decode()
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    name = "specmoe:spec_decode_num_drafts_total"
    assert samples[(name, "verifier-a")] == 3 and samples[(name, "verifier-b")] == 5
    assert sum(v for (n, _), v in samples.items() if n == name) == 8  # what sum(...) reads
    assert sum(ln.split()[:3] in (["#", "TYPE", name], ["#", "TYPE", name[:-6]]) for ln in text.splitlines()) == 1


def test_declared_expert_series_are_exported_at_zero_before_any_call():
    em = EngineMetrics("tiny-moe")
    r = em.registry
    assert value(r, "specmoe:expert_tokens_total", layer="1", expert="3") is None
    em.declare_experts([1, 3], num_experts=4)
    for layer in ("1", "3"):
        for expert in ("0", "3"):
            assert value(r, "specmoe:expert_tokens_total", layer=layer, expert=expert) == 0
            assert value(r, "specmoe:expert_stragglers_total", layer=layer, expert=expert) == 0
    assert value(r, "specmoe:expert_tokens_total", layer="2", expert="0") is None  # not an MoE layer
    text = em.render().decode()
    assert 'specmoe:expert_tokens_total{expert="3",layer="3",model_name="tiny-moe"} 0.0' in text
    em.record_expert_call(layer=3, expert=3, num_tokens=5, latency_s=0.001)
    assert value(r, "specmoe:expert_tokens_total", layer="3", expert="3") == 5


def test_finish_reason_series_are_exported_at_zero_before_any_request():
    rm = RequestMetrics("tiny-moe")
    for reason in ("stop", "length", "abort", "error"):
        assert value(rm.registry, "specmoe:request_success_total", finished_reason=reason) == 0
    assert value(rm.registry, "specmoe:request_success_total", finished_reason="unknown") is None
    rm.track(0.0).on_finish("length", 3, 2)
    assert value(rm.registry, "specmoe:request_success_total", finished_reason="length") == 1


def test_a_refused_request_is_counted_apart_from_finished_ones_by_reason():
    rm = RequestMetrics("tiny-moe")
    for reason in ("queue_full", "ttft_unattainable", "unavailable"):  # exported before any refusal
        assert value(rm.registry, "specmoe:request_refused_total", reason=reason) == 0
    rm.track(0.0).on_refused()
    tracker = rm.track(0.0)
    tracker.on_refused("ttft_unattainable")
    tracker.on_finish("error", 0, 0)  # a second close is ignored
    rm.track(0.0).on_refused("queue_full")
    rm.track(0.0).on_refused("not_a_reason")  # an unknown code: unavailable, no new label value
    assert value(rm.registry, "specmoe:request_refused_total", reason="unavailable") == 2
    assert value(rm.registry, "specmoe:request_refused_total", reason="ttft_unattainable") == 1
    assert value(rm.registry, "specmoe:request_refused_total", reason="queue_full") == 1
    assert value(rm.registry, "specmoe:request_refused_total", reason="not_a_reason") is None
    assert value(rm.registry, "specmoe:request_success_total", finished_reason="error") == 0
    assert value(rm.registry, "specmoe:e2e_request_latency_seconds_count") == 0
    assert value(rm.registry, "specmoe:num_requests_waiting") == 0
