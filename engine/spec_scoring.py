"""Per-sequence terms of the speculation controller's candidate scoring
(:meth:`engine.spec_controller.SpeculationController.plan`): the catch-up tokens a step is charged
(:func:`amortised_catchup`), the chance a draft position was drafted ahead
(:func:`ready_probability`), and how candidates meet TPOT budgets (:func:`tpot_fit`)."""

from __future__ import annotations

import numpy as np


def amortised_catchup(cum: np.ndarray, caps: np.ndarray, ids: list[str], catchup: dict[str, int],
                      remaining: dict[str, int], positions: np.ndarray) -> np.ndarray:
    """``(B,)`` catch-up tokens charged to this step: one step's worth in full, the backlog
    spread over the steps it will pay off in. ``cum``: ``(B, max_k)`` cumulative acceptance
    products; ``caps``: ``(B,)`` draft caps; ``positions``: draft positions ``0..max_k - 1``."""
    c = np.array([catchup.get(sid, 0) for sid in ids], dtype=np.float64)
    if not c.any():
        return c
    per_step = 1.0 + (cum * (positions < np.maximum(caps, 1)[:, None])).sum(1)
    left = np.array([remaining.get(sid, -1) for sid in ids], dtype=np.float64)
    share = np.where(left < 0, 1.0, np.minimum(1.0, per_step / np.maximum(left, 1)))
    return np.minimum(c, per_step) + np.maximum(0.0, c - per_step) * share


def ready_probability(ready_lengths: dict[str, int], ids: list[str], acceptance: np.ndarray,
                      max_k: int) -> np.ndarray:
    """``(B, max_k)``: the chance that a sequence's draft position is already drafted ahead
    (pipelined drafting): its first ``L`` positions if it accepted all ``L`` tokens of its last
    window, with the probability that the drafter's bonus guess matched (its acceptance at
    position ``L + 1``; ``acceptance``: ``(B, max_k)``; ``ready_lengths``: per sequence, ``L``)."""
    ready = np.zeros((len(ids), max_k))
    for row, sid in enumerate(ids):
        length = ready_lengths.get(sid, 0)
        if length:
            ready[row, :length] = acceptance[row, min(length, max_k - 1)]
    return ready


def tpot_fit(ids: list[str], gains: np.ndarray, lengths: np.ndarray, step_s: np.ndarray,
             tpot: dict[str, tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """How each candidate (``lengths``: ``(C, B)`` draft lengths, ``step_s``: ``(C,)`` predicted
    seconds) meets the TPOT budgets (``tpot``: per sequence, (budget s, slack s)).

    Returns:
        ``keeps``: bool ``(C,)``, every budgeted sequence within its budget after the step
        (``step <= budget x E[its tokens] + slack``); ``worst_s``: ``(C,)``, the largest predicted
        seconds per emitted token (``step / E``) among them. Where no candidate keeps every budget,
        the one with the least ``worst_s`` gives the worst-off sequence the most tokens a second,
        so the lowest TPOT it can still reach (ranking by the step's miss in seconds, ``step -
        budget x E - slack``, put short steps first: off over drafts that emit more per second).
    """
    rows = [i for i, sid in enumerate(ids) if sid in tpot]
    if not rows:
        return np.ones(len(step_s), dtype=bool), np.zeros(len(step_s))
    budget_s, slack_s = (np.array([tpot[ids[i]][j] for i in rows]) for j in (0, 1))
    cum = np.concatenate((np.zeros((len(rows), 1)), np.cumsum(gains[rows], axis=1)), axis=1)  # (R, max_k + 1)
    tokens = 1.0 + np.take_along_axis(cum.T, lengths[:, rows], axis=0)  # (C, R) E[emitted] per candidate
    keeps = (step_s[:, None] <= budget_s * tokens + slack_s).all(1)
    return keeps, (step_s[:, None] / tokens).max(1)
