"""Which waiting prompts get a free sequence slot first under ``scheduling_policy: slo``.

Earliest TTFT deadline first is the right order while every deadline can be met. When the running
set is full (``max_num_seqs``), a prompt's wait is for a *slot*, and a slot is held until the
sequence finishes: a chat answer of ~130 tokens holds one ~10x longer than a 13-token code
completion. Under a burst, deadline order then fills the slots with the long holders that are due
first, and the short requests behind them wait past their deadlines; once prompts are late it
serves them first, which makes the ones behind them late too (EDF's domino effect under overload;
measured on the production mix, docs/SCHEDULING.md). So prompts already past their deadline go
after the others, and among the rest Moore's rule for the fewest late jobs on one machine
(J. M. Moore, "An n job, one machine sequencing algorithm for minimizing the number of late jobs",
Management Science 15(1), 1968, in Hodgson's form) picks whom else to defer: go through the jobs
in deadline order and, whenever the last one would be late, drop the longest job kept so far.
Here the machine is the pool of slots (a job starts when the earliest slot frees) and "dropped"
means admitted after every kept prompt of its priority; with parallel slots this is a heuristic,
not an optimum. Lower ``priority`` values stay ahead: a deferred prompt never goes behind one of
a higher value, and the job Moore's rule drops is one of the lowest priority kept, the longest
holder among them. A prompt deferred long enough takes its deadline place again.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotJob:
    """A waiting prompt as the admission simulation sees it.

    Attributes:
        deadline_s: its TTFT deadline (monotonic s; ``math.inf`` without a TTFT budget).
        priority: its ``priority`` (lower runs earlier).
        first_token_s: seconds from taking a slot to its first token (its prefill step).
        hold_s: seconds it holds the slot: ``first_token_s`` plus its decode steps.
        defer_until_s: after this time (monotonic s) it is never deferred again: it takes its
            place in deadline order, so a stream of arrivals that can still be served in time
            cannot starve it (:func:`defer_until_s`).
    """

    deadline_s: float
    priority: int
    first_token_s: float
    hold_s: float
    defer_until_s: float = math.inf


LATE_DEFERRAL = 4.0  # a late prompt may be deferred until this many TTFT budgets past its deadline


def defer_until_s(arrival_s: float, ttft_s: float) -> float:
    """When a prompt that arrived at ``arrival_s`` with a TTFT budget of ``ttft_s`` seconds stops
    being deferrable: ``LATE_DEFERRAL`` budgets after its deadline (never without a budget: it is
    last in deadline order anyway)."""
    return arrival_s + ttft_s * (1.0 + LATE_DEFERRAL)


def deferred_jobs(jobs: list[SlotJob], slot_free_s: list[float], now_s: float) -> list[int]:
    """Indices of the ``jobs`` to admit only after all the others of their priority.

    Jobs already past their deadline at ``now_s`` have missed it whatever the order: serving them
    first (as deadline order does) only makes the jobs behind them miss too, the domino effect of
    earliest-deadline-first under overload, so they are deferred. Among the others, Moore's rule
    defers the longest holder whenever a job would be late. A job past its ``defer_until_s`` is
    never deferred.

    Args:
        jobs: the waiting prompts, in (priority, TTFT deadline, arrival) order.
        slot_free_s: when each sequence slot is free (monotonic s; ``now_s`` for a free one), one
            entry per slot.
        now_s: the current time (monotonic s).

    Returns:
        Ascending indices; empty when every job meets its deadline in the given order (or there
        is no slot at all).
    """
    if not jobs or not slot_free_s:
        return []
    kept: list[int] = []
    dropped: list[int] = []
    slots = sorted(slot_free_s)  # a sorted list is a valid heap
    for i, job in enumerate(jobs):
        deferrable = now_s < job.defer_until_s
        if job.deadline_s < now_s and deferrable:
            dropped.append(i)
            continue
        kept.append(i)
        if _start(job, slots) <= job.deadline_s or job.deadline_s < now_s:
            continue
        candidates = [j for j in kept if now_s < jobs[j].defer_until_s]
        if not candidates:
            continue
        worst = max(candidates, key=lambda j: (jobs[j].priority, jobs[j].hold_s))
        kept.remove(worst)
        dropped.append(worst)
        slots = _replay(jobs, kept, slot_free_s)
    return sorted(dropped)


def _start(job: SlotJob, slots: list[float]) -> float:
    """Give ``job`` the earliest free slot (``slots`` is a heap of free times, updated in place);
    returns its first token's time."""
    first_s = slots[0] + job.first_token_s
    heapq.heapreplace(slots, first_s - job.first_token_s + job.hold_s)
    return first_s


def _replay(jobs: list[SlotJob], kept: list[int], slot_free_s: list[float]) -> list[float]:
    """The slot heap after admitting ``kept`` in order. A late kept job can remain only when a
    higher-priority job's lateness forced a lower-priority one out: nothing more can be done."""
    slots = sorted(slot_free_s)
    for j in kept:
        _start(jobs[j], slots)
    return slots


def decode_hold_s(max_tokens: int, tokens_per_step: float, step_s: float) -> float:
    """Seconds of decode steps a sequence needs for ``max_tokens`` output tokens after its first,
    at ``tokens_per_step`` (>= 1) emitted a step of ``step_s`` seconds."""
    return math.ceil(max(max_tokens - 1, 0) / max(tokens_per_step, 1.0)) * step_s
