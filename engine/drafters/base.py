"""The drafter interface the engine calls: proposals of up to k draft tokens per sequence.

A drafter proposes tokens that the target model then verifies in one forward pass with the
rejection sampler (:mod:`kernels.rejection`). For verification to be lossless the proposal must say
which distribution ``q`` each token was drawn from (Leviathan et al. 2023, Algorithm 1).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec
import torch


class DraftRequest(msgspec.Struct):
    """One sequence asking for draft tokens.

    Attributes:
        seq_id: stable id of the sequence (keys any per-sequence drafter state).
        token_ids: every token so far, prompt then output. May be the engine's live list: read it,
            never mutate it.
        k: the number of tokens wanted, >= 1; a drafter may return fewer.
        temperature: the request's temperature (0 = greedy).
        top_k: the request's top-k (<= 0 disables).
        top_p: the request's top-p (1 disables).
        generator: the request's own generator, the only source of randomness a drafter may use
            for it (so batch composition cannot change its output); None for greedy requests.
        features: for drafters that read the target's hidden states (EAGLE-3,
            :attr:`Drafter.feature_layers` non-empty): ``(rows, F)`` target features of positions
            ``features_start .. len(token_ids) - 2`` (every position the target has run a kept
            token through); None for other drafters.
        features_start: position of the first row of ``features``.
        race_seed: a seeded sampling sequence's seed: each draft token is then the exponential
            race of ``q`` with the target's noise for its position
            (:func:`engine.sampling.race_noise`; position ``len(token_ids) + j`` for draft ``j``),
            and no ``q`` is returned (the target verifies race rows by their own race). None:
            greedy, or drawn from ``generator``.
    """

    seq_id: str
    token_ids: list[int]
    k: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    features: torch.Tensor | None = None
    features_start: int = 0
    race_seed: int | None = None

    @property
    def samples(self) -> bool:
        """Whether the draft is sampled (a generator's draw or a race), not the argmax. A remote
        drafter's race row has no generator (it stays with the engine) but still samples."""
        return self.temperature != 0 and (self.generator is not None or self.race_seed is not None)


class DraftProposal(msgspec.Struct):
    """Draft tokens for one :class:`DraftRequest`.

    Attributes:
        token_ids: ``len <= k`` proposed tokens (possibly none).
        probs: ``(len(token_ids), V)`` float32, row ``j`` the distribution ``q_j`` token ``j`` was
            sampled from (from :func:`engine.sampling.compute_probs`); None when the drafter is
            deterministic (greedy, n-gram), meaning ``q_j`` is one-hot at ``token_ids[j]`` — the
            engine materialises it for sampling rows, where it accepts with probability ``p(x)``.
        pipelined: the tokens were drafted ahead, while the target verified the previous window
            (:mod:`engine.drafters.pipelined`): this step did not wait for the drafter.
        drafting_ahead: the window after this one is being drafted ahead (on its full acceptance).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    pipelined: bool = False
    drafting_ahead: bool = False


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from any drafter (draft model, n-gram, none).

    A drafter may also have ``feature_layers: tuple[int, ...]``: the target layers whose input
    residual stream it reads (EAGLE-3); the engine then keeps those features per sequence and passes
    them in :attr:`DraftRequest.features`. Absent or empty: none are computed.
    """

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request, in order."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget any state kept for ``seq_id`` (finished or cancelled); unknown ids are ignored."""
        ...


class NoneDrafter:
    """Plain decoding: proposes nothing, so every step emits exactly one target token."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [DraftProposal([]) for _ in requests]

    def release(self, seq_id: str) -> None:
        return None
