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
- :class:`RealisedGoodput`: what the models predict, checked against what happened: emitted
  tokens per second of the steps actually run, drafting and not, over the same recent stretch;
  :class:`RealisedCheck` keeps one per batch-size bucket and turns them into the on/off verdict
  and the cadence of explore steps.
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
    """

    def __init__(self, num_features: int, forgetting: float = 0.97, ridge: float = 1e-3, huber: float = 2.0,
                 warmup: int = 8, relative_floor: float = 0.05, resolve_every: int = 8) -> None:
        self.xtx = [[0.0] * num_features for _ in range(num_features)]  # weighted Gram matrix
        self.xty = [0.0] * num_features
        self.forgetting, self.ridge, self.huber, self.warmup = forgetting, ridge, huber, warmup
        self.relative_floor, self.resolve_every = relative_floor, resolve_every
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


class RealisedGoodput:
    """Realised emitted tokens per second of recent steps, per mode (0: not drafting, 1: drafting).

    Tokens and seconds are sums decayed by ``decay`` per observed step of *either* mode, so both
    rates cover the same stretch of time (load drift on a shared machine hits both alike) even
    though one mode runs far more often; the rate is their ratio (time-weighted, so one short
    step cannot dominate). Decay scales a mode's tokens and seconds alike, so a rare mode's rate
    stays its last measured one however long ago that was; keeping it fresh is the explore
    cadence's job (:class:`RealisedCheck`).

    Args:
        decay: weight kept per observed step (0.99: a memory of ~100 steps).
        min_steps: steps each mode needs (counted undecayed) before :meth:`rates` trusts it. A
            decayed count would distrust a rarely explored mode between its explore steps (one
            every 128 steps leaves ~1.4 at a decay of 0.99), and an untrusted rate means a thin
            margin, hence frequent exploring: the backoff could never take hold.
    """

    def __init__(self, decay: float = 0.99, min_steps: float = 2.0) -> None:
        # Per mode (index 0: not drafting, 1: drafting), as Python floats: a handful of float
        # operations a step (numpy's per-call cost on 2-element arrays was most of it).
        self.tokens = [0.0, 0.0]
        self.seconds = [0.0, 0.0]
        self.steps = [0, 0]  # per mode, undecayed: the trust gate
        self.decay, self.min_steps = decay, min_steps

    def observe(self, drafting: bool, num_emitted: int, step_s: float) -> None:
        """One step: ``num_emitted`` tokens in ``step_s`` seconds, drafting or not."""
        d, i = self.decay, int(drafting)
        for total in (self.tokens, self.seconds):
            total[0] *= d
            total[1] *= d
        self.tokens[i] += num_emitted
        self.seconds[i] += step_s
        self.steps[i] += 1

    def rates(self) -> tuple[float, float] | None:
        """Tokens/s (not drafting, drafting), or None until both modes have enough steps."""
        if min(self.steps) < self.min_steps or min(self.seconds) <= 0:
            return None
        return self.tokens[0] / self.seconds[0], self.tokens[1] / self.seconds[1]


class RealisedCheck:
    """The explore/exploit check on realised goodput (an epsilon-greedy two-armed bandit over
    drafting and not): per batch-size bucket (decoding sequences rounded to a power of two) a
    :class:`RealisedGoodput` of pure-decode steps, and the cadence of explore steps that run the
    other mode so its figure stays fresh.

    Drafting must *pay*: it stays on while its realised rate beats plain decoding's by
    ``required_gain`` and comes on when it beats that by ``hysteresis`` more (the ratio drafting /
    off above ``(1 + required_gain) * (1 + hysteresis)``). A tie goes to plain decoding: drafting
    has costs these pure-decode rates do not see (the draft model's catch-up in prefill steps,
    its weights and KV cache evicting the target's from the CPU caches, switching), and with a
    band around equal rates, rates within noise of each other kept whichever mode ran first
    (drafting) for good.

    Args:
        hysteresis: relative gain beyond ``required_gain`` that switches drafting on.
        explore_interval_steps: an explore step this often while the margin is thin or unmeasured,
            4x as rarely otherwise, and while the margin stays wide explore after explore, twice as
            rarely again after each, up to ``2 ** explore_backoff_doublings`` times (binary
            exponential backoff): an explore step runs the losing mode, so on a machine where
            drafting never pays it is pure loss (one in 32 batch-1 steps cost ~2 % of the tokens).
        thin_margin: a ratio within this (relative) of the switching point counts as a thin margin.
        decay, min_steps: of each bucket's :class:`RealisedGoodput`.
        required_gain: relative gain over plain decoding drafting must realise to stay on.
        explore_backoff_doublings: see ``explore_interval_steps`` (0: no backoff).
        explore_time_share: an explore step (or run) starts only while explore steps took at most
            this share of the recent pure-decode time (:meth:`note_time`, decayed like the rates).
            An explore of drafting after a stretch off pays the drafter's catch-up on every
            sequence: at batch 16 with sampling its steps took ~2.2x an off step, and at the
            thin-margin cadence explores were ~25 % of the time for a mode that did not pay.
        explore_run_steps: an explore of drafting (while off) lasts this many pure-decode steps in
            a row: its first step pays the drafter's catch-up on everything it missed while off, a
            cost of switching that the controller leaves out of the drafting figure
            (:meth:`SpeculationController.observe_goodput`), so the steps after it measure
            drafting's own rate.
    """

    def __init__(self, hysteresis: float, explore_interval_steps: int, thin_margin: float, decay: float,
                 min_steps: float, required_gain: float, explore_backoff_doublings: int = 0,
                 explore_run_steps: int = 1, explore_time_share: float = 1.0) -> None:
        self.hysteresis, self.explore_interval_steps, self.thin_margin = hysteresis, explore_interval_steps, thin_margin
        self.required_gain, self.explore_backoff_doublings = required_gain, explore_backoff_doublings
        self.explore_run_steps, self.explore_time_share = explore_run_steps, explore_time_share
        self._seconds = [0.0, 0.0]  # decayed pure-decode seconds: (explore steps, all)
        self._run_left = 0  # further steps of the explore run under way
        self.decay, self.min_steps = decay, min_steps
        self._buckets: dict[int, RealisedGoodput] = {}
        self._by_size: dict[int, RealisedGoodput] = {}  # num_decodes -> its bucket's (a lookup a step)
        self._since_explore = 0  # checked steps since the last explore step
        self._wide_explores = 0  # explore steps in a row scheduled at a wide margin

    def bucket(self, num_decodes: int) -> RealisedGoodput:
        """The realised goodput of steps with about this many decoding sequences."""
        goodput = self._by_size.get(num_decodes)
        if goodput is None:
            key = 1 << round(math.log2(max(num_decodes, 1)))
            if key not in self._buckets:
                self._buckets[key] = RealisedGoodput(self.decay, self.min_steps)
            goodput = self._by_size[num_decodes] = self._buckets[key]
        return goodput

    def standing(self, num_decodes: int, on: bool) -> bool | None:
        """The realised rates' verdict on drafting for steps of about ``num_decodes`` sequences,
        with hysteresis from the current state ``on``; None until both modes are measured. No
        side effects: a step with a prefill chunk asks this (it is not a pure-decode step, so it
        neither explores nor counts toward the explore cadence)."""
        return self._standing(self.bucket(num_decodes).rates(), on)

    def verdict(self, num_decodes: int, on: bool) -> tuple[bool | None, bool] | None:
        """Once per pure-decode step: ``(on, explore)``, ``on`` as :meth:`standing` and
        ``explore`` whether this step runs the other mode; None when nothing was realised yet
        (the cost model decides alone)."""
        goodput = self.bucket(num_decodes)
        if not any(goodput.steps):
            return None
        rates = goodput.rates()
        standing = self._standing(rates, on)
        # Exploring drafting: off by the rates, or unmeasured while off (a lone explore step is a
        # switch step, left out of the figure: drafting would never be measured).
        drafting = standing is False or (standing is None and not on)
        if self._run_left and drafting:  # an explore run of drafting goes on
            self._run_left -= 1
            return standing, True
        self._run_left = 0
        self._since_explore += 1
        thin = self._thin(rates)
        if thin:
            self._wide_explores, interval = 0, self.explore_interval_steps
        else:
            interval = self.explore_interval_steps * 4 << min(self._wide_explores, self.explore_backoff_doublings)
        explore = self._since_explore >= interval and self._seconds[0] <= self.explore_time_share * self._seconds[1]
        if explore:
            self._since_explore = 0
            self._wide_explores += not thin
            self._run_left = self.explore_run_steps - 1 if drafting else 0
        return standing, explore

    def _standing(self, rates: tuple[float, float] | None, on: bool) -> bool | None:
        if rates is None:
            return None
        ratio = self._ratio(rates)
        return bool(ratio >= 1 if on else ratio > 1 + self.hysteresis)

    def _thin(self, rates: tuple[float, float] | None) -> bool:
        return rates is None or abs(self._ratio(rates) - 1) < self.thin_margin

    def _ratio(self, rates: tuple[float, float]) -> float:
        """Drafting's realised rate over plain decoding's, relative to the switching point."""
        off, drafting = rates
        return drafting / (off * (1 + self.required_gain))

    def observe(self, num_decodes: int, drafting: bool, num_emitted: int, step_s: float) -> None:
        """A pure-decode step of ``num_decodes`` sequences, drafting or not."""
        self.bucket(num_decodes).observe(drafting, num_emitted, step_s)

    def note_time(self, step_s: float, explore: bool) -> None:
        """Every pure-decode step the check governs (also those its rates leave out): ``step_s``
        seconds, an explore step or not; bounds the explore steps' share of the time."""
        d = self.decay
        self._seconds = [self._seconds[0] * d + explore * step_s, self._seconds[1] * d + step_s]


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
