"""Training loops for the bundled pair: LM pre-training of the MoE target, distillation of the draft.

Data: one flat token stream (documents joined, each followed by eos id 0). A step samples
``batch`` random windows of ``seq_len + 1`` tokens from it with a seeded ``torch.Generator``, so
the data order is fully determined by the seed. Training runs in phases of increasing sequence
length at a constant number of tokens per step (short windows are cheaper and learn local
syntax; the last phase covers the positions up to 1024 that long benchmark prompts reach).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Phase:
    """A block of training steps at one sequence length."""

    seq_len: int
    steps: int


def parse_phases(spec: str, total_steps: int) -> list[Phase]:
    """``"512:0.7,1024:0.3"`` -> phases of 0.7 and 0.3 of ``total_steps`` (last one takes the rest)."""
    parts = [p.split(":") for p in spec.split(",") if p]
    phases: list[Phase] = []
    used = 0
    for i, (seq, frac) in enumerate(parts):
        steps = total_steps - used if i == len(parts) - 1 else int(round(float(frac) * total_steps))
        phases.append(Phase(int(seq), steps))
        used += steps
    return [p for p in phases if p.steps > 0]


def sample_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random contiguous windows of the token stream.

    Args:
        stream: [N] int64 token ids.
    Returns:
        [batch, seq_len + 1] int64; position t+1 is the label of position t.
    """
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup`` steps, cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices/expert tensors (not norms), the usual LM recipe."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def run_phases(
    model: torch.nn.Module,
    step_fn: StepFn,
    stream: torch.Tensor,
    phases: list[Phase],
    tokens_per_step: int,
    lr: float,
    warmup: int,
    seed: int,
    desc: str,
    extra: torch.Tensor | None = None,
    extra_frac: float = 0.0,
) -> dict[str, float]:
    """Generic loop: sample windows, ``loss, logs = step_fn(windows)``, clip, AdamW, schedule.

    Args:
        extra: optional [S, L + 1] fixed sequences (e.g. target greedy continuations); a step uses
            a batch of whole rows of it instead of stream windows with probability ``extra_frac``.
    Returns the mean of each logged value over the last 10% of steps plus ``seconds``.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr)
    total = sum(p.steps for p in phases)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, total, warmup))
    tail_from = int(total * 0.9)
    tail: dict[str, list[float]] = {}
    t0 = time.time()
    model.train()
    bar = tqdm(total=total, desc=desc, mininterval=5.0, unit="step")
    step = 0
    for phase in phases:
        batch = max(1, tokens_per_step // phase.seq_len)
        for _ in range(phase.steps):
            if extra is not None and torch.rand((), generator=gen).item() < extra_frac:
                rows = torch.randint(0, extra.shape[0], (max(1, tokens_per_step // extra.shape[1]),), generator=gen)
                windows = extra[rows]
            else:
                windows = sample_windows(stream, batch, phase.seq_len, gen)
            loss, logs = step_fn(windows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step >= tail_from:
                for k, v in logs.items():
                    tail.setdefault(k, []).append(v)
            bar.set_postfix(seq=windows.shape[1] - 1, **{k: f"{v:.3f}" for k, v in logs.items()}, refresh=False)
            bar.update(1)
            step += 1
    bar.close()
    model.eval()
    out = {k: sum(v) / len(v) for k, v in tail.items()}
    out["seconds"] = time.time() - t0
    return out


def soft_load_loss(router_logits: tuple[torch.Tensor, ...], top_k: int, tau: float) -> torch.Tensor:
    """Differentiable top-k LOAD balance: E * sum_e (share_e - 1/E)^2, averaged over layers.

    The Switch/Mixtral aux loss only sees mean router probabilities; with near-uniform
    probabilities it sits at its minimum (2.0) even when an expert never makes anybody's top-k
    ("always third"), and its gradient moves every token's logit the same way. Here the share of
    expert e is a soft count of top-k membership, sigmoid((z_te - theta_t) / tau) with theta_t the
    midpoint between the k-th and (k+1)-th largest logits of token t (no gradient): the gradient
    acts on tokens NEAR the top-k boundary, so an under-used expert wins exactly the tokens it
    almost won, and an over-used one sheds its marginal tokens.

    Args:
        router_logits: per layer [tokens, E] router logits.
    Returns:
        scalar; 0 when every expert holds 1/E of the (token, slot) assignments.
    """
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for z in router_logits:
        z = z.float()
        num_experts = z.shape[-1]
        top = z.topk(top_k + 1, dim=-1).values.detach()  # [T, k+1]
        theta = 0.5 * (top[:, top_k - 1] + top[:, top_k])  # [T]
        member = torch.sigmoid((z - theta[:, None]) / tau)  # [T, E] soft top-k membership
        share = member.mean(0) / member.mean(0).sum()  # [E]
        total = total + num_experts * ((share - 1.0 / num_experts) ** 2).sum()
    return total / len(router_logits)


def target_step_fn(model: PreTrainedModel, balance_coef: float = 0.0, balance_tau: float = 0.3) -> StepFn:
    """Next-token CE + ``router_aux_loss_coef`` x Mixtral load-balancing loss (computed by HF)
    + ``balance_coef`` x :func:`soft_load_loss` (see there for why the HF loss alone is not enough)."""

    def step(windows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        inputs, labels = windows[:, :-1], windows[:, 1:]
        out = model(input_ids=inputs, output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss
        if balance_coef > 0:
            loss = loss + balance_coef * soft_load_loss(out.router_logits, model.config.num_experts_per_tok,
                                                        balance_tau)
        # The aux loss value sits near its minimum 2.0 whenever router probabilities are ~uniform,
        # even if the top-k choices all hit the same experts; so also log the smallest actual
        # share of (token, slot) assignments over experts and layers (uniform = 1/num_experts).
        with torch.no_grad():
            e = model.config.num_local_experts
            shares = [
                torch.bincount(lg.topk(model.config.num_experts_per_tok, -1).indices.flatten(), minlength=e)
                for lg in out.router_logits
            ]
            min_share = min((c.min() / c.sum()).item() for c in shares)
        return loss, {"ce": ce.item(), "aux": out.aux_loss.item(), "minshare": min_share}

    return step


def distill_step_fn(draft: PreTrainedModel, teacher: PreTrainedModel, alpha: float, temperature: float) -> StepFn:
    """Loss = (1 - alpha) * T^2 * KL(teacher_T || draft_T) + alpha * CE(draft, data).

    The forward KL over the full 4096-way distribution pushes the draft's argmax onto the
    teacher's, which is what greedy speculative acceptance measures; the small CE term keeps it
    anchored to real text.
    """
    teacher.eval()

    def step(windows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        inputs, labels = windows[:, :-1], windows[:, 1:]
        with torch.no_grad():
            t_logits = teacher(input_ids=inputs, output_router_logits=False).logits  # [B, T, V]
        d_logits = draft(input_ids=inputs).logits  # [B, T, V]
        t_logp = F.log_softmax(t_logits / temperature, dim=-1).flatten(0, 1)
        d_logp = F.log_softmax(d_logits / temperature, dim=-1).flatten(0, 1)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean") * temperature**2
        # At T=1 reuse the log-softmax for the CE (the [B*T, 4096] softmaxes dominate the step time).
        ce_logp = d_logp if temperature == 1.0 else F.log_softmax(d_logits, dim=-1).flatten(0, 1)
        ce = F.nll_loss(ce_logp, labels.flatten())
        loss = (1.0 - alpha) * kl + alpha * ce
        agree = (d_logp.argmax(-1) == t_logp.argmax(-1)).float().mean()  # greedy top-1 agreement
        return loss, {"kl": kl.item(), "ce": ce.item(), "agree": agree.item()}

    return step


@torch.no_grad()
def greedy_continuations(
    model: PreTrainedModel, stream: torch.Tensor, num: int, prompt_len: int, new_tokens: int, batch: int,
    seed: int,
) -> torch.Tensor:
    """Target greedy continuations of random training-text prompts: on-policy data for the draft.

    Speculative acceptance is measured on prompt + TARGET-GREEDY text, whose statistics (e.g.
    repetition loops) differ from human-written code; distilling on it too teaches the draft
    exactly the distribution it is evaluated on. Plain batched greedy decoding with a KV cache;
    eos is not special (a continuation may run into a new document, like the stream does).

    Returns:
        [num, prompt_len + new_tokens] int64 (prompt followed by its continuation).
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    model.eval()
    out = []
    for _ in tqdm(range(0, num, batch), desc="greedy continuations", mininterval=5.0):
        seqs = sample_windows(stream, batch, prompt_len - 1, gen)  # [b, prompt_len]
        cache = DynamicCache()
        logits = model(input_ids=seqs, cache=cache, use_cache=True, output_router_logits=False).logits
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]
            seqs = torch.cat([seqs, nxt], dim=1)
            logits = model(input_ids=nxt, cache=cache, use_cache=True, output_router_logits=False).logits
        out.append(seqs)
    return torch.cat(out)[:num]
