"""The compiled-graph and actor-call transports of expert layers: same outputs as in-process, failover,
hedging, parking (the draft actor and the served app: test_transport_served.py).

These run on the session's Ray (the ``served`` app's), with pools and draft actors of their own.
"""

import os
import signal
import time
from contextlib import contextmanager, suppress

import pytest
import ray
import torch

from actors.expert_config import ExpertPoolConfig
from actors.expert_pool import ExpertPool
from actors.expert_router import ExpertRouter
from actors.graph_park import GraphParking
from actors.router_graphs import GRAPH_HEDGE_INTERVAL_S
from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.model import ExpertStore
from engine.model.moe import dispatch
from kernels.routing import topk_routing
from tests.actors.conftest import TARGET, kill_and_wait, wait_until


def _layer_inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    config = load_model_config(TARGET)
    hidden = torch.randn(tokens, config.hidden_size, generator=gen)
    routing = topk_routing(torch.randn(tokens, config.moe.num_experts, generator=gen), 2, True)
    return hidden, routing


@pytest.fixture
def graph_router(served):
    config = ExpertPoolConfig(experts_per_actor=3, call_timeout_s=5.0)  # groups of 3, 3, 2 experts
    pool = ExpertPool(TARGET, 8, config, prefix=f"test-graph-{os.getpid()}-{time.monotonic_ns()}", detached=False)
    pool.start()
    pool.wait_loaded(120)  # actors up and loaded: a loaded machine's actor start-up is no call timeout
    router = ExpertRouter(pool, torch.float32, graph=True)
    yield router
    router.close()
    pool.shutdown()


def _expected(layer: int, hidden, routing):
    store = ExpertStore(CheckpointReader(TARGET), load_model_config(TARGET))
    plan = dispatch(hidden, routing)
    out = store.forward(layer, plan.hidden, plan.expert_counts, plan.weights)
    return out.new_zeros(hidden.shape).index_add_(0, plan.token_index, out)


def test_graph_and_actor_calls_equal_in_process_experts(graph_router):
    router = graph_router
    cases = [(layer, *_layer_inputs(tokens, seed=tokens)) for layer, tokens in ((0, 1), (1, 7), (3, 37))]
    first = [router.execute(layer, h, r) for layer, h, r in cases]  # no graph yet: actor calls
    assert router.num_call_layers == len(cases) and router.num_graph_layers == 0
    wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
    second = [router.execute(layer, h, r) for layer, h, r in cases]
    assert router.num_graph_layers == len(cases)
    for (layer, h, r), a, b in zip(cases, first, second):
        expected = _expected(layer, h, r)
        torch.testing.assert_close(a, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, expected, rtol=1e-6, atol=1e-6)


def test_two_layers_out_at_once_on_the_graph_give_the_same_outputs(graph_router):
    router = graph_router
    assert router.microbatches == 1  # no graph yet: actor calls are not overlapped
    wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
    assert router.microbatches == 2
    a, b = _layer_inputs(5, seed=4), _layer_inputs(11, seed=5)
    executions = router.graph.stats.executions
    wait_a = router.submit(2, *a)
    wait_b = router.submit(2, *b)  # submitted before A is waited for: both are out
    assert router.num_overlapped_layers == 1
    outs = [wait_a(), wait_b()]
    assert router.graph.stats.executions == executions + 2 and router.num_call_layers == 0
    for (hidden, routing), out in zip((a, b), outs):
        torch.testing.assert_close(out, _expected(2, hidden, routing), rtol=1e-6, atol=1e-6)


def test_a_layer_too_large_for_the_channels_goes_by_actor_calls(graph_router):
    router = graph_router
    wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
    small, large = _layer_inputs(37, seed=1), _layer_inputs(1100, seed=2)  # 1100 x 2 rows x 512 B > 1 MB
    layers = router.num_call_layers, router.num_graph_layers
    outs = [router.execute(1, *small), router.execute(1, *large)]
    assert (router.num_call_layers, router.num_graph_layers) == (layers[0] + 1, layers[1] + 1)
    assert router.graph.stats.oversize == 1 and router.graph.live
    for (hidden, routing), out in zip((small, large), outs):
        torch.testing.assert_close(out, _expected(1, hidden, routing), rtol=1e-6, atol=1e-6)


