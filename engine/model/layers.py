"""Stateless building blocks: RMSNorm, rotary embeddings, ragged causal attention over the KV cache.

Each matches the Hugging Face Llama/Mixtral/Qwen reference (``LlamaRMSNorm``,
``LlamaRotaryEmbedding`` with ``rotate_half``, ``eager``/``sdpa`` attention) in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.batch import ForwardBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32. ``x``: ``(..., dim)``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), half-split layout as in HF."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str = "cpu") -> None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponent)  # (head_dim / 2,)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``(num_tokens,)`` -> cos, sin: ``(num_tokens, 1, head_dim)``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``(num_tokens, num_heads, head_dim)``; cos/sin from :meth:`Rotary.cos_sin`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class AttentionPlan:
    """What every layer's attention in one forward shares, built once per forward.

    Attributes:
        token_slots: ``(num_tokens,)`` int64 KV slot of each new token.
        mask: ``(num_seqs, 1, max_q, max_kv)`` bool, True where a query may attend (causal by
            absolute position, and the sliding window if any).
        slot_rows: a ``slice`` when the batch has a ``slot_range`` (the cache rows are then a view,
            not a gathered copy), else the ``(num_seqs,)`` slot tensor.
        max_q, max_kv: longest new-token run and longest sequence after this pass.
    """

    token_slots: torch.Tensor
    mask: torch.Tensor
    slot_rows: slice | torch.Tensor
    max_q: int
    max_kv: int


def plan_attention(batch: ForwardBatch, sliding_window: int | None = None) -> AttentionPlan:
    """The :class:`AttentionPlan` of ``batch`` (on the batch tensors' device)."""
    device = batch.positions.device
    num_seqs, max_q, max_kv = batch.num_seqs, max(batch.query_lens), max(batch.seq_lens)
    # Padding rows get position 0 so their softmax has one valid key; their output is discarded.
    q_pos = torch.zeros(num_seqs, max_q, dtype=torch.int64, device=device)
    q_pos[batch.token_seq, batch.token_qidx] = batch.positions
    key_pos = torch.arange(max_kv, device=device)
    # Causal by absolute position: also hides stale entries past a rolled-back length, because
    # every position <= a query's position was written in this pass or an earlier kept one.
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    slot_rows = slice(*batch.slot_range) if batch.slot_range is not None else batch.slots
    return AttentionPlan(batch.slots[batch.token_seq], mask[:, None], slot_rows, max_q, max_kv)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Write the new keys/values into the cache, then causal attention for every new token.

    Args:
        q: ``(num_tokens, num_heads, head_dim)``.
        k, v: ``(num_tokens, num_kv_heads, head_dim)`` (grouped-query heads allowed).
        k_cache, v_cache: one layer's cache, ``(max_seqs, num_kv_heads, max_len, head_dim)``.
        batch: ragged batch metadata; query token t of sequence b sits at ``batch.positions[t]``.
        plan: :func:`plan_attention` of ``batch`` (shared by every layer of the forward).

    Returns:
        ``(num_tokens, num_heads, head_dim)``.
    """
    k_cache[plan.token_slots, :, batch.positions] = k
    v_cache[plan.token_slots, :, batch.positions] = v
    q_pad = q.new_zeros(batch.num_seqs, plan.max_q, q.shape[1], q.shape[2])
    q_pad[batch.token_seq, batch.token_qidx] = q
    keys = k_cache[plan.slot_rows, :, :plan.max_kv]
    values = v_cache[plan.slot_rows, :, :plan.max_kv]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys, values, attn_mask=plan.mask, enable_gqa=keys.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2)[batch.token_seq, batch.token_qidx]
