"""Emitting a verified run of tokens into a sequence's output (text, logprobs, counters)."""

from __future__ import annotations

import time

import torch

from engine.outputs import SpecDecodeStats, TokenLogprob
from engine.sampling import top_logprobs
from engine.sequence import Sequence


def emit_tokens(seq: Sequence, tokens: list[int], logit_rows: torch.Tensor | None, num_drafted: int,
                num_accepted: int, stats: SpecDecodeStats) -> str | None:
    """Append one step's tokens to ``seq``'s output; the tokens past a stop are dropped.

    Args:
        tokens: the step's accepted draft tokens and its recovered or bonus token (never
            :data:`kernels.rejection.PLACEHOLDER_TOKEN_ID`: the engine fails such a sequence).
        logit_rows: ``(len(tokens), vocab)`` float32 target logits of those tokens, only when the
            request asked for logprobs (else None).
        num_drafted, num_accepted: the step's draft tokens and how many the target accepted.
        stats: the engine's totals, updated with the sequence's own.

    Returns:
        The finish reason ("stop", "length") when the sequence finished in this run, else None.
    """
    result = seq.state.append(tokens)
    kept = result.num_kept
    comp = seq.completion
    comp.new_token_ids = tokens[:kept]
    comp.token_ids = list(seq.state.token_ids)
    comp.new_text = result.text_delta
    comp.text = seq.state.text
    if comp.logprobs is not None and kept:
        tok_lp, top_ids, top_lps = top_logprobs(logit_rows[:kept], torch.tensor(tokens[:kept],
                                                device=logit_rows.device), seq.params.logprobs)
        tok_lp, top_ids, top_lps = tok_lp.cpu(), top_ids.cpu(), top_lps.cpu()  # small, explicit
        for i in range(kept):
            top = dict(zip(top_ids[i].tolist(), top_lps[i].tolist()))
            comp.logprobs.append(TokenLogprob(tokens[i], float(tok_lp[i]), top))
    for totals in (comp.spec_stats, stats):
        totals.record(num_drafted, min(num_accepted, kept))
        totals.num_emitted_tokens += kept
    if kept and seq.request.metrics.first_token_time_s is None:
        seq.request.metrics.first_token_time_s = time.monotonic()
    return result.finish_reason
