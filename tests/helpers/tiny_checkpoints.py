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


def make_eagle3_head(out_dir: Path, seed: int = 0, layer_ids: tuple[int, ...] = (0, 1, 2), draft_vocab: int = 96,
                     hidden: int = 32, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Save a random EAGLE-3 head for the tiny targets above (hidden 32, 2 layers, vocab VOCAB) in the
    published layout (``midlayer.*``, ``d2t``/``t2d``, no embedding); returns its tensors."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, inter = 4, 2, 8, 48
    rand = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    norm = lambda: 1 + rand(hidden)  # noqa: E731
    draft_ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * 32), "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter), "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, hidden) * 5, "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}))
    return tensors
