"""Async expert router: the Ray implementation of the engine's ``ExpertExecutor``.

The model's forward runs in a worker thread; for each MoE layer it calls :meth:`execute`, which
hands the dispatch to the replica's event loop (``run_coroutine_threadsafe``) and waits in that
thread, so the event loop never blocks. On the loop, every expert group with tokens is sent to one
replica concurrently; the replica with the least outstanding rows wins (tie: lowest recent
latency). A call that fails (dead actor) or times out is retried on another replica of the group,
re-creating the actor when none is left; experts are deterministic, so the output is the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from actors.expert_pool import ExpertPool, Replica
from actors.wire import from_wire, to_wire
from engine.model.moe import combine, dispatch
from kernels.routing import RoutingResult

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, asyncio.TimeoutError)


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

    def end_dispatch(self, dispatch_ctx: Any, layer: int, expert_counts: list[int], records: list[CallRecord]) -> None:
        return None


class AsyncExpertRouter:
    """``ExpertExecutor`` over an :class:`ExpertPool`.

    Args:
        pool: the started expert pool.
        loop: the event loop that awaits actor calls (the verifier replica's loop).
        dtype: activation dtype on the wire.
        telemetry: tracing/metrics hooks (see :class:`NullTelemetry`).
    """

    def __init__(self, pool: ExpertPool, loop: asyncio.AbstractEventLoop, dtype: torch.dtype,
                 telemetry: NullTelemetry | None = None) -> None:
        self.pool, self.loop, self.dtype = pool, loop, dtype
        self.telemetry = telemetry or NullTelemetry()
        self.timeout_s = pool.config.call_timeout_s
        self.max_attempts = pool.config.max_attempts
        self.num_retries = 0

    def execute(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """Called from the engine's worker thread; never from the event loop itself."""
        plan = dispatch(hidden, routing)
        parent = self.telemetry.current_carrier()  # this thread's span, for the dispatch span
        future = asyncio.run_coroutine_threadsafe(
            self.run_layer(layer, plan.hidden, plan.weights, plan.expert_counts.tolist(), parent), self.loop)
        out = future.result()
        return combine(out, plan.token_index, hidden.shape[0])

    async def run_layer(self, layer: int, rows: torch.Tensor, weights: torch.Tensor,
                        expert_counts: list[int], parent: dict | None = None) -> torch.Tensor:
        """Send each group's contiguous rows to one replica concurrently; gather in order.

        Args:
            rows: ``(num_rows, hidden_size)`` grouped by expert; weights: ``(num_rows,)`` float32;
            expert_counts: rows per expert.
        """
        out = torch.empty_like(rows)
        records, slices, start = [], [], 0
        for g, experts in enumerate(self.pool.groups):
            counts = [expert_counts[e] for e in experts]
            n = sum(counts)
            if n:
                records.append(CallRecord(layer, g, experts, counts, n))
                slices.append((start, start + n))
            start += n
        ctx = self.telemetry.begin_dispatch(layer, rows.shape[0], records, parent)
        results = await asyncio.gather(*[
            self._call_group(rec, rows[a:b], weights[a:b], ctx) for rec, (a, b) in zip(records, slices)
        ])
        for (a, b), result in zip(slices, results):
            out[a:b] = result
        self.telemetry.end_dispatch(ctx, layer, expert_counts, records)
        return out

    def _pick(self, group: int) -> Replica:
        alive = self.pool.alive(group)
        if not alive:
            return self.pool.recreate(self.pool.replicas[group][0])
        return min(alive, key=lambda r: (r.outstanding_rows, r.ewma_latency_ms, r.index))

    async def _call_group(self, rec: CallRecord, rows: torch.Tensor, weights: torch.Tensor, ctx: Any):
        payload, w = to_wire(rows), weights.numpy()
        for attempt in range(1, self.max_attempts + 1):
            replica = self._pick(rec.group)
            rec.attempts, rec.replica = attempt, replica.name
            replica.outstanding_rows += rec.rows
            rec.sent_s = time.time()
            carrier = self.telemetry.call_carrier(ctx, rec)
            try:
                ref = replica.handle.forward.remote(rec.layer, rec.counts, payload, w, rec.sent_s, carrier)
                result, timing = await asyncio.wait_for(ref, self.timeout_s)
            except RETRYABLE as e:
                rec.errors.append(f"{replica.name}: {type(e).__name__}")
                self.num_retries += 1
                if isinstance(e, asyncio.TimeoutError):
                    replica.observe_latency(self.timeout_s * 1e3)  # prefer other replicas next time
                    if len(self.pool.alive(rec.group)) == 1:
                        self.pool.recreate(replica)  # a hung sole replica is as good as dead
                else:
                    self.pool.recreate(replica)
                continue
            finally:
                replica.outstanding_rows -= rec.rows
            rec.done_s = time.time()
            rec.timing = timing
            replica.observe_latency(rec.latency_ms)
            return from_wire(result, rows.dtype)
        raise ExpertCallFailed(f"layer {rec.layer} experts {rec.expert_ids}: all {self.max_attempts} attempts "
                               f"failed ({'; '.join(rec.errors)})")
