"""Prompt chunks for the drafter, in the step the target prefills them.

Without this a draft model first sees a prompt when its sequence first drafts, and takes it all
in that step: a 900-token prompt's catch-up ran 11-17 ms on the 2-core VM, one long step in every
running stream. vLLM runs a draft model's prefill alongside the target's; here a drafter that says
``ingests_prompts`` (:class:`engine.drafters.base.Drafter`) gets each step's chunks as ``k = 0``
requests in the same call as that step's draft requests, so the catch-up is spread over the
chunked steps and sized with them (the chunk's cost includes it, see
:meth:`engine.spec_controller.SpeculationController.predict_step_s`).
"""

from __future__ import annotations

from engine.drafters.base import DraftRequest
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


def drafts_later(seq: Sequence) -> bool:
    """Whether a sequence can draft once its prompt is in: it asks for drafts (``k > 0``) and for
    more than the one token its final prefill chunk emits."""
    return seq.k > 0 and seq.params.max_tokens > 1


def ingest_requests(sched: SchedulerOutput) -> tuple[list[DraftRequest], list[tuple[Sequence, int]]]:
    """``k = 0`` draft requests for this step's prefill chunks, and per sequence the prompt
    position its drafter cache will reach (``num_cached`` + its chunk: call before the target's
    forward moves ``num_cached``). Only sequences that can draft later are fed."""
    seqs = [s for s in sched.prefills if drafts_later(s)]
    ends = [(s, s.num_cached + sched.chunks[s.seq_id]) for s in seqs]
    return [DraftRequest(s.seq_id, s.prompt_token_ids[:end], 0) for s, end in ends], ends
