"""Which experts the next MoE layer will need, known one layer ahead (prefetch hints).

Pre-gating: the router of layer ``j`` (the next MoE layer) applied to layer ``i``'s router input
predicts layer ``j``'s experts before layer ``i``'s experts have even run (Pre-gated MoE, Hwang et
al., ISCA 2024, sec. 4, which trains such a gate; ProMoE, Song et al. 2024, reports that the
residual stream changes little between adjacent layers, so the model's own next gate already
predicts well, which is what is used here, with no extra weights). The rows of a verify pass are the
draft tokens plus each sequence's last token, so the hint covers every draft token of the pass.
Consecutive forward passes of the same sequences route alike, so the hint also holds the experts
the next layer routed to in the previous pass (on the bundled model, pre-gating alone missed
about 18 % of next-layer uses at concurrency 1, the previous pass alone about 9 %); the last MoE
layer hints the first one of the next pass with that alone.
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
        self._last: dict[int, set[int]] = {}  # layer -> experts it routed to in its latest forward
        self._first_before: set[int] = set()  # the first MoE layer's experts the pass before

    def hint(self, layer: int, hidden: torch.Tensor, routing: RoutingResult) -> None:
        """Predict and send the next MoE layer's experts.

        Args:
            layer: the MoE layer about to dispatch; hidden: ``(num_tokens, hidden_size)`` its router
                input; routing: its routing (remembered for the next forward pass).
        """
        routed = set(routing.expert_counts.nonzero().flatten().tolist())
        if layer == self.layers[0]:
            self._first_before = self._last.get(layer, set())
        self._last[layer] = routed
        nxt = self._next.get(layer)
        if nxt is None:  # the last MoE layer: the next pass's first layer, from its last two passes
            first = self.layers[0]
            self.prefetch(first, sorted(self._last.get(first, set()) | self._first_before))
            return
        ids = torch.topk(F.linear(hidden, self.routers[nxt]), self.k, dim=-1).indices
        self.prefetch(nxt, sorted(set(ids.flatten().tolist()) | self._last.get(nxt, set())))
