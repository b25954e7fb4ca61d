"""Expert offload through the router's actor-call path, without a Ray cluster (in-process
ExpertWorkers behind fake handles, tests/helpers/fake_ray.py): speculative greedy output is the
same token for token with offload and prefetch on, off, or everything resident; the cache
counters the actors report reach the Prometheus metrics exactly; config errors name the field."""

from __future__ import annotations

import pytest
import torch

from actors.expert_config import ExpertPoolConfig
from actors.expert_router import ExpertRouter
from actors.telemetry import RouterTelemetry
from engine.drafters.draft_model import DraftModelDrafter
from engine.engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from observability import EngineMetrics, StragglerDetector
from tests.engine.bundled import DRAFT, TARGET, prompt_ids
from tests.helpers.fake_ray import FakePool, install_fake_ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _generate(experts=None) -> list[list[int]]:
    target = load_model(TARGET, "float32", experts=experts)
    drafter = DraftModelDrafter(load_model(DRAFT, "float32"), 4, 1024)
    engine = LLMEngine(target, drafter, 4, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                                           max_waiting=100), speculative_policy="fixed")
    requests = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompt_ids(6, max_len=64))]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.outputs[0].token_ids for r in requests]


@pytest.fixture(scope="module")
def resident_output() -> list[list[int]]:
    return _generate()


def _scrape(metrics: EngineMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"specmoe:expert_cache_{name}", {"model_name": "m"}) or 0.0


@pytest.mark.parametrize("prefetch", [True, False])
def test_greedy_output_is_identical_with_half_the_experts_resident(monkeypatch, resident_output, prefetch):
    install_fake_ray(monkeypatch)
    # 2 actors of 4 experts x 4 MoE layers: 8 of their 16 (layer, expert) entries resident.
    pool = FakePool.started(TARGET, max_resident_experts=8, prefetch=prefetch, call_timeout_s=30.0)
    metrics = EngineMetrics("m")
    router = ExpertRouter(pool, torch.float32, RouterTelemetry(metrics, StragglerDetector()))
    assert router.prefetch_enabled is prefetch
    assert _generate(router) == resident_output
    per_actor = [r.handle.target.store for r in pool.all_replicas()]
    for store in per_actor:
        store.drain()
    stats = [store.snapshot() for store in per_actor]
    for store in per_actor:
        store.close()
    total = {k: sum(s[k] for s in stats) for k in ("hits", "misses", "prefetches", "prefetches_used", "evictions")}
    assert total["misses"] > 0 and total["evictions"] > 0
    assert (total["prefetches_used"] > 0) is prefetch and (total["prefetches"] > 0) is prefetch
    # Every counter an actor reported with its answers is in the metrics (the last prefetches of
    # the run land after the last answer, so those two are reported up to then).
    assert _scrape(metrics, "hits_total") == total["hits"]
    assert _scrape(metrics, "misses_total") == total["misses"]
    assert _scrape(metrics, "prefetches_used_total") == total["prefetches_used"]
    assert _scrape(metrics, "stall_seconds_total") > 0
    assert _scrape(metrics, "prefetches_total") <= total["prefetches"]


@pytest.mark.parametrize(("config", "message"), [
    ({"experts_per_actor": 4, "max_resident_experts": 3}, "experts.max_resident_experts must be >= "
                                                          "experts.experts_per_actor"),
    ({"experts_per_actor": 2, "max_resident_experts": 3, "pinned_hot_experts": 2}, r"\(4: one layer"),
    ({"max_resident_experts": 8, "max_resident_bytes": 1 << 20}, "set at most one"),
    ({"max_resident_bytes": 0}, "experts.max_resident_bytes must be >= 1"),
    ({"pinned_hot_experts": -1}, "experts.pinned_hot_experts must be >= 0"),
    ({"simulated_link_gbps": 0.0}, "experts.simulated_link_gbps must be > 0"),
])
def test_config_errors_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        ExpertPoolConfig(**config)


def test_offload_settings_are_none_when_everything_is_resident():
    assert ExpertPoolConfig().offload_settings() is None
    assert ExpertPoolConfig(max_resident_bytes=4096, prefetch=False).offload_settings() == {
        "max_resident": None, "max_resident_bytes": 4096, "num_pinned": 0, "prefetch": False,
        "simulated_link_gbps": None}
