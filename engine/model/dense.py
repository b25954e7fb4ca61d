"""The dense parts of a layer, run eagerly or under ``torch.compile`` (gpt-fast's approach).

Around the two parts that stay eager (attention over the KV cache, the MoE dispatch) a layer is
short chains of small ops on ``(num_tokens, hidden)`` rows: before attention RMSNorm, the fused
QKV projection, the Qwen3 q/k norm and RoPE; after it the output projection, the residual and the
next RMSNorm. On a small model every op is mostly dispatch overhead, so compiling each chain into
one generated kernel sequence is what pays. Weights are arguments rather than closures, so every
layer (and the draft model's layers of the same shapes) shares one compiled graph, and the token
count becomes dynamic after its first change, so decode, verification and prefill shapes do not
recompile per length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers import apply_rotary, rms_norm


def attention_inputs(x: torch.Tensor, norm: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                     qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                     num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of the residual stream ``x``.

    Args:
        x: ``(num_tokens, hidden)``; norm: ``(hidden,)`` the input RMSNorm weight.
        wqkv: ``((num_heads + 2 * num_kv_heads) * head_dim, hidden)`` q, k, v projections stacked;
            bqkv: its bias or None.
        qk_norm: ``(num_heads + num_kv_heads, head_dim)`` per-head RMSNorm weights (Qwen3) or None.
        cos, sin: ``(num_tokens, 1, head_dim)`` from :meth:`engine.model.layers.Rotary.cos_sin`.

    Returns:
        q ``(num_tokens, num_heads, head_dim)``, k and v ``(num_tokens, num_kv_heads, head_dim)``,
        in ``x.dtype``.
    """
    n, head_dim = x.shape[0], cos.shape[-1]
    qkv = F.linear(rms_norm(x, norm, eps), wqkv, bqkv)
    # Queries and keys side by side as heads: one (norm and) RoPE for both.
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(n, num_heads + num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(n, num_kv_heads, head_dim)
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps)
    qk = apply_rotary(qk, cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], v


def attention_output(attn: torch.Tensor, x: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None,
                     norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual after attention and its RMSNorm.

    Args:
        attn: ``(num_tokens, num_heads, head_dim)`` attention output; x: ``(num_tokens, hidden)``;
        wo: ``(hidden, num_heads * head_dim)``, bo: its bias or None; norm: ``(hidden,)``.

    Returns:
        ``x + o_proj(attn)`` and its RMSNorm, both ``(num_tokens, hidden)``.
    """
    x = x + F.linear(attn.flatten(1), wo, bo)
    return x, rms_norm(x, norm, eps)


class DenseOps:
    """:func:`attention_inputs` and :func:`attention_output`, compiled or not.

    Args:
        compiled: wrap both in ``torch.compile`` (inductor; CPU needs a C++ compiler). The first
            call of each new shape class compiles (seconds); outputs equal the eager ones within
            float rounding (fused kernels reorder reductions).
    """

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        wrap = torch.compile if compiled else (lambda fn: fn)
        self.attention_inputs = wrap(attention_inputs)
        self.attention_output = wrap(attention_output)
