"""Stateless building blocks: RMSNorm, rotary embeddings, ragged causal attention over the KV cache.

Each matches the Hugging Face Llama/Mixtral/Qwen reference (``LlamaRMSNorm``,
``LlamaRotaryEmbedding`` with ``rotate_half``, ``eager``/``sdpa`` attention) in float32.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.batch import ForwardBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32. ``x``: ``(..., dim)``."""
    if x.dtype == torch.float32 and weight.dim() == 1:  # torch's op: exactly the steps below, one call
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), half-split layout as in HF.

    cos/sin are tables over positions, computed once (and grown by doubling when a longer sequence
    comes), so a forward only indexes them. The sine table carries ``rotate_half``'s sign: its first
    half is negated, so :func:`apply_rotary` needs no negation or concatenation per layer.
    """

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponent)  # (head_dim / 2,)
        self.dtype = dtype
        self._cos = self._sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of ``positions`` ``(num_tokens,)`` int64, each ``< max_len`` (a host
        int, so growing the tables needs no device sync) -> two ``(num_tokens, 1, head_dim)``."""
        if max_len > self._cos.shape[0]:
            self._grow(max(max_len, 2 * self._cos.shape[0]))
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    def _grow(self, length: int) -> None:
        # Float32 angles as HF computes them (position * inv_freq), cast to the model dtype after.
        positions = torch.arange(length, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = freqs.shape[-1]
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._sin[:, :half].neg_()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``(num_tokens, num_heads, head_dim)``; cos/sin from :meth:`Rotary.cos_sin`.

    ``roll`` swaps the halves; the signed sine turns that into HF's ``rotate_half(x) * sin``
    bit for bit (``(-a) * b == a * (-b)`` exactly).
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


@dataclass
class AttentionPlan:
    """What every layer's attention in one forward shares, built once per forward.

    Attributes:
        token_slots: ``(num_tokens,)`` int64 KV slot of each new token.
        mask: ``(num_seqs, 1, max_q, max_kv)`` bool, True where a query may attend (causal by
            absolute position, and the sliding window if any); None when no key needs hiding
            (see ``causal``).
        causal: with ``mask`` None, whether SDPA's own causal mask applies (sequences all
            prefilled from position 0: queries and keys are the same positions, padding queries
            discarded) or every query sees every key (decoding sequences that all have ``max_kv``
            tokens).
        slot_rows: a ``slice`` of cache rows when the batch's slots lie in a span at most twice as
            long as the batch (the cache rows are then a view, not a gathered copy in every
            layer), else the ``(num_seqs,)`` slot tensor.
        slot_order: when the slots are such a span but not a range in batch order (sequences that
            joined a running batch at freed slots, others that left gaps), ``(span, rows)``: the
            span's length and the ``(num_seqs,)`` int64 cache row of each batch sequence within it;
            attention then runs over every row of the span (queries and ``mask`` scattered to
            their rows, gap rows see zero queries and every key, outputs gathered back), which
            costs less than copying the sequences' keys and values. Else None.
        max_q, max_kv: longest new-token run and longest sequence after this pass.
        uniform: every sequence appends ``max_q`` tokens (decoding, or verifying equal drafts): the
            queries are a view of the flat tokens, not a padded copy.
    """

    token_slots: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    slot_rows: slice | torch.Tensor
    max_q: int
    max_kv: int
    uniform: bool
    slot_order: tuple[int, torch.Tensor] | None = None


@dataclass
class GroupedPlan:
    """Attention of one forward in contiguous groups of sequences (:func:`plan_grouped_attention`).

    Attributes:
        groups: per group, its token rows (a slice of the batch's flat tokens), its sub-batch and
            that sub-batch's :class:`AttentionPlan`.
        max_kv: longest sequence after this pass (RoPE tables).
    """

    groups: list[tuple[slice, ForwardBatch, AttentionPlan]]
    max_kv: int


def plan_grouped_attention(batch: ForwardBatch, sliding_window: int | None = None,
                           max_padding: float = 1.5, min_waste_rows: int = 256) -> GroupedPlan:
    """Plans for attention in groups, so short queries are not padded to a long one's length.

    Attention runs over ``(num_seqs, max_q)`` padded queries (:func:`attention`): one 512-token
    prefill chunk beside seven 7-token verifications would cost 8 x 512 query rows. Consecutive
    sequences share a group while its padded rows stay within ``max_padding`` x its real tokens
    or waste fewer than ``min_waste_rows`` (a call costs more than a few padded rows); each group
    is one attention call (the engine orders prefills before decodes, so a mixed step
    is usually two groups). Every query sees exactly what it would in one call.
    """
    cuts, start = [], 0
    for b in range(1, batch.num_seqs):
        lens = batch.query_lens[start:b + 1]
        padded, real = len(lens) * max(lens), sum(lens)
        if padded > max_padding * real and padded - real >= min_waste_rows:
            cuts.append(b)
            start = b
    parts = batch.split_at(cuts) if cuts else [batch]
    groups, t = [], 0
    for part in parts:
        n = int(part.input_ids.shape[0])
        groups.append((slice(t, t + n), part, plan_attention(part, sliding_window)))
        t += n
    return GroupedPlan(groups, max(batch.seq_lens))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, plan: GroupedPlan) -> torch.Tensor:
    """:func:`attention` of every group of ``plan`` (same shapes as :func:`attention`)."""
    if len(plan.groups) == 1:
        _, part, p = plan.groups[0]
        return attention(q, k, v, k_cache, v_cache, part, p)
    return torch.cat([attention(q[rows], k[rows], v[rows], k_cache, v_cache, part, p)
                      for rows, part, p in plan.groups])


