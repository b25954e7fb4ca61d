"""The expert router's actor-call transport without a Ray cluster: real in-process ExpertWorkers
behind fake handles (tests/helpers/fake_ray.py), so timeouts, deaths and replica choice are
deterministic and each case runs in milliseconds.

Covered: timeout of a sole replica -> re-created and retried; ExpertCallFailed after max_attempts;
hot_expert_replicas sizes a group and a timed-out call moves to the other replica without
re-creating anything; least-outstanding choice; bf16 rows on the wire, both transports' formats;
two verifier replicas sharing one pool (by name) re-create one actor, not two, after a death.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors import expert_pool
from actors.actor_calls import ExpertCallFailed
from actors.expert_actor import ExpertWorker
from actors.expert_config import ExpertPoolConfig
from actors.expert_pool import ExpertPool
from actors.expert_router import ExpertRouter
from actors.wire import from_bytes, from_wire, to_bytes, to_wire
from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.model import ExpertStore
from tests.helpers.fake_ray import FakeActor, FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"
CONFIG = load_model_config(TARGET)
LAYER = CONFIG.moe.sparse_layers[-1]


@pytest.fixture
def fake_ray(monkeypatch):
    return install_fake_ray(monkeypatch)


def _pool(dtype: str = "float32", behaviour=None, **config) -> FakePool:
    return FakePool.started(TARGET, dtype, behaviour, **config)


def _rows(dtype: torch.dtype, seed: int = 0):
    """Rows grouped by expert: 3 for expert 1 (group 0), 2 for expert 6 (group 1), odd sizes."""
    gen = torch.Generator().manual_seed(seed)
    counts = [0] * CONFIG.moe.num_experts
    counts[1], counts[6] = 3, 2
    rows = torch.randn(5, CONFIG.hidden_size, generator=gen).to(dtype)
    weights = torch.rand(5, generator=gen)
    return rows, weights, counts


def _expected(rows, weights, counts, dtype: torch.dtype) -> torch.Tensor:
    store = ExpertStore(CheckpointReader(TARGET), CONFIG, dtype=dtype)
    return store.forward(LAYER, rows, torch.tensor(counts), weights)


def test_a_hung_sole_replica_is_recreated_and_the_retry_gives_the_same_rows(fake_ray):
    pool = _pool(behaviour=lambda g, i, gen: "hung" if (g, gen) == (1, 0) else "ok")
    router = ExpertRouter(pool, torch.float32)
    rows, weights, counts = _rows(torch.float32)
    out = router.run_layer(LAYER, rows, weights, counts)
    torch.testing.assert_close(out, _expected(rows, weights, counts, torch.float32), rtol=0, atol=0)
    assert fake_ray.timeouts == 1 and router.actor_calls.num_retries == 1
    assert [(r.generation, r.alive) for r in pool.replicas[1]] == [(1, True)]  # re-created once
    assert [(r.generation, r.alive) for r in pool.replicas[0]] == [(0, True)]  # the healthy group untouched


def test_a_recreated_actors_first_call_waits_for_its_start(fake_ray):
    # The fresh actor answers 0.8 s after the call, past the 0.5 s call timeout (a start on a
    # loaded machine): it is waited for, not killed and re-created again.
    pool = _pool(behaviour=lambda g, i, gen: "hung" if (g, gen) == (1, 0) else 0.8 if g == 1 else "ok")
    router = ExpertRouter(pool, torch.float32)
    rows, weights, counts = _rows(torch.float32)
    out = router.run_layer(LAYER, rows, weights, counts)
    torch.testing.assert_close(out, _expected(rows, weights, counts, torch.float32), rtol=0, atol=0)
    assert fake_ray.timeouts == 1 and router.actor_calls.num_retries == 1  # only the hung generation's
    assert [(r.generation, r.alive, r.fresh) for r in pool.replicas[1]] == [(1, True, False)]
    # Once it has answered it is held to the call timeout again.
    fresh = pool.replicas[1][0]
    router.run_layer(LAYER, rows, weights, counts)
    assert pool.replicas[1][0] is not fresh and fake_ray.timeouts == 2


def test_every_attempt_failing_raises_expert_call_failed_after_max_attempts(fake_ray):
    pool = _pool(behaviour=lambda g, i, gen: "dead" if g == 0 else "ok", max_attempts=3)
    router = ExpertRouter(pool, torch.float32)
    rows, weights, counts = _rows(torch.float32)
    with pytest.raises(ExpertCallFailed, match=r"experts \[0, 1, 2, 3\]: all 3 attempts failed") as err:
        router.run_layer(LAYER, rows, weights, counts)
    assert str(err.value).count("RayActorError") == 3  # one reason per attempt, each named
    assert pool.replicas[0][0].generation == 3 and router.actor_calls.num_retries == 3  # each death re-created the actor


def test_hot_expert_replicas_size_the_group_and_a_timeout_moves_to_the_other_replica(fake_ray):
    pool = _pool(replicas=1, hot_expert_replicas={1: 2},
                 behaviour=lambda g, i, gen: "hung" if (g, i) == (1, 0) else "ok")
    assert [len(pool.replicas[g]) for g in range(len(pool.groups))] == [1, 2]
    router = ExpertRouter(pool, torch.float32)
    rows, weights, counts = _rows(torch.float32, seed=1)
    out = router.run_layer(LAYER, rows, weights, counts)
    torch.testing.assert_close(out, _expected(rows, weights, counts, torch.float32), rtol=0, atol=0)
    first, second = pool.replicas[1]
    assert len(first.handle.calls) == 1 and len(second.handle.calls) == 1  # tried r0 (hung), then r1
    assert (first.generation, first.alive) == (0, True)  # another replica was alive: nothing re-created
    assert first.ewma_latency_ms == 500.0  # the timeout counts as its latency, so r1 is preferred next
    router.run_layer(LAYER, rows, weights, counts)
    assert len(first.handle.calls) == 1 and len(second.handle.calls) == 2
    assert first.outstanding_rows == second.outstanding_rows == 0


def test_the_least_expected_completion_wins(fake_ray):
    """Expected completion = (calls in flight + 1) x latency EWMA."""
    pool = _pool(hot_expert_replicas={0: 3})
    router = ExpertRouter(pool, torch.float32)
    a, b, c = pool.replicas[0]
    a.ewma_latency_ms, b.ewma_latency_ms, c.ewma_latency_ms = 1.0, 9.0, 5.0
    a.begin(4, 0.0)  # another verifier thread's call in flight: 2 x 1 ms
    assert router.actor_calls.pick(0) is a
    for _ in range(4):
        a.begin(4, 0.0)  # five in flight: 6 x 1 ms
    assert router.actor_calls.pick(0) is c
    c.alive = False
    assert router.actor_calls.pick(0) is a  # 6 ms < 9 ms


@pytest.mark.parametrize("transport", ["actor_calls", "bytes"])
def test_bf16_rows_cross_the_wire_bit_exactly(fake_ray, transport):
    rows, weights, counts = _rows(torch.bfloat16, seed=2)
    if transport == "bytes":  # the compiled-graph channel format
        encoded = to_bytes(rows)
        assert len(encoded) == rows.numel() * 2
        back = from_bytes(encoded, tuple(rows.shape), torch.bfloat16)
    else:
        wire = to_wire(rows)
        assert wire.dtype == np.int16  # numpy has no bfloat16: its bit pattern travels
        back = from_wire(wire, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), rows.view(torch.int16))

    pool = _pool(dtype="bfloat16")
    router = ExpertRouter(pool, torch.bfloat16)
    out = router.run_layer(LAYER, rows, weights, counts)
    assert out.dtype == torch.bfloat16
    sent = pool.replicas[0][0].handle.calls[0][1][2]
    assert sent.dtype == np.int16 and sent.shape == (3, CONFIG.hidden_size)
    assert torch.equal(out, _expected(rows, weights, counts, torch.bfloat16))


class _Cluster:
    """``ExpertActor.options(**o).remote(...)`` with Ray's ``get_if_exists`` semantics over a name
    registry: two verifier replicas naming the same actor get the same handle."""

    def __init__(self) -> None:
        self.actors: dict[str, FakeActor] = {}
        self.options: dict[str, dict] = {}

    def options_of(self, **options):
        cluster = self

        class _Creator:
            def remote(self, checkpoint, expert_ids, dtype, device, threads, tracing, offload=None):
                name = options["name"]
                assert options["get_if_exists"]
                if name not in cluster.actors:
                    cluster.actors[name] = FakeActor(ExpertWorker(checkpoint, expert_ids, dtype, offload=offload))
                    cluster.options[name] = options
                return cluster.actors[name]

        return _Creator()


def test_verifier_replicas_share_the_pool_and_recreate_the_same_generation(fake_ray, monkeypatch):
    cluster = _Cluster()
    monkeypatch.setattr(expert_pool.ExpertActor, "options", cluster.options_of)
    config = ExpertPoolConfig(experts_per_actor=4, call_timeout_s=0.5, transport="actor_calls")
    pools = [ExpertPool(TARGET, CONFIG.moe.num_experts, config) for _ in range(2)]  # shared: detached
    for pool in pools:
        pool.start()
    assert sorted(cluster.actors) == ["specmoe-experts-g0-r0-v0", "specmoe-experts-g1-r0-v0"]
    assert all(o["lifetime"] == "detached" and o["namespace"] == "specmoe" for o in cluster.options.values())
    routers = [ExpertRouter(pool, torch.float32) for pool in pools]
    rows, weights, counts = _rows(torch.float32, seed=3)
    expected = _expected(rows, weights, counts, torch.float32)
    cluster.actors["specmoe-experts-g1-r0-v0"].behaviour = "dead"  # the shared actor dies
    for router in routers:  # each replica finds out on its own and re-creates the same next generation
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert sorted(cluster.actors) == ["specmoe-experts-g0-r0-v0", "specmoe-experts-g1-r0-v0",
                                      "specmoe-experts-g1-r0-v1"]
    assert pools[0].replicas[1][0].handle is pools[1].replicas[1][0].handle  # one actor, not two
    assert [r.actor_calls.num_retries for r in routers] == [1, 1]


def test_wait_loaded_returns_once_every_actor_holds_its_weights(fake_ray):
    pool = _pool()
    stores = [r.handle.target.store for r in pool.all_replicas()]
    assert all(s._layers == {} for s in stores)  # lazily loaded: nothing read yet
    pool.wait_loaded(timeout_s=1.0)
    assert [sorted(s._layers) for s in stores] == [list(CONFIG.moe.sparse_layers)] * len(stores)
    still_loading = _pool(behaviour=lambda group, index, generation: "hung" if group == 1 else "ok")
    with pytest.raises(fake_ray.exceptions.GetTimeoutError):
        still_loading.wait_loaded(timeout_s=0.1)
