"""Metadata of one ragged forward pass: several sequences, each with its own new tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Flattened tokens of ``num_seqs`` sequences, each appending ``query_lens[b]`` tokens.

    Attributes:
        input_ids: ``(num_tokens,)`` int64, sequences concatenated in batch order.
        positions: ``(num_tokens,)`` int64 absolute positions (RoPE and cache index).
        slots: ``(num_seqs,)`` int64 KV cache slot of each sequence.
        query_lens: tokens appended per sequence (prefill: the prompt; decode: 1; verify: k + 1).
        seq_lens: cached length of each sequence after this pass.
        token_seq: ``(num_tokens,)`` int64 batch index of each token.
        token_qidx: ``(num_tokens,)`` int64 index of each token within its sequence's new tokens.
        logits_indices: ``(num_logits,)`` int64 rows of the flattened tokens that need logits.
        slot_range: ``(first, last + 1)`` when the slots are consecutive and ascending (the KV cache
            rows are then a view, not a gather), else None; known on the host, so no device sync.
        logit_counts: logit rows per sequence (host), in batch order.
        slot_ids: the KV cache slot of each sequence (host), in batch order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    token_seq: torch.Tensor
    token_qidx: torch.Tensor
    logits_indices: torch.Tensor
    slot_range: tuple[int, int] | None = None
    logit_counts: list[int] | None = None
    slot_ids: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def split(self, parts: int) -> list[ForwardBatch]:
        """Contiguous micro-batches of whole sequences with about equal token counts (two-batch
        overlap); at most ``num_seqs`` of them. Fields are views or small device ops on this
        batch's tensors; every boundary is known on the host, so no device sync.

        Concatenating the micro-batches' logit rows (and token rows) in order gives this batch's.
        """
        parts = max(1, min(parts, self.num_seqs))
        if parts == 1:  # the common case: the batch itself, no views to build
            return [self]
        cum = list(itertools.accumulate(self.query_lens))
        bounds = [0]
        for k in range(1, parts):  # each cut where the tokens before it are nearest k / parts of all
            cuts = range(bounds[-1] + 1, self.num_seqs - (parts - k) + 1)  # a sequence left per part
            bounds.append(min(cuts, key=lambda j: abs(cum[j - 1] - cum[-1] * k / parts)))
        return self.split_at(bounds[1:])

    def split_at(self, cuts: list[int]) -> list[ForwardBatch]:
        """Contiguous sub-batches ending before each sequence index in ``cuts`` (ascending, in
        ``(0, num_seqs)``) and at the end; views or small device ops, no device sync."""
        bounds = [0, *cuts, self.num_seqs]
        counts = self.logit_counts or [1] * self.num_seqs
        out, tok0, logit0 = [], 0, 0
        for a, b in zip(bounds, bounds[1:]):
            ntok, nlog = sum(self.query_lens[a:b]), sum(counts[a:b])
            slots, ids = self.slots[a:b], self.slot_ids[a:b] if self.slot_ids is not None else None
            if self.slot_range is not None:
                rng = (self.slot_range[0] + a, self.slot_range[0] + b)
            else:  # a part may be consecutive where the whole batch is not
                rng = consecutive_range(ids) if ids is not None else None
            out.append(ForwardBatch(self.input_ids[tok0:tok0 + ntok], self.positions[tok0:tok0 + ntok], slots,
                                    self.query_lens[a:b], self.seq_lens[a:b], self.token_seq[tok0:tok0 + ntok] - a,
                                    self.token_qidx[tok0:tok0 + ntok],
                                    self.logits_indices[logit0:logit0 + nlog] - tok0, rng, counts[a:b], ids))
            tok0, logit0 = tok0 + ntok, logit0 + nlog
        return out

    @classmethod
    def build(
        cls,
        slots: list[int],
        new_tokens: list[list[int]],
        start_positions: list[int],
        logits: str | list[int] = "last",
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build the metadata.

        Args:
            slots: KV slot per sequence.
            new_tokens: tokens to append per sequence (each non-empty).
            start_positions: cached length of each sequence before this pass.
            logits: "last" (one row per sequence), "all" (every new token), or a count per sequence:
                its last ``logits[b]`` new tokens (prefill: 1; verification: k + 1).

        Raises:
            ValueError: empty token list or mismatched lengths.
        """
        if not (len(slots) == len(new_tokens) == len(start_positions)) or not slots:
            raise ValueError("slots, new_tokens and start_positions must be non-empty and equally long")
        if any(len(t) == 0 for t in new_tokens):
            raise ValueError("every sequence in a forward batch needs at least one new token")
        query_lens = [len(t) for t in new_tokens]
        if logits == "last":
            logits = [1] * len(query_lens)
        elif logits == "all":
            logits = query_lens
        elif isinstance(logits, str) or len(logits) != len(query_lens):
            raise ValueError(f"logits must be 'last', 'all' or one count per sequence, got {logits!r}")
        if not all(1 <= n <= q for n, q in zip(logits, query_lens)):
            raise ValueError(f"logit counts {logits} must be in [1, query length] per sequence")
        flat = [tok for toks in new_tokens for tok in toks]
        positions = [s + i for s, n in zip(start_positions, query_lens) for i in range(n)]
        token_seq = [b for b, n in enumerate(query_lens) for _ in range(n)]
        token_qidx = [i for n in query_lens for i in range(n)]
        logits_indices = [i for end, n in zip(itertools.accumulate(query_lens), logits) for i in range(end - n, end)]
        # One host tensor and one copy to the device for all the metadata; the fields are views.
        parts = (flat, positions, slots, token_seq, token_qidx, logits_indices)
        host = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
        # split_with_sizes, not Tensor.split: the latter's Python wrapper costs more than the split.
        fields = host.to(device).split_with_sizes([len(part) for part in parts])
        return cls(*fields[:3], query_lens, [s + n for s, n in zip(start_positions, query_lens)], *fields[3:],
                   slot_range=consecutive_range(slots), logit_counts=logits, slot_ids=list(slots))


def consecutive_range(slots: list[int]) -> tuple[int, int] | None:
    """``(first, last + 1)`` when ``slots`` are consecutive and ascending, else None."""
    return (slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) else None
