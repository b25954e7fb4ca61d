"""Draft-model drafter: a small dense model proposes k tokens autoregressively.

Its KV cache is a cache in the strict sense: per sequence it remembers which tokens it holds, and
each proposal first syncs to the sequence's current tokens (longest common prefix kept, the rest
fed again). Rejected drafts are rolled back by that sync, and a sequence it has never seen (new
replica, restart, eviction) is simply re-prefilled, so any drafter instance can serve any sequence.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.drafters.base import DraftProposal, DraftRequest
from engine.kv_cache import KVCache
from engine.loader import LoadedModel
from engine.model import ForwardBatch
from engine.sampling import compute_probs, draw_uniforms, greedy_argmax, race_scores
from kernels.rejection import inverse_cdf_sample


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CachedDrafter:
    """What model drafters share: an LRU of per-sequence KV slots and the draft sampling rule.

    Args:
        kv: the drafter's own KV cache (one slot per kept sequence).
    """

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._cached: dict[str, list[int]] = {}
        self.num_cache_misses = 0

    def release(self, seq_id: str) -> None:
        """Forget a sequence (finished or cancelled) and free its slot."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.kv.free(slot)
        self._cached.pop(seq_id, None)

    def _slot_for(self, seq_id: str, pinned: set[str]) -> int:
        if seq_id in self._slots:
            self._slots.move_to_end(seq_id)
            return self._slots[seq_id]
        self.num_cache_misses += 1
        if self.kv.num_free == 0:
            victim = next(s for s in self._slots if s not in pinned)
            self.release(victim)
        slot = self.kv.allocate()
        self._slots[seq_id] = slot
        self._cached[seq_id] = []
        return slot

    def _step_batch(self, active: list[int], slots: list[int], feeds: list[list[int]], starts: list[int],
                    device) -> ForwardBatch:
        """The next draft forward's batch over the ``active`` requests (KV room reserved)."""
        for b in active:
            self.kv.reserve(slots[b], starts[b] + len(feeds[b]))
        return ForwardBatch.build([slots[b] for b in active], [feeds[b] for b in active],
                                  [starts[b] for b in active], device=device)

    def _append_drafts(self, requests: list[DraftRequest], logits: torch.Tensor, active: list[int],
                       tokens: list[list[int]], probs: list[list[torch.Tensor]], starts: list[int],
                       feeds: list[list[int]]) -> None:
        """One drafted token for each ``active`` request from ``logits`` ``(len(active), vocab)``,
        recorded with its ``q`` (sampling only) and fed at the next draft step.

        Greedy rows: the argmax. Sampled rows: ``q`` from the same temperature/top-k/top-p rule the
        target uses (one :func:`compute_probs` call for all of them: the rule is row-wise); a race
        row (``race_seed``) takes the race of ``q`` at its position, any other is drawn with one
        uniform from its own request's generator and keeps ``q``. Either way a request's drafts do
        not depend on its batch.
        """
        ids = greedy_argmax(logits).tolist()
        rows = [row for row, b in enumerate(active) if requests[b].samples]
        if rows:
            rs = [requests[active[row]] for row in rows]
            q = compute_probs(logits[rows], torch.tensor([r.temperature for r in rs]),
                              torch.tensor([r.top_k for r in rs]),
                              torch.tensor([r.top_p for r in rs], dtype=torch.float32))
            drawn = [i for i, r in enumerate(rs) if r.race_seed is None]
            if drawn:
                uniforms = torch.cat([draw_uniforms(rs[i].generator, 1) for i in drawn]).to(q.device)
                for i, token in zip(drawn, inverse_cdf_sample(q[drawn], uniforms).tolist()):
                    ids[rows[i]] = token
                    probs[active[rows[i]]].append(q[i])
            raced = [i for i, r in enumerate(rs) if r.race_seed is not None]
            if raced:  # one race over every seeded row: position = tokens so far + drafts so far
                keys = [(rs[i].race_seed, len(rs[i].token_ids) + len(tokens[active[rows[i]]])) for i in raced]
                for i, token in zip(raced, greedy_argmax(race_scores(q[raced], keys)).tolist()):
                    ids[rows[i]] = token
        for row, b in enumerate(active):
            tokens[b].append(ids[row])
            starts[b] += len(feeds[b])
            feeds[b] = [ids[row]]


class DraftModelDrafter(CachedDrafter):
    """Proposes tokens with a draft model sharing the target's tokenizer.

    Args:
        draft: the loaded draft model.
        max_seqs: sequences whose KV the drafter keeps; the least recently used is evicted.
        max_len: context window of the draft cache.
    """

    def __init__(self, draft: LoadedModel, max_seqs: int, max_len: int | None = None) -> None:
        super().__init__(draft.model.new_kv_cache(max_seqs, max_len))
        self.draft = draft

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Draft ``request.k`` tokens for each request (batched, k forwards at most)."""
        if not requests:
            return []
        pinned = {r.seq_id for r in requests}
        slots, feeds, starts = [], [], []
        for r in requests:
            slot = self._slot_for(r.seq_id, pinned)
            # Keep the common prefix, but always re-feed at least the newest token for its logits.
            keep = min(_common_prefix(self._cached[r.seq_id], r.token_ids), len(r.token_ids) - 1)
            self.kv.truncate(slot, min(keep, self.kv.lengths[slot]))
            slots.append(slot)
            feeds.append(r.token_ids[keep:])
            starts.append(keep)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(r.k for r in requests)):
            batch = self._step_batch(active, slots, feeds, starts, self.draft.model.device)
            logits = self.draft.model.forward(batch, self.kv)  # (len(active), vocab)
            self._append_drafts(requests, logits, active, tokens, probs, starts, feeds)
            active = [b for b in active if requests[b].k > step + 1]
            if not active:
                break
        for b, r in enumerate(requests):
            # The cache now holds the tokens plus every draft except the last one.
            self._cached[r.seq_id] = r.token_ids + tokens[b][:-1]
            self.kv.truncate(slots[b], len(self._cached[r.seq_id]))
        return [DraftProposal(tokens[b], torch.stack(probs[b]) if probs[b] else None) for b in range(len(requests))]
