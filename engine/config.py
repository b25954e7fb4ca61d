"""Model configuration: the Hugging Face ``config.json`` normalised into one typed Struct.

Supported architectures and the HF classes whose ``config.json`` they read:
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` (MoE targets) and
``LlamaForCausalLM``, ``Qwen3ForCausalLM`` (dense drafts). Both the transformers-4 (``rope_theta``)
and transformers-5 (``rope_parameters``) spellings are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from engine.errors import ConfigError

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES = MOE_ARCHITECTURES + DENSE_ARCHITECTURES


class MoEConfig(msgspec.Struct, frozen=True):
    """Sparse MoE block settings.

    Attributes:
        num_experts: routed experts per MoE layer.
        top_k: experts chosen per token.
        intermediate_size: per-expert FFN width.
        renormalize: divide the top-k weights by their sum (Mixtral: always; Qwen: norm_topk_prob).
        shared_expert_intermediate_size: Qwen2-MoE shared expert width (0 = none).
        sparse_layers: indices of the layers that are MoE (the others use a dense MLP).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()


class ModelConfig(msgspec.Struct, frozen=True):
    """Architecture-independent view of a decoder-only checkpoint config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def load_model_config(checkpoint_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` for EOS ids) from a checkpoint directory.

    Raises:
        CheckpointError: the directory or config.json is missing or not JSON.
        ConfigError: unknown architecture (the message lists the supported ones) or a missing,
            unsupported or out-of-range field (named: sizes below 1, ``num_experts_per_tok`` beyond
            the expert count, an EOS id outside the vocabulary).
    """
    raw = read_config_json(Path(checkpoint_dir), "a Hugging Face checkpoint directory")
    gen_path = Path(checkpoint_dir) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return parse_hf_config(raw, gen)


