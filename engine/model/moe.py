"""Sparse MoE: router -> dispatch -> experts -> combine, with experts behind an executor interface.

The model computes router logits and top-k routing itself and hands the rest to an
:class:`ExpertExecutor`: :class:`LocalExpertExecutor` runs every expert in-process; the Ray expert
router (``actors/``) sends each expert's token group to expert actors. Both return the same
combined output, so the model never knows where its experts live.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig
from engine.model.names import expert_names
from kernels.expert_ffn import expert_ffn, linear_layout
from kernels.routing import RoutingResult


class ExpertExecutor(Protocol):
    """Runs the routed experts of one MoE layer.

    An executor whose experts are offloaded may also have ``prefetch_enabled = True`` and a
    ``prefetch(layer, expert_ids)`` method: the model then sends it, before each MoE layer's
    ``execute``, the experts predicted for the next one (:mod:`engine.expert_predictor`).
    """

    def execute(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """``hidden``: ``(num_tokens, hidden_size)`` -> ``(num_tokens, hidden_size)``, the
        routing-weighted sum of each token's top-k expert outputs (shared experts excluded)."""
        ...


def submit_experts(executor: ExpertExecutor, layer: int, hidden: torch.Tensor,
                   routing: RoutingResult) -> Callable[[], torch.Tensor]:
    """Start one MoE layer's experts; the returned function waits for ``execute``'s result.

    An executor with a ``submit`` method (the same arguments, returning that function) keeps its
    experts running while the caller goes on (two-batch overlap); any other runs ``execute`` now.
    """
    if hasattr(executor, "submit"):
        return executor.submit(layer, hidden, routing)
    out = executor.execute(layer, hidden, routing)
    return lambda: out


class DispatchPlan(NamedTuple):
    """Assignments grouped by expert.

    Attributes:
        hidden: ``(num_tokens * top_k, hidden_size)`` token rows in expert order.
        weights: ``(num_tokens * top_k,)`` float32 routing weight of each row.
        token_index: ``(num_tokens * top_k,)`` int64 source token of each row.
        expert_counts: ``(num_experts,)`` int64 rows per expert.
    """

    hidden: torch.Tensor
    weights: torch.Tensor
    token_index: torch.Tensor
    expert_counts: torch.Tensor


def dispatch(hidden: torch.Tensor, routing: RoutingResult) -> DispatchPlan:
    """Group token rows by expert using the routing permutation."""
    top_k = routing.topk_ids.shape[1]
    token_index = routing.sorted_slots // top_k
    weights = routing.topk_weights.reshape(-1)[routing.sorted_slots]
    return DispatchPlan(hidden[token_index], weights, token_index, routing.expert_counts)


def combine(expert_out: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum weighted expert rows back per token: ``(rows, hidden)`` -> ``(num_tokens, hidden)``."""
    out = expert_out.new_zeros(num_tokens, expert_out.shape[1])
    return out.index_add_(0, token_index, expert_out)


def expert_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """On-disk shapes of one routed expert's (gate, up, down): ``(I, H)``, ``(I, H)``, ``(H, I)``."""
    inter, hsize = config.moe.intermediate_size, config.hidden_size
    return (inter, hsize), (inter, hsize), (hsize, inter)


def expert_entry_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one routed expert's (gate, up, down) weights in ``dtype``: one resident entry."""
    return sum(math.prod(s) for s in expert_shapes(config)) * dtype.itemsize


class ExpertStore:
    """Stacked weights of some experts of every MoE layer, loaded lazily from a checkpoint.

    Args:
        reader: checkpoint to read from; only the held experts' tensors are read.
        config: the model config (must be MoE).
        expert_ids: experts held, e.g. ``[3]`` for a one-expert actor; None holds all.
        dtype, device: where the weights live.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        config: ModelConfig,
        expert_ids: Iterable[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        assert config.moe is not None, "ExpertStore needs an MoE config"
        self.config = config
        self.expert_ids = sorted(expert_ids) if expert_ids is not None else list(range(config.moe.num_experts))
        bad = [e for e in self.expert_ids if not 0 <= e < config.moe.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} out of range [0, {config.moe.num_experts})")
        self._reader, self._dtype, self._device = reader, dtype, device
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate, w_up, w_down) stacked over held experts: ``(E_local, I, H)``, ``(E_local, I, H)``,
        ``(E_local, H, I)``; loaded on first use."""
        if layer not in self._layers:
            if layer not in self.config.moe.sparse_layers:
                raise ValueError(f"layer {layer} is not an MoE layer")
            stacks = []
            for which, shape in enumerate(expert_shapes(self.config)):
                tensors = [
                    self._reader.get(expert_names(self.config, layer, e)[which], shape, self._dtype, self._device)
                    for e in self.expert_ids
                ]
                stacks.append(linear_layout(torch.stack(tensors)))
            self._layers[layer] = (stacks[0], stacks[1], stacks[2])
        return self._layers[layer]

    def load_all(self) -> None:
        for layer in self.config.moe.sparse_layers:
            self.weights(layer)

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_counts: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the held experts on rows grouped in ``self.expert_ids`` order.

        Args:
            hidden: ``(rows, hidden_size)``; expert_counts: ``(len(expert_ids),)`` int64;
            weights: optional ``(rows,)`` float32 routing weights applied to the outputs.
        """
        w_gate, w_up, w_down = self.weights(layer)
        return expert_ffn(hidden, expert_counts, w_gate, w_up, w_down, weights)


class LocalExpertExecutor:
    """Every expert in this process: dispatch, one grouped FFN call, combine."""

    def __init__(self, store: ExpertStore) -> None:
        if len(store.expert_ids) != store.config.moe.num_experts:
            raise ValueError("LocalExpertExecutor needs a store holding every expert")
        self.store = store

    def execute(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        plan = dispatch(hidden, routing)
        out = self.store.forward(layer, plan.hidden, plan.expert_counts, plan.weights)
        return combine(out, plan.token_index, hidden.shape[0])
