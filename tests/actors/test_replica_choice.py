"""Latency-aware replica choice, row splitting and probes, on both transports, without a Ray cluster:
in-process ExpertWorkers behind fake handles (tests/helpers/fake_ray.py) and, for the compiled-graph
path, a fake graph that runs every member's ``forward_graph`` in-process (tests/helpers/fake_graph.py).

Covered: a fixed straggler is avoided after its first slow call (no hedge needed), probed at the
interval without anyone waiting, and used again once it recovers; rows split over the fast
replicas only; in a compiled graph a straggling member makes the router rebuild the graph over
the group's other replica once it straggled in two executions (an execution still out goes by
actor calls instead of waiting behind it), machine-wide slowness does not, and a guest replica is bound as a second task of its
host; output identical to in-process experts throughout.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from actors import expert_router
from actors.expert_config import ReplicationConfig
from actors.expert_router import ExpertRouter
from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.model import ExpertStore
from tests.helpers.fake_graph import FakeGraph
from tests.helpers.fake_ray import FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"
CONFIG = load_model_config(TARGET)
LAYER = CONFIG.moe.sparse_layers[-1]
CHOICE = dict(replicas=2, hedge=False, probe_interval_s=0.05, split_min_rows=0)
# Rows of one expert split over replicas go through GEMMs of other sizes: the same values up to
# float32 rounding (greedy output stays identical: tests/actors/test_expert_replication.py).
SPLIT_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def fake_ray(monkeypatch):
    return install_fake_ray(monkeypatch)


def _rows(seed: int = 0, per_expert: int = 3):
    """``per_expert`` rows for every expert."""
    gen = torch.Generator().manual_seed(seed)
    n = per_expert * CONFIG.moe.num_experts
    return torch.randn(n, CONFIG.hidden_size, generator=gen), torch.rand(n, generator=gen), [per_expert] * 8


def _expected(rows, weights, counts) -> torch.Tensor:
    store = ExpertStore(CheckpointReader(TARGET), CONFIG, dtype=torch.float32)
    return store.forward(LAYER, rows, torch.tensor(counts), weights)


def _forwards(replica) -> int:
    return sum(1 for name, _ in replica.handle.calls if name in ("forward", "forward_graph"))


def _router(**config) -> ExpertRouter:
    """A router over a fake pool whose workers have loaded their weights (a first lazy load would
    be timed as a slow call)."""
    pool = FakePool.started(TARGET, **config)
    for r in pool.all_replicas():
        r.handle.target.load()
    return ExpertRouter(pool, torch.float32)


def test_a_fixed_straggler_is_avoided_probed_and_used_again_once_it_recovers(fake_ray):
    router = _router(**CHOICE)
    rows, weights, counts = _rows()
    expected = _expected(rows, weights, counts)
    router.run_layer(LAYER, rows, weights, counts)
    slow, fast = router.pool.replicas[1]  # the first call of group 1 went to r0
    assert _forwards(slow) == 1 and _forwards(fast) == 0
    slow.handle.set_delay_ms.remote(500.0)
    slow.ewma_latency_ms, fast.ewma_latency_ms = 0.5, 1.0  # the next call goes to the straggler
    router.run_layer(LAYER, rows, weights, counts)
    assert _forwards(slow) == 2 and slow.ewma_latency_ms > 5.0  # one slow call: avoided from now on
    start, outs = time.monotonic(), []
    for _ in range(5):
        outs.append(router.run_layer(LAYER, rows, weights, counts))
        time.sleep(0.02)
    assert time.monotonic() - start < 0.45  # nobody waited for the 500 ms straggler
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert _forwards(slow) == 3  # a probe, unwaited, one at a time
    time.sleep(0.55)
    router.run_layer(LAYER, rows, weights, counts)  # reaps the probe: 500 ms, still avoided
    assert slow.ewma_latency_ms >= 400.0
    slow.handle.set_delay_ms.remote(0.0)  # it recovers: the next probe sees it
    time.sleep(0.55)  # the probe sent before it recovered ends
    for _ in range(3):
        router.run_layer(LAYER, rows, weights, counts)
        time.sleep(0.06)
    assert slow.ewma_latency_ms < 50.0  # a fresh probe's latency, not the 500 ms of before
    fast.ewma_latency_ms = 10 * slow.ewma_latency_ms + 50.0
    calls = _forwards(slow)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert _forwards(slow) == calls + 1  # chosen again (a chosen replica gets no probe)
    assert router.actor_calls.num_hedges == 0 and router.actor_calls.num_retries == 0


def test_rows_are_split_over_the_fast_replicas_only(fake_ray):
    router = _router(**dict(CHOICE, split_min_rows=2, hot_expert_replicas={0: 3}))
    rows, weights, counts = _rows(seed=1)  # 12 rows for group 0, 12 for group 1
    expected = _expected(rows, weights, counts)
    a, b, c = router.pool.replicas[0]
    a.ewma_latency_ms, b.ewma_latency_ms, c.ewma_latency_ms = 1.0, 1.5, 100.0
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    forwards = [[args for name, args in r.handle.calls if name == "forward"] for r in (a, b, c)]
    assert [len(f) for f in forwards] == [1, 1, 1] and router.num_probes == 1  # c: only a probe
    assert sorted(sum(f[0][1]) for f in forwards[:2]) == [6, 6]  # counts of each part: 6 rows each
    assert router.actor_imbalance[-1] == pytest.approx(6 / (24 / 5))  # 5 actors: 6, 6, 0 and 6, 6


def test_a_straggling_graph_member_is_replaced_and_guests_are_bound_to_their_host(fake_ray):
    config = dict(CHOICE, split_min_rows=1, straggler_floor_ms=50.0, replication=ReplicationConfig(
        enabled=True, check_every_dispatches=2, patience_checks=1, min_interval_s=0.0, max_replicas_per_group=3))
    router = _router(**config)
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=2)
    expected = _expected(rows, weights, counts)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_call_layers == 1 and router.graph.live  # built on the first request
    slow, other = router.pool.replicas[1]
    assert router.graph.members[1] is slow
    slow.handle.set_delay_ms.remote(300.0)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_graph_layers == 1 and router.graph.rebuilds == 0  # one slow execution is no evidence
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_graph_layers == 2 and router.graph.rebuilds == 1  # two are: replaced at once
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_call_layers == 2  # this layer by actor calls, to the other replica
    router.graph.request_build()
    assert router.graph.members[1] is other  # the rebuilt graph has the fast replica of group 1
    start = time.monotonic()
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert time.monotonic() - start < 0.1 and router.num_graph_layers == 3

    hot = [0] * 8
    hot[0], hot[1] = 6, 6  # every row to group 0: a guest of it is added and becomes ready
    hot_rows, hot_weights = rows[:12], weights[:12]
    hot_expected = _expected(hot_rows, hot_weights, hot)
    for _ in range(8):  # the rebalancer's load EWMA still carries the balanced layers above
        torch.testing.assert_close(router.run_layer(LAYER, hot_rows, hot_weights, hot), hot_expected, **SPLIT_TOL)
        router.graph.request_build()
    guests = [r for r in router.pool.replicas[0] if r.host is not None]
    assert len(guests) == 1 and guests[0].ready and router.graph.rebuilds >= 2
    assert any(m is guests[0] for m in router.graph.members)  # bound once more, on its host's actor
    before = _forwards(guests[0].host)
    torch.testing.assert_close(router.run_layer(LAYER, hot_rows, hot_weights, hot), hot_expected, **SPLIT_TOL)
    assert _forwards(guests[0].host) >= before + 2  # its own (empty) task and the guest's
    assert router.actor_imbalance[-1] < 4.0


def test_a_straggler_found_sends_the_execution_still_out_by_actor_calls(fake_ray):
    """Two-batch overlap: another micro-batch's execution is out when a member is found
    straggling (its second slow execution in this graph). The graph is dropped at once, so that
    layer goes by actor calls to the group's other replica instead of queueing behind the
    straggler, and the rebuilt graph holds that replica."""
    router = _router(**dict(CHOICE, straggler_floor_ms=50.0))
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=4)
    expected = _expected(rows, weights, counts)
    for _ in range(2):  # built, then one execution measures every member
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    slow = router.graph.members[1]
    other = next(r for r in router.pool.replicas[1] if r is not slow)
    slow.handle.set_delay_ms.remote(300.0)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    first = router._start_layer(LAYER, rows, weights, counts)  # micro-batch A's layer
    second = router._start_layer(LAYER, rows, weights, counts)  # B's, out behind it
    torch.testing.assert_close(first(), expected, rtol=0, atol=0)  # the second slow execution
    assert router.graph.rebuilds == 1 and not router.graph.live
    start = time.monotonic()
    torch.testing.assert_close(second(), expected, rtol=0, atol=0)
    assert time.monotonic() - start < 0.25  # not the 300 ms straggler again
    assert router.num_call_layers == 2 and _forwards(other) >= 1  # 1 while the graph was built, 1 now
    router.graph.request_build()
    assert router.graph.members[1] is other


def test_a_late_graph_execution_goes_to_other_replicas_and_the_rebuilt_graph_leaves_its_members_out(fake_ray):
    """Hedging on: an execution past its groups' hedge deadline is given up (this fake finds it
    late only after running it; the real graph stops waiting at the deadline:
    tests/actors/test_transport.py). Its members are suspects: the layer's actor calls go to the
    other replicas, the graph built at once holds those, and the suspects are usable again once
    it is live."""
    router = _router(**dict(CHOICE, hedge=True, hedge_min_samples=2, hedge_floor_ms=50.0, probe_interval_s=60.0))
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=5)
    expected = _expected(rows, weights, counts)
    for _ in range(3):  # built, then two executions: two latencies of each group
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_graph_hedges == 0
    members = router.graph.members
    members[1].handle.set_delay_ms.remote(300.0)
    before = [_forwards(m) for m in members]
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_graph_hedges == 1 and router.graph.stats.late == 1
    assert [_forwards(m) for m in members] == [n + 1 for n in before]  # the graph execution only
    assert all(m.stats.suspect for m in members)
    assert router.graph.live and not any(m is old for m in router.graph.members for old in members)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert not any(m.stats.suspect for m in members)  # the new graph is live: usable again


def _with_standby(router: ExpertRouter) -> list[FakeGraph]:
    """A live graph and a standby over the router's rules (each graph's members by its role)."""
    graphs: list[FakeGraph] = []
    for i in range(2):
        graphs.append(FakeGraph(lambda i=i: router._members_of(graphs[i])))
    router.graph, router.standby = graphs
    return graphs


def test_a_late_execution_switches_to_the_standby_graph_with_no_build_and_no_actor_call_layer(fake_ray):
    """Two replicas a group: once the live graph has run and the replicas outside it have been
    probed, a standby graph is built over them. A late execution makes the standby the live graph
    at once: the next layer runs on it, output identical. No new standby is built while the
    straggler left out is avoided (the only replica of its group outside the live graph). Without
    the standby the same late execution is followed by actor-call layers until a rebuild is live
    (the test above)."""
    router = _router(**dict(CHOICE, hedge=True, hedge_min_samples=2, hedge_floor_ms=50.0, probe_interval_s=0.05))
    rows, weights, counts = _rows(seed=5)
    expected = _expected(rows, weights, counts)
    first, second = _with_live_standby(router, rows, weights, counts)
    assert first.live and not router.num_graph_hedges
    assert {id(r) for r in first.members}.isdisjoint(id(r) for r in second.members)
    members = first.members
    members[1].handle.set_delay_ms.remote(300.0)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.num_graph_hedges == 1 and router.num_graph_takeovers == 1
    assert router.graph is second and router.standby is first and not first.live
    layers = (router.num_graph_layers, router.num_call_layers)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert (router.num_graph_layers, router.num_call_layers) == (layers[0] + 1, layers[1])  # on the standby
    assert not any(m.stats.suspect for m in members)  # a graph without them is live
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # the straggler's probe is answered (300 ms) within this
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
        time.sleep(0.05)
    assert members[1].stats.ewma_latency_ms > 50.0 and not first.live  # avoided: no standby over it


def _with_live_standby(router: ExpertRouter, rows, weights, counts) -> list[FakeGraph]:
    graphs = _with_standby(router)
    for _ in range(30):  # the live graph is built, runs, and the replicas outside it get probed
        router.run_layer(LAYER, rows, weights, counts)
        if graphs[1].live:
            return graphs
        time.sleep(0.02)
    raise AssertionError("no standby graph was built")


@pytest.mark.parametrize("cause", ["failure", "straggler"])
def test_a_failed_graph_or_a_straggling_member_hands_over_to_the_standby(fake_ray, cause):
    """A failed execution (a member died) or a member that straggled in two executions: the layer
    after it runs on the standby graph, not by actor calls, output identical."""
    router = _router(**dict(CHOICE, straggler_floor_ms=50.0, probe_interval_s=0.05))
    rows, weights, counts = _rows(seed=9)
    expected = _expected(rows, weights, counts)
    first, second = _with_live_standby(router, rows, weights, counts)
    if cause == "failure":
        first.fail_next = True
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    else:
        first.members[1].handle.set_delay_ms.remote(200.0)
        for _ in range(2):  # two slow executions: replaced at once
            torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
        assert not first.live
    layers = (router.num_graph_layers, router.num_call_layers)
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), expected, rtol=0, atol=0)
    assert router.graph is second and router.num_graph_takeovers == 1
    assert (router.num_graph_layers, router.num_call_layers) == (layers[0] + 1, layers[1])
    events = router.graph_events()
    assert (events["takeover"], events["build"], events["failure"]) == (1, 2, int(cause == "failure"))


def test_a_straggling_member_has_its_groups_outside_replica_probed_at_once(fake_ray):
    """Two groups: the straggler rule is judged against the other group's call, not a median
    that includes the straggler's own latency (with two calls, that median is the straggler)."""
    router = _router(**dict(CHOICE, straggler_floor_ms=50.0, probe_interval_s=60.0))
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=7)
    for _ in range(2):  # built, then one execution (and the outside replicas' first probes)
        router.run_layer(LAYER, rows, weights, counts)
    slow = router.graph.members[1]
    other = next(r for r in router.pool.replicas[1] if r is not slow)
    router.actor_calls.losers.reap()
    before = _forwards(other)
    slow.handle.set_delay_ms.remote(300.0)
    router.run_layer(LAYER, rows, weights, counts)
    assert _forwards(other) == before + 1  # probed in the layer its group's member straggled, not 60 s on


