"""Trainable EAGLE-3 head and its training-time-test (TTT) loss (Li et al. 2025, EAGLE-3, Section 3.2).

The module's parameter names are the on-disk names :class:`engine.model.eagle3.Eagle3Head` reads,
so ``state_dict()`` is the checkpoint. The math is the head's: ``fc`` fuses three target features,
one decoder layer over ``cat(input_layernorm(embed(x_{p+1})), hidden_norm(h_p))`` with the residual
from ``h_p``, ``norm``, ``lm_head`` over the draft vocabulary.

TTT: step 1 runs every anchor row ``a`` on the target's feature ``h_a`` and token ``x_{a+1}``; step
``j > 1`` runs row ``a + j - 1`` on token ``x_{a+j}`` and the head's own step ``j - 1`` output, as at
inference. Its query sees the step-1 keys of positions ``0..a`` (the true rows in the cache) plus
its own anchor's keys of steps ``2..j`` (the draft rows), so the mask is causal over step-1 keys plus
a diagonal per earlier step. Step ``j`` predicts ``x_{a+j+1}`` and is scored against the target's
distribution there (restricted to the draft vocabulary), weighted ``decay^(j-1)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split RoPE of ``x`` ``(B, heads, T, d)`` at positions ``pos`` ``(T,)``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _Layer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(2 * hidden, heads * head_dim, bias=False),
                                        "k_proj": nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
                                        "v_proj": nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
                                        "o_proj": nn.Linear(heads * head_dim, hidden, bias=False)})
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(hidden, inter, bias=False),
                                  "up_proj": nn.Linear(hidden, inter, bias=False),
                                  "down_proj": nn.Linear(inter, hidden, bias=False)})


class TrainableEagle3(nn.Module):
    """EAGLE-3 head for training (see module docstring).

    Args:
        embed: ``(vocab, hidden)`` target input embedding (frozen, not saved).
        draft_ids: ``(draft_vocab,)`` target ids of the draft vocabulary, ascending.
    """

    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 theta: float, embed: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.eps, self.theta, self.heads, self.kv_heads, self.head_dim = eps, theta, heads, kv_heads, head_dim
        self.fc = nn.Linear(3 * embed.shape[1], hidden, bias=False)
        self.midlayer = _Layer(hidden, inter, heads, kv_heads, head_dim)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, draft_ids.numel(), bias=False)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        t2d = torch.zeros(embed.shape[0], dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("draft_ids", draft_ids, persistent=False)

    def _qkv(self, tokens: torch.Tensor, h: torch.Tensor, pos: torch.Tensor):
        m, a = self.midlayer, self.midlayer.self_attn
        x = torch.cat([_rms(F.embedding(tokens, self.embed), m.input_layernorm, self.eps),
                       _rms(h, m.hidden_norm, self.eps)], -1)
        B, T, _ = x.shape
        q = a["q_proj"](x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = a["k_proj"](x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a["v_proj"](x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        return (_rope(q, pos, self.theta), _rope(k, pos, self.theta).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1))

    def _finish(self, h: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.midlayer
        B, _, T, _ = attn.shape
        r = h + m.self_attn["o_proj"](attn.transpose(1, 2).reshape(B, T, -1))
        u = _rms(r, m.post_attention_layernorm, self.eps)
        r = r + m.mlp["down_proj"](F.silu(m.mlp["gate_proj"](u)) * m.mlp["up_proj"](u))
        return self.lm_head(_rms(r, self.norm, self.eps)), r

    def ttt_logits(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft logits of each TTT step.

        Args:
            tokens: ``(B, T)`` token ids ``x_0 .. x_{T-1}``.
            features: ``(B, T, 3 * target_hidden)`` target features of those positions.
            steps: unrolled draft steps J >= 1.

        Returns:
            J tensors ``(B, A, draft_vocab)``, A = T - J anchors; step j's row a predicts ``x_{a+j+1}``.
        """
        A = tokens.shape[1] - steps
        anchors = torch.arange(A)
        h = self.fc(features[:, :A])
        scale = self.head_dim ** -0.5
        causal = anchors[None, :] <= anchors[:, None]  # (A, A): step-1 key b visible to anchor a
        keys, out = [], []
        for j in range(1, steps + 1):
            q, k, v = self._qkv(tokens[:, j:j + A], h, anchors + j - 1)
            if j == 1:
                k1, v1 = k, v
            else:
                keys.append((k, v))
            s1 = (q @ k1.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            diag = [((q * kk).sum(-1, keepdim=True) * scale) for kk, _ in keys]  # own anchor, steps 2..j
            p = torch.softmax(torch.cat([s1, *diag], -1), -1)
            attn = p[..., :A] @ v1 + sum(p[..., A + i:A + i + 1] * vv for i, (_, vv) in enumerate(keys))
            logits, h = self._finish(h, attn)
            out.append(logits)
        return out

    def ttt_loss(self, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
                 steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
        """Soft cross-entropy against the target's distribution over the draft vocabulary.

        Args:
            target_logits: ``(B, T, vocab)`` target logits (row p: distribution of ``x_{p+1}``).

        Returns:
            the weighted loss and each step's top-1 agreement with the target's argmax.
        """
        A = tokens.shape[1] - steps
        loss, acc = 0.0, []
        for j, logits in enumerate(self.ttt_logits(tokens, features, steps), start=1):
            ref = target_logits[:, j:j + A]
            p = torch.softmax(ref[..., self.draft_ids], -1)
            loss = loss + decay ** (j - 1) * -(p * torch.log_softmax(logits, -1)).sum(-1).mean()
            acc.append(float((self.draft_ids[logits.argmax(-1)] == ref.argmax(-1)).float().mean()))
        return loss, acc

    _NORMS = frozenset({"norm", "midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm"})

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The on-disk tensors (no embedding: the engine shares the target's). Norm weights are bare
        parameters here, ``<name>.weight`` on disk."""
        return {k + ".weight" if k in self._NORMS else k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`checkpoint_tensors` (a warm start from a saved head of the same shapes).

        Raises:
            ValueError: naming the first missing tensor or the first whose shape differs.
        """
        own = self.state_dict()
        state = {}
        for k, v in own.items():
            disk = k + ".weight" if k in self._NORMS else k
            if disk not in tensors:
                raise ValueError(f"head checkpoint has no tensor {disk}")
            if tensors[disk].shape != v.shape:
                raise ValueError(f"head checkpoint tensor {disk}: shape {tuple(tensors[disk].shape)}, "
                                 f"expected {tuple(v.shape)}")
            state[k] = tensors[disk]
        self.load_state_dict(state)
