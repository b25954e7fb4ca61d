"""Which experts the next MoE layer will need, known one layer ahead (prefetch hints).

Pre-gating: the router of layer ``j`` (the next MoE layer) applied to layer ``i``'s router input
predicts layer ``j``'s experts before layer ``i``'s experts have even run (Pre-gated MoE, Hwang et
al., ISCA 2024, sec. 4, which trains such a gate; ProMoE, Song et al. 2024, reports that the
residual stream changes little between adjacent layers, so the model's own next gate already
predicts well, which is what is used here, with no extra weights). The rows of a verify pass are the
draft tokens plus each sequence's last token, so the hint covers every draft token of the pass.
The last MoE layer predicts the first one of the next forward pass from this pass's first-layer
routing (consecutive decode steps of the same sequences route alike).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.routing import RoutingResult

Prefetch = Callable[[int, list[int]], None]  # (layer, expert ids)


class PreGatePredictor:
    """Sends ``prefetch(next_layer, experts)`` for each MoE layer, before that layer's dispatch.

    Args:
        routers: ``{layer: (num_experts, hidden_size) gate weight}`` of every MoE layer.
        top_k: experts per token of the model; ``extra``: predict ``top_k + extra`` per token
            (more recall for more loads).
        prefetch: the expert executor's hint sink.
    """

    def __init__(self, routers: dict[int, torch.Tensor], top_k: int, prefetch: Prefetch, extra: int = 0) -> None:
        self.layers = sorted(routers)
        self.routers, self.prefetch = routers, prefetch
        self.k = min(top_k + extra, next(iter(routers.values())).shape[0])
        self._next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self._first_layer_experts: list[int] = []

    def hint(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> None:
        """Predict and send the next MoE layer's experts.

        Args:
            layer: the MoE layer about to dispatch; hidden: ``(num_tokens, hidden_size)`` its router
                input; routing: its routing (the first layer's is remembered for the wrap-around).
        """
        if layer == self.layers[0]:
            self._first_layer_experts = routing.expert_counts.nonzero().flatten().tolist()
        nxt = self._next.get(layer)
        if nxt is None:  # the last MoE layer: the next pass's first layer
            self.prefetch(self.layers[0], self._first_layer_experts)
            return
        ids = torch.topk(F.linear(hidden, self.routers[nxt]), self.k, dim=-1).indices
        self.prefetch(nxt, torch.unique(ids).tolist())