def test_killing_an_actor_during_graph_forwards_gives_identical_output(graph_router):
    router = graph_router
    hidden, routing = _layer_inputs(9, seed=3)
    expected = _expected(2, hidden, routing)
    wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
    victim = router.graph.members[1]
    kill_and_wait(victim.handle)
    outs = [router.execute(2, hidden, routing) for _ in range(3)]
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert router.graph.stats.failures == 1 and router.actor_calls.num_retries >= 1
    assert router.pool.replicas[1][0].generation == victim.generation + 1  # the dead actor was replaced
    # The graph comes back over the new actor, with the same output.
    wait_until(lambda: router.graph.live, 120, "the rebuilt graph", poke=router.graph.request_build)
    graph_layers = router.num_graph_layers
    torch.testing.assert_close(router.execute(2, hidden, routing), expected, rtol=1e-6, atol=1e-6)
    assert router.num_graph_layers == graph_layers + 1 and router.graph.stats.builds == 2


@contextmanager
def _stopped(victim):
    """The member's process SIGSTOPped: it answers nothing."""
    pid = ray._private.state.actors(victim.handle._actor_id.hex())["Pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextmanager
def _stuck_in_forward(victim):
    """The member stuck inside its expert computation (a hung kernel or collective: the GIL free,
    so its second thread still answers calls)."""
    ray.get(victim.handle.set_delay_ms.remote(600_000))
    yield


@pytest.mark.parametrize("hang", [_stopped, _stuck_in_forward], ids=["stopped", "stuck_in_forward"])
def test_a_hung_actor_under_the_graph_is_replaced_without_waiting_for_actor_calls(served, hang):
    # The graph's execution times out once; the member that then does not answer how long its
    # computation has run, or has been in one for half the call timeout, is re-created before the
    # layer's actor calls go out, so none of them times out on it (before: the fallback's call to
    # the hung actor waited call_timeout_s again). The fresh actor's first call also waits for its
    # start, which a loaded machine can make longer than 2 s.
    config = ExpertPoolConfig(experts_per_actor=3, call_timeout_s=2.0)
    pool = ExpertPool(TARGET, 8, config, prefix=f"test-hung-{hang.__name__}-{os.getpid()}", detached=False)
    pool.start()
    pool.wait_loaded(120)
    router = ExpertRouter(pool, torch.float32, graph=True)
    hidden, routing = _layer_inputs(9, seed=3)
    expected = _expected(2, hidden, routing)
    try:
        wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
        victim = router.graph.members[1]
        generations = [r.generation for r in router.graph.members]
        with hang(victim):
            out = router.execute(2, hidden, routing)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert router.graph.stats.failures == 1
        assert router.actor_calls.num_retries == 0  # no actor call waited on the hung actor
        assert [r.generation for r in (pool.replicas[g][0] for g in range(3))] == \
            [generations[0], generations[1] + 1, generations[2]]  # only the hung actor re-created
    finally:
        router.close()
        pool.shutdown()


@contextmanager
def _two_replica_router(name: str, **config):
    """A graph router over 2 groups x 2 replicas (loaded), torn down afterwards."""
    config = ExpertPoolConfig(experts_per_actor=4, replicas=2, call_timeout_s=10.0, probe_interval_s=0.2, **config)
    pool = ExpertPool(TARGET, 8, config, prefix=f"test-{name}-{os.getpid()}", detached=False)
    pool.start()
    pool.wait_loaded(120)
    router = ExpertRouter(pool, torch.float32, graph=True)
    try:
        yield router
    finally:
        router.close()
        pool.shutdown()


def test_an_actor_killed_under_the_graph_hands_the_next_layer_to_the_standby_graph(served):
    """Two replicas a group: the layer whose execution fails is redone by actor calls, and the next
    ones run on the standby graph at once, with the same output and no build."""
    # Only the failure path: no hedges, and a straggler rule no scheduling hiccup of this VM meets
    # (it replaced the live graph during warm-up in some runs, so the killed actor was in the graph
    # that took over).
    with _two_replica_router("graph-standby-kill", hedge=False, straggler_multiple=1000.0,
                             straggler_floor_ms=10_000.0) as router:
        hidden, routing = _layer_inputs(9, seed=8)  # rows for both groups
        expected = _expected(1, hidden, routing)
        wait_until(lambda: router.graph.live and router.standby.live, 120, "the graph and its standby",
                   poke=lambda: router.execute(1, hidden, routing))
        victim, standby = router.graph.members[1], router.standby
        kill_and_wait(victim.handle)
        torch.testing.assert_close(router.execute(1, hidden, routing), expected, rtol=1e-6, atol=1e-6)
        assert not router.graph.live  # dropped: this layer went by actor calls
        builds, graph_layers = router.graph_stats()["builds"], router.num_graph_layers
        for _ in range(3):
            torch.testing.assert_close(router.execute(1, hidden, routing), expected, rtol=1e-6, atol=1e-6)
        assert router.graph is standby and router.num_graph_takeovers == 1
        assert router.num_graph_layers == graph_layers + 3 and router.graph_stats()["builds"] == builds


@pytest.mark.parametrize("standby", [False, True], ids=["rebuild", "standby"])
def test_a_graph_member_turned_straggler_is_hedged_by_actor_calls_and_left_out_of_the_next_graph(served, standby):
    """A late execution is given up at its deadline; the next graph leaves the straggler out: a
    rebuild, or (``graph_standby``) the parked standby graph over the other replicas, live at once."""
    # A 50 ms floor keeps a loaded CI machine's hiccups from hedging.
    with _two_replica_router(f"graph-hedge-{standby:d}", hedge_min_samples=2, hedge_floor_ms=50.0,
                             graph_standby=standby) as router:
        hidden, routing = _layer_inputs(9, seed=6)  # rows for both groups
        expected = _expected(1, hidden, routing)
        ready = (lambda: router.graph.live and router.standby.live) if standby else (lambda: router.graph.live)
        # Layers build the graph, probe the replicas outside it, then build the standby over those.
        wait_until(ready, 120, "the compiled graph", poke=lambda: router.execute(1, hidden, routing))
        for _ in range(4):  # graph latencies for both groups' hedge deadlines; probes of the others
            torch.testing.assert_close(router.execute(1, hidden, routing), expected, rtol=1e-6, atol=1e-6)
            time.sleep(0.25)
        # A hiccup of a loaded machine may have hedged already: its graphs live again, its interval over.
        wait_until(ready, 120, "the compiled graph", poke=lambda: router.execute(1, hidden, routing))
        time.sleep(max(0.0, GRAPH_HEDGE_INTERVAL_S - (time.monotonic() - router._graph_hedged_s)))
        before = router.graph_stats()
        hedges, takeovers = router.num_graph_hedges, router.num_graph_takeovers
        straggler = router.graph.members[0]
        assert not standby or router.standby.parked  # the standby polls nothing while it waits
        ray.get(straggler.handle.set_delay_ms.remote(3000.0))
        start = time.monotonic()
        out = router.execute(1, hidden, routing)
        elapsed_s = time.monotonic() - start
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert elapsed_s < 1.5, f"the layer waited {elapsed_s:.2f} s for a 3 s straggler"
        after = router.graph_stats()
        assert (router.num_graph_hedges, after["late"], after["failures"]) == (
            hedges + 1, before["late"] + 1, before["failures"])
        assert router.num_graph_takeovers == takeovers + standby
        if standby:  # live at once, no build: the next layer runs on it
            assert router.graph.live and after["builds"] == before["builds"]
        else:  # rebuilt at once (after the straggler's call ends) over the other replica of its group
            wait_until(lambda: router.graph.live, 120, "the rebuilt graph")
        assert all(m is not straggler for m in router.graph.members)
        graph_layers = router.num_graph_layers
        torch.testing.assert_close(router.execute(1, hidden, routing), expected, rtol=1e-6, atol=1e-6)
        assert router.num_graph_layers == graph_layers + 1


@ray.remote(num_cpus=0, max_concurrency=2)
class _Echo(GraphParking):
    """The smallest graph member: answers its part of a request."""

    def forward_graph(self, request, index: int):
        return None if self._parked(request) or request is None else request[index]


def test_each_graph_keeps_one_driver_proxy_actor_across_rebuilds(served):
    """Ray creates a driver proxy actor at each compile (a worker process starting up, ~0.5 CPU s
    on a 2-core machine). A rebuild of a graph reuses the one of its first build; two graphs live
    at once have their own (a teardown closes the channels its proxy reads)."""
    from types import SimpleNamespace

    from actors.compiled_graph import ActorGraph

    graphs = []
    for _ in range(2):
        member = SimpleNamespace(handle=_Echo.remote())
        graphs.append(ActorGraph("proxy-test", lambda m=member: ([m], "forward_graph"), lambda n: None,
                                 timeout_s=30.0, idle_park_s=60.0, buffer_size_bytes=1 << 20))

    def proxy_pid(graph) -> int:
        return ray.get(graph._dag._proxy_actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)

    try:
        for g in graphs:
            wait_until(lambda g=g: g.live, 120, "a compiled graph", poke=g.request_build)
        first = [proxy_pid(g) for g in graphs]
        assert first[0] != first[1]
        graphs[0].rebuild()
        wait_until(lambda: graphs[0].live, 120, "the rebuilt graph")
        assert graphs[0].stats.builds == 2 and proxy_pid(graphs[0]) == first[0]
        assert graphs[0].wait(graphs[0].submit(("a",))) == ["a"] and graphs[1].wait(graphs[1].submit(("b",))) == ["b"]
    finally:
        for g in graphs:
            g.close()


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_an_idle_graph_is_parked_and_woken_by_the_next_layer_without_a_rebuild(served):
    config = ExpertPoolConfig(experts_per_actor=3, graph_idle_park_s=0.5, graph_build_after_s=0.4)
    pool = ExpertPool(TARGET, 8, config, prefix=f"test-idle-{os.getpid()}", detached=False)
    pool.start()
    pool.wait_loaded(120)  # actors up and loaded: a loaded machine's actor start-up is no call timeout
    router = ExpertRouter(pool, torch.float32, graph=True)
    pids = {r.name: ray.get(r.handle.info.remote())["pid"] for r in pool.all_replicas()}
    try:
        hidden, routing = _layer_inputs(4, seed=1)
        router.execute(0, hidden, routing)  # actor calls: no graph yet
        wait_until(lambda: router.graph.live, 120, "the compiled graph", poke=router.graph.request_build)
        wait_until(lambda: router.graph.stats.parks == 1, 10, "the idle graph's parking")
        assert router.graph.live and router.graph.stats.builds == 1
        # Parked actors block instead of polling the channels: a fraction of a core, not most of one.
        before = {name: _cpu_s(pid) for name, pid in pids.items()}
        time.sleep(2.0)
        used = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
        assert all(s < 0.3 for s in used.values()), used
        # The next layer wakes it and goes through the graph at once: no rebuild, no actor calls.
        calls, layers = router.num_call_layers, router.num_graph_layers
        torch.testing.assert_close(router.execute(0, hidden, routing), _expected(0, hidden, routing))
        assert (router.num_call_layers, router.num_graph_layers) == (calls, layers + 1)
        assert router.graph.stats.builds == 1 and router.graph.stats.rebuilds == 0
        # A member killed while parked: the wake-up finds it, the layer goes by actor calls.
        wait_until(lambda: router.graph.stats.parks == 2, 10, "the second parking")
        kill_and_wait(router.graph.members[0].handle)
        torch.testing.assert_close(router.execute(0, hidden, routing), _expected(0, hidden, routing))
        assert router.graph.stats.failures == 1 and router.num_call_layers == calls + 1
    finally:
        router.close()
        pool.shutdown()
