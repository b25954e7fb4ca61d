"""Spans and metrics of an expert dispatch that fails (every attempt of a group dies): the dispatch
span and each attempt's call span are exported, ended, with error status; no expert tokens are
counted for the failed layer, while a later successful dispatch records its calls exactly."""

from __future__ import annotations

import pytest
import torch

from actors.actor_calls import ExpertCallFailed
from actors.expert_router import ExpertRouter
from actors.telemetry import RouterTelemetry
from engine.config import load_model_config
from observability import EngineMetrics, StragglerDetector, flush_tracing
from observability import semconv as sc
from tests.helpers.fake_ray import FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"
ERROR = 2  # OTLP STATUS_CODE_ERROR


def _sample(metrics: EngineMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_a_failed_dispatch_ends_its_spans_with_errors_and_counts_no_tokens(traced, monkeypatch):
    install_fake_ray(monkeypatch)
    pool = FakePool.started(TARGET, behaviour=lambda g, i, gen: "dead" if g == 1 else "ok", max_attempts=2)
    metrics = EngineMetrics("m")
    router = ExpertRouter(pool, torch.float32, RouterTelemetry(metrics, StragglerDetector()))
    layer = 1
    counts = [0] * pool.num_experts
    counts[2], counts[5] = 2, 3  # group 0 answers, group 1 dies twice
    rows = torch.randn(5, load_model_config(TARGET).hidden_size, generator=torch.Generator().manual_seed(0))
    weights = torch.ones(5)
    with pytest.raises(ExpertCallFailed):
        router.run_layer(layer, rows, weights, counts)
    assert flush_tracing(5.0)
    spans = traced.wait_for_spans(4, timeout_s=10)
    dispatch = [s for s in spans if s.name == sc.SPAN_MOE_DISPATCH]
    calls = [s for s in spans if s.name == sc.SPAN_EXPERT_CALL]
    assert len(dispatch) == 1 and dispatch[0].status_code == ERROR
    assert dispatch[0].attributes[sc.MOE_LAYER] == layer and dispatch[0].end_time_ns >= dispatch[0].start_time_ns > 0
    # group 1: two attempts, each its own span ending in error; group 0's answered call is closed
    # with the dispatch's error (its result is discarded).
    assert sorted((s.attributes[sc.EXPERT_ATTEMPTS], s.attributes[sc.EXPERT_ERROR].split(":")[0]) for s in calls) \
        == [(1, "ExpertCallFailed"), (1, "RayActorError"), (2, "RayActorError")]
    assert all(s.status_code == ERROR and s.parent_span_id == dispatch[0].span_id and s.end_time_ns > 0
               for s in calls)
    for expert in (2, 5):
        assert _sample(metrics, "specmoe:expert_tokens_total", layer=str(layer), expert=str(expert)) == 0

    pool.behaviour = lambda g, i, gen: "ok"
    pool.recreate(pool.replicas[1][0], "test")  # a healthy generation now
    router.run_layer(layer, rows, weights, counts)
    assert _sample(metrics, "specmoe:expert_tokens_total", layer=str(layer), expert="2") == 2
    assert _sample(metrics, "specmoe:expert_tokens_total", layer=str(layer), expert="5") == 3

