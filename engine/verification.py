"""One engine step's verification, on the device where the target's logits live.

The target forward returns ``sum(num_logits)`` logit rows (one per prefill, ``k + 1`` per decoding
sequence with ``k`` draft tokens). :func:`build_verify_batch` gathers them into the padded
``(B, K + 1, V)`` layout of :mod:`kernels.rejection` with one index on the logits' device; only
small per-sequence data (draft ids, parameters, uniforms) crosses from the host, explicitly. An
all-greedy batch takes the argmax path (:func:`kernels.rejection.greedy_verify`): no probabilities,
no draft distributions and no uniforms are allocated. Otherwise target probabilities come from
:func:`engine.sampling.compute_probs` and the rejection sampler (Leviathan et al. 2023,
Algorithm 1) runs through :func:`kernels.rejection.rejection_sample` (the Triton kernel on CUDA).

Randomness is per sequence, so a batch's composition never changes a request's output. An
unseeded sampling sequence draws ``2k + 1`` uniforms from its own CPU generator per step (``k``
accept, ``k + 1`` sample). A seeded one (a *race* row) draws nothing: its token at each position
is the exponential race of :func:`engine.sampling.race_scores`, a function of its seed and the
position only, so it is verified like a greedy row on those scores and its output does not depend
on the draft lengths either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.drafters.base import DraftProposal
from engine.sampling import compute_probs, draw_uniforms, greedy_argmax, race_scores
from engine.sampling_params import SamplingParams
from kernels.rejection import greedy_verify, rejection_sample


@dataclass
class VerifyBatch:
    """Device tensors of one step's verification (``B`` sequences, ``K`` longest draft, ``V`` vocab).

    Attributes:
        draft_ids: ``(B, K)`` int64, zero-padded; num_draft: ``(B,)`` int64.
        target_logits: ``(B, K + 1, V)`` the logit rows of each sequence, padded by repeating its
            last row (padded positions are never read).
        greedy: ``(B,)`` bool.
        draft_probs: ``(B, K, V)`` float32 draft distributions, or None for an all-greedy batch.
        target_probs: ``(B, K + 1, V)`` float32, or None for an all-greedy batch; a race row holds
            its race scores (:func:`engine.sampling.race_scores`), read only for their argmax.
        accept_u, sample_u: ``(B, K)`` and ``(B, K + 1)`` float32 uniforms, or None (all greedy).
    """

    draft_ids: torch.Tensor
    num_draft: torch.Tensor
    target_logits: torch.Tensor
    greedy: torch.Tensor
    draft_probs: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    accept_u: torch.Tensor | None = None
    sample_u: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return self.target_probs is None


def build_verify_batch(logits: torch.Tensor, num_logits: list[int], draft_lists: list[list[int]],
                       proposals: list[DraftProposal | None], generators: list[torch.Generator | None],
                       params: list[SamplingParams], races: list[tuple[int, int] | None] | None = None
                       ) -> VerifyBatch:
    """Lay out one step for the rejection sampler.

    Args:
        logits: ``(sum(num_logits), V)`` target logits, any device.
        num_logits: rows per sequence (``len(draft_lists[b]) + 1``, or 1 for a prefill).
        draft_lists: draft token ids per sequence (empty for prefills and non-speculating rows).
        proposals: the drafter's proposal per sequence (None where nothing was drafted); its
            ``probs`` ``(n, V)`` is ``q`` (None: deterministic drafter, ``q`` one-hot).
        generators: each sequence's own generator (None for greedy sequences).
        params: each sequence's sampling parameters.
        races: per sequence, ``(race seed, position of its first logit row's token)`` for a
            seeded sampling sequence, else None (None: no race rows).

    Returns:
        The :class:`VerifyBatch`, every tensor on ``logits.device``.
    """
    device, batch = logits.device, len(draft_lists)
    k = max(len(d) for d in draft_lists)
    races = races or [None] * batch
    all_greedy = all(p.temperature == 0 for p in params)
    if k == 0 and all_greedy:  # plain greedy decoding: a view and this batch size's constants
        draft_ids, num_draft, greedy = _no_drafts(batch, device)
        return VerifyBatch(draft_ids, num_draft, logits[:, None], greedy)
    draft_ids = [d + [0] * (k - len(d)) for d in draft_lists]
    if k == 0:  # one row per sequence, in order (plain decoding): the layout is a view
        target_logits = logits[:, None]
    else:
        index, offset = [], 0
        for n in num_logits:
            index.append([offset + min(j, n - 1) for j in range(k + 1)])
            offset += n
        # Small host tensors, copied to the device once each (explicit: the host/device boundary).
        target_logits = logits[torch.tensor(index, dtype=torch.int64).to(device)]  # (B, K + 1, V)
    out = VerifyBatch(torch.tensor(draft_ids, dtype=torch.int64).reshape(batch, k).to(device),
                      torch.tensor([len(d) for d in draft_lists], dtype=torch.int64).to(device), target_logits,
                      torch.tensor([p.temperature == 0 or r is not None for p, r in zip(params, races)]).to(device))
    if all_greedy:
        return out
    vocab = logits.shape[-1]
    out.draft_probs = torch.zeros(batch, k, vocab, dtype=torch.float32, device=device)
    accept_u, sample_u = torch.zeros(batch, k), torch.zeros(batch, k + 1)
    for b, (d, proposal, gen, race) in enumerate(zip(draft_lists, proposals, generators, races)):
        if gen is None or race is not None:  # greedy or race row: q and uniforms are never read
            continue
        if d and proposal is not None and proposal.probs is not None:
            out.draft_probs[b, : len(d)] = proposal.probs.to(device)
        elif d:  # deterministic drafter: q is one-hot at the proposed token
            out.draft_probs[b, torch.arange(len(d), device=device), out.draft_ids[b, : len(d)]] = 1.0
        u = draw_uniforms(gen, 2 * len(d) + 1)  # draws depend only on this sequence's own history
        accept_u[b, : len(d)], sample_u[b, : len(d) + 1] = u[: len(d)], u[len(d):]
    out.accept_u, out.sample_u = accept_u.to(device), sample_u.to(device)
    out.target_probs = compute_probs(target_logits, torch.tensor([p.temperature for p in params]),
                                     torch.tensor([p.top_k for p in params], dtype=torch.int64),
                                     torch.tensor([p.top_p for p in params], dtype=torch.float32))
    for b, race in enumerate(races):
        if race is not None:  # rows past the draft are padding, never read
            n = len(draft_lists[b]) + 1
            seed, first = race
            out.target_probs[b, :n] = race_scores(out.target_probs[b, :n], [(seed, first + j) for j in range(n)])
    return out


@functools.lru_cache(maxsize=64)
def _no_drafts(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read-only ``draft_ids`` ``(batch, 0)``, ``num_draft`` zeros and ``greedy`` all True of a plain
    greedy step, built once per batch size instead of from host lists every step."""
    ids = torch.zeros(batch, 0, dtype=torch.int64, device=device)
    return ids, torch.zeros(batch, dtype=torch.int64, device=device), torch.ones(batch, dtype=torch.bool, device=device)


def verify(batch: VerifyBatch) -> tuple[list[list[int]], list[int]]:
    """Accepted drafts plus the recovered/bonus token per sequence.

    Returns:
        Per sequence the ``num_accepted + 1`` emitted token ids, and ``num_accepted``; one
        explicit device-to-host copy of the ``(B, K + 1)`` result.
    """
    if batch.all_greedy and batch.draft_ids.shape[1] == 0:  # nothing drafted: each row's argmax
        host_ids = greedy_argmax(batch.target_logits[:, 0]).cpu().tolist()
        return [[t] for t in host_ids], [0] * len(host_ids)
    if batch.all_greedy:
        out_ids, num_acc = greedy_verify(batch.draft_ids, batch.num_draft, greedy_argmax(batch.target_logits))
    else:
        out_ids, num_acc = rejection_sample(batch.draft_ids, batch.num_draft, batch.draft_probs, batch.target_probs,
                                            batch.accept_u, batch.sample_u, batch.greedy)
    host_ids, host_acc = out_ids.cpu().tolist(), num_acc.cpu().tolist()
    return [ids[: n + 1] for ids, n in zip(host_ids, host_acc)], host_acc
