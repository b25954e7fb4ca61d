"""DispatchRecorder: one call per layer dispatch gives flags, metrics, EWMA and expert-call spans."""

import pytest

from observability import (
    DispatchRecorder,
    EngineMetrics,
    ExpertCall,
    LatencyTracker,
    flush_tracing,
    start_span,
)
from observability import (
    semconv as sc,
)

MS = 1_000_000  # ns per ms


def _calls(t0: int) -> list[ExpertCall]:
    return [
        ExpertCall(expert=0, num_tokens=4, start_ns=t0, end_ns=t0 + 2 * MS, replica="actor-a", compute_time_ms=1.5),
        ExpertCall(expert=3, num_tokens=1, start_ns=t0, end_ns=t0 + 3 * MS, replica="actor-b"),
        ExpertCall(expert=5, num_tokens=2, start_ns=t0, end_ns=t0 + 40 * MS, replica="actor-c", compute_time_ms=4.0),
        ExpertCall(expert=6, num_tokens=1, start_ns=t0, end_ns=t0 + 90 * MS, replica="actor-d", error="RayActorError"),
    ]


def test_dispatch_recorder_flags_records_and_emits_child_spans(traced):
    metrics, tracker = EngineMetrics("tiny-moe"), LatencyTracker(alpha=1.0)
    rec = DispatchRecorder(metrics=metrics, tracker=tracker)
    with start_span(sc.SPAN_MOE_DISPATCH, attributes={sc.MOE_LAYER: 1, sc.MOE_NUM_TOKENS: 4,
                                                      sc.MOE_NUM_EXPERTS_HIT: 4}):
        flags = rec.record(1, _calls(1_700_000_000 * 10**9), num_experts=8)
    # latencies 2, 3, 40 ms (the failed call is left out): median 3 -> threshold 9 ms
    assert flags == [False, False, True, False]
    assert rec.detector.counts() == {(1, 5): 1}

    r, m = metrics.registry, {"model_name": "tiny-moe", "layer": "1"}
    assert r.get_sample_value("specmoe:expert_stragglers_total", {**m, "expert": "5"}) == 1
    assert r.get_sample_value("specmoe:expert_tokens_total", {**m, "expert": "0"}) == 4
    assert r.get_sample_value("specmoe:expert_tokens_total", {**m, "expert": "6"}) is None  # failed
    assert r.get_sample_value("specmoe:moe_load_imbalance", m) == pytest.approx(4 / (8 / 8))
    assert tracker.snapshot() == {"actor-a": 2.0, "actor-b": 3.0, "actor-c": 40.0}

    assert flush_tracing(5.0)
    spans = traced.wait_for_spans(5)
    (dispatch,) = [s for s in spans if s.name == sc.SPAN_MOE_DISPATCH]
    calls = {s.attributes["specmoe.expert.id"]: s for s in spans if s.name == sc.SPAN_EXPERT_CALL}
    assert dispatch.attributes["specmoe.moe.num_stragglers"] == 1
    assert all(c.parent_span_id == dispatch.span_id and c.trace_id == dispatch.trace_id for c in calls.values())
    assert calls[5].attributes == {
        "specmoe.moe.layer": 1, "specmoe.expert.id": 5, "specmoe.expert.replica": "actor-c",
        "specmoe.expert.num_tokens": 2, "specmoe.expert.compute_time_ms": 4.0,
        "specmoe.expert.queue_time_ms": 36.0, "specmoe.expert.straggler": True,
    }
    assert "specmoe.expert.queue_time_ms" not in calls[3].attributes  # no compute time reported
    assert calls[6].status_code == 2 and calls[6].attributes["error.type"] == "RayActorError"
    assert calls[0].end_time_ns - calls[0].start_time_ns == 2 * MS


def test_split_expert_gets_one_key_per_replica_and_bad_input_is_swallowed():
    rec = DispatchRecorder(emit_spans=False)
    calls = [ExpertCall(1, 2, 0, 1 * MS, "r1"), ExpertCall(1, 2, 0, 1 * MS, "r2"),
             ExpertCall(2, 2, 0, 1 * MS, "r3"), ExpertCall(1, 2, 0, 30 * MS, "r4")]
    assert rec.record(0, calls) == [False, False, False, True]
    assert rec.detector.counts() == {(0, (1, "r4")): 1}
    assert rec.record(0, [object()]) is None
