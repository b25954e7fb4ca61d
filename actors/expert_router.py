"""Expert router: the Ray implementation of the engine's ``ExpertExecutor``.

The model's forward runs in the verifier's engine thread; for each MoE layer it calls
:meth:`ExpertRouter.execute`, which sends every expert group with tokens to its actor from that
same thread (no event-loop hop: the loop that streams outputs never carries a dispatch). Two
transports (``experts.transport``):

* ``compiled_graph``: one execution of the replica's expert :class:`ActorGraph` per layer, over the
  fastest replica of every group plus the guest replicas; while the graph builds, after it failed,
  or for a retry, the layer goes by actor calls. The graph is rebuilt when the replicas change
  (:mod:`actors.replication`) or when a member turns into a straggler next to a replica outside it.
* ``actor_calls``: one ``.remote()`` per call, retried on another replica when it fails and
  hedged past its group's deadline (:mod:`actors.actor_calls`).

Either way a group's rows go to its replicas with the least expected completion, split in even
contiguous parts over several of them when there are enough rows, stragglers avoided and probed
(:mod:`actors.replica_choice`); each answered call feeds its actor's latency EWMA.

Experts are deterministic, so a retried or re-routed layer gives the same output.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from statistics import median_high
from typing import Any

import ray
import torch

from actors.actor_calls import ActorCalls
from actors.expert_calls import Call, CallRecord, NullTelemetry, record_answer
from actors.expert_pool import ExpertPool, Replica
from actors.replica_choice import choose, probe_due, split_counts, straggler_bound_ms
from actors.replication import Rebalancer
from actors.router_graphs import RouterGraphs
from actors.wire import from_bytes, to_bytes
from engine.model.moe import combine, dispatch
from kernels.routing import RoutingResult

log = logging.getLogger(__name__)
# After a graph execution's timeout, how long its members get to say how long their current
# computation has run before the ones that do not are re-created: an idle actor answers in ~1 ms,
# a loaded 2-core machine's in tens.
HUNG_PING_TIMEOUT_S = 2.0
# ... and a member whose current computation has run this share of call_timeout_s is stuck in it
# (one layer's expert FFN takes milliseconds; the execution already waited the whole timeout).
STUCK_SHARE_OF_CALL_TIMEOUT = 0.5
# A layer that waited this long for its experts gets a warning (at most one per interval): a stall
# short of call_timeout_s holds every request of the unit and would otherwise leave no trace in logs.
SLOW_LAYER_WARN_S = 1.0
SLOW_LAYER_WARN_INTERVAL_S = 10.0


class ExpertRouter(RouterGraphs):
    """``ExpertExecutor`` over an :class:`ExpertPool`, called from the engine thread only.

    Args:
        pool: the started expert pool.
        dtype: activation dtype on the wire.
        telemetry: tracing/metrics hooks (see :class:`NullTelemetry`).
        graph: build a compiled graph over ``pool`` (needs a private pool: an actor can be in one
            compiled graph only); False: actor calls only.
    """

    def __init__(self, pool: ExpertPool, dtype: torch.dtype, telemetry: NullTelemetry | None = None,
                 graph: bool = False) -> None:
        self.pool, self.dtype = pool, dtype
        self._init_graphs(graph)  # self.graph (the live one) and self.standby (actors/router_graphs.py)
        self.telemetry = telemetry or NullTelemetry()
        self.actor_calls = ActorCalls(pool, self.telemetry)  # every layer without a live graph, retries, probes
        self.num_graph_layers = 0
        self.num_overlapped_layers = 0  # graph layers submitted while another was still out
        self.num_call_layers = 0
        self.num_probes = 0
        replication = pool.config.replication
        self.rebalancer = Rebalancer(pool, replication, ray) if replication.enabled else None
        # max/mean rows per expert actor of each recent dispatch (the balance replication aims at)
        self.actor_imbalance: deque[float] = deque(maxlen=4096)
        self.prefetch_enabled = pool.config.offload_settings() is not None and pool.config.prefetch
        self._hint: list | None = None  # [layer, expert_ids]
        self.overlap = pool.config.two_batch_overlap
        self._actor_free_s: dict[int, float] = {}  # when each actor finished our latest call (wall s)
        self._slow_warned_s, self._slow_unwarned = -SLOW_LAYER_WARN_INTERVAL_S, 0  # monotonic s, count

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        """The model's prediction for the next MoE layer: sent with this layer's calls (offload)."""
        self._hint = [layer, expert_ids]  # a list: it travels in graph payloads (see _submit_graph)

    def execute(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """``(num_tokens, hidden_size)`` -> the routing-weighted sum of each token's experts.

        Raises:
            actors.actor_calls.ExpertCallFailed: a group failed ``max_attempts`` times.
        """
        return self.submit(layer, hidden, routing)()

    def submit(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> Callable[[], torch.Tensor]:
        """Start the layer's expert calls; the returned function waits for :meth:`execute`'s
        result (``engine.model.moe.submit_experts``). On a live compiled graph the execution runs
        while the caller goes on (two-batch overlap); otherwise the calls go when it is called."""
        plan = dispatch(hidden, routing)
        finish = self._start_layer(layer, plan.hidden, plan.weights, plan.expert_counts.tolist())
        return lambda: combine(finish(), plan.token_index, hidden.shape[0])

    @property
    def microbatches(self) -> int:
        """Micro-batches the model splits a forward into (``experts.two_batch_overlap``): 2 while
        the compiled graph is live, else 1 (actor calls are not overlapped)."""
        return 2 if self.overlap and self.graph is not None and self.graph.live else 1

    def run_layer(self, layer: int, rows: torch.Tensor, weights: torch.Tensor,
                  expert_counts: list[int]) -> torch.Tensor:
        """Send each group's contiguous rows to its replicas; gather the outputs in order.

        Args:
            rows: ``(num_rows, hidden_size)`` grouped by expert; weights: ``(num_rows,)`` float32;
            expert_counts: rows per expert.

        Returns:
            ``(num_rows, hidden_size)`` weighted expert outputs, in ``rows`` order.
        """
        return self._start_layer(layer, rows, weights, expert_counts)()

    def _start_layer(self, layer: int, rows: torch.Tensor, weights: torch.Tensor,
                     expert_counts: list[int]) -> Callable[[], torch.Tensor]:
        """:meth:`run_layer` up to the graph's submission; the returned function finishes it."""
        started_s = time.monotonic()
        w = weights.detach().to("cpu", torch.float32)  # explicit host copy: the wire boundary
        hint, self._hint = self._hint, None
        # Every dispatch, executions out or not: a probe's answer is what lets a straggling
        # graph member be replaced (with two-batch overlap an execution is nearly always out).
        self.actor_calls.losers.reap()
        if self.graph is None or not self.graph.inflight:  # rebuilds and rebalancing wait until none is out
            self._between_dispatches()
        members = self._live_members()
        if members is not None and not self.graph.fits(rows.nbytes + w.nbytes):
            members = None  # a large prefill's rows: too big for the channels, so actor calls
        calls = self._plan(layer, rows, w, expert_counts, members, hint)
        if calls is None:  # a group has no usable member in the live graph: this layer by actor calls
            members, calls = None, self._plan(layer, rows, w, expert_counts, None, hint)
        self._record_balance(calls, expert_counts)
        records = [c.record for c in calls]
        ctx = self.telemetry.begin_dispatch(layer, rows.shape[0], records, self.telemetry.current_carrier())
        try:
            execution = self._submit_graph(layer, calls, ctx, members) if members and calls else None
        except Exception as e:
            self.telemetry.end_dispatch(ctx, layer, expert_counts, records, f"{type(e).__name__}: {e}")
            raise
        if execution is not None:  # counted after its own submission: another micro-batch's is still out
            self.num_overlapped_layers += execution[0].inflight > 1

        def finish() -> torch.Tensor:
            error = None
            try:
                results = self._wait_graph(calls, execution) if execution is not None else None
                if results is None and execution is not None and execution[1].timed_out:
                    self.pool.replace_unresponsive(
                        members, HUNG_PING_TIMEOUT_S, STUCK_SHARE_OF_CALL_TIMEOUT * self.pool.config.call_timeout_s)
                if results is not None and self._graph_straggler(members) is not None:
                    # Replaced at once, not once no execution is out: an execution still out
                    # (the other micro-batch's) queues behind the straggler; dropping the graph
                    # sends it by actor calls now (its wait returns None).
                    self._replace_graph()
                if results is None and members and calls:
                    late = execution is not None and execution[1].late
                    self._abandon(calls, "compiled graph past its hedge deadline" if late
                                  else "compiled graph failed or replaced")
                if results is None:
                    results = self.actor_calls.run(layer, calls, ctx)
                    self.num_call_layers += 1
                else:
                    self.num_graph_layers += 1
                self._probe(layer, calls, members)
                self._warn_if_slow(layer, calls, time.monotonic() - started_s)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                raise
            finally:
                self.telemetry.end_dispatch(ctx, layer, expert_counts, records, error)
            out = torch.empty_like(rows)
            for c, result in zip(calls, results):
                out[c.start:c.end] = result
            return out

        return finish

    def _warn_if_slow(self, layer: int, calls: list[Call], waited_s: float) -> None:
        """A warning for a layer that waited ``waited_s`` >= :data:`SLOW_LAYER_WARN_S` for its
        experts, naming the slowest call; at most one per :data:`SLOW_LAYER_WARN_INTERVAL_S`, with
        the count of slow layers not reported since the last one."""
        if waited_s < SLOW_LAYER_WARN_S or not calls:
            return
        now = time.monotonic()
        if now - self._slow_warned_s < SLOW_LAYER_WARN_INTERVAL_S:
            self._slow_unwarned += 1
            return
        slowest = max(calls, key=lambda c: c.record.latency_ms).record
        log.warning("MoE layer %d waited %.1f s for its experts (slowest call: %s, %.1f s by %s; "
                    "call_timeout_s %g s; %d more slow layers since the last warning)", layer, waited_s,
                    slowest.replica, slowest.latency_ms / 1e3, slowest.transport or "?",
                    self.pool.config.call_timeout_s, self._slow_unwarned)
        self._slow_warned_s, self._slow_unwarned = now, 0

    def _between_dispatches(self) -> None:
        """Let the rebalancer act, rebuild a stale graph, look after the standby."""
        if self.rebalancer is not None:
            try:
                self.rebalancer.step()
            except Exception:  # replication is an optimisation: never a request's failure
                log.warning("expert rebalancing failed", exc_info=True)
        self._maintain_graphs()

    def _plan(self, layer: int, rows: torch.Tensor, w: torch.Tensor, expert_counts: list[int],
              members: list[Replica] | None, hint: list | None = None) -> list[Call] | None:
        """The layer's calls: each group's rows over its chosen replicas (members of the live graph
        when ``members`` is given; None when a group with rows has none usable there)."""
        calls, planned, start = [], {}, 0
        for g, experts in enumerate(self.pool.groups):
            counts = [expert_counts[e] for e in experts]
            n = sum(counts)
            if not n:
                continue
            usable = self.pool.alive(g)
            if members is not None:
                usable = [r for r in usable if any(r is m for m in members)]
                if not usable:
                    return None
            chosen = choose(usable, n, self.pool.config, planned) if usable else [None]
            for replica, (part, a, b) in zip(chosen, split_counts(counts, len(chosen))):
                rec = CallRecord(layer, g, experts, part, b - a)
                calls.append(Call(rec, rows[start + a:start + b], w[start + a:start + b], start + a, start + b,
                                  replica, hint=hint))
            start += n
        return calls

    def _record_balance(self, calls: list[Call], expert_counts: list[int]) -> None:
        """max/mean planned rows per expert actor of this dispatch; the rebalancer's routed rows."""
        per_actor = {id(r.stats): 0 for r in self.pool.actors() if r.alive}
        for c in calls:
            if c.replica is not None and id(c.replica.stats) in per_actor:
                per_actor[id(c.replica.stats)] += c.record.rows
        total = sum(per_actor.values())
        if total:
            self.actor_imbalance.append(max(per_actor.values()) / (total / len(per_actor)))
        if self.rebalancer is not None:
            self.rebalancer.observe([sum(expert_counts[e] for e in experts) for experts in self.pool.groups])

    def _probe(self, layer: int, calls: list[Call], members: list[Replica] | None) -> None:
        """Send a copy of one call of each group to every usable replica due a probe (its result
        is never waited for; it ends as a probe in :class:`Losers`). A group whose graph member
        straggled this layer (the straggler rule against the median of the other groups' calls:
        with two groups a median over all calls would be the straggler's own latency) has its
        replicas outside the graph probed at once, so that a fresh view of them lets the graph
        be rebuilt without it."""
        now, cfg = time.monotonic(), self.pool.config
        first: dict[int, Call] = {}
        chosen: dict[int, list[Replica]] = {}
        for c in calls:
            first.setdefault(c.record.group, c)
            chosen.setdefault(c.record.group, []).append(c.replica)
        for g, c in first.items():
            straggled = False
            if members is not None:  # only a graph member's straggling triggers the at-once probe
                others = [x.record.latency_ms for x in calls if x.record.group != g]
                bound_ms = straggler_bound_ms(cfg, median_high(others)) if others else None
                straggled = bound_ms is not None and any(
                    x.record.latency_ms > bound_ms for x in calls if x.record.group == g)
            for r in self.pool.alive(g):
                outside = members is not None and not any(r is m for m in members)
                interval_s = 0.0 if straggled and outside else cfg.probe_interval_s
                if probe_due(r, chosen[g], interval_s, outside, now):
                    try:
                        probe = self.actor_calls.send(layer, c, r)
                    except Exception:  # a probe is optional; the next real call finds a dead replica
                        log.debug("probing %s failed", r.name, exc_info=True)
                        continue
                    self.actor_calls.losers.add_probe(probe.ref, r, c.record.rows, probe.sent_s, probe.sent_mono_s)
                    self.num_probes += 1

    def _submit_graph(self, layer: int, calls: list[Call], ctx: Any, members: list[Replica]):
        """Submit the layer as one compiled-graph execution: ``(graph, execution, member index)``,
        or None (no graph is live any more)."""
        graph = self.graph
        graph.wake()  # a parked graph's wake-up is not the calls' latency
        sent_s = time.time()
        index = {id(m): i for i, m in enumerate(members)}
        per_member: list = [None] * len(members)
        for c in calls:
            c.record.sent_s, c.record.attempts, c.record.transport = sent_s, 1, "compiled_graph"
            c.record.replica = c.replica.name
            call = [c.record.counts, to_bytes(c.hidden), to_bytes(c.weights), self.telemetry.call_carrier(ctx, c.record),
                    c.hint]
            per_member[index[id(c.replica)]] = call if c.replica.host is None else [*call, c.record.expert_ids]
            c.replica.stats.last_call_s = time.monotonic()
        # Lists, not tuples: Ray's channel serialiser (msgpack with strict types) pickles every
        # tuple, ~15 us of this thread's time per execution and as much on each actor.
        execution = graph.submit([layer, per_member, sent_s])
        return None if execution is None else (graph, execution, index)

    def _wait_graph(self, calls: list[Call], submitted: tuple) -> list | None:
        """The outputs of a submitted execution, or None (the graph failed: use actor calls).

        A call's own latency starts when it was sent or when its actor finished this router's
        previous call, whichever is later: behind another micro-batch's execution it queued, and
        queueing behind our own work must not make the actor look like a straggler."""
        graph, execution, index = submitted  # the live graph may have changed since (the other micro-batch)
        hedge_ms = self._graph_hedge_ms(calls)
        results = graph.wait(execution, None if hedge_ms is None else hedge_ms / 1e3)
        if execution.late:
            self._graph_late(calls, hedge_ms, graph)
        if results is None:
            return None
        out, samples = [], self._graph_samples()
        for c in calls:
            result, timing = results[index[id(c.replica)]]
            free_s = self._actor_free_s.get(id(c.replica), 0.0)
            own_ms = record_answer(c.record, c.replica, timing, max(c.record.sent_s, free_s))
            self.actor_calls.hedging.observe(c.record.group, own_ms)
            samples.setdefault(id(c.replica.stats), deque(maxlen=2)).append(own_ms)
            self._actor_free_s[id(c.replica)] = c.record.done_s
            out.append(from_bytes(result, tuple(c.hidden.shape), c.hidden.dtype, c.hidden.device))
        return out

    def _abandon(self, calls: list[Call], reason: str) -> None:
        """The graph failed or was dropped under these calls: their attempts end, and actor calls
        go next to each group's best replica now (the planned member may be the straggler or the
        dead actor that ended the graph)."""
        for c in calls:
            self.telemetry.abandon_call(c.record, reason)
            c.record.attempts, c.replica = 0, None

    def replication_stats(self) -> dict:
        """Usable replicas per group, guests added/removed, and the mean max/mean rows per actor of
        the latest 256 dispatches (verifier stats, benchmarks)."""
        recent = list(self.actor_imbalance)[-256:]
        rb = self.rebalancer
        return {"replicas_per_group": [len(self.pool.alive(g)) for g in range(len(self.pool.groups))],
                "guests_added": rb.num_added if rb else 0, "guests_removed": rb.num_removed if rb else 0,
                "actor_imbalance_recent": sum(recent) / len(recent) if recent else None}

    def close(self) -> None:
        self._close_graphs()
