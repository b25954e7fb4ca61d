"""On-disk tensor names of each supported architecture (Hugging Face transformers layouts)."""

from __future__ import annotations

from engine.config import ModelConfig


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def moe_prefix(config: ModelConfig, layer: int) -> str:
    """``block_sparse_moe.`` for Mixtral, ``mlp.`` for the Qwen MoE family."""
    sub = "block_sparse_moe." if config.architecture == "MixtralForCausalLM" else "mlp."
    return layer_prefix(layer) + sub


def router_name(config: ModelConfig, layer: int) -> str:
    return moe_prefix(config, layer) + "gate.weight"


def expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) projection names of one routed expert.

    Mixtral stores them as w1 (gate), w3 (up), w2 (down); Qwen MoE as gate_proj/up_proj/down_proj.
    """
    base = f"{moe_prefix(config, layer)}experts.{expert}."
    if config.architecture == "MixtralForCausalLM":
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def mlp_names(prefix: str) -> tuple[str, str, str]:
    """(gate, up, down) names of a dense SwiGLU MLP under ``prefix`` (e.g. ``model.layers.0.mlp.``)."""
    return prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight"
