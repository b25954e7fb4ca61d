"""Online step-cost models for the speculation controller (:mod:`engine.spec_controller`).

Step time is learned from the steps the engine actually runs, never from constants:

- :class:`OnlineLinearCost`: exponentially weighted ridge regression ``t = theta . x`` with
  non-negative coefficients, refreshed after every step (recursive least squares with forgetting,
  solved from its sufficient statistics so a badly conditioned start cannot run away). Steps are
  Huber-weighted (Huber 1964; weight ``min(1, c s / |r|)`` for residual ``r`` and a running
  residual scale ``s``), so a step stalled by something else (another process on the core, a
  page fault, a garbage collection) cannot move the coefficients far.
- :func:`prefill_attention_pairs`: the attention work of prefill chunks, which tokens alone miss:
  a chunk's queries attend over everything before them, so the same chunk late in a long prompt
  costs more than at its start.
- :class:`ExpertActivation`: how many distinct experts a forward over ``T`` tokens activates.
  Under top-k routing each token picks ``top_k`` of ``E`` experts; with an effective per-token
  activation probability ``p`` per expert, ``E[distinct] = E * (1 - (1 - p)^T)`` per MoE layer.
  ``p`` is fitted online from observed (tokens, distinct) pairs, so routing skew (hot experts)
  shows up as a smaller ``p`` than the uniform ``top_k / E``. This is the MoE effect on verify
  cost: more verified tokens touch more experts (Cascade; MoE-Spec), until all are active.

What the models predict is checked against what happened in :mod:`engine.spec_realised`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.model.moe import submit_experts


def prefill_attention_pairs(start: int, length: int) -> float:
    """Causal (query, key) pairs of a prefill chunk, in thousands: ``length`` queries at positions
    ``start .. start + length - 1``, each attending over the keys up to its own position, so
    ``length * (start + (length + 1) / 2) / 1e3``. A feature of the target's step cost: measured
    on the bundled pair (2026-12-05), a 241-token chunk at position 659 ran 1.8x what a cost linear
    in tokens predicted, where chunks at the start of a prompt ran 1.05x."""
    return length * (start + (length + 1) / 2) / 1e3


class LogQuantile:
    """Online ``q``-quantile of positive ratios (measured / predicted step time), tracked in log
    space by stochastic approximation (Robbins and Monro 1951; the quantile as the root of
    ``P(x <= m) - q``): each observation above the estimate raises its log by ``rate * q``, each
    other lowers it by ``rate * (1 - q)``, so it settles where a share ``1 - q`` lies above.
    Starts at 1 (predictions trusted)."""

    def __init__(self, q: float = 0.9, rate: float = 0.05) -> None:
        self.q, self.rate, self._log = q, rate, 0.0

    def observe(self, ratio: float) -> None:
        above = math.log(max(ratio, 1e-9)) > self._log
        self._log += self.rate * (self.q if above else self.q - 1.0)

    @property
    def value(self) -> float:
        return math.exp(self._log)


class OnlineLinearCost:
    """``seconds ~= theta . features`` fitted online; ``theta >= 0``.

    A handful of features (3-4), so the statistics, the solve and the predictions are plain Python
    floats: the controller updates and reads this every engine step, right after a forward has
    evicted the caches, where numpy's per-call overhead on 3x3 arrays cost ~40 us a step in
    place (a solve ~0.2 ms) against ~1.3 ms for a whole batch-1 step of the bundled pair.

    Args:
        num_features: length of every feature vector (include a constant 1 for a fixed cost).
        forgetting: weight kept by past observations per new one (0 < f <= 1); 0.97 forgets
            a step's influence after ~30 steps, so the model follows load changes.
        ridge: regulariser, relative to each feature's weighted energy (diagonal of the Gram matrix).
        huber: residuals beyond ``huber`` times the running residual scale are down-weighted.
        warmup: observations taken at full weight before the residual scale is trusted.
        relative_floor: the residual scale is at least this fraction of the prediction.
        resolve_every: observations after which the fit is solved again even if nothing predicted
            (predictions solve whatever is pending first).
        fixed_cost: feature 0 is a constant 1 (the step's fixed cost) and is left out of the
            ridge. Where the data cannot tell it from a marginal cost (every recent step of one
            shape: plain decoding at batch 1 has 1 token and 8 experts every step), a ridge on
            every feature split the time evenly between them, so a step of another shape was
            priced off a made-up slope; unregularised, the fixed cost takes it, and an untried
            shape is priced like the tried one until steps of its own show its slope (optimism
            that the controller's explore steps then test).
    """

    def __init__(self, num_features: int, forgetting: float = 0.97, ridge: float = 1e-3, huber: float = 2.0,
                 warmup: int = 8, relative_floor: float = 0.05, resolve_every: int = 8,
                 fixed_cost: bool = False) -> None:
        self.xtx = [[0.0] * num_features for _ in range(num_features)]  # weighted Gram matrix
        self.xty = [0.0] * num_features
        self.forgetting, self.ridge, self.huber, self.warmup = forgetting, ridge, huber, warmup
        self.relative_floor, self.resolve_every, self.fixed_cost = relative_floor, resolve_every, fixed_cost
        self.num_observations = 0
        self._coef = [0.0] * num_features  # the fitted coefficients (``theta`` as an array)
        self._pending = 0  # observations since the last solve
        self.residual_scale_s = 0.0  # EW mean absolute residual of the (weighted) fit, seconds

    def observe(self, features: list[float], seconds: float, robust: bool = True) -> None:
        """Add one measured step: ``features`` (len num_features), ``seconds`` its duration;
        ``robust=False`` takes it at full weight (a deliberately informative step, e.g. a probe)."""
        # Against the last solved fit, solved again once every ``resolve_every`` observations
        # at least: residuals against a stale fit would weight the next steps wrongly.
        predicted = self.predict(*features, refresh=self._pending >= self.resolve_every)
        residual = abs(seconds - predicted)
        # Never trust the scale below a relative floor: a fit that is exact on its usual points
        # must still learn from a rare, informative one (a probe of another draft length).
        limit = self.huber * max(self.residual_scale_s, self.relative_floor * abs(predicted))
        trusted = self.num_observations >= self.warmup
        w = limit / residual if robust and trusted and residual > limit > 0 else 1.0
        # The scale follows the clipped residual, so a run of outliers widens it only gradually.
        clipped = min(residual, limit) if trusted else residual
        self.residual_scale_s += (clipped - self.residual_scale_s) * \
            ((1.0 - self.forgetting) if trusted else 1.0 / (self.num_observations + 1))
        f = self.forgetting
        for row, xi in zip(self.xtx, features):  # xtx <- f xtx + w x x^T, xty <- f xty + w x y
            wxi = w * float(xi)
            for j, xj in enumerate(features):
                row[j] = f * row[j] + wxi * float(xj)
        self.xty = [f * b + w * float(xi) * seconds for b, xi in zip(self.xty, features)]
        self.num_observations += 1
        self._pending += 1  # solved when a prediction needs it: a run of steps nothing predicts for
        # (plain decoding the realised check keeps off) pays one solve per resolve_every

    @property
    def theta(self) -> np.ndarray:
        """``(num_features,)`` float64 fitted coefficients, all >= 0."""
        self._refresh()
        return np.asarray(self._coef)

    def _refresh(self) -> None:
        if self._pending:
            self._coef = self._solve()
            self._pending = 0

    def _solve(self) -> list[float]:
        n = len(self.xty)
        # Ridge per feature, scaled by that feature's own energy: units-free, and a feature never
        # seen (all zeros so far) gets a zero coefficient instead of a singular system.
        reg = [self.ridge * self.xtx[i][i] + 1e-12 for i in range(n)]
        if self.fixed_cost:
            reg[0] = 1e-12
        theta = self._solve_subset(list(range(n)), reg)
        # A negative marginal cost is an artefact of collinear features: drop it and refit the rest.
        for _ in range(n):
            if all(t >= 0 for t in theta):
                break
            theta = self._solve_subset([i for i in range(n) if theta[i] >= 0], reg)
        return [max(t, 0.0) for t in theta]

    def _solve_subset(self, keep: list[int], reg: list[float]) -> list[float]:
        """The ridge solution over the features in ``keep`` (the others 0)."""
        theta = [0.0] * len(self.xty)
        if keep:
            a = [[self.xtx[i][j] + (reg[i] if i == j else 0.0) for j in keep] for i in keep]
            for i, t in zip(keep, _solve_linear(a, [self.xty[i] for i in keep])):
                theta[i] = t
        return theta

    def predict(self, *columns, refresh: bool = True):
        """Seconds ``theta . features`` for features given by column: ``columns[i]`` is feature
        ``i``, a float or an ``(N,)`` array (then ``(N,)`` seconds). Per call a handful of scalar
        or elementwise operations, no feature matrix: the controller predicts several times a step.
        ``refresh=False``: with the fit as last solved (observations since not solved in), for
        figures that only report or calibrate.
        """
        if refresh:
            self._refresh()
        out = self._coef[0] * columns[0]
        for coef, column in zip(self._coef[1:], columns[1:]):
            out = out + coef * column
        return out


class ExpertActivation:
    """Distinct experts activated per forward, as a function of its token count.

    Args:
        num_experts: routed experts per MoE layer ``E`` (0 for a dense target: always 0).
        num_moe_layers: MoE layers ``L``; counts are totals over layers.
        top_k: experts per token; ``top_k / E`` is the prior activation probability.
        smoothing: EMA weight of a new observation of ``p``.
    """

    def __init__(self, num_experts: int, num_moe_layers: int, top_k: int, smoothing: float = 0.1) -> None:
        self.num_experts, self.num_layers = num_experts, num_moe_layers
        self.p = min(1.0, top_k / num_experts) if num_experts else 0.0
        self.smoothing = smoothing

    def observe(self, num_tokens: int, distinct_total: int) -> None:
        """One forward: ``num_tokens`` tokens activated ``distinct_total`` (layer, expert) pairs."""
        if not self.num_experts or num_tokens <= 0 or not self.num_layers:
            return
        frac = min(distinct_total / (self.num_layers * self.num_experts), 1.0 - 1e-6)
        p = 1.0 - (1.0 - frac) ** (1.0 / num_tokens)  # invert E[distinct] = E (1 - (1 - p)^T)
        self.p += self.smoothing * (p - self.p)

    def predict(self, num_tokens):
        """Expected distinct (layer, expert) pairs for a token count (a number, or ``(N,)`` counts
        -> ``(N,)``)."""
        return self.num_layers * self.num_experts * (1.0 - (1.0 - self.p) ** num_tokens)


class ActivationMeter:
    """An :class:`engine.model.moe.ExpertExecutor` wrapper counting distinct (layer, expert) pairs.

    The count stays on the routing's device until :meth:`take` (once per step, after the step's
    results were copied to the host anyway), so metering adds no device sync inside the forward.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self._active: list = []

    def execute(self, layer: int, hidden, routing):
        return self.submit(layer, hidden, routing)()

    def submit(self, layer: int, hidden, routing):
        """Count the layer's experts and start them (``engine.model.moe.submit_experts``)."""
        self._active.append(routing.expert_counts)  # counted in take(): one op a step, not two a layer
        return submit_experts(self.inner, layer, hidden, routing)

    def take(self, count: bool = True) -> int | None:
        """Distinct (layer, expert) pairs since the last call; None if no MoE layer ran or
        ``count`` is False (the step is not fed to the cost model: forget it uncounted)."""
        if not self._active or not count:
            self._active.clear()
            return None
        total = int(torch.count_nonzero(torch.stack(self._active)))
        self._active.clear()
        return total

    def __getattr__(self, name: str):  # the wrapped executor's other attributes (stats, close)
        return getattr(self.inner, name)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a x = b`` for a small dense system (Gaussian elimination with partial pivoting;
    ``a`` and ``b`` are overwritten). The ridge keeps the cost model's systems non-singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            if factor:
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
                b[r] -= factor * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x
