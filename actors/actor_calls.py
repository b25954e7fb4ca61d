"""The actor-call transport of the expert router: one ``.remote()`` per call, then ``ray.wait``
per arrival, so each call gets its own latency.

A call that fails (dead actor) or times out is retried on another replica of its group,
re-creating the actor when none is left. With >= 2 live replicas, a call not back by its group's
hedge deadline (``experts.hedge_*``: a factor times a recent-latency quantile, at least a floor)
is also sent to another replica; the first answer wins, the other is cancelled and its late
result never read (:mod:`actors.hedging`). Experts are deterministic, so a retried or hedged call
gives the same rows.

Used for every layer when ``experts.transport`` is ``actor_calls``, and on the compiled-graph
transport while the graph builds, after it failed, for a layer too large for its channels, and
for probes (:class:`actors.expert_router.ExpertRouter`).
"""

from __future__ import annotations

import time
from typing import Any

import ray

from actors.expert_calls import Attempt, Call, NullTelemetry, record_answer
from actors.expert_pool import ExpertPool, Replica
from actors.hedging import HedgePolicy, Losers
from actors.replica_choice import choose
from actors.wire import from_wire, to_wire

RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# Longest wait for a re-created actor's first answer (its process start and weight load: 2-5 s on
# the 2-core VM, longer when loaded), where experts.call_timeout_s is below it.
FRESH_ACTOR_START_S = 30.0


class ExpertCallFailed(RuntimeError):
    """Every attempt for an expert group failed."""


