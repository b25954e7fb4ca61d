"""Seeded random inputs of the kernel tests, on any device (the CPU tier through the interpreter,
the GPU tier at realistic shapes on CUDA). For a given seed the CPU values never change."""

from __future__ import annotations

import torch

from kernels.checks import PLACEHOLDER_TOKEN_ID


def make_inputs(counts: list[int], hidden: int, inter: int, dtype: torch.dtype, seed: int,
                device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Grouped expert-FFN inputs: ``(x, counts, w_gate, w_up, w_down, routing_weights)``.

    Shapes: x ``(sum(counts), hidden)``; counts ``(E,)`` int64 on the host; w_gate/w_up
    ``(E, inter, hidden)``; w_down ``(E, hidden, inter)``, all ``dtype`` on ``device``, scaled by
    fan-in so activations stay O(1); routing weights ``(rows,)`` float32 in [0, 1).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    experts, rows = len(counts), sum(counts)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = rand(rows, hidden)
    w_gate = rand(experts, inter, hidden, scale=hidden**-0.5)
    w_up = rand(experts, inter, hidden, scale=hidden**-0.5)
    w_down = rand(experts, hidden, inter, scale=inter**-0.5)
    routing_weights = torch.rand(rows, generator=gen, device=device)
    return x, torch.tensor(counts, dtype=torch.int64), w_gate, w_up, w_down, routing_weights


def make_batch(batch: int, k: int, vocab: int, seed: int, greedy_frac: float = 0.5, peaked: bool = False,
               device: str = "cpu") -> list[torch.Tensor]:
    """Random verification inputs ``[ids (B, K), n (B,), q (B, K, V), p (B, K + 1, V), accept_u (B, K),
    sample_u (B, K + 1), greedy (B,)]`` on ``device``. Draft tokens come from q; in greedy rows most
    are replaced by the target argmax so that long accepted runs occur. Every n in [0, K] appears for
    batch > K."""
    gen = torch.Generator(device=device).manual_seed(seed)
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen, device=device) * (4.0 if peaked else 1.0)
    draft_logits = target_logits[:, :k] + 0.5 * torch.randn(batch, k, vocab, generator=gen, device=device)
    p = torch.softmax(target_logits, dim=-1)
    q = torch.softmax(draft_logits, dim=-1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    greedy = torch.rand(batch, generator=gen, device=device) < greedy_frac
    follow = greedy[:, None] & (torch.rand(batch, k, generator=gen, device=device) < 0.8)
    ids = torch.where(follow, p[:, :k].argmax(dim=-1), ids)
    n = torch.arange(batch, device=device) % (k + 1)
    ids = torch.where(torch.arange(k, device=device)[None, :] < n[:, None], ids, PLACEHOLDER_TOKEN_ID)
    accept_u = torch.rand(batch, k, generator=gen, device=device)
    sample_u = torch.rand(batch, k + 1, generator=gen, device=device)
    return [ids, n, q, p, accept_u, sample_u, greedy]
