"""Adaptive draft length: pick k per sequence each step so the step emits the most tokens per second.

For a step with decoding sequences ``s`` drafting ``k_s`` tokens, the expected emitted tokens are
``sum_s E_s(k_s)`` with ``E_s(k) = 1 + sum_{i<=k} prod_{j<=i} a_{s,j}`` (Leviathan et al. 2023,
eq. 1 generalised to per-position acceptance ``a_{s,j}``), and the step time is

    T = T_draft(passes = max k_s, drafted = sum k_s, catch-up = tokens the drafter must ingest first)
      + T_target(tokens = base + sum k_s, experts = distinct experts those tokens activate)

with both parts learned online from measured steps (:mod:`engine.spec_cost`). The controller
maximises ``sum E_s / (T - T_chunk)``: a prefill chunk in the step costs ``T_chunk`` whatever is
drafted, so the decodes' drafting must pay for itself (judged over the whole step, the chunk's
time diluted the drafts' cost and drafting won steps where plain decoding is faster). The
allocations scored are one draft length ``k`` for the batch, drafted by the ``m`` sequences it
pays most for (:mod:`engine.spec_candidates`: ragged lengths ran slower than their features
predicted); every ``(k, m)`` is scored at once (vectorised) and the best wins, drafting nothing
included: then nothing is drafted at all.

Acceptance: per sequence and position, decayed counts shrunk toward a server-wide estimate
(:mod:`engine.spec_acceptance`). Hysteresis keeps speculation on or off unless the other choice is
``hysteresis`` better; a warm-up cycles k to make the cost model identifiable, and every
``probe_interval_steps`` one probe step drafts another length (2, max, 0, max / 2 in turn), so the
estimates cover the whole range and never go stale (speculation off included), except while the
realised check below says off (a probe drafting every sequence then pays the drafter's catch-up on
the whole off stretch, for estimates its explore steps refresh anyway; at batch 16 with sampling
probes were 5 % of the steps and 9-13 % of the time). Explore steps are bounded the same way: at
most ``explore_time_share`` of the recent pure-decode time.

Whether to draft at all is then checked against what happened (an explore/exploit check on
realised goodput, as in an epsilon-greedy two-armed bandit): per batch-size bucket, the emitted
tokens per second the controller's own pure-decode steps realised, drafting and not
(:class:`engine.spec_realised.RealisedCheck`, which also sets the cadence of explore steps that
run the other mode). Once both are measured they decide on versus off in pure-decode steps
whatever the model predicts, TPOT budgets or not (a tie goes to plain decoding; a step with a
prefill chunk follows its decodes' bucket and never explores); the model still chooses what to
draft when on. While the rates keep speculation off, most plain steps are not fed to the cost
model (``off_fit_interval_steps``). A drafter's catch-up on a prompt counts in the drafting
figure: for short requests it is most of what drafting costs. On a shared CPU the model misses
costs its features cannot see, so a fit alone can keep speculation on where plain decoding is
faster (issue 13).

Only draft *lengths* change, never how tokens are verified, so output stays lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from engine.spec_acceptance import AcceptanceEstimates, expected_tokens
from engine.spec_candidates import draft_candidates
from engine.spec_cost import ExpertActivation, LogQuantile, OnlineLinearCost
from engine.spec_realised import RealisedCheck
from engine.spec_scoring import amortised_catchup, ready_probability, tpot_fit
from engine.spec_settings import ControllerSettings

SpeculativePolicy = Literal["adaptive", "fixed"]


@dataclass
class Decision:
    """What the controller chose for one step and why (span attributes, metrics).

    Attributes:
        k: draft length per sequence id (0: not drafted).
        reason: "fixed", "warmup", "probe", "explore" or "adaptive".
        expected_tokens: predicted emitted tokens of the step.
        predicted_step_s: predicted step seconds (draft + target + verify).
    """

    k: dict[str, int] = field(default_factory=dict)
    reason: str = "fixed"
    expected_tokens: float = 0.0
    predicted_step_s: float = 0.0


class SpeculationController:
    """Chooses each decoding sequence's draft length per step.

    Args:
        max_k: the configured draft length; no sequence drafts more (its own cap may be lower).
        policy: "adaptive" (this controller) or "fixed" (every sequence drafts its cap).
        activation: expert-activation model of the target (distinct experts per token count).
        settings: tuning; defaults are fine.
    """

    def __init__(self, max_k: int, policy: SpeculativePolicy = "adaptive",
                 activation: ExpertActivation | None = None, settings: ControllerSettings | None = None) -> None:
        self.max_k, self.policy = max_k, policy
        self.settings = settings or ControllerSettings()
        self.activation = activation or ExpertActivation(0, 0, 1)
        # [1, passes, drafted tokens, catch-up tokens]: a sequence that has not drafted for a while
        # (or ever: its prompt) costs the drafter a prefill of what it missed, a real cost of k > 0.
        self.draft_cost = OnlineLinearCost(4, forgetting=0.95, fixed_cost=True)
        # [1, target tokens, distinct experts, prefill attention pairs (thousands)]
        self.target_cost = OnlineLinearCost(4, fixed_cost=True)
        s = self.settings
        self.estimates = AcceptanceEstimates(max_k, s.acceptance_prior, s.prior_weight, s.global_decay,
                                             s.sequence_decay)
        self._positions = np.arange(max_k)  # draft positions 0..max_k - 1, for masks
        self._decode_steps = 0
        self._planned: Decision | None = None  # the last optimised decision (:meth:`_reuse`)
        self._plan_age = 0  # steps it was reused
        self._num_probes = 0
        self._on = True
        # Measured / predicted step time per (drafting, with a prefill chunk): the regression fits
        # the common kind best, so the rarer ones may be biased; this corrects the comparison.
        # The kinds differ (in process at batch 16, drafting: 0.85 decode-only, 1.14 with a chunk),
        # and one factor for both skewed each (pooled: 0.79).
        self.calibration = {(drafting, chunked): 1.0 for drafting in (False, True) for chunked in (False, True)}
        # The 90th percentile of a chunked step's measured / (calibrated) predicted time, for
        # chunks sized to an ITL budget (engine.slo.SLOPolicy.prefill_limit).
        self.chunk_overrun = LogQuantile(0.9)
        self._ready: dict[str, int] = {}  # windows probably drafted ahead, for the next plan only
        self.realised = RealisedCheck(s.hysteresis, s.explore_interval_steps, s.thin_margin, s.goodput_decay,
                                      s.goodput_min_steps, s.required_gain, s.explore_backoff_doublings,
                                      s.explore_run_steps, s.explore_time_share)
        self.last = Decision()
        # Whether the last planned step should be metered and fed to the cost model
        # (:meth:`observe_step`): all but one in ``off_fit_interval_steps`` of the plain steps the
        # realised rates keep off are not.
        self.fits_last_step = True
        self._off_steps = 0
        self._drafted_last = False  # whether the last pure-decode step drafted

    # ------------------------------------------------------------------ decisions
    def plan(self, caps: dict[str, int], num_base_tokens: int, num_prefills: int = 0,
             catchup: dict[str, int] | None = None,
             remaining: dict[str, int] | None = None,
             tpot: dict[str, tuple[float, float]] | None = None, prefill_pairs: float = 0.0) -> Decision:
        """Draft lengths for this step.

        Args:
            caps: per decoding sequence id, the most it may draft (its own k, max_tokens, context).
            num_base_tokens: target tokens of the step without drafts (prefill tokens + one per
                decoding sequence).
            num_prefills: prefilling sequences (each emits one token).
            catchup: per sequence, tokens the drafter has not seen yet (it ingests them before
                drafting); missing entries count as 0.
            remaining: per sequence, output tokens it may still produce. A catch-up backlog (a
                prompt, a long k = 0 phase) is paid once but pays off over every remaining step, so
                beyond one step's worth of tokens it is charged ``E[tokens] / remaining`` a step.
            tpot: per sequence with a TPOT budget, (budget s, slack s): slack is how far ahead of
                its budget it is (budget x tokens after the first - time since the first token;
                negative: behind). Only draft totals whose predicted step keeps every such
                sequence within budget are chosen (step <= budget x E[its tokens] + slack), or,
                when none does, those that miss it least: a sequence behind its budget shortens
                drafts that would stretch the step more than they emit.
            prefill_pairs: the step's prefill chunks' attention work
                (:func:`engine.spec_cost.prefill_attention_pairs`, summed).
        """
        self.fits_last_step = True
        if self.policy == "fixed" or self.max_k == 0 or not caps or not any(caps.values()):
            self.last = Decision(dict(caps), "fixed")
            return self.last
        self._decode_steps += 1
        s = self.settings
        if self._decode_steps <= s.warmup_steps:
            decision = Decision(self._warmup_k(caps), "warmup")
        elif (self._decode_steps - s.warmup_steps) % s.probe_interval_steps == 0 \
                and self.realised.standing(len(caps), self._on) is not False:
            probe_ks = (2, self.max_k, 0, max(1, self.max_k // 2))
            k = probe_ks[self._num_probes % len(probe_ks)]
            self._num_probes += 1
            decision = Decision({sid: min(c, k) for sid, c in caps.items()}, "probe")
        else:
            verdict = self._verdict(len(caps), num_base_tokens, num_prefills)
            # Off by the realised rates, or an explore step of off while they say on (without TPOT
            # budgets, which off might break): the model's choice would be overruled, so it is not
            # computed. A plain-decoding step pays no optimisation, and an explore step measures
            # off as it runs when the rates keep it off.
            explore_off = verdict == (True, True) and not tpot
            if verdict == (False, False) or explore_off:
                decision = Decision(dict.fromkeys(caps, 0), "explore" if explore_off else "adaptive",
                                    float(len(caps)),
                                    self.predict_step_s(num_base_tokens, refresh=False, prefill_pairs=prefill_pairs))
                if not explore_off:
                    self._off_steps += 1
                    self.fits_last_step = self._off_steps % s.off_fit_interval_steps == 0
            elif (decision := self._reuse(caps, num_base_tokens, num_prefills, tpot or {}, verdict)) is None:
                decision = self._optimise(caps, num_base_tokens, num_prefills, catchup or {}, remaining or {},
                                          tpot or {}, verdict, prefill_pairs)
                # A plan around windows drafted ahead is good for this step only.
                self._planned, self._plan_age = (None if self._ready else decision), 0
            if decision.reason == "adaptive":
                self._on = sum(decision.k.values()) > 0  # the state hysteresis keeps (not probes)
        self._ready.clear()  # a window drafted ahead is good for the next step only
        self.last = decision
        return decision

    def _reuse(self, caps: dict[str, int], num_base_tokens: int, num_prefills: int,
               tpot: dict[str, tuple[float, float]], verdict: tuple[bool | None, bool] | None) -> Decision | None:
        """The last optimised draft lengths again (each within its sequence's cap), or None: replan.

        Optimising costs ~0.1-0.3 ms a step in place (the estimates, every (k, m) candidate, two
        cost-model solves), 2-7 % of a step of the bundled pair, and its inputs move slowly (the
        acceptance estimates remember ~10 verifications, the cost fits ~30 steps). So the same
        decoding sequences in a pure-decode step reuse it for up to ``replan_interval_steps`` steps
        while the realised check agrees on drafting, nothing is drafted ahead, no step explores,
        and no sequence with a TPOT budget is behind it."""
        planned = self._planned
        if planned is None or planned.reason != "adaptive" or self._plan_age + 1 >= self.settings.replan_interval_steps:
            return None
        if num_prefills or num_base_tokens != len(caps) or self._ready or caps.keys() != planned.k.keys():
            return None
        drafting = any(planned.k.values())
        if verdict is not None and (verdict[1] or verdict[0] is not None and verdict[0] != drafting):
            return None
        if any(slack_s < 0 for _, slack_s in tpot.values()):
            return None
        self._plan_age += 1
        return Decision({sid: min(k, caps[sid]) for sid, k in planned.k.items()}, "adaptive",
                        planned.expected_tokens, planned.predicted_step_s)

    def _verdict(self, num_decodes: int, num_base_tokens: int, num_prefills: int) -> tuple[bool | None, bool] | None:
        """The realised check's say in this step (:meth:`RealisedCheck.verdict`); None: the model
        decides alone. Realised rates are of pure-decode steps, which also run its explore steps.
        A step with a prefill chunk follows its decodes' bucket (its drafting is judged as theirs,
        chunk aside) without exploring; drafting there when it does not pay also desynchronises
        the batch (sequences finish at different steps, so later prompts are admitted one by one
        into more mixed steps instead of together). A window drafted ahead is a cost the rates do
        not separate out."""
        if self._ready:
            return None
        if num_base_tokens == num_decodes and not num_prefills:
            return self.realised.verdict(num_decodes, self._on)
        on = self.realised.standing(num_decodes, self._on)
        return None if on is None else (on, False)

    def _warmup_k(self, caps: dict[str, int]) -> dict[str, int]:
        """Cycle k through ``max, 1, max / 2, 0``: on odd steps every sequence alike, on even steps
        staggered per sequence, so passes, drafted tokens and verified tokens vary independently
        and the cost model can tell them apart."""
        cycle = (self.max_k, 1, max(1, self.max_k // 2), 0)
        t = self._decode_steps - 1
        stagger = t % 2
        return {sid: min(c, cycle[(t // 2 + stagger * i) % len(cycle)]) for i, (sid, c) in enumerate(caps.items())}

    def _optimise(self, caps: dict[str, int], num_base_tokens: int, num_prefills: int,
                  catchup: dict[str, int], remaining: dict[str, int],
                  tpot: dict[str, tuple[float, float]], verdict: tuple[bool | None, bool] | None,
                  prefill_pairs: float) -> Decision:
        """The model's best draft lengths, overruled on or off by ``verdict``
        (:meth:`RealisedCheck.verdict`; None: not a pure-decode step, the model decides)."""
        ids = list(caps)
        acceptance = self.estimates.of_sequences(ids, self.estimates.server_wide())  # (B, max_k)
        cum = np.cumprod(acceptance, axis=1)
        cap = np.array([caps[sid] for sid in ids])
        charged = amortised_catchup(cum, cap, ids, catchup, remaining, self._positions)  # (B,) catch-up tokens
        gains = np.where(self._positions < cap[:, None], cum, 0.0)  # (B, max_k), zero beyond each cap
        ready = None
        if self._ready:  # windows drafted ahead (pipelined): drafting them costs little
            ready = ready_probability(self._ready, ids, acceptance, self.max_k)
            # Drafting past a ready window would redraft it all: a likely-ready one caps the sequence.
            gains[(ready[:, :1] >= 0.5) & (ready == 0)] = 0.0
        cand = draft_candidates(gains, ready, charged)
        expected = len(ids) + num_prefills + cand.gain
        tokens = num_base_tokens + cand.tokens
        drafting = cand.drafted > 0
        draft_s = np.where(drafting, self.draft_cost.predict(1.0, cand.passes, cand.drafted, cand.caught), 0.0)
        target_s = self.target_cost.predict(1.0, tokens, self.activation.predict(tokens), prefill_pairs)
        chunked = prefill_pairs > 0
        calibration = np.where(drafting, self.calibration[True, chunked], self.calibration[False, chunked])
        step_s = np.maximum(draft_s + target_s, 1e-6) * calibration
        # A prefill chunk riding along costs the same whatever is drafted, and diluting the drafts'
        # cost in its time made drafting look cheap: the decodes' drafting is judged by their own
        # rate, step time less the chunk's (a chunk's token is emitted whatever is drafted).
        chunk_s = self._chunk_s(num_base_tokens, len(ids), prefill_pairs) * calibration
        rate = (expected - num_prefills) / np.maximum(step_s - chunk_s, 1e-6)
        # What the realised check may pick (on, or to explore): within every TPOT budget, or any
        # when none is (barred from measuring a mode, the check never decided; docs/SCHEDULING.md).
        allowed, free = np.ones(len(rate), dtype=bool), rate
        if tpot:
            keeps, worst_s = tpot_fit(ids, gains, cand.lengths, step_s, tpot)
            if keeps.any():
                allowed = keeps
                rate = np.where(keeps, rate, -np.inf)
            else:  # the model's pick: the most tokens a second for the worst-off sequence
                rate = np.where(worst_s <= worst_s.min(), rate, -np.inf)
        best = int(np.argmax(rate))
        drafts = cand.gain[1:].any() and allowed[1:].any()
        best_on = int(np.argmax(np.where(allowed, free, -np.inf)[1:])) + 1 if drafts else 0
        h = self.settings.hysteresis
        if best == 0 and self._on and best_on and rate[best_on] * (1 + h) >= rate[0]:
            best = best_on  # stay on unless off is clearly better
        elif best > 0 and not self._on and rate[best] < rate[0] * (1 + h):
            best = 0  # stay off unless on is clearly better
        reason = "adaptive"
        if best_on and verdict is not None:
            on, explore = verdict
            if on is False:  # measured: the realised rates decide on or off
                best = 0
            elif on and not best:
                best = best_on
            other = 0 if best else best_on
            if explore and allowed[other]:  # the other mode, to keep its rate fresh
                best, reason = other, "explore"
        return Decision(dict(zip(ids, cand.lengths[best].tolist())), reason, float(expected[best]), float(step_s[best]))

    def _chunk_s(self, num_base_tokens: int, num_decodes: int, prefill_pairs: float) -> float:
        """Predicted target seconds of a step's prefill chunk: the step's base tokens less its
        decodes' (0 without a chunk)."""
        if num_base_tokens <= num_decodes:
            return 0.0
        tokens = np.array([num_base_tokens, num_decodes], dtype=np.float64)
        both = self.target_cost.predict(1.0, tokens, self.activation.predict(tokens),
                                        np.array([prefill_pairs, 0.0]))
        return max(0.0, float(both[0] - both[1]))

    def predict_step_s(self, num_target_tokens: int, passes: int = 0, num_drafted: int = 0,
                       refresh: bool = True, prefill_pairs: float = 0.0) -> float:
        """Predicted seconds of a step with this many target tokens, prefill attention work
        (``prefill_pairs``: :func:`engine.spec_cost.prefill_attention_pairs`, summed over its
        chunks) and draft work (0 before any step was observed); ``refresh=False``: with the fits
        as last solved (a figure only reported)."""
        experts = self.activation.predict(num_target_tokens)
        target = self.target_cost.predict(1.0, num_target_tokens, experts, prefill_pairs, refresh=refresh)
        draft = self.draft_cost.predict(1.0, passes, num_drafted, 0.0, refresh=refresh) if num_drafted else 0.0
        return float(target + draft) * self.calibration[num_drafted > 0, prefill_pairs > 0]

    def expected_tokens(self, seq_id: str, k: int) -> float:
        """Tokens a step verifying ``k`` drafts of ``seq_id`` is expected to emit:
        ``1 + sum_{i<=k} prod_{j<=i} a_j`` (Leviathan et al. 2023, eq. 1, with per-position
        acceptance estimates ``a``); 1.0 for k = 0."""
        return expected_tokens(self.acceptance(seq_id), k)

    def acceptance(self, seq_id: str | None = None) -> np.ndarray:
        """Estimated acceptance per draft position ``(max_k,)`` in [0, 1]: the server-wide one, or
        one sequence's (shrunk toward the server-wide estimate)."""
        glob = self.estimates.server_wide()
        return glob if seq_id is None else self.estimates.of_sequence(seq_id, glob)

    def note_drafted_ahead(self, seq_id: str, length: int) -> None:
        """``seq_id`` accepted every token of a window whose successor was being drafted ahead:
        its next ``length`` draft tokens are probably ready (engine.drafters.pipelined)."""
        if self.max_k and self.policy == "adaptive" and length > 0:
            self._ready[seq_id] = min(length, self.max_k)

    # ------------------------------------------------------------------ feedback
    def observe_acceptances(self, verified: list[tuple[str, int, int]]) -> None:
        """One step's verifications ``(seq_id, num_drafted, num_accepted)``, one per sequence;
        those that drafted nothing are ignored."""
        if self.max_k == 0:
            return
        seen = [(sid, min(d, self.max_k), min(a, d, self.max_k)) for sid, d, a in verified if d > 0]
        if seen:
            self.estimates.observe_many(*zip(*seen))

    def observe_step(self, draft_s: float, passes: int, num_drafted: int, target_s: float,
                     num_target_tokens: int, distinct_experts: int | None, num_catchup: int = 0,
                     prefill_pairs: float = 0.0) -> None:
        """Measured costs of one step: the draft phase (0 s when nothing was drafted) and the
        target forward plus verification, with the distinct (layer, expert) pairs it activated
        and its prefill chunks' attention work (``prefill_pairs``, as :meth:`plan` takes it)."""
        experts = float(self.activation.predict(num_target_tokens) if distinct_experts is None else distinct_experts)
        # The fits as last solved: solving them for a figure that only calibrates would cost a
        # solve per step even where nothing predicts (plain decoding kept off).
        predicted = self.target_cost.predict(1.0, num_target_tokens, experts, prefill_pairs, refresh=False)
        if num_drafted > 0:
            predicted += self.draft_cost.predict(1.0, passes, num_drafted, num_catchup, refresh=False)
        if predicted > 0:  # before the models learn from this step: an honest out-of-sample ratio
            mode, rate = (num_drafted > 0, prefill_pairs > 0), self.settings.calibration_rate
            # In log space with the step's deviation clipped: one stalled step moves it by 22 % at most.
            dev = math.log(max(draft_s + target_s, 1e-9) / predicted / self.calibration[mode])
            if prefill_pairs > 0:
                self.chunk_overrun.observe(math.exp(dev))
            self.calibration[mode] *= math.exp(rate * min(1.0, max(-1.0, dev)))
        # Warm-up and probe steps exist to inform the fit (lengths the controller would not pick):
        # they count in full; its own choices are Huber-weighted against stalls.
        robust = self.last.reason not in ("warmup", "probe")
        if num_drafted > 0:
            self.draft_cost.observe([1.0, passes, num_drafted, num_catchup], draft_s, robust)
        if distinct_experts is not None:
            self.activation.observe(num_target_tokens, distinct_experts)
        self.target_cost.observe([1.0, num_target_tokens, experts, prefill_pairs], target_s, robust)

    def observe_goodput(self, num_emitted: int, step_s: float) -> None:
        """A pure-decode step (no prefill chunk) of the last plan emitted ``num_emitted`` tokens in
        ``step_s`` seconds (the whole step: plan, draft, target, verify, emit, and a drafter's
        catch-up on a prompt it had not seen: that is what drafting costs a short request).

        Only the controller's own choices and explore steps count: warm-up and probe lengths are
        not its policy. Nor does a step that switches drafting on after a plain one: it pays the
        drafter's catch-up on every token it missed while off, a one-off cost of switching whose
        size grows with the off stretch."""
        drafting = any(self.last.k.values())
        switching, self._drafted_last = drafting and not self._drafted_last, drafting
        if self.policy != "adaptive" or self.last.reason not in ("adaptive", "explore") or step_s <= 0:
            return
        self.realised.note_time(step_s, self.last.reason == "explore")  # the switch step's cost too
        if switching:
            return
        self.realised.observe(len(self.last.k), drafting, num_emitted, step_s)

    def release(self, seq_id: str) -> None:
        """Forget a finished sequence's estimates."""
        self.estimates.release(seq_id)
        self._ready.pop(seq_id, None)