class ActorCalls:
    """Expert calls by plain actor calls over ``pool``, from one thread (the engine's).

    Attributes:
        num_retries: attempts that failed or timed out and were sent again.
        num_hedges: hedges sent.
        hedging: the hedge deadlines (:class:`HedgePolicy`; ``enabled`` may be switched live).
        losers: hedge losers and probes still running (:class:`Losers`), reaped between layers.
    """

    def __init__(self, pool: ExpertPool, telemetry: NullTelemetry) -> None:
        self.pool, self.telemetry = pool, telemetry
        self.timeout_s = pool.config.call_timeout_s
        self.max_attempts = pool.config.max_attempts
        self.hedging = HedgePolicy(pool.config)
        self.losers = Losers(ray)
        self.num_retries = 0
        self.num_hedges = 0

    def run(self, layer: int, calls: list[Call], ctx: Any) -> list:
        """Every call in flight at once; hedged past its deadline; retried on another replica
        until ``max_attempts``. Returns each call's output rows, in ``calls`` order.

        Raises:
            ExpertCallFailed: a call failed ``max_attempts`` times.
        """
        results: dict[int, Any] = {}  # id(call) -> its output rows
        todo = list(calls)
        while todo:
            inflight: dict[Any, Attempt] = {}
            for c in todo:
                rec = c.record
                if rec.attempts >= self.max_attempts:
                    raise ExpertCallFailed(f"layer {rec.layer} experts {rec.expert_ids}: all {self.max_attempts} "
                                           f"attempts failed ({'; '.join(rec.errors)})")
                planned = c.replica if rec.attempts == 0 and c.replica is not None and c.replica.alive else None
                replica = planned or self.pick(rec.group)
                rec.attempts, rec.replica, rec.transport = rec.attempts + 1, replica.name, "actor_call"
                rec.sent_s = time.time()
                c.carrier = self.telemetry.call_carrier(ctx, rec)
                attempt = self.send(layer, c, replica)
                deadline_ms = self.hedging.deadline_ms(rec.group, len(self.pool.alive(rec.group)))
                if deadline_ms is not None:
                    attempt.hedge_at = attempt.sent_mono_s + deadline_ms / 1e3
                inflight[attempt.ref] = attempt
            todo = self._collect(layer, inflight, results)
        return [results[id(c)] for c in calls]

    def send(self, layer: int, c: Call, replica: Replica) -> Attempt:
        """One ``forward`` call of ``c``'s rows to ``replica`` (its rows count as outstanding there)."""
        if c.wire is None:
            c.wire = to_wire(c.hidden)
        sent_s, sent_mono_s = time.time(), time.monotonic()
        args = (layer, c.record.counts, c.wire, c.weights.numpy(), sent_s, c.carrier, c.hint)
        if replica.host is not None:  # a guest: its host also holds its own group's experts
            args = (*args, c.record.expert_ids)
        ref = replica.handle.forward.remote(*args)
        replica.begin(c.record.rows, sent_mono_s)
        return Attempt(ref, c, replica, sent_s, sent_mono_s)

    def pick(self, group: int) -> Replica:
        """The replica of ``group`` with the least expected completion (a retry, or no plan)."""
        alive = self.pool.alive(group)
        if not alive:
            return self.pool.recreate(self.pool.replicas[group][0], f"group {group} has no live replica")
        return choose(alive, 1, self.pool.config, {})[0]

    def _collect(self, layer: int, inflight: dict, results: dict) -> list[Call]:
        """Wait for each call as it arrives (so each gets its own latency), hedging the ones past
        their deadline; return the calls to retry (every attempt failed or timed out)."""
        retry: list[Call] = []
        # A re-created actor's first call also waits for its start (process, weights): under
        # call_timeout_s alone a loaded machine's slow start was a timeout, a kill and a re-creation
        # again, each attempt's actor killed while it started, until the call failed.
        fresh = any(a.replica.fresh for a in inflight.values())
        deadline = time.monotonic() + (max(self.timeout_s, FRESH_ACTOR_START_S) if fresh else self.timeout_s)
        pending = list(inflight)
        while pending:
            self._hedge_due(layer, inflight, pending)
            hedge_at = [a.hedge_at for a in inflight.values() if a.hedge_at is not None]
            wake = min([deadline, *hedge_at])
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, wake - time.monotonic()))
            if not ready:
                if wake >= deadline:
                    break
                continue  # a hedge deadline passed
            failed = self._arrived(inflight.pop(ready[0]), ready[0], inflight, pending, results)
            if failed is not None:
                retry.append(failed)
        return retry + self._timed_out(inflight, pending)

    def _arrived(self, a: Attempt, ref: Any, inflight: dict, pending: list, results: dict) -> Call | None:
        """Read one arrived attempt: its rows into ``results`` and its twin cancelled, or the
        call to retry (it failed and no twin is still out)."""
        c, replica = a.call, a.replica
        replica.end(c.record.rows)
        twins = [r for r in pending if inflight[r].call is c]
        try:
            result, timing = ray.get(ref)
        except RETRYABLE as e:
            if twins:  # the call's other attempt may still answer
                self._lost_attempt(c, replica, type(e).__name__)
                return None
            self._failed(c, replica, type(e).__name__, dead=True)
            return c
        own_ms = record_answer(c.record, replica, timing, a.sent_s)
        self.hedging.observe(c.record.group, own_ms)
        c.record.hedge_won = a.hedge
        if a.hedge:  # a fresh head-to-head: the winner's view is its latency now (a stale EWMA
            replica.ewma_latency_ms = own_ms  # would send the next call back to the straggler)
        results[id(c)] = from_wire(result, c.hidden.dtype, c.hidden.device)
        for r in twins:  # the loser: cancelled, its late result never read
            pending.remove(r)
            loser = inflight.pop(r)
            self.losers.add(r, loser.replica, c.record.rows, loser.sent_mono_s, loser.waited_ms)
        return None

    def _timed_out(self, inflight: dict, pending: list) -> list[Call]:
        """The calls of the attempts still out at the deadline: each to retry once."""
        retry: dict[int, Call] = {}
        for ref in pending:
            a = inflight[ref]
            a.replica.end(a.call.record.rows)
            a.replica.observe_latency(self.timeout_s * 1e3)  # prefer other replicas next time
            if id(a.call) not in retry:
                retry[id(a.call)] = a.call
                # A hung sole replica is as good as dead.
                self._failed(a.call, a.replica, "timeout", dead=len(self.pool.alive(a.call.record.group)) == 1)
        return list(retry.values())

    def _hedge_due(self, layer: int, inflight: dict, pending: list) -> None:
        """Send every call whose hedge deadline has passed to another live replica (once a call)."""
        now = time.monotonic()
        for a in [a for a in inflight.values() if a.hedge_at is not None and a.hedge_at <= now]:
            a.hedge_at = None
            busy = {inflight[ref].replica.name for ref in pending if inflight[ref].call is a.call}
            others = [r for r in self.pool.alive(a.call.record.group) if r.name not in busy]
            if not others:
                continue
            other = min(others, key=lambda r: (r.stats.expected_ms(), r.outstanding_rows, r.index))
            waited_ms = a.waited_ms = (now - a.sent_mono_s) * 1e3
            # At least this slow now: the router prefers the other replica once the hedge wins.
            a.replica.ewma_latency_ms = max(a.replica.ewma_latency_ms, waited_ms)
            hedge = self.send(layer, a.call, other)
            hedge.hedge = True
            inflight[hedge.ref] = hedge
            pending.append(hedge.ref)
            a.call.record.hedges += 1
            self.num_hedges += 1
            self.telemetry.hedge_call(a.call.record, a.replica.name, other.name, waited_ms)

    def _lost_attempt(self, c: Call, replica: Replica, reason: str) -> None:
        """One attempt of a hedged call failed while its twin is still in flight."""
        c.record.errors.append(f"{replica.name}: {reason}")
        self.losers.forget(replica)
        self.pool.recreate(replica, self._why(c, reason))

    def _why(self, c: Call, reason: str) -> str:
        """What an operator reads in the re-creation warning."""
        if reason == "timeout":
            reason = f"no answer in call_timeout_s = {self.timeout_s:g} s"
        return f"{reason} in a call of layer {c.record.layer}"

    def _failed(self, c: Call, replica: Replica, reason: str, dead: bool) -> None:
        c.record.errors.append(f"{replica.name}: {reason}")
        self.telemetry.abandon_call(c.record, reason)
        self.num_retries += 1
        if dead:
            self.losers.forget(replica)
            self.pool.recreate(replica, self._why(c, reason))
