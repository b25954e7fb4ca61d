"""Expert router: the Ray implementation of the engine's ``ExpertExecutor``.

The model's forward runs in the verifier's engine thread; for each MoE layer it calls
:meth:`ExpertRouter.execute`, which sends every expert group with tokens to its actor from that
same thread (no event-loop hop: the loop that streams outputs never carries a dispatch). Two
transports (``experts.transport``):

* ``compiled_graph``: one execution of the replica's expert :class:`ActorGraph` per layer; while the graph
  builds, after it failed, or for a retry, the layer goes by actor calls.
* ``actor_calls``: one ``.remote()`` per group, then ``ray.wait`` per arrival. The replica with the
  least outstanding rows wins (tie: lowest recent latency). A call that fails (dead actor) or times
  out is retried on another replica of the group, re-creating the actor when none is left.

Experts are deterministic, so a retried or re-routed layer gives the same output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from actors.compiled_graph import ActorGraph
from actors.expert_pool import ExpertPool, Replica
from actors.wire import from_bytes, from_wire, to_bytes, to_wire
from engine.model.moe import combine, dispatch
from kernels.routing import RoutingResult

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ExpertCallFailed(RuntimeError):
    """Every attempt for an expert group failed."""


@dataclass
class CallRecord:
    """One expert-group call of a layer dispatch (times: ``time.time()`` seconds)."""

    layer: int
    group: int
    expert_ids: list[int]
    counts: list[int]
    rows: int
    replica: str = ""
    transport: str = ""
    sent_s: float = 0.0
    done_s: float = 0.0
    attempts: int = 0
    timing: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    span: Any = None

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.sent_s) * 1e3


class NullTelemetry:
    """Router hooks that do nothing (``actors.telemetry.RouterTelemetry`` plugs in here)."""

    def current_carrier(self) -> dict | None:
        return None

    def begin_dispatch(self, layer: int, num_tokens: int, records: list[CallRecord], parent: dict | None) -> Any:
        return None

    def call_carrier(self, dispatch_ctx: Any, record: CallRecord) -> dict | None:
        return None

    def abandon_call(self, record: CallRecord, reason: str) -> None:
        return None

    def end_dispatch(self, dispatch_ctx: Any, layer: int, expert_counts: list[int], records: list[CallRecord],
                     error: str | None = None) -> None:
        return None


@dataclass
class _Call:
    """One group's slice of a layer: its record and rows (encoded per transport when sent)."""

    record: CallRecord
    hidden: torch.Tensor  # (rows, hidden_size)
    weights: torch.Tensor  # (rows,) float32, on the host


