"""What the speculation controller's cost models predict, checked against what happened.

- :class:`RealisedGoodput`: emitted tokens per second of the steps actually run, drafting and
  not, over the same recent stretch.
- :class:`RealisedCheck`: one per batch-size bucket, turned into the on/off verdict and the
  cadence of explore steps (an epsilon-greedy two-armed bandit over drafting and not).
"""

from __future__ import annotations

import math


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
        explore_run_steps: an explore of drafting (while off, or while drafting is unmeasured and
            the controller is off) lasts this many pure-decode steps in a row: its first step pays
            the drafter's catch-up on everything it missed while off, a cost of switching that the
            controller leaves out of the drafting figure
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
