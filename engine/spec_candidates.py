"""The draft allocations the speculation controller scores each step (:mod:`engine.spec_controller`).

A candidate is one draft length ``k`` for the batch, drafted by the ``m`` sequences it pays most
for (each up to its own cap), the others drafting nothing; plus the empty candidate. Scoring
allocations entry by entry (the largest marginal gain first, any length per sequence) gave ragged
lengths that ran 4-11 % slower than one length at batch 4-16 of the bundled pair for about the
same tokens (docs/BENCHMARKS.md, issue 13): unequal query lengths cost what the cost model's
features do not see (padded attention, a draft pass plan per length). One length with per-sequence
inclusion keeps what per-sequence choice is for: a sequence whose drafts are rarely accepted does
not draft (or stretch the step) for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Candidates:
    """``C = 1 + max_k * B`` allocations; row 0 drafts nothing.

    Attributes:
        lengths: ``(C, B)`` int64 draft length of each sequence.
        gain: ``(C,)`` expected accepted draft tokens (the emitted tokens beyond one a sequence).
        drafted: ``(C,)`` draft tokens to produce (a window drafted ahead counts its miss chance).
        passes: ``(C,)`` draft passes (the longest sequence's, ready positions discounted alike).
        caught: ``(C,)`` catch-up tokens charged to the drafting sequences.
        tokens: ``(C,)`` draft tokens the target verifies.
    """

    lengths: np.ndarray
    gain: np.ndarray
    drafted: np.ndarray
    passes: np.ndarray
    caught: np.ndarray
    tokens: np.ndarray


def draft_candidates(gains: np.ndarray, ready: np.ndarray | None, charged: np.ndarray) -> Candidates:
    """Every (length k, first m sequences) allocation.

    Args:
        gains: ``(B, max_k)`` float64 ``prod_{j<=i} a_j`` per sequence and position, zero beyond
            the sequence's cap (so zero from some position on).
        ready: ``(B, max_k)`` chance each position is already drafted ahead (pipelined), or None.
        charged: ``(B,)`` catch-up tokens a sequence costs the drafter if it drafts at all.

    For each ``k`` the sequences go in order of expected gain per unit of draft work
    (``gain / (1 + work)``: a window drafted ahead costs little and goes first).
    """
    num_seqs, max_k = gains.shape
    active = gains > 0
    work = active if ready is None else active * (1.0 - ready)
    # Per sequence, at batch length k + 1 (column k): its length, gain, work, passes, catch-up.
    per_k = np.stack((np.cumsum(active, axis=1), np.cumsum(gains, axis=1), np.cumsum(work, axis=1),
                      np.maximum.accumulate(work * np.arange(1, max_k + 1), axis=1),
                      np.broadcast_to((charged * active[:, 0])[:, None], gains.shape)))  # (5, B, max_k)
    order = np.argsort(-(per_k[1] / (1.0 + per_k[2])).T, axis=1, kind="stable")  # (max_k, B)
    ranked = np.take_along_axis(per_k.transpose(0, 2, 1), order[None], axis=2)  # (5, max_k, m)
    sums = np.cumsum(ranked, axis=2)
    passes = np.maximum.accumulate(ranked[3], axis=1)
    rank = np.argsort(order, axis=1)  # (max_k, B): each sequence's place in its length's order
    lengths = np.where(rank[:, None, :] < np.arange(1, num_seqs + 1)[:, None], per_k[0].T[:, None, :], 0)
    zero = np.zeros(1)
    return Candidates(np.concatenate((np.zeros((1, num_seqs), dtype=np.int64),
                                      lengths.reshape(-1, num_seqs).astype(np.int64))),
                      *(np.concatenate((zero, a.ravel())) for a in (sums[1], sums[2], passes, sums[4], sums[0])))
