"""N-gram prompt-lookup drafter: propose the tokens that followed the last match of the suffix.

Prompt Lookup Decoding (Saxena 2023) and vLLM's n-gram proposer: outputs often copy spans of the
prompt or of earlier output (code edits, quoting, extraction). The drafter looks for the most
recent earlier occurrence of the sequence's trailing n-gram, longest ``n`` first, and proposes the
tokens that followed it. It needs no model and is deterministic, so its draft distribution ``q`` is
one-hot at each proposed token (the rejection sampler then accepts token ``x`` with prob ``p(x)``).
"""

from __future__ import annotations

import numpy as np

from engine.drafters.base import DraftProposal, DraftRequest


class NgramDrafter:
    """Prompt-lookup drafter; also a :class:`engine.drafters.base.Drafter`.

    Args:
        min_n: shortest suffix n-gram that may match, >= 1.
        max_n: longest suffix n-gram tried first, >= min_n.

    Raises:
        ValueError: if ``1 <= min_n <= max_n`` does not hold.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request with ``probs=None`` (q is one-hot at each proposed token)."""
        return [DraftProposal(self.lookup(r.token_ids, r.k)) for r in requests]

    def release(self, seq_id: str) -> None:
        """Stateless: nothing to forget."""
        return None

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the most recent earlier match of the longest suffix n-gram.

        For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens also occur ending at
        some earlier position ``e`` (``e < len - 1``, so the suffix itself does not count), take the
        largest such ``e`` and return ``token_ids[e + 1 : e + 1 + k]`` (which may run into the
        suffix itself, and is shorter than ``k`` when the match is near the end). No match: ``[]``.

        Args:
            token_ids: prompt + output so far.
            k: tokens wanted, >= 0.
        """
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # match_len[e] = how many trailing tokens agree when the suffix is aligned to end at e,
        # capped at max_n; computed for every candidate end e in [0, length - 2] at once.
        ends = np.arange(length - 1)
        still_matching = np.ones(length - 1, dtype=bool)
        match_len = np.zeros(length - 1, dtype=np.int64)
        for j in range(min(self.max_n, length - 1)):
            ok = ends >= j
            ok[ok] = tokens[ends[ok] - j] == tokens[length - 1 - j]
            still_matching &= ok
            if not still_matching.any():
                break
            match_len += still_matching
        n = int(match_len.max())
        if n < self.min_n:
            return []
        end = int(np.flatnonzero(match_len >= n)[-1])
        return tokens[end + 1 : end + 1 + k].tolist()
