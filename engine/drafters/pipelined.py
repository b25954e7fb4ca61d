"""Pipelined drafting: draft window i+1 while the target verifies window i.

After returning window ``i`` (``d_1..d_k``) for a greedy sequence, a background thread keeps
drafting on the assumption that the target accepts all of it: it drafts the draft model's guess
``g`` of the bonus token, then the ``k`` tokens after ``d_1..d_k, g``. The next proposal for that
sequence is that window, ready at once, when the sequence's tokens are exactly the assumed ones
(all ``k`` accepted and the target's bonus token equal to ``g``); otherwise it is discarded and the
window is drafted as usual. This is PEARL's "post-verify" (Liu et al., ICLR 2025, sec. 3.2), with
the draft model in its own process (the serving unit's draft actor) so that drafting overlaps the
target's verify pass.

Lossless by construction: a pipelined window is exactly the greedy window the draft model would
propose for those tokens (same model, same cache contents), and verification does not change.
Only greedy sequences are pipelined: a sampled sequence's draft must draw from its own generator
in order, between the target's verification draws, which drafting ahead cannot do.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from engine.drafters.base import Drafter, DraftProposal, DraftRequest

log = logging.getLogger(__name__)


class PipelinedDrafter:
    """Wraps a drafter whose greedy proposals depend only on the tokens (a draft model) and drafts
    each greedy sequence's next window ahead, on one background thread.

    The inner drafter is never called from two threads at once: every call first waits for the
    window being drafted ahead.

    Args:
        inner: the drafter that proposes (e.g. :class:`DraftModelDrafter`).

    Attributes:
        num_windows_prepared: windows drafted ahead (one per greedy proposal).
        num_windows_used: of those, windows proposed as they were (the step skipped its drafting).
    """

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="draft-ahead")
        self._pending: Future | None = None
        # seq_id -> (the tokens the window assumes, the window)
        self._ahead: dict[str, tuple[list[int], list[int]]] = {}
        self.num_windows_prepared = 0
        self.num_windows_used = 0

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Proposals for ``requests``: a window drafted ahead where it still fits, the inner
        drafter's otherwise; then drafts the next windows ahead (in the background)."""
        if not requests:  # e.g. a call that only releases caches: keep the windows
            return []
        self._wait()
        ahead, self._ahead = self._ahead, {}
        out: list[DraftProposal | None] = [None] * len(requests)
        misses = []
        for i, r in enumerate(requests):
            hit = ahead.get(r.seq_id)
            if hit is not None and not r.samples and r.k <= len(hit[1]) and hit[0] == r.token_ids:
                out[i] = DraftProposal(hit[1][:r.k], None, pipelined=True)
                self.num_windows_used += 1
            else:
                misses.append(i)
        if misses:
            for i, p in zip(misses, self.inner.propose([requests[i] for i in misses])):
                out[i] = p
        self._draft_ahead(requests, out)
        return out

    def _draft_ahead(self, requests: list[DraftRequest], proposals: list[DraftProposal]) -> None:
        # Copies: the request's tokens may be the engine's live list, which grows meanwhile.
        nxt = []
        max_len = getattr(getattr(self.inner, "kv", None), "max_len", None)
        for r, p in zip(requests, proposals):
            # The window ahead caches the sequence, this window and all but the last of its own
            # len + 1 tokens: past the drafter's context it can only fail (it logged every step).
            fits = max_len is None or len(r.token_ids) + 2 * len(p.token_ids) <= max_len
            if not r.samples and p.token_ids and fits:
                nxt.append(DraftRequest(r.seq_id, list(r.token_ids) + p.token_ids, len(p.token_ids) + 1))
                p.drafting_ahead = True
        if not nxt:
            return
        self.num_windows_prepared += len(nxt)
        self._pending = self._executor.submit(self._run_ahead, nxt)

    def _run_ahead(self, nxt: list[DraftRequest]) -> dict[str, tuple[list[int], list[int]]]:
        ahead = {}
        for r, p in zip(nxt, self.inner.propose(nxt)):
            if len(p.token_ids) == r.k:  # [bonus guess g, then the window after it]
                ahead[r.seq_id] = (r.token_ids + p.token_ids[:1], p.token_ids[1:])
        return ahead

    def _wait(self) -> None:
        """Collect the window drafted ahead; a failure there only means no window is ready."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            self._ahead = pending.result()
        except Exception as e:  # the inner drafter syncs its cache on the next call anyway
            log.warning("drafting ahead failed (%s: %s); drafting as usual", type(e).__name__, e)
            self._ahead = {}

    def release(self, seq_id: str) -> None:
        self._wait()  # keeps the other sequences' windows
        self._ahead.pop(seq_id, None)
        self.inner.release(seq_id)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
