"""Telemetry of a hedged expert call: one call span per group, the hedge an event on it (from and
to which replica, after how long) and attributes (hedges, hedge_won); the hedge counter."""

from __future__ import annotations

import torch

from actors.expert_router import ExpertRouter
from actors.telemetry import RouterTelemetry
from engine.config import load_model_config
from observability import EngineMetrics, StragglerDetector, flush_tracing
from observability import semconv as sc
from tests.helpers.fake_ray import FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"


def test_a_hedged_call_has_a_hedge_event_and_attributes(traced, monkeypatch):
    install_fake_ray(monkeypatch)
    pool = FakePool.started(TARGET, replicas=2, hedge_floor_ms=30.0, hedge_factor=1.0, hedge_min_samples=1)
    metrics = EngineMetrics("m")
    router = ExpertRouter(pool, torch.float32, RouterTelemetry(metrics, StragglerDetector()))
    layer = 1
    counts = [0] * pool.num_experts
    counts[2], counts[5] = 2, 3
    rows = torch.randn(5, load_model_config(TARGET).hidden_size, generator=torch.Generator().manual_seed(0))
    router.run_layer(layer, rows, torch.ones(5), counts)  # arms hedging: one latency per group
    slow = router.actor_calls.pick(1)
    slow.handle.set_delay_ms.remote(200.0)
    router.run_layer(layer, rows, torch.ones(5), counts)
    assert flush_tracing(5.0)
    calls = [s for s in traced.wait_for_spans(6, timeout_s=10) if s.name == sc.SPAN_EXPERT_CALL]
    assert len(calls) == 4  # two dispatches x two groups: the hedge is not a span of its own
    hedged = [s for s in calls if s.attributes[sc.EXPERT_HEDGES] == 1]
    assert len(hedged) == 1 and hedged[0].attributes[sc.EXPERT_HEDGE_WON] is True
    assert hedged[0].attributes[sc.EXPERT_ID] == "4,5,6,7"
    (name, attrs), = hedged[0].events
    other = next(r for r in pool.replicas[1] if r is not slow)
    assert name == sc.EVENT_EXPERT_HEDGE and attrs[sc.EVENT_HEDGE_FROM] == slow.name
    assert attrs[sc.EVENT_HEDGE_TO] == other.name and attrs[sc.EVENT_HEDGE_WAITED_MS] >= 30.0
    assert all(s.attributes[sc.EXPERT_HEDGES] == 0 and s.events == [] for s in calls if s not in hedged)
    sample = metrics.registry.get_sample_value
    assert sample("specmoe:expert_hedges_total", {"model_name": "m", "layer": "1", "expert": "5"}) == 1
    assert sample("specmoe:expert_hedges_total", {"model_name": "m", "layer": "1", "expert": "2"}) is None


def test_hedge_counters_are_declared_at_zero():
    metrics = EngineMetrics("m")
    metrics.declare_experts([1, 3], num_experts=4)
    text = metrics.render().decode()
    assert 'specmoe:expert_hedges_total{expert="3",layer="3",model_name="m"} 0.0' in text
    metrics.record_hedge(3, 3)
    assert metrics.registry.get_sample_value("specmoe:expert_hedges_total",
                                             {"model_name": "m", "layer": "3", "expert": "3"}) == 1
