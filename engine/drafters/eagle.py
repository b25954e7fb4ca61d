"""EAGLE-3 drafter: an :class:`engine.model.eagle3.Eagle3Head` proposes k tokens from the target's
own hidden states (Li et al. 2025, EAGLE-3; the head's draft loop is Algorithm 1 of EAGLE, Li et al.
2024, restricted to one chain instead of a tree).

Head row ``p`` pairs token ``x_{p+1}`` with the target feature of position ``p`` and predicts
``x_{p+2}``. A sequence of ``N`` tokens has target features for positions ``0 .. N-2`` (the newest
token has not been through the target yet), so its "true" rows are ``0 .. N-2`` and row ``N-2``
yields the first draft. Each later draft step appends one row pairing the previous draft token with
the head's own output of the row before. Only true rows stay in the head's KV cache: draft rows
are dropped after each proposal (their feature was the head's guess, not the target's). Like the
draft model's cache it is a cache in the strict sense (LRU, synced to the sequence's tokens, and
re-derived from the features on a miss), so rejected drafts need no rollback.
"""

from __future__ import annotations

import torch

from engine.drafters.base import DraftProposal, DraftRequest
from engine.drafters.draft_model import CachedDrafter, _common_prefix
from engine.model.eagle3 import Eagle3Head


class EagleDrafter(CachedDrafter):
    """Proposes tokens with an EAGLE-3 head; a :class:`engine.drafters.base.Drafter`.

    Args:
        head: the loaded head.
        max_seqs: sequences whose head KV the drafter keeps (LRU).
        max_len: context window of the head cache.
    """

    def __init__(self, head: Eagle3Head, max_seqs: int, max_len: int | None = None) -> None:
        super().__init__(head.new_kv_cache(max_seqs, max_len))
        self.head = head
        self._rows: dict[str, int] = {}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.layer_ids

    def release(self, seq_id: str) -> None:
        super().release(seq_id)
        self._rows.pop(seq_id, None)

    def rows_kept(self, seq_id: str, token_ids: list[int]) -> int:
        """How many of the sequence's true rows the cache holds and will reuse (0 for an unknown
        sequence), i.e. the first feature position a proposal for ``token_ids`` needs."""
        if seq_id not in self._rows:
            return 0
        # Row p holds x_{p+1}; the newest true row is always recomputed for its logits.
        return max(0, min(self._rows[seq_id], _common_prefix(self._cached[seq_id], token_ids) - 1,
                          len(token_ids) - 2))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Draft ``request.k`` tokens per request (batched; k head forwards at most).

        Raises:
            ValueError: a request without the features of the rows the cache lacks.
        """
        if not requests:
            return []
        pinned = {r.seq_id for r in requests}
        slots, feeds, starts, feats = [], [], [], []
        for r in requests:
            keep = self.rows_kept(r.seq_id, r.token_ids)
            slot = self._slot_for(r.seq_id, pinned)
            end = len(r.token_ids) - 1
            if r.features is None or keep < r.features_start or r.features_start + r.features.shape[0] < end:
                raise ValueError(f"{r.seq_id}: EAGLE-3 needs target features of positions {keep}..{end - 1}")
            self.kv.truncate(slot, min(keep, self.kv.lengths[slot]))
            slots.append(slot)
            feeds.append(r.token_ids[keep + 1:end + 1])
            starts.append(keep)
            feats.append(r.features[keep - r.features_start:end - r.features_start])
        features = torch.cat(feats).to(self.head.device)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(r.k for r in requests)):
            batch = self._step_batch(active, slots, feeds, starts, self.head.device)
            logits, out = self.head.forward(batch, self.kv, features)  # (len(active), vocab), (.., hidden)
            self._append_drafts(requests, logits, active, tokens, probs, starts, feeds)
            keep_rows = [row for row, b in enumerate(active) if requests[b].k > step + 1]
            active = [active[row] for row in keep_rows]
            if not active:
                break
            features = out[keep_rows]
        for b, r in enumerate(requests):
            end = len(r.token_ids) - 1
            self.kv.truncate(slots[b], end)  # true rows only
            self._rows[r.seq_id], self._cached[r.seq_id] = end, list(r.token_ids)
        return [DraftProposal(tokens[b], torch.stack(probs[b]) if probs[b] else None) for b in range(len(requests))]


class FeatureHistory:
    """The engine's copy of each sequence's target features (positions ``0 .. N-2``), so a drafter
    that missed steps (k = 0, a new draft replica) can catch up.

    Args:
        width: feature width (``3 * target_hidden`` for EAGLE-3).
        dtype, device: storage dtype and device (the target's).
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self._buf: dict[str, torch.Tensor] = {}
        self._len: dict[str, int] = {}

    def append(self, seq_id: str, rows: torch.Tensor) -> None:
        """Add ``rows`` ``(n, width)`` after the sequence's last kept position (buffer doubles)."""
        n, buf = self._len.get(seq_id, 0), self._buf.get(seq_id)
        if buf is None or n + rows.shape[0] > buf.shape[0]:
            grown = torch.empty(max(2 * n + rows.shape[0], 64), self.width, dtype=self.dtype, device=self.device)
            if buf is not None:
                grown[:n] = buf[:n]
            self._buf[seq_id] = buf = grown
        buf[n:n + rows.shape[0]] = rows
        self._len[seq_id] = n + rows.shape[0]

    def get(self, seq_id: str) -> torch.Tensor:
        """``(num_positions, width)`` view of every kept feature of the sequence."""
        n = self._len.get(seq_id, 0)
        return self._buf[seq_id][:n] if n else torch.empty(0, self.width, dtype=self.dtype, device=self.device)

    def release(self, seq_id: str) -> None:
        self._buf.pop(seq_id, None)
        self._len.pop(seq_id, None)
