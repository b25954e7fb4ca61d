"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", Section 3 and Figure 5), in the checkpoint layout the published heads use.

Architecture, per draft position ``p`` (row ``p`` pairs token ``x_{p+1}`` with the feature of
position ``p``, and predicts ``x_{p+2}``):

* feature: the target's residual stream entering three of its layers (low, middle, high; layer ids
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; id ``num_layers`` means the last layer's output,
  a specmoe extension: published heads and vLLM use ids below ``num_layers``) concatenated, ``(3 * target_hidden,)``, projected
  by ``fc`` to ``hidden``; on later draft steps the head's own previous output (already ``hidden``).
* one decoder layer whose attention input is ``cat(input_layernorm(embed(x_{p+1})), hidden_norm(h))``
  (``2 * hidden`` wide), with the residual taken from ``h`` (before ``hidden_norm``); SwiGLU MLP.
* ``norm`` then ``lm_head`` over a reduced draft vocabulary; draft id ``d`` is target id
  ``d + d2t[d]``. The token embedding is the head's ``embed_tokens.weight`` or else the target's.

On-disk layout (SafeAILab EAGLE / SpecForge / vLLM ``LlamaForCausalLMEagle3``): ``config.json`` with
``draft_vocab_size`` and ``eagle_config``; tensors ``fc.weight``, ``midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` and
optionally ``t2d`` and ``embed_tokens.weight`` (``layers.0.`` for ``midlayer.`` and a ``model.``
prefix are accepted too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig, _field_getter, _rope_theta, read_config_json
from engine.errors import CheckpointError, ConfigError
from engine.kv_cache import KVCache
from engine.model.batch import ForwardBatch
from engine.model.layers import Rotary, apply_rotary, attention, attention_backends, plan_attention, rms_norm
from kernels.expert_ffn import swiglu

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    """The head's ``config.json``, normalised."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    layer_ids: tuple[int, ...]


def load_eagle3_config(path: Path, target: ModelConfig) -> Eagle3Config:
    """Read and check a head's ``config.json`` against its target.

    Layer ids default to vLLM's ``(2, num_layers // 2, num_layers - 3)`` when the config has none.

    Raises:
        CheckpointError: no or unparsable config.json.
        ConfigError: wrong architecture, a missing field, or a head that does not fit the target
            (vocabulary, hidden size, layer ids); the message names the field.
    """
    raw = read_config_json(path, "an EAGLE-3 head directory")
    file = path / "config.json"
    arch = (raw.get("architectures") or [None])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise ConfigError(f"{file}: config.architectures: {arch!r} is not an EAGLE-3 head "
                          f"(expected one of {', '.join(EAGLE3_ARCHITECTURES)}); speculative_method eagle3 "
                          f"takes an EAGLE-3 head as draft_model (the bundled one: checkpoints/stdlib-eagle3)")
    get = _field_getter(raw)
    if get("num_hidden_layers", int) != 1:
        raise ConfigError(f"{file}: config.num_hidden_layers: an EAGLE-3 head has 1 decoder layer, "
                          f"got {raw['num_hidden_layers']}")
    hidden, heads = get("hidden_size", int), get("num_attention_heads", int)
    n = target.num_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    cfg = Eagle3Config(
        hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        intermediate_size=get("intermediate_size", int), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(raw),
        max_position_embeddings=get("max_position_embeddings", int), vocab_size=get("vocab_size", int),
        draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]), layer_ids=tuple(int(i) for i in ids))
    _check_fits(file, cfg, target)
    return cfg


def check_feature_layers(layer_ids: tuple[int, ...], num_layers: int, field: str) -> None:
    """The target layers whose input an EAGLE-3 head reads: three ids in ``[0, num_layers]``
    (``num_layers``: the last layer's output).

    Raises:
        ConfigError: otherwise, the message starting with ``field``.
    """
    if len(layer_ids) != 3 or not all(0 <= i <= num_layers for i in layer_ids):
        raise ConfigError(f"{field}: need three layer ids in [0, {num_layers}] of the target, got {list(layer_ids)}")


def _check_fits(file: Path, cfg: Eagle3Config, target: ModelConfig) -> None:
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"{file}: config.vocab_size: {cfg.vocab_size} differs from the target's "
                          f"{target.vocab_size} (the head must use the target's tokenizer)")
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{file}: config.target_hidden_size (or hidden_size): the head reads "
                          f"{cfg.target_hidden_size}-wide target features, the target's hidden size is {target.hidden_size}")
    check_feature_layers(cfg.layer_ids, target.num_layers, f"{file}: config.eagle_config.eagle_aux_hidden_state_layer_ids")
    if not 1 <= cfg.draft_vocab_size <= cfg.vocab_size:
        raise ConfigError(f"{file}: config.draft_vocab_size: must be in [1, {cfg.vocab_size}], got {cfg.draft_vocab_size}")


class Eagle3Head:
    """A loaded EAGLE-3 head: weights, the draft->target id map, and its ragged forward.

    Args:
        path: head checkpoint directory.
        target: the target's config and its ``(vocab, hidden)`` input embedding (used when the head
            stores none).
        dtype, device: parameter and activation dtype/device.

    Raises:
        CheckpointError: a missing tensor or a wrong shape (named), or a ``d2t`` map that sends two
            draft ids to one target id or outside the vocabulary.
        ConfigError: see :func:`load_eagle3_config`.
    """

    def __init__(self, path: str | Path, target: ModelConfig, target_embed: torch.Tensor,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"EAGLE-3 head directory {str(path)!r} does not exist")
        self.config = c = load_eagle3_config(path, target)
        self.dtype, self.device = dtype, device
        reader = CheckpointReader(path)
        get = _NameResolver(reader, dtype, device)
        h, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = get("fc.weight", (h, 3 * c.target_hidden_size))
        self.input_norm = get("midlayer.input_layernorm.weight", (h,))
        self.hidden_norm = get("midlayer.hidden_norm.weight", (h,))
        self.post_attn_norm = get("midlayer.post_attention_layernorm.weight", (h,))
        a = "midlayer.self_attn."
        self.wqkv = torch.cat([get(a + "q_proj.weight", (q_out, 2 * h)), get(a + "k_proj.weight", (kv_out, 2 * h)),
                               get(a + "v_proj.weight", (kv_out, 2 * h))])
        self.wo = get(a + "o_proj.weight", (h, q_out))
        m, inter = "midlayer.mlp.", c.intermediate_size
        self.mlp = (get(m + "gate_proj.weight", (inter, h)), get(m + "up_proj.weight", (inter, h)),
                    get(m + "down_proj.weight", (h, inter)))
        self.norm = get("norm.weight", (h,))
        self.lm_head = get("lm_head.weight", (c.draft_vocab_size, h))
        if get.has("embed_tokens.weight"):
            self.embed = get("embed_tokens.weight", (c.vocab_size, h))
        elif tuple(target_embed.shape) != (c.vocab_size, h):
            raise CheckpointError(f"{path}: no embed_tokens.weight, and the target's embedding "
                                  f"{tuple(target_embed.shape)} does not fit the head's hidden size {h}")
        else:
            self.embed = target_embed.to(device=device, dtype=dtype)
        self.draft_to_target = self._load_d2t(get, path)  # (draft_vocab,) int64 target ids
        self.rotary = Rotary(c.head_dim, c.rope_theta, dtype, device)

    def _load_d2t(self, get: _NameResolver, path: Path) -> torch.Tensor:
        c = self.config
        if not get.has("d2t"):
            if c.draft_vocab_size != c.vocab_size:
                raise CheckpointError(f"{path}: tensor 'd2t' is missing (needed: draft_vocab_size "
                                      f"{c.draft_vocab_size} < vocab_size {c.vocab_size})")
            return torch.arange(c.vocab_size, device=self.device)
        offsets = get("d2t", (c.draft_vocab_size,), keep_dtype=True)
        if offsets.is_floating_point():
            raise CheckpointError(f"{path}: tensor 'd2t' must hold integer offsets, got {offsets.dtype}")
        ids = torch.arange(c.draft_vocab_size, device=self.device) + offsets.long()
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel():
            raise CheckpointError(f"{path}: tensor 'd2t' maps draft ids outside [0, {c.vocab_size}) or two draft "
                                  f"ids to one target id (target id = draft id + d2t[draft id])")
        return ids

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.config.layer_ids

    def new_kv_cache(self, max_seqs: int, max_len: int | None = None) -> KVCache:
        """A one-layer cache for the head; ``max_len`` defaults to its context window."""
        c = self.config
        return KVCache(1, max_seqs, max_len or c.max_position_embeddings, c.num_kv_heads, c.head_dim,
                       self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over ragged rows (``batch.input_ids`` holds each row's token ``x_{p+1}``).

        Args:
            features: ``(num_tokens, 3 * target_hidden)`` target features (fused by ``fc``) or
                ``(num_tokens, hidden)`` head outputs of the previous draft step.

        Returns:
            ``(num_logits, vocab)`` float32 logits over the TARGET vocabulary (tokens outside the
            draft vocabulary at ``-inf``), and ``(num_logits, hidden)`` the head's pre-norm outputs
            of those rows (the next draft step's features).
        """
        c = self.config
        h = F.linear(features.to(self.dtype), self.fc) if features.shape[-1] != c.hidden_size else features.to(self.dtype)
        emb = F.embedding(batch.input_ids, self.embed)
        x = torch.cat([rms_norm(emb, self.input_norm, c.rms_norm_eps), rms_norm(h, self.hidden_norm, c.rms_norm_eps)], -1)
        plan = plan_attention(batch)
        cos, sin = self.rotary.cos_sin(batch.positions, plan.max_kv)
        n, nq, nkv = x.shape[0], c.num_heads, c.num_kv_heads
        qkv = F.linear(x, self.wqkv)
        qk = apply_rotary(qkv[:, : (nq + nkv) * c.head_dim].view(n, nq + nkv, c.head_dim), cos, sin)
        v = qkv[:, (nq + nkv) * c.head_dim:].view(n, nkv, c.head_dim)
        with attention_backends(self.device):
            out = attention(qk[:, :nq], qk[:, nq:], v, kv.k[0], kv.v[0], batch, plan)
        r = h + F.linear(out.flatten(1), self.wo)
        r = r + swiglu(rms_norm(r, self.post_attn_norm, c.rms_norm_eps), *self.mlp)
        r = r[batch.logits_indices]
        draft_logits = F.linear(rms_norm(r, self.norm, c.rms_norm_eps), self.lm_head).float()
        logits = draft_logits.new_full((r.shape[0], c.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft_logits
        return logits, r


class _NameResolver:
    """Reads head tensors by canonical name, accepting the ``layers.0.`` and ``model.`` spellings."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, device) -> None:
        self.reader, self.dtype, self.device = reader, dtype, device

    def _find(self, name: str) -> str | None:
        alt = name.replace("midlayer.", "layers.0.")
        return next((n for n in (name, alt, "model." + name, "model." + alt) if n in self.reader), None)

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def __call__(self, name: str, shape: tuple[int, ...], keep_dtype: bool = False) -> torch.Tensor:
        found = self._find(name)
        if found is None:
            raise CheckpointError(f"{self.reader.dir}: tensor {name!r} is missing from the EAGLE-3 head")
        return self.reader.get(found, shape, None if keep_dtype else self.dtype, self.device)
