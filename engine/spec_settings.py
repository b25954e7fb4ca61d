"""Tuning of the adaptive draft-length controller (:mod:`engine.spec_controller`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerSettings:
    """Tuning of :class:`SpeculationController` (defaults measured on the bundled pair).

    Attributes:
        warmup_steps: decode steps that cycle k through ``max, 1, max / 2, 0`` before adapting
            (:meth:`SpeculationController._warmup_k`).
        probe_interval_steps: every this many decode steps, one probe step drafts the next length
            of ``(2, max, 0, max / 2)`` per sequence (its cap permitting) to refresh acceptance and
            cost estimates where the controller's own choices give no data.
        hysteresis: relative rate gain needed to switch speculation on or off (the model's
            choice; for the realised check, the gain beyond ``required_gain`` that switches on).
        required_gain: realised relative gain over plain decoding drafting must show to be (and
            stay) on (:class:`engine.spec_realised.RealisedCheck`): a tie goes to plain decoding.
        acceptance_prior: server-wide acceptance at position 0 before anything is observed.
        prior_weight: pseudo-observations of the server-wide estimate in a sequence's estimate.
        sequence_decay, global_decay: per-observation decay of acceptance counts.
        calibration_rate: EMA weight (in log space, each step's deviation clipped to +-1) of a
            step's measured / predicted time in the per-mode calibration of predictions.
        explore_interval_steps: while the realised on/off margin is thin (or not yet measured),
            every this many decode steps one explore step runs the other mode; 4x as many
            otherwise, doubling after each explore step that leaves the margin wide, up to
            ``2 ** explore_backoff_doublings`` times that (:class:`engine.spec_realised.RealisedCheck`).
        explore_backoff_doublings: see ``explore_interval_steps``; 2: at a wide margin the
            explore interval goes 32, 64, 128 decode steps.
        explore_run_steps: pure-decode steps an explore of drafting lasts (while off); the first,
            which pays the drafter's catch-up, is left out of the realised drafting figure
            (:class:`engine.spec_realised.RealisedCheck`).
        explore_time_share: explore steps start only while they took at most this share of the
            recent pure-decode time (:class:`engine.spec_realised.RealisedCheck`).
        off_fit_interval_steps: while the realised rates keep speculation off (by a wide margin
            or a thin one), only one plain-decoding step in this many is metered and fed to the
            cost model: its fit then matters only at explore steps and for latency budgets, its
            plain steps all have the same features, and metering and fitting them cost ~3 % of a
            batch-1 step of the bundled pair.
        replan_interval_steps: a pure-decode step of the same sequences reuses the last optimised
            draft lengths for up to this many steps in all (1: optimise every step); see
            :meth:`SpeculationController._reuse` for when it replans anyway.
        thin_margin: a realised ratio (drafting / off) within this (relative) of the switching
            point (``1 + required_gain``) counts as a thin margin.
        goodput_decay: per-step decay of the realised goodput sums (0.99: ~100 steps' memory).
        goodput_min_steps: decayed steps each mode needs before its realised rate is trusted.
    """

    warmup_steps: int = 8
    probe_interval_steps: int = 16
    hysteresis: float = 0.05
    required_gain: float = 0.05
    acceptance_prior: float = 0.6
    prior_weight: float = 3.0
    sequence_decay: float = 0.9
    global_decay: float = 0.995
    calibration_rate: float = 0.2
    explore_interval_steps: int = 8
    explore_backoff_doublings: int = 2
    explore_run_steps: int = 3
    explore_time_share: float = 0.1
    off_fit_interval_steps: int = 8
    replan_interval_steps: int = 4
    thin_margin: float = 0.2
    goodput_decay: float = 0.99
    goodput_min_steps: float = 2.0
