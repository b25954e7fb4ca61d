"""Speculative-decoding verification: accept or reject draft tokens against the target model.

The torch reference below is the CPU path and the ground truth for the Triton kernel in
``kernels/rejection_triton.py``. It implements the modified rejection sampling of Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding" (Algorithm 1), equivalently
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"
(Algorithm 2). For a draft token ``x`` sampled from the draft distribution ``q``:

* accept ``x`` iff ``u < p(x) / q(x)`` with ``u ~ U[0, 1)``  (accepts with prob ``min(1, p/q)``);
* on the first rejection, sample the recovered token from ``norm(max(0, p - q))``;
* if every draft token is accepted, sample one bonus token from the next target distribution.

Every emitted token is then distributed exactly as the target ``p`` (Leviathan et al., Appendix
A.1). Greedy rows use the deterministic special case: accept while the draft equals the target
argmax and emit the argmax at the first mismatch (or as the bonus token).

All randomness comes in as explicit uniforms, so the function is pure: the caller draws them from
each request's own generator and a batch's composition cannot change any request's output.
"""

from __future__ import annotations

import torch

from kernels.checks import PLACEHOLDER_TOKEN_ID, check_rejection_args

__all__ = ["PLACEHOLDER_TOKEN_ID", "greedy_verify", "inverse_cdf_sample", "rejection_sample",
           "rejection_sample_reference"]


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverting the CDF with a given uniform.

    Returns the first index ``i`` with ``cumsum(probs)[i] > u * sum(probs)``. Because a
    zero-probability token leaves the cumulative sum unchanged it can never be the *first* index
    to exceed the threshold, so zero-probability tokens are never returned. Rows need not be
    normalised. The cumulative sum is taken in float64 so that vocabulary-sized rows do not lose
    the mass of their tail to float32 rounding. If the threshold still reaches the row total
    (only possible for ``u >= 1``), the last nonzero-probability token is returned.

    Args:
        probs: ``(B, V)`` float32, non-negative, unnormalised allowed.
        uniforms: ``(B,)`` float32 in ``[0, 1)``.

    Returns:
        ``(B,)`` int64 token ids. A row with no positive entry (invalid input) gives
        :data:`PLACEHOLDER_TOKEN_ID`, so the caller can detect it instead of emitting token 0.

    Raises:
        ValueError: on mismatched shapes.
    """
    if probs.dim() != 2 or uniforms.shape != probs.shape[:1]:
        raise ValueError(
            f"probs must be (B, V) and uniforms (B,), got {tuple(probs.shape)} and {tuple(uniforms.shape)}"
        )
    vocab = probs.shape[1]
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    threshold = uniforms.to(torch.float64) * cdf[:, -1]
    # right=True: the first index whose cdf is strictly greater than the threshold.
    ids = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(-1)
    positions = torch.arange(vocab, device=probs.device).expand_as(probs)
    last_nonzero = torch.where(probs > 0, positions, -1).amax(dim=-1)
    ids = torch.where(ids >= vocab, last_nonzero, ids)
    return torch.where(last_nonzero < 0, PLACEHOLDER_TOKEN_ID, ids)


def rejection_sample_reference(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of draft runs in one vectorised pass (reference implementation).

    Row ``b`` has ``n = num_draft_tokens[b]`` draft tokens ``x_0..x_{n-1}`` (entries past ``n``
    are ignored and may hold anything, e.g. :data:`PLACEHOLDER_TOKEN_ID`). ``p_j`` is
    ``target_probs[b, j]``, the target distribution for the token after ``j`` draft tokens;
    ``q_j`` is ``draft_probs[b, j]``, the distribution ``x_j`` was sampled from.

    * Greedy rows: ``t_j = argmax p_j`` (ties to the lower id). Accept ``x_j`` while
      ``x_j == t_j``; at the first mismatch ``j`` emit ``t_j``; if all ``n`` are accepted emit the
      bonus ``t_n``. ``draft_probs`` is not read for greedy rows.
    * Sampling rows: accept ``x_j`` iff ``accept_uniforms[b, j] < p_j(x_j) / q_j(x_j)``
      (``q_j(x_j) == 0`` accepts). At the first rejection ``j`` emit
      ``inverse_cdf_sample(max(0, p_j - q_j), sample_uniforms[b, j])`` (the residual need not be
      normalised; if float rounding leaves it with no mass, i.e. ``p_j`` and ``q_j`` agree up to
      rounding and the rejection itself was a rounding artefact, ``p_j`` is used instead).
      If all ``n`` are accepted emit ``inverse_cdf_sample(p_n, sample_uniforms[b, n])``.

    Args:
        draft_token_ids: ``(B, K)`` int64.
        num_draft_tokens: ``(B,)`` int64 in ``[0, K]``.
        draft_probs: ``(B, K, V)`` float32, or None only when every row is greedy. A deterministic
            drafter (n-gram) has one-hot ``q``; the caller materialises it for sampling rows.
        target_probs: ``(B, K + 1, V)`` float32 (rows from :func:`engine.sampling.compute_probs`).
        accept_uniforms: ``(B, K)`` float32 in ``[0, 1)``.
        sample_uniforms: ``(B, K + 1)`` float32 in ``[0, 1)``.
        greedy: ``(B,)`` bool.

    Returns:
        ``output_token_ids``: ``(B, K + 1)`` int64, the accepted drafts then the recovered/bonus
        token, then :data:`PLACEHOLDER_TOKEN_ID`; ``num_accepted``: ``(B,)`` int64 accepted draft
        count (the row emits ``num_accepted + 1`` tokens).

    Raises:
        ValueError: on inconsistent shapes, or ``draft_probs`` None with a sampling row.
    """
    check_rejection_args(draft_token_ids, num_draft_tokens, draft_probs, target_probs, accept_uniforms,
                sample_uniforms, greedy)
    batch, k = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    positions = torch.arange(k, device=device)
    in_draft = positions[None, :] < num_draft_tokens[:, None]  # (B, K)
    # Padding ids may be negative; clamp only for indexing, in_draft masks them out.
    safe_draft = draft_token_ids.clamp(min=0)

    # Target argmax over all K + 1 positions; torch.argmax returns the first maximum -> lower id.
    target_argmax = target_probs.argmax(dim=-1)  # (B, K + 1)
    accept = torch.where(greedy[:, None], safe_draft == target_argmax[:, :k], _sampled_accept(
        safe_draft, draft_probs, target_probs[:, :k], accept_uniforms, greedy))
    num_accepted = _accepted_prefix(accept & in_draft)

    # Position of the emitted non-draft token: the first rejection, or n for the bonus token.
    stop = num_accepted
    p_stop = target_probs[rows, stop]  # (B, V)
    residual = p_stop
    if draft_probs is not None and k > 0:
        q_stop = draft_probs[rows, stop.clamp(max=k - 1)]
        # Bonus position (stop == n): no draft token there, so the residual is p itself.
        rejected = (stop < num_draft_tokens)[:, None]
        residual = torch.where(rejected, (p_stop - q_stop).clamp(min=0), p_stop)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_stop)
    sampled = inverse_cdf_sample(residual, sample_uniforms[rows, stop])
    final_token = torch.where(greedy, target_argmax[rows, stop], sampled)
    return _assemble(draft_token_ids, num_accepted, final_token), num_accepted