class ExpertRouter:
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
        self.graph = ActorGraph.from_config("expert", self._graph_members, lambda n: (None, [None] * n, 0.0),
                                            pool.config) if graph else None
        self.telemetry = telemetry or NullTelemetry()
        self.timeout_s = pool.config.call_timeout_s
        self.max_attempts = pool.config.max_attempts
        self.num_retries = 0
        self.num_graph_layers = 0
        self.num_call_layers = 0

    def execute(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """``(num_tokens, hidden_size)`` -> the routing-weighted sum of each token's experts.

        Raises:
            ExpertCallFailed: a group failed ``max_attempts`` times.
        """
        plan = dispatch(hidden, routing)
        out = self.run_layer(layer, plan.hidden, plan.weights, plan.expert_counts.tolist())
        return combine(out, plan.token_index, hidden.shape[0])

    def run_layer(self, layer: int, rows: torch.Tensor, weights: torch.Tensor,
                  expert_counts: list[int]) -> torch.Tensor:
        """Send each group's contiguous rows to its actor; gather the outputs in order.

        Args:
            rows: ``(num_rows, hidden_size)`` grouped by expert; weights: ``(num_rows,)`` float32;
            expert_counts: rows per expert.

        Returns:
            ``(num_rows, hidden_size)`` weighted expert outputs, in ``rows`` order.
        """
        out = torch.empty_like(rows)
        calls, slices, start = [], [], 0
        w = weights.detach().to("cpu", torch.float32)  # explicit host copy: the wire boundary
        for g, experts in enumerate(self.pool.groups):
            counts = [expert_counts[e] for e in experts]
            n = sum(counts)
            if n:
                calls.append(_Call(CallRecord(layer, g, experts, counts, n), rows[start:start + n], w[start:start + n]))
                slices.append((start, start + n))
            start += n
        records = [c.record for c in calls]
        ctx = self.telemetry.begin_dispatch(layer, rows.shape[0], records, self.telemetry.current_carrier())
        error = None
        try:
            results = self._via_graph(layer, calls, ctx)
            if results is None:
                results = self._via_actor_calls(layer, calls, ctx)
                self.num_call_layers += 1
            else:
                self.num_graph_layers += 1
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.telemetry.end_dispatch(ctx, layer, expert_counts, records, error)
        for (a, b), result in zip(slices, results):
            out[a:b] = result
        return out

    def _via_graph(self, layer: int, calls: list[_Call], ctx: Any) -> list | None:
        """One compiled-graph execution, or None (no live graph, or it failed: use actor calls)."""
        if self.graph is None or not calls:
            return None
        if not self.graph.live:
            self.graph.request_build()  # in the background; this layer goes by actor calls
            return None
        sent_s = time.time()
        per_group: list = [None] * len(self.pool.groups)
        for c in calls:
            c.record.sent_s, c.record.attempts, c.record.transport = sent_s, 1, "compiled_graph"
            per_group[c.record.group] = (c.record.counts, to_bytes(c.hidden), to_bytes(c.weights),
                                         self.telemetry.call_carrier(ctx, c.record))
        replicas = self.graph.members
        results = self.graph.execute((layer, per_group, sent_s))
        if results is None:
            for c in calls:
                self.telemetry.abandon_call(c.record, "compiled graph failed")
                c.record.attempts = 0
            return None
        out = []
        for c in calls:
            result, timing = results[c.record.group]
            self._done(c.record, replicas[c.record.group], timing)
            out.append(from_bytes(result, tuple(c.hidden.shape), c.hidden.dtype, c.hidden.device))
        return out

    def _via_actor_calls(self, layer: int, calls: list[_Call], ctx: Any) -> list:
        """Every group's call in flight at once; retries on another replica until ``max_attempts``."""
        results: dict[int, Any] = {}
        todo = list(calls)
        while todo:
            inflight = {}
            for c in todo:
                rec = c.record
                if rec.attempts >= self.max_attempts:
                    raise ExpertCallFailed(f"layer {rec.layer} experts {rec.expert_ids}: all {self.max_attempts} "
                                           f"attempts failed ({'; '.join(rec.errors)})")
                replica = self._pick(rec.group)
                rec.attempts, rec.replica, rec.transport = rec.attempts + 1, replica.name, "actor_call"
                replica.outstanding_rows += rec.rows
                rec.sent_s = time.time()
                carrier = self.telemetry.call_carrier(ctx, rec)
                ref = replica.handle.forward.remote(layer, rec.counts, to_wire(c.hidden), c.weights.numpy(),
                                                    rec.sent_s, carrier)
                inflight[ref] = (c, replica)
            todo = self._collect(inflight, results)
        return [results[c.record.group] for c in calls]

    def _collect(self, inflight: dict, results: dict) -> list[_Call]:
        """Wait for each call as it arrives (so each gets its own latency); return the ones to retry."""
        retry: list[_Call] = []
        deadline = time.monotonic() + self.timeout_s
        pending = list(inflight)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            c, replica = inflight[ready[0]]
            replica.outstanding_rows -= c.record.rows
            try:
                result, timing = ray.get(ready[0])
            except RETRYABLE as e:
                self._failed(c, replica, type(e).__name__, dead=True)
                retry.append(c)
                continue
            self._done(c.record, replica, timing)
            results[c.record.group] = from_wire(result, c.hidden.dtype, c.hidden.device)
        for ref in pending:  # timed out
            c, replica = inflight[ref]
            replica.outstanding_rows -= c.record.rows
            replica.observe_latency(self.timeout_s * 1e3)  # prefer other replicas next time
            # A hung sole replica is as good as dead.
            self._failed(c, replica, "timeout", dead=len(self.pool.alive(c.record.group)) == 1)
            retry.append(c)
        return retry

    def _failed(self, c: _Call, replica: Replica, reason: str, dead: bool) -> None:
        c.record.errors.append(f"{replica.name}: {reason}")
        self.telemetry.abandon_call(c.record, reason)
        self.num_retries += 1
        if dead:
            self.pool.recreate(replica)

    @staticmethod
    def _done(rec: CallRecord, replica: Replica, timing: dict) -> None:
        # The call's end is the actor's end of compute, so each call has its own latency even when
        # several arrive together (a compiled graph returns all of a layer at once).
        rec.done_s = max(rec.sent_s, timing["start_s"] + timing["compute_ms"] / 1e3)
        rec.timing, rec.replica = timing, replica.name
        replica.observe_latency(rec.latency_ms)

    def _graph_members(self) -> tuple[list[Replica], str]:
        """One live replica of every group (a dead one is re-created by the next actor call first)."""
        if not all(self.pool.alive(g) for g in range(len(self.pool.groups))):
            raise RuntimeError("an expert group has no live replica yet")
        return [self.pool.alive(g)[0] for g in range(len(self.pool.groups))], "forward_graph"

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()

    def _pick(self, group: int) -> Replica:
        alive = self.pool.alive(group)
        if not alive:
            return self.pool.recreate(self.pool.replicas[group][0])
        return min(alive, key=lambda r: (r.outstanding_rows, r.ewma_latency_ms, r.index))