def test_machine_wide_slowness_replaces_no_member(fake_ray):
    """Every member equally slow in the same execution (a loaded machine): no member straggles
    against the others, so the graph stays, whatever the idle replicas outside it measure."""
    router = _router(**dict(CHOICE, straggler_floor_ms=50.0))
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=5)
    for _ in range(2):
        router.run_layer(LAYER, rows, weights, counts)
    for m in router.graph.members:
        m.handle.set_delay_ms.remote(200.0)
    for _ in range(2):
        torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), _expected(rows, weights, counts),
                                   rtol=0, atol=0)
    assert router.graph.rebuilds == 0 and router.graph.live and router.num_graph_layers == 3


class ParkedGraph(FakeGraph):
    """A graph found parked: its first wake-up takes 300 ms (a busy machine's); a submission
    wakes it too, as :meth:`actors.compiled_graph.ActorGraph.submit` does."""

    woken = False

    def wake(self) -> None:
        if not self.woken:
            time.sleep(0.3)
            self.woken = True

    def submit(self, request):
        self.wake()
        return super().submit(request)


def test_a_parked_graphs_wake_up_is_not_timed_as_its_calls_latency(fake_ray):
    router = _router(**CHOICE)
    router.graph = ParkedGraph(router._graph_members)
    rows, weights, counts = _rows(seed=3)
    router.run_layer(LAYER, rows, weights, counts)  # actor calls; the graph is built
    members = router.graph.members
    for m in members:
        m.ewma_latency_ms = 0.0  # the next call's latency becomes the EWMA as it is
    torch.testing.assert_close(router.run_layer(LAYER, rows, weights, counts), _expected(rows, weights, counts),
                               rtol=0, atol=0)
    assert router.graph.woken and router.num_graph_layers == 1
    # Timed from the end of the wake-up: each call's own compute, not 300 ms more.
    assert all(0 < m.ewma_latency_ms < 150 for m in members), [m.ewma_latency_ms for m in members]