def greedy_verify(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule of :func:`rejection_sample_reference` alone, from the target argmax.

    For an all-greedy batch nothing of vocabulary size is needed beyond the target logits' argmax:
    no probabilities, no draft distributions, no uniforms.

    Args:
        draft_token_ids: ``(B, K)`` int64; num_draft_tokens: ``(B,)`` int64 in ``[0, K]``.
        target_argmax: ``(B, K + 1)`` int64, ``argmax`` of the target logits (ties to the lower id).

    Returns:
        ``output_token_ids`` ``(B, K + 1)`` and ``num_accepted`` ``(B,)``, exactly as the reference
        returns for greedy rows.
    """
    batch, k = draft_token_ids.shape
    if tuple(target_argmax.shape) != (batch, k + 1) or tuple(num_draft_tokens.shape) != (batch,):
        raise ValueError(f"target_argmax must be ({batch}, {k + 1}) and num_draft_tokens ({batch},), got "
                         f"{tuple(target_argmax.shape)} and {tuple(num_draft_tokens.shape)}")
    positions = torch.arange(k, device=draft_token_ids.device)
    in_draft = positions[None, :] < num_draft_tokens[:, None]
    num_accepted = _accepted_prefix((draft_token_ids == target_argmax[:, :k]) & in_draft)
    rows = torch.arange(batch, device=draft_token_ids.device)
    return _assemble(draft_token_ids, num_accepted, target_argmax[rows, num_accepted]), num_accepted


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Drafts are accepted as a prefix: ``(B, K)`` bool -> ``(B,)`` length of the leading True run."""
    return torch.cumprod(accept.to(torch.int64), dim=-1).sum(dim=-1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """``(B, K + 1)``: the accepted drafts, the recovered/bonus token, then placeholders."""
    batch, k = draft_token_ids.shape
    positions = torch.arange(k, device=draft_token_ids.device)
    output = torch.full((batch, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=draft_token_ids.device)
    output[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], draft_token_ids, PLACEHOLDER_TOKEN_ID)
    output[torch.arange(batch, device=draft_token_ids.device), num_accepted] = final_token
    return output


def _sampled_accept(safe_draft, draft_probs, target_probs_k, accept_uniforms, greedy) -> torch.Tensor:
    """``(B, K)`` bool: ``u < p(x) / q(x)`` per draft token (``q(x) == 0`` accepts)."""
    if draft_probs is None:
        # Only reachable when all rows are greedy (checked); the result is then unused.
        return torch.zeros_like(safe_draft, dtype=torch.bool)
    p_x = target_probs_k.gather(-1, safe_draft[..., None]).squeeze(-1)
    q_x = draft_probs.gather(-1, safe_draft[..., None]).squeeze(-1)
    # The ratio, not u * q < p, is the documented rule the Triton kernel reproduces bit-for-bit.
    ratio = p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    return (q_x <= 0) | (accept_uniforms < ratio)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: Triton on CUDA when enabled (see :mod:`kernels.dispatch`), the reference elsewhere.

    Same arguments and results as :func:`rejection_sample_reference`.
    """
    from kernels.dispatch import use_triton

    args = (draft_token_ids, num_draft_tokens, draft_probs, target_probs, accept_uniforms,
            sample_uniforms, greedy)
    if use_triton(target_probs):
        from kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(*args)
    return rejection_sample_reference(*args)
