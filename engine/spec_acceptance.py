"""Per-position acceptance estimates for the speculation controller (:mod:`engine.spec_controller`).

Per sequence and draft position, exponentially decayed (accepted, tried) counts, shrunk toward a
server-wide estimate; the server-wide estimate is itself shrunk toward the position before it, so
deep positions inherit shallow ones until they are observed. Position 0 starts at a prior.
The expected tokens of verifying ``k`` drafts follow Leviathan et al. 2023, eq. 1, generalised to
per-position acceptance.

Counts are Python lists, a pair per sequence, and :meth:`AcceptanceEstimates.observe_many` folds in
a step's verifications: the controller reads and updates them every engine step, right after a
forward has evicted the caches, where numpy's per-call cost on ``(max_k,)`` arrays made the
per-sequence update ~10 us a sequence (2-4 % of a step of the bundled pair); a step's estimates
are read as one ``(B, max_k)`` array (:meth:`AcceptanceEstimates.of_sequences`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def expected_tokens(acceptance: np.ndarray, k: int) -> float:
    """``1 + sum_{i<=k} prod_{j<=i} a_j`` for per-position acceptance ``a`` ``(max_k,)``; 1.0 for k = 0."""
    return 1.0 + float(np.cumprod(acceptance[:k]).sum()) if k > 0 else 1.0


class AcceptanceEstimates:
    """Server-wide and per-sequence acceptance per draft position.

    A verification of ``d`` drafts with the first ``a`` accepted sees positions ``< min(d, a + 1)``
    (past the first rejection nothing is known): each seen position's counts decay by the
    kind's factor, then ``tried`` gains 1 there and ``accepted`` gains 1 at positions ``< a``.

    Args:
        max_k: draft positions tracked.
        prior: server-wide acceptance at position 0 before anything is observed.
        prior_weight: pseudo-observations of the shrinkage target in each estimate.
        global_decay, sequence_decay: per-observation decay of the server-wide and of a
            sequence's counts.
    """

    def __init__(self, max_k: int, prior: float, prior_weight: float, global_decay: float,
                 sequence_decay: float) -> None:
        self.max_k, self.prior, self.prior_weight = max_k, prior, prior_weight
        self.global_decay, self.sequence_decay = global_decay, sequence_decay
        self._global = ([0.0] * max_k, [0.0] * max_k)  # (accepted, tried) per position
        self._seqs: dict[str, tuple[list[float], list[float]]] = {}
        self._unseen = ([0.0] * max_k, [0.0] * max_k)
        self._server_wide: np.ndarray | None = None  # cached until the next observation

    def server_wide(self) -> np.ndarray:
        """``(max_k,)`` in [0, 1], read-only: each position's counts shrunk toward the position
        before it. Cached between observations: the latency-budget planning asks for every
        decoding sequence's expected tokens, each step (:mod:`engine.slo`)."""
        if self._server_wide is None:
            w, prev, glob = self.prior_weight, self.prior, []
            for a, t in zip(*self._global):
                prev = (a + w * prev) / (t + w)
                glob.append(prev)
            self._server_wide = np.array(glob)
            self._server_wide.flags.writeable = False
        return self._server_wide

    def of_sequences(self, seq_ids: Sequence[str], glob: np.ndarray) -> np.ndarray:
        """``(len(seq_ids), max_k)``: each sequence's counts shrunk toward ``glob``
        (:meth:`server_wide`); a sequence never observed gets ``glob``."""
        counts = np.array([self._seqs.get(sid, self._unseen) for sid in seq_ids])  # (B, 2, max_k)
        w = self.prior_weight
        return (counts[:, 0] + w * glob) / (counts[:, 1] + w)

    def of_sequence(self, seq_id: str, glob: np.ndarray) -> np.ndarray:
        """``(max_k,)``: :meth:`of_sequences` of one sequence."""
        return self.of_sequences([seq_id], glob)[0]

    def observe_many(self, seq_ids: Sequence[str], num_drafted: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Verifications in order: ``num_drafted[i]`` (1..max_k) tokens of ``seq_ids[i]``, the
        first ``num_accepted[i]`` (0..num_drafted[i]) accepted."""
        self._server_wide = None
        for sid, drafted, accepted in zip(seq_ids, num_drafted, num_accepted):
            counts = self._seqs.get(sid)
            if counts is None:
                counts = self._seqs[sid] = ([0.0] * self.max_k, [0.0] * self.max_k)
            seen = min(drafted, accepted + 1)  # positions past the first rejection are unseen
            for (hits, tries), decay in ((counts, self.sequence_decay), (self._global, self.global_decay)):
                for j in range(seen):
                    hits[j] = hits[j] * decay + (j < accepted)
                    tries[j] = tries[j] * decay + 1.0

    def release(self, seq_id: str) -> None:
        """Forget a finished sequence's counts."""
        self._seqs.pop(seq_id, None)
