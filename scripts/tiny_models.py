"""Configs, parameter accounting and checkpoint writing for the bundled target/draft pair.

Target: ``MixtralForCausalLM`` (8 experts, top-2). Draft: dense ``LlamaForCausalLM`` with tied
embeddings. Both share the byte-level BPE tokenizer (eos = ``<|endoftext|>`` = id 0, no bos/pad).
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)

from scripts.tiny_tokenizer import save_hf_tokenizer

EOS_ID = 0


@dataclass(frozen=True)
class TargetSize:
    """Shape knobs of the MoE target (defaults give ~4.4 M total / ~2.0 M active parameters)."""

    hidden: int = 128
    intermediate: int = 256  # per expert
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    aux_loss_coef: float = 0.02


@dataclass(frozen=True)
class DraftSize:
    """Shape knobs of the dense draft (defaults give ~0.37 M parameters, tied embeddings)."""

    hidden: int = 64
    intermediate: int = 192
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4


def target_config(size: TargetSize, vocab_size: int, max_positions: int = 1024) -> MixtralConfig:
    """Mixtral config; ``output_router_logits=True`` so the HF forward adds the load-balancing loss."""
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        num_local_experts=size.experts,
        num_experts_per_tok=size.top_k,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=size.aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )


def draft_config(size: DraftSize, vocab_size: int, max_positions: int = 1024) -> LlamaConfig:
    """Llama config with tied input/output embeddings (the embedding is most of a tiny model)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )


def count_params(model: PreTrainedModel) -> dict[str, int]:
    """Total and per-token ACTIVE parameter counts (shared/tied tensors counted once).

    Active = embedding + attention + norms + router + ``top_k`` of ``num_experts`` experts + lm_head.
    For a dense model active == total. The embedding table is counted in full (convention of the
    model card), even though a token only reads one row of it.
    """
    seen: set[int] = set()
    total = 0
    active = 0.0
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if experts and ".experts." in name:
            active += p.numel() * top_k / experts  # each token runs top_k of the experts
        else:
            active += p.numel()
    return {"total": total, "active": int(round(active))}


def copy_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """Deep copy of a config, so saving tweaks never leak into the live model."""
    return _copy.deepcopy(config)


def save_checkpoint(model: PreTrainedModel, tok: Tokenizer, out_dir: Path) -> None:
    """Write a Hugging Face checkpoint dir: config, bf16 safetensors, tokenizer, generation config.

    The in-memory model is left in fp32 (a bf16 copy is saved), so it can keep serving as teacher.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = GenerationConfig(eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=None, do_sample=False)
    config = copy_config(model.config)
    if hasattr(config, "output_router_logits"):
        # Training needs the router logits for the aux loss; inference does not (as in Mixtral-8x7B).
        config.output_router_logits = False
    copy = type(model)(config)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = gen
    copy.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    save_hf_tokenizer(tok, out_dir, model_max_length=model.config.max_position_embeddings)


def build_target(size: TargetSize, vocab_size: int) -> MixtralForCausalLM:
    """Fresh randomly initialised target (call ``torch.manual_seed`` first for determinism)."""
    return MixtralForCausalLM(target_config(size, vocab_size))


def build_draft(size: DraftSize, vocab_size: int) -> LlamaForCausalLM:
    """Fresh randomly initialised draft (call ``torch.manual_seed`` first for determinism)."""
    return LlamaForCausalLM(draft_config(size, vocab_size))
