"""Hedged expert calls on the actor-call path, without a Ray cluster: in-process ExpertWorkers behind
fake handles (tests/helpers/fake_ray.py) whose ``set_delay_ms`` makes a replica a straggler.

Covered: the deadline rule and config errors; a hedge only once the deadline has passed, counted
once per (layer, expert); the loser cancelled, its late (here: poisoned) result never read and its
rows released; no hedge with one replica or with hedging off; greedy output identical to
in-process experts with a slowed replica, hedging on and off.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from actors.expert_config import ExpertPoolConfig
from actors.expert_router import ExpertRouter
from actors.hedging import HedgePolicy
from actors.telemetry import RouterTelemetry
from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.llm import LLM
from engine.model import ExpertStore
from engine.sampling_params import SamplingParams
from observability import EngineMetrics, StragglerDetector
from tests.helpers.fake_ray import FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"
CONFIG = load_model_config(TARGET)
LAYER = CONFIG.moe.sparse_layers[-1]
HEDGE = dict(replicas=2, hedge_floor_ms=100.0, hedge_factor=1.0, hedge_min_samples=1,
             probe_interval_s=60.0)  # no probe (tests/actors/test_replica_choice.py): only hedges


@pytest.fixture
def fake_ray(monkeypatch):
    return install_fake_ray(monkeypatch)


def _rows(seed: int = 0):
    """3 rows for expert 1 (group 0), 2 for expert 6 (group 1)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [0] * CONFIG.moe.num_experts
    counts[1], counts[6] = 3, 2
    return torch.randn(5, CONFIG.hidden_size, generator=gen), torch.rand(5, generator=gen), counts


def _expected(rows, weights, counts) -> torch.Tensor:
    store = ExpertStore(CheckpointReader(TARGET), CONFIG, dtype=torch.float32)
    return store.forward(LAYER, rows, torch.tensor(counts), weights)


def _hedges(metrics: EngineMetrics, expert: int) -> float:
    return metrics.registry.get_sample_value("specmoe:expert_hedges_total", {
        "model_name": "m", "layer": str(LAYER), "expert": str(expert)}) or 0.0


def _tokens(metrics: EngineMetrics, expert: int) -> float:
    return metrics.registry.get_sample_value("specmoe:expert_tokens_total", {
        "model_name": "m", "layer": str(LAYER), "expert": str(expert)}) or 0.0


def _router(**config) -> tuple[ExpertRouter, EngineMetrics]:
    metrics = EngineMetrics("m")
    pool = FakePool.started(TARGET, **config)
    return ExpertRouter(pool, torch.float32, RouterTelemetry(metrics, StragglerDetector())), metrics