def plan_attention(batch: ForwardBatch, sliding_window: int | None = None) -> AttentionPlan:
    """The :class:`AttentionPlan` of ``batch`` (on the batch tensors' device); every decision on
    the host, from the batch's lengths."""
    max_q, max_kv = max(batch.query_lens), max(batch.seq_lens)
    uniform = min(batch.query_lens) == max_q
    slot_rows, order = _slot_rows(batch)
    token_slots = batch.slots if max_q == 1 else batch.slots[batch.token_seq]
    windowed = sliding_window is not None and sliding_window < max_kv
    if not windowed and max_q == 1 and min(batch.seq_lens) == max_kv:
        return AttentionPlan(token_slots, None, False, slot_rows, max_q, max_kv, uniform, order)
    if not windowed and batch.seq_lens == batch.query_lens:
        # Every sequence is prefilled from position 0: SDPA's causal mask is its position mask
        # for every real query (key j <= query i < its length); keys past a sequence's length
        # are seen only by its padding queries, whose rows are discarded.
        return AttentionPlan(token_slots, None, True, slot_rows, max_q, max_kv, uniform, order)
    mask = _mask(batch, max_q, max_kv, uniform, sliding_window)
    if order is not None:  # gap rows may see every key (no row without one: no NaN), discarded
        span_mask = mask.new_ones(order[0], *mask.shape[1:])
        span_mask[order[1]] = mask
        mask = span_mask
    return AttentionPlan(token_slots, mask, False, slot_rows, max_q, max_kv, uniform, order)


def _slot_rows(batch: ForwardBatch) -> tuple[slice | torch.Tensor, tuple[int, torch.Tensor] | None]:
    """:attr:`AttentionPlan.slot_rows` and ``slot_order`` of ``batch`` (decided on the host)."""
    if batch.slot_range is not None:
        return slice(*batch.slot_range), None
    if batch.slot_ids is None:
        return batch.slots, None
    lo, hi = min(batch.slot_ids), max(batch.slot_ids) + 1
    if hi - lo > 2 * batch.num_seqs:  # mostly gaps: attending over them would cost more than a copy
        return batch.slots, None
    return slice(lo, hi), (hi - lo, batch.slots - lo)  # device ops on the slot tensor: no host copy


