"""Tiny random-weight checkpoints of every supported architecture, written with transformers.

transformers is the reference implementation here (a test extra); runtime code never imports it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
    eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

ARCHITECTURES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, shared_expert_intermediate_size=24, mlp_only_layers=[1], **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=6, norm_topk_prob=True, **MOE)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def byte_tokenizer() -> Tokenizer:
    """A word-level tokenizer over VOCAB single-character tokens (enough for string prompts)."""
    vocab = {chr(32 + i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=chr(32)))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tok


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0):
    """Save a random tiny ``arch`` model to ``out_dir``; returns the transformers model (eval, fp32)."""
    import transformers

    config_cls, model_cls, extra = ARCHITECTURES[arch]
    kwargs = {**COMMON, **extra}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(out_dir)
    byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    return model