def test_the_deadline_is_a_factor_times_the_quantile_at_least_the_floor():
    config = ExpertPoolConfig(hedge_quantile=0.95, hedge_factor=2.0, hedge_floor_ms=10.0, hedge_window=20,
                              hedge_min_samples=5)
    policy = HedgePolicy(config)
    for ms in range(1, 5):
        policy.observe(0, float(ms))
    assert policy.deadline_ms(0, live_replicas=2) is None  # 4 samples < min_samples
    for ms in range(5, 41):  # the window keeps the last 20: 21..40 ms
        policy.observe(0, float(ms))
    assert policy.deadline_ms(0, live_replicas=2) == 2.0 * 39.0  # nearest rank: 19th of 20
    assert policy.deadline_ms(0, live_replicas=1) is None
    assert policy.deadline_ms(1, live_replicas=2) is None  # a group never observed
    policy.config = msgspec.structs.replace(config, hedge_floor_ms=100.0)
    assert policy.deadline_ms(0, live_replicas=2) == 100.0
    policy.enabled = False
    assert policy.deadline_ms(0, live_replicas=2) is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hedge_quantile", 0.0, "experts.hedge_quantile must be in"),
    ("hedge_quantile", 1.5, "experts.hedge_quantile must be in"),
    ("hedge_factor", 0.5, "experts.hedge_factor must be >= 1"),
    ("hedge_floor_ms", -1.0, "experts.hedge_floor_ms must be >= 0"),
    ("graph_hedge_floor_ms", -1.0, "experts.graph_hedge_floor_ms must be >= 0"),
    ("hedge_min_samples", 0, "experts.hedge_min_samples must be >= 1"),
    ("hedge_min_samples", 65, "experts.hedge_min_samples must be >= 1 and <= experts.hedge_window"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ExpertPoolConfig(**{field: value})
    assert ExpertPoolConfig().hedge is True and ExpertPoolConfig(hedge=False).hedge is False


def test_a_hedge_is_sent_only_past_the_deadline_and_the_late_result_is_never_read(fake_ray):
    router, metrics = _router(**HEDGE)
    rows, weights, counts = _rows()
    expected = _expected(rows, weights, counts)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)

    slow = router.actor_calls.pick(1)  # the replica the next call of group 1 goes to: 20 ms, under the 100 ms floor
    slow.handle.set_delay_ms.remote(20.0)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.actor_calls.num_hedges == 0 and _hedges(metrics, 6) == 0 and fake_ray.cancelled == []

    slow = router.actor_calls.pick(1)
    slow.handle.set_delay_ms.remote(600.0)
    poisoned = []
    slow.handle.target = type("Poisoned", (), {"forward": lambda *a: poisoned.append(a)})()
    start = time.monotonic()
    out = router.run_layer(LAYER, rows, weights, counts)
    took_s = time.monotonic() - start
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert 0.1 <= took_s < 0.5  # hedged at the 100 ms deadline, not the 600 ms straggler
    assert router.actor_calls.num_hedges == 1 and _hedges(metrics, 6) == 1
    assert _hedges(metrics, 1) == 0 and _hedges(metrics, 7) == 0  # group 0 answered in time; 7 had no rows
    assert len(fake_ray.cancelled) == 1 and slow.outstanding_rows == 2  # the loser still runs there
    assert slow.ewma_latency_ms >= 100.0 and router.actor_calls.pick(1) is not slow  # the winner is preferred now
    assert _tokens(metrics, 6) == 3 * 2  # three layers of 2 rows: the hedged one counted once

    assert router.actor_calls.losers.reap() == 0 and slow.outstanding_rows == 2  # still running: kept
    time.sleep(0.6)  # the loser ends; it is dropped unread and its rows released
    assert router.actor_calls.losers.reap() == 1 and poisoned == [] and router.actor_calls.losers.pending == []
    assert all(r.outstanding_rows == 0 for r in router.pool.all_replicas())
    assert slow.ewma_latency_ms > router.actor_calls.pick(1).ewma_latency_ms  # it was seen running > 100 ms
    slow.handle.target = router.actor_calls.pick(0).handle.target.__class__(TARGET, [4, 5, 6, 7])  # recovered
    slow.handle.set_delay_ms.remote(0.0)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.actor_calls.num_hedges == 1 and router.actor_calls.num_retries == 0 and len(fake_ray.cancelled) == 1


def test_a_hedge_that_dies_leaves_the_first_send_to_answer(fake_ray):
    router, _ = _router(**HEDGE)
    rows, weights, counts = _rows(seed=2)
    expected = _expected(rows, weights, counts)
    router.run_layer(LAYER, rows, weights, counts)
    slow, other = router.pool.replicas[1]
    slow.ewma_latency_ms, other.ewma_latency_ms = 0.0, 1000.0  # the first send goes to `slow`
    slow.handle.set_delay_ms.remote(300.0)
    other.handle.behaviour = "dead"
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.actor_calls.num_hedges == 1 and router.actor_calls.num_retries == 0  # no retry: the first send answered
    assert [r.generation for r in router.pool.replicas[1]] == [0, 1]  # the dead hedge target re-created
    assert slow.outstanding_rows == 0 and router.actor_calls.losers.pending == []


@pytest.mark.parametrize("config", [dict(HEDGE, replicas=1), dict(HEDGE, hedge=False)])
def test_no_hedge_with_a_single_replica_or_hedging_off(fake_ray, config):
    router, metrics = _router(**config)
    rows, weights, counts = _rows(seed=1)
    expected = _expected(rows, weights, counts)
    router.run_layer(LAYER, rows, weights, counts)
    router.actor_calls.pick(1).handle.set_delay_ms.remote(120.0)
    start = time.monotonic()
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert time.monotonic() - start >= 0.12  # waited for the straggler
    assert router.actor_calls.num_hedges == 0 and _hedges(metrics, 6) == 0 and fake_ray.cancelled == []


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [[5, 17, 99, 3], [42, 8, 8, 1000, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("hedge", [True, False])
def test_greedy_output_is_identical_with_a_slowed_replica(fake_ray, hedge):
    llm = LLM(model=TARGET, skip_tokenizer_init=True, max_num_seqs=2)
    reference = _greedy(llm)
    router, _ = _router(**dict(HEDGE, hedge=hedge, hedge_floor_ms=20.0))
    llm.engine.target.model.experts = router
    router.run_layer(LAYER, *_rows())  # one latency per group: hedging armed
    for g in range(len(router.pool.groups)):
        router.actor_calls.pick(g).handle.set_delay_ms.remote(100.0)  # the preferred replica of every group
    assert _greedy(llm) == reference
    assert (router.actor_calls.num_hedges >= len(router.pool.groups)) if hedge else router.actor_calls.num_hedges == 0
    assert router.actor_calls.num_retries == 0
