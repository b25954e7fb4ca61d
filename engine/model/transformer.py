"""Decoder-only transformer (Llama/Mixtral/Qwen families) computing what the HF reference computes.

A pure model in the gpt-fast spirit: weights are plain tensors read by on-disk name, the forward is
ragged (several sequences with different numbers of new tokens, see :class:`ForwardBatch`) over a
slot KV cache, and MoE experts are reached through an :class:`ExpertExecutor` applied from outside.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.expert_predictor import PreGatePredictor
from engine.kv_cache import KVCache
from engine.model.batch import ForwardBatch
from engine.model.dense import DenseOps
from engine.model.layers import (
    Rotary,
    attention_backends,
    grouped_attention,
    plan_grouped_attention,
    rms_norm,
)
from engine.model.moe import ExpertExecutor, submit_experts
from engine.model.names import layer_prefix, mlp_names, moe_prefix, router_name
from kernels.expert_ffn import linear_layout, swiglu
from kernels.routing import topk_routing


@dataclass
class _Attention:
    # q, k and v projections stacked into one matrix: one GEMM per layer instead of three.
    wqkv: torch.Tensor  # ((num_heads + 2 * num_kv_heads) * head_dim, hidden)
    wo: torch.Tensor  # (hidden, num_heads * head_dim)
    bqkv: torch.Tensor | None = None  # ((num_heads + 2 * num_kv_heads) * head_dim,)
    bo: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None  # (num_heads + num_kv_heads, head_dim) Qwen3: q_norm rows, then k_norm


@dataclass
class _Layer:
    attn: _Attention
    input_norm: torch.Tensor  # (hidden,)
    post_attn_norm: torch.Tensor  # (hidden,)
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # dense (gate, up, down)
    router: torch.Tensor | None = None  # (num_experts, hidden)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # Qwen2-MoE shared expert
    shared_gate: torch.Tensor | None = None  # (1, hidden)


class Transformer:
    """The target or draft model.

    Args:
        config: normalised model config.
        reader: checkpoint; routed expert weights are NOT read here (they belong to the executor).
        experts: executor for MoE layers (required for MoE configs).
        dtype, device: parameter and activation dtype/device.
        compile: run each layer's dense parts under ``torch.compile`` (:class:`DenseOps`); attention
            over the KV cache and the MoE dispatch stay eager.

    Raises:
        CheckpointError: a missing tensor or a shape mismatch (names the tensor).
    """

    def __init__(
        self,
        config: ModelConfig,
        reader: CheckpointReader,
        experts: ExpertExecutor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        compile: bool = False,
    ) -> None:
        if config.is_moe and experts is None:
            raise ValueError(f"{config.architecture} is an MoE model: pass an ExpertExecutor")
        self.config, self.experts, self.dtype, self.device = config, experts, dtype, device
        load = _Loader(reader, dtype, device)
        c = config
        self.embed = load("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.norm = load("model.norm.weight", (c.hidden_size,))
        # The LM head in its own (CPU: column-major) copy even when tied: the embedding is read by rows.
        self.lm_head = linear_layout(self.embed if c.tie_word_embeddings
                                     else load("lm_head.weight", (c.vocab_size, c.hidden_size)))
        self.layers = [self._load_layer(load, i) for i in range(c.num_layers)]
        self.dense = DenseOps(compile)
        self.predictor = self._predictor(experts)
        self.rotary = Rotary(c.head_dim, c.rope_theta, dtype, device)

    def _load_layer(self, load: _Loader, i: int) -> _Layer:
        c, p = self.config, layer_prefix(i)
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        a = p + "self_attn."
        # Llama/Qwen3 put attention_bias on o_proj too; Qwen2 biases only q/k/v.
        o_bias = c.attention_bias and c.architecture != "Qwen2MoeForCausalLM"
        outs = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
        attn = _Attention(
            wqkv=linear_layout(torch.cat([load(f"{a}{n}.weight", (o, c.hidden_size)) for n, o in outs.items()])),
            wo=load.linear(a + "o_proj.weight", (c.hidden_size, q_out)),
            bqkv=torch.cat([load(f"{a}{n}.bias", (o,)) for n, o in outs.items()]) if c.attention_bias else None,
            bo=load(a + "o_proj.bias", (c.hidden_size,)) if o_bias else None,
            qk_norm=torch.stack([load(a + "q_norm.weight", (c.head_dim,))] * c.num_heads
                                + [load(a + "k_norm.weight", (c.head_dim,))] * c.num_kv_heads) if c.qk_norm else None,
        )
        layer = _Layer(attn, load(p + "input_layernorm.weight", (c.hidden_size,)),
                       load(p + "post_attention_layernorm.weight", (c.hidden_size,)))
        if c.moe is not None and i in c.moe.sparse_layers:
            layer.router = load.linear(router_name(c, i), (c.moe.num_experts, c.hidden_size))
            if c.moe.shared_expert_intermediate_size:
                sp = moe_prefix(c, i) + "shared_expert."
                layer.shared = load.mlp(sp, c.moe.shared_expert_intermediate_size, c.hidden_size)
                layer.shared_gate = load.linear(moe_prefix(c, i) + "shared_expert_gate.weight", (1, c.hidden_size))
        else:
            layer.mlp = load.mlp(p + "mlp.", c.intermediate_size, c.hidden_size)
        return layer

    def _predictor(self, experts: ExpertExecutor | None) -> PreGatePredictor | None:
        """Prefetch hints for an executor that takes them (``prefetch_enabled``: an offloading pool)."""
        if not getattr(experts, "prefetch_enabled", False):
            return None
        routers = {i: layer.router for i, layer in enumerate(self.layers) if layer.router is not None}
        return PreGatePredictor(routers, self.config.moe.top_k, experts.prefetch)

    def new_kv_cache(self, max_seqs: int, max_len: int | None = None) -> KVCache:
        """A cache sized for this model; ``max_len`` defaults to the context window."""
        c = self.config
        return KVCache(c.num_layers, max_seqs, max_len or c.max_position_embeddings, c.num_kv_heads,
                       c.head_dim, self.dtype, self.device)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run new tokens of every sequence in ``batch`` and return float32 logits.

        Returns:
            ``(len(batch.logits_indices), vocab_size)`` float32 logits of the selected rows.
        """
        return self.forward_with_features(batch, kv, ())[0]

    @torch.inference_mode()
    def forward_with_features(self, batch: ForwardBatch, kv: KVCache,
                              layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, plus the residual stream entering each layer of ``layer_ids`` for every
        new token (what an EAGLE-3 head reads; vLLM's ``aux_hidden_states`` convention: id ``i``
        is the input of layer ``i``, id 0 the embeddings; specmoe also takes ``num_layers``, the
        last layer's output before the final norm).

        With an executor whose experts run elsewhere and that asks for ``microbatches`` > 1 (the
        Ray expert router), the batch's sequences are split into that many micro-batches whose
        layers interleave: one micro-batch's attention runs while another's experts are out (two-
        batch overlap, as in DeepSeek-V3's inference and SGLang's ``--enable-two-batch-overlap``).
        Each micro-batch computes exactly what it would alone, so the output is the same.

        Returns:
            the logits, and ``(num_tokens, len(layer_ids) * hidden)`` features in ``layer_ids``
            order (None when ``layer_ids`` is empty).
        """
        parts = batch.split(getattr(self.experts, "microbatches", 1)) if self.experts is not None else [batch]
        with attention_backends(self.device):  # around every micro-batch: their layers interleave
            outs = _interleave([self._layer_steps(b, kv, layer_ids) for b in parts])
        if len(outs) == 1:
            return outs[0]
        logits = torch.cat([o[0] for o in outs])
        return logits, (torch.cat([o[1] for o in outs]) if layer_ids else None)

    def _layer_steps(self, batch: ForwardBatch, kv: KVCache, layer_ids: tuple[int, ...]):
        """The forward of one (micro-)batch as a generator: it yields while a MoE layer's experts
        are out (submitted, not yet waited for) and returns ``(logits, features)``."""
        x = F.embedding(batch.input_ids, self.embed)  # (num_tokens, hidden)
        captured: dict[int, torch.Tensor] = {}
        plan = plan_grouped_attention(batch, self.config.sliding_window)  # the same for every layer
        cos, sin = self.rotary.cos_sin(batch.positions, plan.max_kv)
        c, dense = self.config, self.dense
        for i, layer in enumerate(self.layers):
            if i in layer_ids:
                captured[i] = x
            a = layer.attn
            q, k, v = dense.attention_inputs(x, layer.input_norm, a.wqkv, a.bqkv, a.qk_norm, cos, sin,
                                             c.rms_norm_eps, c.num_heads, c.num_kv_heads)
            out = grouped_attention(q, k, v, kv.k[i], kv.v[i], plan)
            x, h = dense.attention_output(out, x, a.wo, a.bo, layer.post_attn_norm, c.rms_norm_eps)
            if layer.router is None:
                x = x + swiglu(h, *layer.mlp)
                continue
            moe = self.config.moe
            routing = topk_routing(F.linear(h, layer.router), moe.top_k, moe.renormalize)
            if self.predictor is not None:
                self.predictor.hint(i, h, routing)
            pending = submit_experts(self.experts, i, h, routing)
            try:
                yield  # another micro-batch's attention runs while these experts are out
            except GeneratorExit:  # another micro-batch failed: collect these experts, then stop
                with contextlib.suppress(Exception):
                    pending()
                raise
            out = pending()
            if layer.shared is not None:
                out = out + torch.sigmoid(F.linear(h, layer.shared_gate)) * swiglu(h, *layer.shared)
            x = x + out
        captured[len(self.layers)] = x
        features = torch.cat([captured[i] for i in layer_ids], -1) if layer_ids else None
        x = rms_norm(x[batch.logits_indices], self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float(), features


def _interleave(steps: list) -> list:
    """Drive generators round-robin until each returns; their return values in order."""
    results: list = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        for j in list(live):
            try:
                next(steps[j])
            except StopIteration as done:
                results[j] = done.value
                live.remove(j)
            except BaseException:
                for other in live:  # the others drain what they have out (see _layer_steps)
                    if other != j:
                        steps[other].close()
                raise
    return results


class _Loader:
    """Reads named tensors with shape checks into the model dtype/device."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, device) -> None:
        self.reader, self.dtype, self.device = reader, dtype, device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.get(name, shape, self.dtype, self.device)

    def linear(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """A weight read by ``F.linear``, in :func:`kernels.expert_ffn.linear_layout`."""
        return linear_layout(self(name, shape))

    def mlp(self, prefix: str, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, u, d = mlp_names(prefix)
        return self.linear(g, (inter, hidden)), self.linear(u, (inter, hidden)), self.linear(d, (hidden, inter))
