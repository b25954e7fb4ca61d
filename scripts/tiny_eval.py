"""Held-out evaluation of the bundled pair: perplexity, unigram baseline, expert routing shares.

All functions take already-tokenized held-out text (a flat stream of ids with eos=0 between
documents) cut into non-overlapping windows; every model is scored on exactly the same
next-token positions (positions 1..T-1 of each window), so the perplexities are comparable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel


def cut_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows from the start of ``stream`` ([N] int64) -> [W, seq_len] (tail dropped)."""
    n = stream.numel() // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def model_nll(model: PreTrainedModel, windows: torch.Tensor, batch: int = 8, desc: str = "ppl") -> float:
    """Mean next-token negative log-likelihood (nats/token) over all windows.

    Args:
        windows: [W, T] int64; each window is scored independently (no cross-window context).
    """
    model.eval()
    total, count = 0.0, 0
    for i in tqdm(range(0, windows.shape[0], batch), desc=desc, mininterval=5.0):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits.float()  # [b, T, V]
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += x[:, 1:].numel()
    return total / count


def unigram_nll(counts: torch.Tensor, windows: torch.Tensor) -> float:
    """Mean NLL (nats/token) of an add-one smoothed unigram on the same positions as ``model_nll``.

    Args:
        counts: [V] training-token counts; p(t) = (counts[t] + 1) / (sum(counts) + V).
        windows: [W, T] int64.
    """
    counts = counts.double()
    logp = torch.log((counts + 1.0) / (counts.sum() + counts.numel()))
    return -logp[windows[:, 1:]].mean().item()


@torch.no_grad()
def routing_shares(model: PreTrainedModel, windows: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """Share of routed (token, slot) assignments per expert, per layer.

    Each token sends ``num_experts_per_tok`` slots; the share of expert e in layer l is
    (#slots of layer l routed to e) / (#tokens * top_k). Uniform routing gives 1 / num_experts.

    Returns:
        [num_layers, num_experts] float64, rows sum to 1.
    """
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_local_experts, dtype=torch.float64)
    for i in tqdm(range(0, windows.shape[0], batch), desc="routing", mininterval=5.0):
        out = model(input_ids=windows[i : i + batch], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # each [b*T, E]
            top = logits.topk(cfg.num_experts_per_tok, dim=-1).indices
            counts[layer] += torch.bincount(top.flatten(), minlength=cfg.num_local_experts).double()
    return counts / counts.sum(dim=1, keepdim=True)


def ppl(nll: float) -> float:
    """Perplexity from mean NLL in nats/token."""
    return math.exp(nll)