def test_a_stalled_layer_is_logged_once_per_interval_naming_the_slowest_call(fake_ray, monkeypatch, caplog):
    monkeypatch.setattr(expert_router, "SLOW_LAYER_WARN_S", 0.15)
    router = _router(**dict(CHOICE, replicas=1, straggler_multiple=1000.0, straggler_floor_ms=10_000.0))
    router.graph = FakeGraph(router._graph_members)
    rows, weights, counts = _rows(seed=5)
    router.run_layer(LAYER, rows, weights, counts)  # actor calls; the graph is built
    stalled = router.graph.members[1]
    with caplog.at_level(logging.WARNING, logger=expert_router.log.name):
        router.run_layer(LAYER, rows, weights, counts)  # a fast layer: nothing
        assert not caplog.records
        stalled.handle.set_delay_ms.remote(200.0)
        for _ in range(3):
            router.run_layer(LAYER, rows, weights, counts)
    (record,) = caplog.records  # one warning: the next two stalls fall in its interval
    message = record.getMessage()
    assert message.startswith(f"MoE layer {LAYER} waited 0.") and f"slowest call: {stalled.name}, 0." in message
    assert "by compiled_graph" in message and "0 more slow layers" in message
    router._slow_warned_s -= expert_router.SLOW_LAYER_WARN_INTERVAL_S  # the interval has passed
    with caplog.at_level(logging.WARNING, logger=expert_router.log.name):
        router.run_layer(LAYER, rows, weights, counts)
    assert "2 more slow layers since the last warning" in caplog.records[-1].getMessage()
