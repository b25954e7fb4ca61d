"""Per-position acceptance estimates for the speculation controller (:mod:`engine.spec_controller`).

Per sequence and draft position, exponentially decayed (accepted, tried) counts, shrunk toward a
server-wide estimate; the server-wide estimate is itself shrunk toward the position before it, so
deep positions inherit shallow ones until they are observed. Position 0 starts at a prior.
The expected tokens of verifying ``k`` drafts follow Leviathan et al. 2023, eq. 1, generalised to
per-position acceptance.
"""

from __future__ import annotations

import numpy as np


def expected_tokens(acceptance: np.ndarray, k: int) -> float:
    """``1 + sum_{i<=k} prod_{j<=i} a_j`` for per-position acceptance ``a`` ``(max_k,)``; 1.0 for k = 0."""
    return 1.0 + float(np.cumprod(acceptance[:k]).sum()) if k > 0 else 1.0


class _Counts:
    """Decayed (accepted, tried) counts per draft position, ``(max_k,)`` float64 each."""

    def __init__(self, max_k: int, decay: float) -> None:
        self.accepted = np.zeros(max_k)
        self.tried = np.zeros(max_k)
        self.decay = decay

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        seen = min(num_drafted, num_accepted + 1)  # positions past the first rejection are unseen
        self.accepted[:seen] *= self.decay
        self.tried[:seen] *= self.decay
        self.tried[:seen] += 1.0
        self.accepted[:num_accepted] += 1.0


class AcceptanceEstimates:
    """Server-wide and per-sequence acceptance per draft position.

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
        self.sequence_decay = sequence_decay
        self._global = _Counts(max_k, global_decay)
        self._seqs: dict[str, _Counts] = {}

    def server_wide(self) -> np.ndarray:
        """``(max_k,)`` in [0, 1]: each position's counts shrunk toward the position before it."""
        g, w = self._global, self.prior_weight
        glob = np.empty(self.max_k)
        prev = self.prior
        for j in range(self.max_k):
            prev = glob[j] = (g.accepted[j] + w * prev) / (g.tried[j] + w)
        return glob

    def of_sequence(self, seq_id: str, glob: np.ndarray) -> np.ndarray:
        """``(max_k,)``: a sequence's counts shrunk toward ``glob`` (:meth:`server_wide`), which is
        returned as it is for a sequence never observed."""
        seq, w = self._seqs.get(seq_id), self.prior_weight
        return glob if seq is None else (seq.accepted + w * glob) / (seq.tried + w)

    def observe(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verification of ``num_drafted`` (1..max_k) tokens of ``seq_id``, the first
        ``num_accepted`` (0..num_drafted) accepted."""
        self._global.observe(num_drafted, num_accepted)
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Counts(self.max_k, self.sequence_decay)
        seq.observe(num_drafted, num_accepted)

    def release(self, seq_id: str) -> None:
        """Forget a finished sequence's counts."""
        self._seqs.pop(seq_id, None)