def read_config_json(directory: Path, kind: str) -> dict[str, Any]:
    """``directory/config.json`` as a dict.

    Raises:
        CheckpointError: the file is missing (the message asks whether ``directory`` is ``kind``)
            or is not JSON.
    """
    from engine.errors import CheckpointError

    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json (is {directory!s} {kind}?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def parse_hf_config(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Normalise an HF config dict. See :func:`load_model_config` for errors."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        # An EAGLE-3 head loaded as a model: the usual slip is a draft_model without its method.
        hint = " (an EAGLE-3 draft head: load it with speculative_method 'eagle3')" if "eagle" in str(arch).lower() else ""
        raise ConfigError(f"config.architectures: unsupported architecture {arch!r}{hint}; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    _refuse_unsupported(raw)
    defaults = _HF_DEFAULTS.get(arch, {})
    get = _field_getter(raw)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        _require_at_least(name, get(name, int), 1)
    _require_at_least("max_position_embeddings", get("max_position_embeddings", int), 2)
    num_heads = get("num_attention_heads", int)
    hidden = get("hidden_size", int)
    head_dim = raw.get("head_dim") or hidden // num_heads
    num_layers = get("num_hidden_layers", int)
    config = ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=int(head_dim),
        intermediate_size=get("intermediate_size", int),
        rms_norm_eps=float(raw.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
        rope_theta=_rope_theta(raw, defaults.get("rope_theta", 10000.0)),
        max_position_embeddings=get("max_position_embeddings", int),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=_attention_bias(arch, raw),
        qk_norm=arch in ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM"),
        sliding_window=_sliding_window(arch, raw, num_layers),
        eos_token_ids=_eos_ids(raw, generation_config or {}),
        moe=_moe_config(arch, raw, num_layers) if arch in MOE_ARCHITECTURES else None,
    )
    bad_eos = [i for i in config.eos_token_ids if not 0 <= i < config.vocab_size]
    if bad_eos:
        where = "generation_config.eos_token_id" if "eos_token_id" in (generation_config or {}) else "config.eos_token_id"
        raise ConfigError(f"{where}: {bad_eos[0]} is outside the vocabulary [0, {config.vocab_size})")
    return config


def _require_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"config.{name}: must be >= {low}, got {value}")


def _field_getter(raw: dict[str, Any]):
    def get(name: str, typ: type):
        if name not in raw or raw[name] is None:
            raise ConfigError(f"config.{name}: missing")
        try:
            return typ(raw[name])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.{name}: expected {typ.__name__}, got {raw[name]!r}") from e

    return get


# transformers' defaults for fields a config.json may leave out (its config classes'), where they
# differ from the common ones (rms_norm_eps 1e-6, rope_theta 10000): a Mixtral config without them
# ran with other values than transformers.
_HF_DEFAULTS = {"MixtralForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 1e6}}


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Config features the model code does not implement: refused by name rather than ignored
    (each one ignored gave output unlike transformers' for the same weights)."""
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"config.hidden_act: {act!r} is not supported (supported: 'silu')")
    if raw.get("mlp_bias"):
        raise ConfigError("config.mlp_bias: MLP biases are not supported")
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"config.quantization_config: quantized checkpoints ({method!r}) are not supported; "
                          f"use a bfloat16, float16 or float32 export")


def _rope_theta(raw: dict[str, Any], default: float = 10000.0) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    # The key the file itself uses, for the message.
    for where, source, key in (("rope_parameters", params, "rope_type"), ("rope_scaling", scaling, "rope_type"),
                               ("rope_scaling", scaling, "type")):
        if source.get(key, "default") != "default":
            raise ConfigError(f"config.{where}.{key}: {source[key]!r} is not supported (supported: 'default')")
    theta = params.get("rope_theta", raw.get("rope_theta", default))
    return float(theta)


def _attention_bias(arch: str, raw: dict[str, Any]) -> bool:
    if arch == "Qwen2MoeForCausalLM":
        return bool(raw.get("qkv_bias", True))  # Qwen2 always had q/k/v biases; v5 names the flag
    return bool(raw.get("attention_bias", False))


def _sliding_window(arch: str, raw: dict[str, Any], num_layers: int) -> int | None:
    """One attention window for every layer, or None. transformers' Llama has none (a
    ``sliding_window`` key there is ignored), Qwen only with ``use_sliding_window``; a window on
    some layers only (``layer_types``, or Qwen's ``max_window_layers`` below the layer count) is
    refused: the model applies one window to all."""
    if arch == "LlamaForCausalLM" or (arch.startswith("Qwen") and not raw.get("use_sliding_window", False)):
        return None
    window = raw.get("sliding_window")
    if not window:
        return None
    kinds = set(raw.get("layer_types") or [])
    if len(kinds) > 1:
        raise ConfigError(f"config.layer_types: a sliding window on some layers only ({sorted(kinds)}) is not "
                          f"supported")
    if kinds:
        return int(window) if kinds == {"sliding_attention"} else None
    mwl = raw.get("max_window_layers")
    if arch.startswith("Qwen") and mwl is not None and 0 < int(mwl) < num_layers:
        raise ConfigError(f"config.max_window_layers: {mwl} windows some of the {num_layers} layers only, which is "
                          f"not supported")
    return int(window)


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _moe_config(arch: str, raw: dict[str, Any], num_layers: int) -> MoEConfig:
    get = _field_getter(raw)
    if arch == "MixtralForCausalLM":
        num_experts = get("num_local_experts", int)
        return MoEConfig(
            num_experts=num_experts,
            top_k=_top_k(get, "num_local_experts", num_experts),
            intermediate_size=get("intermediate_size", int),
            renormalize=True,
            sparse_layers=tuple(range(num_layers)),
        )
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(raw.get("mlp_only_layers") or [])
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; hub configs use num_experts.
    experts_field = "num_experts" if "num_experts" in raw else "num_local_experts"
    num_experts = get(experts_field, int)
    sparse = tuple(i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=_top_k(get, experts_field, num_experts),
        intermediate_size=get("moe_intermediate_size", int),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        sparse_layers=sparse,
    )


def _top_k(get, experts_field: str, num_experts: int) -> int:
    """``num_experts_per_tok``, checked against the expert count where there are experts (a top-k
    beyond it failed every forward at run time instead of the load)."""
    top_k = get("num_experts_per_tok", int)
    if num_experts > 0 and not 1 <= top_k <= num_experts:
        raise ConfigError(f"config.num_experts_per_tok: must be in [1, config.{experts_field} = {num_experts}], "
                          f"got {top_k}")
    return top_k


def context_window(max_model_len: int | None, max_position_embeddings: int, field: str = "max_model_len") -> int:
    """The engine's context window in tokens: ``max_model_len``, or the model's
    ``max_position_embeddings`` when None.

    Raises:
        ConfigError: ``max_model_len`` outside ``[2, max_position_embeddings]`` (a larger window
            than the model was trained for, as vLLM refuses by default; and its KV cache would be
            sized for it); the message starts with ``field``.
    """
    if max_model_len is None:
        return max_position_embeddings
    if not 2 <= max_model_len <= max_position_embeddings:
        raise ConfigError(f"{field}: must be in [2, {max_position_embeddings}] (the model's "
                          f"max_position_embeddings), got {max_model_len}")
    return max_model_len
