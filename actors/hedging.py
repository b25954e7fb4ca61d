"""Hedged expert calls: per-group deadlines from recent latencies, and the losers (and probes) still in flight.

A call on the actor-call path that has not returned ``deadline_ms(group)`` after it was sent is
sent again to another live replica of its group; the first result is taken (experts are
deterministic, so either gives the same rows) and the other call is cancelled. A cancelled call
that already runs on its actor still finishes there: :class:`Losers` keeps its rows counted as
outstanding on that replica (so the router keeps preferring others) until it is done, then drops
its result unread. Nothing here blocks or raises into a request.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class LatencyWindow:
    """The last ``size`` call latencies of one expert group, milliseconds."""

    def __init__(self, size: int) -> None:
        self._values_ms: deque[float] = deque(maxlen=size)

    def observe(self, latency_ms: float) -> None:
        if math.isfinite(latency_ms) and latency_ms >= 0:
            self._values_ms.append(float(latency_ms))

    def __len__(self) -> int:
        return len(self._values_ms)

    def quantile_ms(self, q: float) -> float:
        """The ``q`` quantile (nearest rank, 0 < q <= 1) of the window; 0.0 when empty."""
        if not self._values_ms:
            return 0.0
        ordered = sorted(self._values_ms)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class HedgePolicy:
    """When to hedge a call of each expert group.

    Args:
        config: an :class:`actors.expert_config.ExpertPoolConfig` (its ``hedge*`` fields).
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.enabled: bool = config.hedge  # a switch the verifier may flip at run time
        self.windows: dict[int, LatencyWindow] = {}

    def observe(self, group: int, latency_ms: float) -> None:
        """One answered call's own round trip (from its send to its result), milliseconds."""
        if group not in self.windows:
            self.windows[group] = LatencyWindow(self.config.hedge_window)
        self.windows[group].observe(latency_ms)

    def deadline_ms(self, group: int, live_replicas: int) -> float | None:
        """Milliseconds after sending at which a call of ``group`` is hedged, or None: hedging is
        off, the group has one live replica, or fewer than ``min_samples`` latencies are known."""
        w = self.windows.get(group)
        c = self.config
        if not self.enabled or live_replicas < 2 or w is None or len(w) < c.hedge_min_samples:
            return None
        return max(c.hedge_floor_ms, c.hedge_factor * w.quantile_ms(c.hedge_quantile))


@dataclass
class _Loser:
    ref: Any
    replica: Any
    rows: int
    sent_mono_s: float  # time.monotonic() of its send
    running_ms: float  # it was still running this long after its send (a lower bound of its latency)
    observed_ms: float  # the part of running_ms already given to the replica's latency
    probe_sent_s: float | None = None  # a probe: time.time() of its send (its latency is read exactly)


class Losers:
    """Calls whose result is not needed (a hedge's loser, cancelled; a probe): their rows stay
    outstanding on their replica until they end.

    Args:
        ray_module: the ``ray`` module the router uses (``wait``, ``cancel``; a fake in tests).
    """

    def __init__(self, ray_module: Any) -> None:
        self.ray = ray_module
        self.pending: list[_Loser] = []
        self.num_cancelled = 0

    def add(self, ref: Any, replica: Any, rows: int, sent_mono_s: float, observed_ms: float) -> None:
        """Cancel ``ref`` (a queued call never runs; a running one finishes, unread).

        Args:
            sent_mono_s: ``time.monotonic()`` when it was sent; observed_ms: the latency already
                observed for it on ``replica`` (the wait before its hedge).
        """
        try:
            self.ray.cancel(ref)
            self.num_cancelled += 1
        except Exception:
            log.debug("cancelling a hedged call's loser failed", exc_info=True)
        running_ms = (time.monotonic() - sent_mono_s) * 1e3
        self.pending.append(_Loser(ref, replica, rows, sent_mono_s, running_ms, observed_ms))

    def add_probe(self, ref: Any, replica: Any, rows: int, sent_s: float, sent_mono_s: float) -> None:
        """A probe (:mod:`actors.replica_choice`): not cancelled; when it ends, its own latency (from
        ``sent_s``, ``time.time()``, to the actor's end of compute) becomes ``replica``'s latency view:
        a fresh measurement of a replica that got no other call, so a recovered straggler is used
        again at once and one still slow stays avoided."""
        self.pending.append(_Loser(ref, replica, rows, sent_mono_s, 0.0, 0.0, probe_sent_s=sent_s))

    def reap(self) -> int:
        """Drop the losers that have ended (result or cancellation, never read); returns how many.

        A loser that has ended gives its replica the longest time it was seen still running (a
        lower bound of its latency, exact to one check while traffic flows), so the router keeps
        preferring the replica that won."""
        if not self.pending:
            return 0
        try:
            refs = [x.ref for x in self.pending]
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        except Exception:
            log.debug("checking hedged calls' losers failed", exc_info=True)
            return 0
        now = time.monotonic()
        done_ids = {id(r) for r in done}
        still = []
        for x in self.pending:
            if id(x.ref) in done_ids:
                x.replica.end(x.rows)
                if x.probe_sent_s is not None:
                    self._probe_latency(x)
                elif x.running_ms > x.observed_ms:
                    x.replica.observe_latency(x.running_ms)
            else:
                x.running_ms = (now - x.sent_mono_s) * 1e3
                still.append(x)
        reaped = len(self.pending) - len(still)
        self.pending = still
        return reaped

    def _probe_latency(self, x: _Loser) -> None:
        try:
            _, timing = self.ray.get(x.ref)
        except Exception:  # a dead replica is found by the next real call
            log.debug("a probe failed", exc_info=True)
            return
        x.replica.ewma_latency_ms = max(0.0, timing["start_s"] + timing["compute_ms"] / 1e3 - x.probe_sent_s) * 1e3

    def forget(self, replica: Any) -> None:
        """A replica was re-created: its losers will never be waited for again."""
        self.pending = [x for x in self.pending if x.replica is not replica]
