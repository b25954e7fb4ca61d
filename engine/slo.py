"""Latency budgets: SLO classes, their attainment, and the scheduling decisions that use them.

A request names an SLO class (``SamplingParams.slo_class``, else the scheduler's default); a class
budgets time to first token and time per output token. Definitions follow ``vllm bench serve``'s
goodput (DistServe, Zhong et al. 2024): TTFT = first token - arrival; TPOT = (finish - first
token) / (output tokens - 1); a request meets its SLO iff every budget its class sets is met.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import msgspec

from engine.errors import QueueFull
from engine.outputs import RequestOutput
from engine.request_ranges import RequestError
from engine.slo_admission import SlotJob, decode_hold_s, defer_until_s, deferred_jobs
from engine.slo_budget import (
    itl_cap_ms,
    prefill_token_limit,
    projected_slack_s,
    sequence_slack_s,
    step_allowance_ms,
    wait_estimate_s,
)
from engine.spec_cost import prefill_attention_pairs


class SLOClass(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Latency budget of one request class (None: not budgeted).

    Attributes:
        ttft_ms: time to first token, ms.
        tpot_ms: time per output token after the first, ms; also the inter-token budget the
            scheduler keeps a step under when it sizes prefill chunks (a decode ahead of its
            budget lets a step spend part of its slack: one long gap, the same TPOT).
        itl_ms: longest gap between two stream items of a decoding request that the scheduler
            lets a prefill chunk cause, ms (p99 inter-token latency); it caps what the TPOT slack
            would allow. Not judged in attainment (TPOT is). None: only the TPOT budget sizes
            chunks.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None

    def check(self, where: str) -> None:
        """Raises ValueError naming ``where`` (e.g. ``slo_classes.interactive``) and the field
        when a budget is not > 0 (called by the config holding the class, which knows its name:
        msgspec's error path shows a dict key as ``[...]``)."""
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{where}.{name} must be > 0, got {v}")


class DeadlineUnattainable(QueueFull):
    """The request's TTFT budget cannot be met at the current load (HTTP 503 + Retry-After)."""

    code = "ttft_unattainable"


def request_slo_met(slo: SLOClass, metrics, num_output_tokens: int) -> bool:
    """Whether a finished request met every budget of its class (``metrics``: RequestMetrics)."""
    if metrics.first_token_time_s is None or metrics.finished_time_s is None:
        return False
    if slo.ttft_ms is not None and (metrics.first_token_time_s - metrics.arrival_time_s) * 1e3 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and num_output_tokens > 1:
        tpot_ms = (metrics.finished_time_s - metrics.first_token_time_s) * 1e3 / (num_output_tokens - 1)
        if tpot_ms > slo.tpot_ms:
            return False
    return True


class SLOPolicy:
    """The engine's use of latency budgets: admission, chunk sizing, attainment counts.

    Args:
        scheduler: the engine's scheduler; its config holds ``slo_classes``, the default class
            and the refusal switch.
        controller: the speculation controller, whose online cost model predicts step times.
    """

    def __init__(self, scheduler, controller) -> None:
        self.scheduler, self.controller = scheduler, controller
        self.counts: dict[str, list[int]] = {}  # class -> [met, finished]

    @property
    def config(self):
        return self.scheduler.config

    def check(self, params, prompt_len: int, decodes) -> None:
        """Raise RequestError (a ValueError naming ``slo_class``) for an unknown class;
        DeadlineUnattainable when the prefill work the
        scheduler would run before this request (``Scheduler.prompts_ahead``), its own prompt
        included, cannot finish within the class's TTFT budget beside the running ``decodes``,
        which leave as they finish (:meth:`prefill_phases`, :func:`wait_estimate_s`), with each
        prompt's attention over itself (:func:`engine.spec_cost.prefill_attention_pairs`)."""
        if params.slo_class is not None and params.slo_class not in self.config.slo_classes:
            known = (f"must be one of {sorted(self.config.slo_classes)}" if self.config.slo_classes else
                     "names no class: none is configured (engine.scheduler.slo_classes)")
            raise RequestError(f"'slo_class' {known}, got {params.slo_class!r}", param="slo_class")
        slo = self.config.slo_for(params.slo_class)[1]
        if not self.config.refuse_unattainable_ttft or slo is None or slo.ttft_ms is None:
            return
        deadline_s = time.monotonic() + slo.ttft_ms / 1e3
        ahead = self.scheduler.prompts_ahead(params.priority, deadline_s)
        tokens = sum(s.num_prompt_tokens_left for s in ahead) + prompt_len
        # Each prompt's causal attention over itself, however it is chunked (the cost is linear in it).
        pairs = sum(prefill_attention_pairs(s.num_cached, s.num_prompt_tokens_left) for s in ahead)
        pairs += prefill_attention_pairs(0, prompt_len)
        predict = self.step_predictor()
        attention_s = max(predict(0, pairs) - predict(0), 0.0)
        wait_s = wait_estimate_s(tokens, self.prefill_phases(decodes), predict) + attention_s
        if wait_s * 1e3 > slo.ttft_ms:
            raise DeadlineUnattainable(
                f"slo_class {self.config.slo_for(params.slo_class)[0]!r}: the TTFT budget of {slo.ttft_ms:g} ms "
                f"cannot be met (about {wait_s * 1e3:.0f} ms of prefill work is queued); retry later")

    def decode_tokens(self, seq) -> int:
        """Target tokens a decoding sequence takes in a step: 1 + its draft length last step."""
        return 1 + self.controller.last.k.get(seq.seq_id, 0)

    def steps_left(self, seq) -> int:
        """Steps until a decoding sequence reaches ``max_tokens``, at the tokens a step it is
        expected to emit at its last draft length (a stop string or EOS may end it sooner)."""
        k = self.controller.last.k.get(seq.seq_id, 0)
        left = max(seq.params.max_tokens - seq.num_output_tokens, 0)
        return math.ceil(left / self.controller.expected_tokens(seq.seq_id, k))

    def prefill_phases(self, decodes) -> list[tuple[float, int, int]]:
        """The steps ahead as phases (steps, decode target tokens, prefill tokens a step): each
        phase ends when the next running decode is expected to finish, which takes its tokens and
        its TPOT constraint off the step (the short outputs of a burst free the budget within a
        few steps); the last phase, with the decodes left, is unbounded (``math.inf`` steps).
        Prompts prefilled meanwhile join as decodes in reality: this is the optimistic side."""
        steps = {s.seq_id: self.steps_left(s) for s in decodes}
        left = sorted(decodes, key=lambda s: steps[s.seq_id])
        phases, done = [], 0
        while True:
            reserved = sum(self.decode_tokens(s) for s in left)
            per_step = self.scheduler.prefill_tokens_per_step(reserved, self.prefill_limit(left, reserved))
            if not left:
                return phases + [(math.inf, reserved, per_step)]
            end = steps[left[0].seq_id]
            if end > done:
                phases.append((end - done, reserved, per_step))
            done, left = end, [s for s in left if steps[s.seq_id] > end]

    def deferred_prompts(self, waiting: list, running: list, num_free_slots: int) -> set[str]:
        """Seq ids of the ``waiting`` prompts (in the scheduler's earliest-deadline order) to admit
        after the others (:func:`engine.slo_admission.deferred_jobs`): a prompt that would miss
        its TTFT budget waiting for a slot lets shorter ones go first instead of making them late
        too. Empty unless ``scheduling_policy`` is "slo" with SLO classes, with no slot free now
        (only admissions are reordered), or before any step time is learned.

        Each running sequence frees its slot after its remaining steps (:meth:`steps_left`; a
        prompt still prefilling, its prompt step and ``max_tokens`` steps) at the predicted
        decode-only step; a waiting prompt takes one step of its prompt's tokens to its first
        token and ``max_tokens - 1`` decode steps at one token each (before it drafts nothing is
        known about its acceptance)."""
        cfg = self.config
        free_now = min(num_free_slots, cfg.max_num_seqs - len(running))
        if cfg.scheduling_policy != "slo" or free_now <= 0 or len(waiting) < 2 or not cfg.slo_classes:
            return set()
        decodes = [s for s in running if not s.num_prompt_tokens_left]
        decode_tokens = sum(self.decode_tokens(s) for s in decodes)
        predict = self.step_predictor()
        step_s = predict(max(decode_tokens, 1))
        if step_s <= 0:
            return set()
        now = time.monotonic()

        def frees_at(s) -> float:  # a running sequence's slot
            if not s.num_prompt_tokens_left:
                return now + self.steps_left(s) * step_s
            return now + predict(decode_tokens + s.num_prompt_tokens_left) + decode_hold_s(s.params.max_tokens, 1.0, step_s)

        jobs = []
        for s in waiting:
            # The scheduler's "slo" key holds the TTFT deadline (arrival + budget; inf without one).
            deadline_s, arrival_s = self.scheduler.key_of(s)[1], s.request.metrics.arrival_time_s
            first_s = predict(decode_tokens + len(s.prompt_token_ids))
            jobs.append(SlotJob(deadline_s, s.params.priority, first_s,
                                first_s + decode_hold_s(s.params.max_tokens, 1.0, step_s),
                                defer_until_s(arrival_s, deadline_s - arrival_s)))
        frees = [now] * free_now + [frees_at(s) for s in running]
        return {waiting[i].seq_id for i in deferred_jobs(jobs, frees, now)}

    def step_predictor(self, batch_scale: float = 1.0) -> Callable[..., float]:
        """Predicted step seconds for a number of target tokens (and, optionally, the prefill
        chunks' attention work, :func:`engine.spec_cost.prefill_attention_pairs`): the target
        forward and, drafting as the last step did (its drafted tokens times ``batch_scale``, for
        a batch that many times as large), the draft phase (learned online; 0 before any step)."""
        ks = list(self.controller.last.k.values())
        passes, drafted = max(ks, default=0), round(sum(ks) * batch_scale)
        return lambda tokens, pairs=0.0: self.controller.predict_step_s(tokens, passes, drafted, prefill_pairs=pairs)

    def prefill_limit(self, decodes, decode_tokens: int) -> int | None:
        """Prefill tokens this step may take so the running decodes keep their TPOT budgets.

        TPOT is judged per request, (finish - first token) / (output tokens - 1), so a decode may
        absorb a longer step as long as its whole remaining output still fits its budget. Its
        allowance for the step (:func:`step_allowance_ms`) is the decode-only step time plus a
        share of its projected slack (:func:`projected_slack_s`: the time its TPOT budget leaves
        over its remaining decode-only steps), and never less than its TPOT budget times the
        tokens it is expected to emit in the step (:meth:`SpeculationController.expected_tokens`
        at its last draft length). Its class's ``itl_ms`` caps the allowance: slack buys one long
        gap in a stream at the same TPOT, and that gap is the p99 ITL a client sees. The cap is
        divided by the 90th percentile of chunked steps' measured / predicted time
        (``SpeculationController.chunk_overrun``), so nine chunked steps in ten keep it, and the
        chunk's attention work counts as if it continued the furthest started prompt. A flat
        per-step cap sized chunks for the worst case and slowed bursts' TTFT: the production
        mix's 13-token completions have 50 ms x 12 of TPOT budget and decode steps of ~10-20 ms.

        A cap (an ``itl_ms``, or a TPOT allowance of a decode behind its budget) that the predicted
        decode-only step exceeds does not apply (the decode's other caps still do): no chunk size
        keeps it, and capping anyway held every step to the minimum chunk of one prompt. Over HTTP
        at concurrency 16 on the 2-core VM (every step predicted at 20-47 ms against the embedded
        config's 25 ms ITL cap) that admitted prompts one 32-token chunk a step: 2-5 of 16
        requests decoding while up to 13 waited, time to first token 2.1-4.0 s, speculation
        0.64-0.88x of plain decoding's throughput; with sampling (temperature 0.8, decodes behind
        their 25 ms TPOT budget) the TPOT floor did the same (TTFT 2.4 s, 0.62x). The decode-only
        step judged is the one once the prompts in line decode too (:meth:`_num_joining`), each
        with the running decodes' mean target and drafted tokens: a cap only the current few
        decodes keep held chunks to ~40 tokens there, so few decoded, their short steps kept the
        cap, and 2 of 5 servers stayed so (4-5 of 16 decoding, TTFT p50 1.6-2.0 s, 0.74-0.86x).
        Overloaded like that, chunks are sized by the token budget alone, as in vLLM."""
        if not self.config.slo_classes:  # nothing is budgeted (the common case): no per-decode work
            return None
        predict = self.step_predictor()
        now, decode_s, budgets = time.monotonic(), predict(decode_tokens), []
        grown = (len(decodes) + self._num_joining()) / max(len(decodes), 1)  # the batch once they decode
        full_ms = self.step_predictor(grown)(round(decode_tokens * grown)) * 1e3
        overrun = self.controller.chunk_overrun.value  # measured / predicted, chunked steps' p90
        for s in decodes:
            slo = self.config.slo_for(s.params.slo_class)[1]
            if slo is None:
                continue
            caps_ms = []
            if slo.tpot_ms:
                k = self.controller.last.k.get(s.seq_id, 0)
                slack_s = projected_slack_s(s, slo.tpot_ms / 1e3, now, self.steps_left(s), decode_s)
                caps_ms.append(step_allowance_ms(slo.tpot_ms, self.controller.expected_tokens(s.seq_id, k),
                                                 decode_s * 1e3, None if slack_s is None else slack_s * 1e3))
            if slo.itl_ms:  # the gap this step makes in its stream, whatever the slack allows,
                caps_ms.append(itl_cap_ms(slo.itl_ms, overrun, full_ms))
            # A cap the decode-only step exceeds once the prompts in line decode too cannot be
            # kept by shrinking the chunk; holding chunks small then only starves admission.
            attainable = [c for c in caps_ms if c > full_ms]
            if attainable:
                budgets.append(min(attainable))
        if not budgets:
            return None
        # The chunk's attention work, as if it continued the furthest started prompt (the largest
        # for its size: late chunks of a long prompt ran 1.8x a cost linear in tokens).
        start = max((s.num_cached for s in self.scheduler.running if s.num_prompt_tokens_left), default=0)
        return prefill_token_limit(budgets, decode_tokens, self.config.max_num_batched_tokens,
                                   lambda tokens: predict(tokens, prefill_attention_pairs(start, tokens - decode_tokens)))

    def _num_joining(self) -> int:
        """Prompts in line to decode: those partly prefilled and the waiting ones free seats admit
        (``max_num_seqs``)."""
        running = self.scheduler.running
        prefilling = sum(1 for s in running if s.num_prompt_tokens_left)
        seats = max(0, self.config.max_num_seqs - len(running))
        return prefilling + min(len(self.scheduler.waiting), seats)

    def tpot_slack(self, decodes) -> dict[str, tuple[float, float]]:
        """(TPOT budget s, slack s) per decoding sequence with a TPOT budget and a first token, for
        the speculation controller (:func:`sequence_slack_s`; negative: behind its budget)."""
        if not self.config.slo_classes:
            return {}
        now, out = time.monotonic(), {}
        for seq in decodes:
            slo = self.config.slo_for(seq.params.slo_class)[1]
            if slo is not None and slo.tpot_ms is not None:
                budget_s = slo.tpot_ms / 1e3
                slack_s = sequence_slack_s(seq, budget_s, now)
                if slack_s is not None:
                    out[seq.seq_id] = (budget_s, slack_s)
        return out

    def record(self, request: RequestOutput, params) -> None:
        """Count a finished request against its class's budget. Classless requests are not
        counted, nor aborted ones: a request its client abandoned has no latency to judge (it
        could count as met with no token delivered), as vLLM's bench counts only completed ones."""
        name, slo = self.config.slo_for(params.slo_class)
        if slo is None or any(o.finish_reason == "abort" for o in request.outputs):
            return
        tokens = max((len(o.token_ids) for o in request.outputs), default=0)
        ok = request.metrics is not None and request_slo_met(slo, request.metrics, tokens)
        met_total = self.counts.setdefault(name, [0, 0])
        met_total[0] += int(ok)
        met_total[1] += 1

    def totals(self) -> dict[str, list[int]]:
        """{class: [met, finished]} since the engine started."""
        return {k: list(v) for k, v in self.counts.items()}
