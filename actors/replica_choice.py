"""Which replicas of an expert group take a layer's rows, and how the rows are split over them.

Latency-aware choice (both transports): a replica's expected completion is ``(calls in flight +
calls already planned this layer + 1) x its latency EWMA`` (:meth:`ActorStats.expected_ms`; the
least-expected-completion rule of latency-aware load balancers such as Finagle's and Envoy's
least-request balancers, with the EWMA as the per-request cost). A replica above the straggler
rule (``straggler_multiple`` x the group's best and above ``straggler_floor_ms``, the same rule
that flags stragglers) is avoided; the others share the rows: up to ``rows // split_min_rows``
of them, in contiguous parts of even size. An avoided replica still gets a probe (a copy of one
call, nobody waits for it) every ``probe_interval_s``, so its latency view follows it when it
recovers (a probe's latency replaces its view: :meth:`actors.hedging.Losers.add_probe`). Experts are deterministic and row-wise, so any split gives the same output rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from actors.expert_pool import Replica


def straggler_bound_ms(config, reference_ms: float) -> float:
    """The straggler rule: a latency above ``straggler_multiple`` x ``reference_ms`` (a best or a
    median) and above ``straggler_floor_ms`` is a straggler's."""
    return max(config.straggler_floor_ms, config.straggler_multiple * reference_ms)


def unsuspected(replicas: Sequence[Replica]) -> list[Replica]:
    """``replicas`` without the suspects of a late graph execution (``ActorStats.suspect``), unless
    that leaves none."""
    return [r for r in replicas if not r.stats.suspect] or list(replicas)


def choose(replicas: Sequence[Replica], rows: int, config, planned: dict[int, int]) -> list[Replica]:
    """The replicas, best first, that take ``rows`` rows of one group.

    Args:
        replicas: the group's usable replicas (non-empty).
        config: an :class:`actors.expert_config.ExpertPoolConfig` (``split_min_rows``, ``straggler_*``).
        planned: calls already planned this layer per actor (``id(replica.stats)``); updated.
    """
    def expected(r: Replica) -> float:
        return r.stats.expected_ms(planned.get(id(r.stats), 0))

    replicas = unsuspected(replicas)
    ranked = sorted(replicas, key=lambda r: (expected(r), r.outstanding_rows, r.index))
    bound_ms = straggler_bound_ms(config, expected(ranked[0]))
    fast = [r for r in ranked if expected(r) <= bound_ms]
    k = 1 if config.split_min_rows == 0 else max(1, min(len(fast), rows // config.split_min_rows))
    for r in fast[:k]:
        planned[id(r.stats)] = planned.get(id(r.stats), 0) + 1
    return fast[:k]


def is_avoided(replica: Replica, others: Sequence[Replica], config, floor_ms: float = 0.0) -> bool:
    """Whether the straggler rule avoids ``replica`` against the best of ``others`` that have a
    latency view (a replica never measured is no evidence); ``floor_ms``: a higher floor than
    ``straggler_floor_ms`` for a coarser judgement (a standby graph's members)."""
    expected = [r.stats.expected_ms() for r in others if r.stats.ewma_latency_ms]
    return bool(expected) and replica.stats.expected_ms() > max(floor_ms, straggler_bound_ms(config, min(expected)))


def split_counts(counts: Sequence[int], parts: int) -> list[tuple[list[int], int, int]]:
    """Split rows grouped by expert (``counts[i]`` rows of the group's i-th expert) into ``parts``
    contiguous runs of even size (the first ``rows % parts`` one row longer).

    Returns:
        ``(counts of the part, start row, end row)`` per part, rows relative to the group.
    """
    total = sum(counts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + total // parts + (1 if i < total % parts else 0)
        bounds.append((start, end))
        start = end
    out = []
    for a, b in bounds:
        part, lo = [], 0
        for c in counts:  # the overlap of [a, b) with this expert's rows [lo, lo + c)
            part.append(max(0, min(b, lo + c) - max(a, lo)))
            lo += c
        out.append((part, a, b))
    return out


def probe_due(replica: Replica, chosen: Sequence[Replica], interval_s: float, unmeasured: bool,
              now_s: float | None = None) -> bool:
    """Whether ``replica`` (not chosen this layer) should get a probe now: it got no call or probe
    for ``interval_s``, has nothing in flight, and has a latency view unless ``unmeasured`` (a
    replica outside the live compiled graph; one without a view is otherwise chosen first anyway)."""
    if any(replica is r for r in chosen) or replica.inflight or not (unmeasured or replica.stats.ewma_latency_ms):
        return False
    now_s = time.monotonic() if now_s is None else now_s
    return now_s - replica.stats.last_call_s >= interval_s
