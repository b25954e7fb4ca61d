"""Latency-budget arithmetic the scheduler's chunk sizing and admission use: TPOT slack, a
step's allowance under a TPOT or ITL budget, the prefill tokens a step budget leaves, and the wait
for queued prefill work. Pure functions of times and token counts (:class:`engine.slo.SLOPolicy`
feeds them the engine's state and its cost model's predictions)."""

from __future__ import annotations

import math
from collections.abc import Callable

SLACK_SHARE = 0.5  # share of a decode's accumulated TPOT slack that one step may spend


def sequence_slack_s(seq, tpot_budget_s: float, now_s: float) -> float | None:
    """Seconds a decoding sequence is ahead of its TPOT deadline: budget x output tokens after
    the first - seconds since its first token (negative: behind; None: no first token yet).
    Its request meets the TPOT budget iff the slack is >= 0 when it finishes."""
    first_s = seq.request.metrics.first_token_time_s
    if first_s is None:
        return None
    return tpot_budget_s * max(seq.num_output_tokens - 1, 0) - (now_s - first_s)


def projected_slack_s(seq, tpot_budget_s: float, now_s: float, steps_left: int, decode_step_s: float) -> float | None:
    """Seconds a decoding sequence can still lose and meet its TPOT budget: the budget for all of
    its output after the first token (budget x (max_tokens - 1)), less the time since its first
    token and its ``steps_left`` remaining steps at ``decode_step_s`` each (None: no first token).
    Negative: it is behind, even if no step runs longer than a decode-only one."""
    first_s = seq.request.metrics.first_token_time_s
    if first_s is None:
        return None
    whole_s = tpot_budget_s * max(seq.params.max_tokens - 1, 0)
    return whole_s - (now_s - first_s) - steps_left * decode_step_s


def step_allowance_ms(tpot_ms: float, expected_tokens: float, decode_step_ms: float,
                      slack_ms: float | None) -> float:
    """Step time a decode allows, ms: the decode-only step (``decode_step_ms``) plus
    ``SLACK_SHARE`` of its projected slack, at least its TPOT budget for each token it is expected
    to emit in the step (also when it has no slack, or no first token: ``slack_ms`` None).

    Spending only a share keeps a reserve for the steps after (each later step may spend a share
    of what is left, and an EOS before ``max_tokens`` leaves fewer tokens to average over), and a
    decode behind its budget still allows its per-token budget: holding steps under that would
    stall every prefill without letting it catch up."""
    floor_ms = tpot_ms * expected_tokens
    if slack_ms is None or slack_ms <= 0:
        return floor_ms
    return max(floor_ms, decode_step_ms + SLACK_SHARE * slack_ms)


def itl_cap_ms(itl_ms: float, overrun: float, decode_step_ms: float) -> float:
    """The step time an ITL budget allows a chunk to fill, ms: ``itl_ms / overrun`` (``overrun``:
    the chunked steps' measured / predicted 90th percentile), so nine chunked steps in ten keep
    it; sized for the predicted (mean) step, half of them overran it, and a long prompt's few
    chunks set the short requests' p99 ITL. Where that falls below the predicted decode-only step
    (``decode_step_ms``) but the budget itself does not, the budget itself: the margin cannot be
    kept, and dropping the cap as unattainable let whole prompts through (over HTTP, where steps
    are slower and noisier: short streams' p99 gap 87-105 ms beside 900-token prompts, against
    56-68 ms with the plain cap)."""
    margined = itl_ms / overrun
    return margined if margined > decode_step_ms else itl_ms


def wait_estimate_s(tokens_ahead: int, phases: list[tuple[float, int, int]],
                    predict_step_s: Callable[[int], float]) -> float:
    """Seconds until ``tokens_ahead`` prefill tokens (this prompt's included) are through.

    Args:
        tokens_ahead: prompt tokens to prefill, this prompt's last.
        phases: (steps, decode target tokens, prefill tokens a step) in order, the last one with
            ``math.inf`` steps (:meth:`SLOPolicy.prefill_phases`).
        predict_step_s: step seconds for a number of target tokens.

    Returns:
        The predicted seconds of the full steps and the step with the remainder (inf when the
        last phase prefills nothing).
    """
    wait_s = 0.0
    for steps, decode_tokens, per_step in phases:
        if per_step <= 0:
            if math.isinf(steps):
                return math.inf
            wait_s += steps * predict_step_s(decode_tokens)
            continue
        full = min(steps, tokens_ahead // per_step)
        wait_s += full * predict_step_s(decode_tokens + per_step)
        tokens_ahead -= full * per_step
        if tokens_ahead <= 0:
            return wait_s
        if full < steps:  # the remainder goes in this phase's next step
            return wait_s + predict_step_s(decode_tokens + tokens_ahead)
    return math.inf


def prefill_token_limit(step_budgets_ms: list[float], decode_tokens: int, max_tokens: int,
                        predict_step_s: Callable[[int], float]) -> int | None:
    """Prefill tokens a step may add and still end within the tightest running decode's budget.

    Args:
        step_budgets_ms: per running decode, the step time its TPOT budget allows, ms (TPOT budget
            x the tokens it is expected to emit this step; empty: no limit).
        decode_tokens: target tokens of the step's decodes (with their drafts).
        max_tokens: the step's token budget; the answer is at most ``max_tokens - decode_tokens``.
        predict_step_s: step seconds for a number of target tokens (non-decreasing; learned online).

    Returns:
        The largest token count ``c`` with ``predict_step_s(decode_tokens + c)`` within budget (by
        bisection), or None when nothing limits it (no budgets, or no step cost learned yet).
    """
    if not step_budgets_ms or predict_step_s(max_tokens) <= 0:
        return None
    budget_s = min(step_budgets_ms) / 1e3
    lo, hi = 0, max(0, max_tokens - decode_tokens)
    if predict_step_s(decode_tokens + hi) <= budget_s:
        return hi
    while lo < hi:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi + 1) // 2
        if predict_step_s(decode_tokens + mid) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