def _mask(batch: ForwardBatch, max_q: int, max_kv: int, uniform: bool, sliding_window: int | None) -> torch.Tensor:
    """``(num_seqs, 1, max_q, max_kv)`` bool attention mask by absolute position."""
    device = batch.positions.device
    if uniform:
        q_pos = batch.positions.view(batch.num_seqs, max_q)
    else:
        # Padding rows get position 0 so their softmax has one valid key; their output is discarded.
        q_pos = torch.zeros(batch.num_seqs, max_q, dtype=torch.int64, device=device)
        q_pos[batch.token_seq, batch.token_qidx] = batch.positions
    key_pos = torch.arange(max_kv, device=device)
    # Causal by absolute position: also hides stale entries past a rolled-back length, because
    # every position <= a query's position was written in this pass or an earlier kept one.
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask[:, None]


class _CudnnAttentionOff:
    """cuDNN's SDPA switched off while any CUDA forward runs, and back as it was after the last.

    cuDNN's SDPA (the backend torch prefers on Hopper) builds an execution plan for every new shape,
    and decoding grows the key length by one each step: measured on an H200, each decode step of a
    2-layer Mixtral-shaped model took ~39 ms against ~3 ms without it (flash and memory-efficient
    attention take any length at no build cost). torch's switch is process-wide and the draft model
    may run on a second thread (engine/drafters/pipelined.py), so entries are counted under a lock:
    a per-forward ``sdpa_kernel`` context would restore cuDNN when one thread's forward ends while
    the other's is still running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = True

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._depth += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                torch.backends.cuda.enable_cudnn_sdp(self._saved)


_CUDNN_ATTENTION_OFF = _CudnnAttentionOff()


def attention_backends(device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context a whole forward on ``device`` runs in: on CUDA without cuDNN's SDPA
    (:class:`_CudnnAttentionOff`), elsewhere as torch chooses."""
    if torch.device(device).type == "cuda":
        return _CUDNN_ATTENTION_OFF
    return contextlib.nullcontext()


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
    if plan.uniform:
        q_pad = q.view(batch.num_seqs, plan.max_q, q.shape[1], q.shape[2])
    else:
        q_pad = q.new_zeros(batch.num_seqs, plan.max_q, q.shape[1], q.shape[2])
        q_pad[batch.token_seq, batch.token_qidx] = q
    if plan.slot_order is not None:  # queries at their cache rows of the span
        span, rows = plan.slot_order
        q_span = q_pad.new_zeros(span, *q_pad.shape[1:])
        q_span[rows] = q_pad
        q_pad = q_span
    keys = k_cache[plan.slot_rows, :, :plan.max_kv]
    values = v_cache[plan.slot_rows, :, :plan.max_kv]
    out = _sdpa(q_pad.transpose(1, 2), keys, values, plan).transpose(1, 2)
    if plan.slot_order is not None:
        out = out[plan.slot_order[1]]  # back to batch order
    return out.reshape(q.shape) if plan.uniform else out[batch.token_seq, batch.token_qidx]


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """SDPA of ``(N, H, Q, D)`` queries over ``(N, KV, L, D)`` keys and values -> ``(N, H, Q, D)``.

    One query a sequence (a decode step) with grouped-query heads: each KV head's ``H / KV``
    query heads go in as that head's query rows (FlashAttention-2's packed GQA), one pass over
    the keys for the group. On CPU 1.2-1.45x faster than ``enable_gqa`` for one query (16
    sequences of 100-1000 tokens: 488 against 653 us), and numerically SDPA's general path, the
    one every longer query takes (bit-identical to it for two or more queries); not for longer
    queries, where it was slower (0.8-1.0x). The mask, ``(N, 1, 1, L)``, broadcasts over the rows.
    """
    n, num_heads, q_len, head_dim = q.shape
    num_kv = keys.shape[1]
    if q_len == 1 and num_heads != num_kv and not plan.causal:
        packed = q.reshape(n, num_kv, num_heads // num_kv, head_dim)  # head h = kv * group + g
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=plan.mask)
        return out.view(n, num_heads, 1, head_dim)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask, is_causal=plan.causal,
                                          enable_gqa=num_heads != num_kv)
