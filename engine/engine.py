"""The in-process speculative decoding engine with continuous batching.

One :meth:`LLMEngine.step`: the scheduler picks running sequences (decode) and admits waiting ones
(prefill); the drafter proposes up to k tokens per decoding sequence; ONE target forward runs the
prefills and, for each decoding sequence, its newest token plus its draft tokens; the rejection
sampler (``kernels.rejection``) turns the target and draft distributions into accepted, recovered
and bonus tokens; the sequences emit them (stopping inside the run if needed) and roll their KV
caches back to what they kept. Greedy output equals plain greedy decoding token for token and
sampled output follows the target distribution (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import msgspec

from engine.config import context_window
from engine.cost_feedback import build_controller, learns_costs, observe_costs, take_distinct_experts
from engine.drafters.base import Drafter, DraftProposal, DraftRequest
from engine.drafters.eagle import FeatureHistory
from engine.emission import emit_tokens
from engine.errors import QueueFull
from engine.loader import LoadedModel
from engine.model import ForwardBatch
from engine.observer import PHASE_DRAFT, PHASE_TARGET, PHASE_VERIFY, NullStepObserver, StepObserver, StepStats
from engine.outputs import RequestMetrics, RequestOutput, SpecDecodeStats
from engine.request_ranges import (
    check_draft_length,
    check_n,
    check_priority,
    check_prompt,
    check_stop_ids,
    check_without_tokenizer,
)
from engine.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import SeqStatus, Sequence
from engine.slo import SLOPolicy
from engine.spec_controller import Decision, SpeculativePolicy
from engine.spec_cost import prefill_attention_pairs
from engine.verification import build_verify_batch, verify
from kernels.rejection import PLACEHOLDER_TOKEN_ID

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a loaded target and a drafter.

    Args:
        target: the target model (its experts may live in other processes).
        drafter: proposes draft tokens (draft model, n-gram, or none).
        num_speculative_tokens: the most a sequence drafts, k (0..16); a request may ask for less.
        scheduler_config: batching limits; ``max_num_seqs`` sizes the target KV cache.
        max_model_len: context window, 2 up to the target's ``max_position_embeddings`` (the default).
        observer: step/phase hooks (tracing); defaults to none.
        speculative_policy: "adaptive" picks each sequence's draft length per step, up to its k
            and 0 included (:mod:`engine.spec_controller`); "fixed" always drafts k.

    Raises:
        ConfigError: ``max_model_len`` outside that range.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        num_speculative_tokens: int = 0,
        scheduler_config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        observer: StepObserver | None = None,
        speculative_policy: SpeculativePolicy = "adaptive",
    ) -> None:
        self.target = target
        self.observer = observer or NullStepObserver()
        self.last_step = StepStats()
        self.last_step_error: Exception | None = None  # the latest step's failure (offline generate raises it)
        self.drafter = drafter
        # EAGLE-3: the target layers whose input the drafter reads, kept per sequence.
        self.feature_layers: tuple[int, ...] = tuple(getattr(drafter, "feature_layers", ()))
        self.features = FeatureHistory(len(self.feature_layers) * target.config.hidden_size, target.model.dtype,
                                       target.model.device) if self.feature_layers else None
        self.num_speculative_tokens = num_speculative_tokens
        self.scheduler = Scheduler(scheduler_config or SchedulerConfig())
        self.max_model_len = context_window(max_model_len, target.config.max_position_embeddings)
        self.kv = target.model.new_kv_cache(self.scheduler.config.max_num_seqs, self.max_model_len)
        self.stats = SpecDecodeStats()
        self.num_steps = 0
        self.finished_by_reason: dict[str, int] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self.controller = build_controller(target, drafter, speculative_policy, self.scheduler.config)
        self.slo = SLOPolicy(self.scheduler, self.controller)
        self.draft_length_counts = [0] * (MAX_SPECULATIVE_TOKENS + 1)  # decoding sequences by chosen k
        self.num_spec_off_steps = 0
        self._catchup: dict[str, int] = {}  # per sequence, tokens the drafter caught up on this step
        # Windows drafted ahead (engine.drafters.pipelined): used by the next proposal, or discarded.
        self.num_pipelined_windows = {"used": 0, "discarded": 0}
        self._drafting_ahead: set[str] = set()

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time_s: float | None = None,
    ) -> RequestOutput:
        """Queue a request (``params.n`` sequences).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, prompt + max_tokens beyond
                the context window, a draft length above the engine's, or a duplicate request id.
            QueueFull: the waiting queue is full (DeadlineUnattainable: the request's TTFT budget
                cannot be met at this load, with ``refuse_unattainable_ttft``).
        """
        if params.max_tokens is None:  # vLLM: up to the context window
            params = msgspec.structs.replace(params, max_tokens=max(self.max_model_len - len(prompt_token_ids), 1))
        self._check_request(request_id, prompt_token_ids, params)
        request = RequestOutput(request_id, prompt, list(prompt_token_ids), [],
                                metrics=RequestMetrics(arrival_time_s or time.monotonic()))
        k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        seqs = [Sequence.sample_of(request, i, params, k, self.target.tokenizer, self.target.eos_token_ids)
                for i in range(params.n)]
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return request

    def _check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise what :meth:`add_request` raises, before it adds anything."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params.validate()
        check_draft_length(params.num_speculative_tokens, self.num_speculative_tokens)
        vocab_size = self.target.config.vocab_size
        check_prompt(prompt_token_ids, params.max_tokens, vocab_size, self.max_model_len)
        check_stop_ids(params.stop_token_ids, vocab_size)
        if self.target.tokenizer is None:
            check_without_tokenizer(False, params.stop)
        check_n(params.n, self.scheduler.config.max_num_seqs, self.scheduler.config.max_waiting)
        check_priority(params.priority, self.scheduler.config.scheduling_policy)
        if not self.scheduler.can_accept(params.n):  # QueueFull: a 503 to retry, where check_n's is a 400
            raise QueueFull(f"the server is at capacity ({self.scheduler.config.max_num_seqs} running + "
                            f"{self.scheduler.config.max_waiting} waiting sequences); retry later")
        decodes = [s for s in self.scheduler.running if not s.num_prompt_tokens_left]
        self.slo.check(params, len(prompt_token_ids), decodes)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request; its KV slots are freed now. Returns False if it was not running."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + draft + verify step; return the requests that progressed."""
        decodes = [s for s in self.scheduler.running if not s.num_prompt_tokens_left]
        limit = None  # no prompt to chunk (a decode-only step): none of the per-decode budget work
        if self.scheduler.waiting or len(decodes) < len(self.scheduler.running):
            limit = self.slo.prefill_limit(decodes, sum(self.slo.decode_tokens(s) for s in decodes))
        deferred = self.slo.deferred_prompts(self.scheduler.waiting, self.scheduler.running, self.kv.num_free)
        sched = self.scheduler.schedule(self.kv.num_free, self._decode_cost, limit, deferred)
        if sched.empty:
            return []
        for seq in sched.prefills:
            if seq.slot is None:  # newly admitted (a continuing chunked prefill has its slot)
                seq.slot = self.kv.allocate()
                seq.request.metrics.first_scheduled_time_s = seq.request.metrics.first_scheduled_time_s \
                    or time.monotonic()
        seqs = sched.prefills + sched.decodes
        for seq in seqs:  # every completion of a touched request: a finished sibling adds nothing
            for completion in seq.request.outputs:
                completion.new_text, completion.new_token_ids = "", []
        start = time.perf_counter()
        before = (self.stats.num_draft_tokens, self.stats.num_accepted_tokens, self.stats.num_emitted_tokens)
        with self.observer.step(sorted({s.request_id for s in seqs})) as report:
            decision = Decision()
            # Before the forward moves num_cached: where each chunk starts sets its attention work.
            pairs = sum(prefill_attention_pairs(s.num_cached, sched.chunks[s.seq_id]) for s in sched.prefills)
            try:
                decision = self._plan(sched, pairs)
                with self.observer.phase(PHASE_DRAFT):
                    t0 = time.perf_counter()
                    drafts = self._propose(sched.decodes, decision)
                    t1 = time.perf_counter()
                self._verify_and_emit(sched, drafts)
                target_s = time.perf_counter() - t1
                fits = learns_costs(self.controller.max_k, self.scheduler.config) and self.controller.fits_last_step
                distinct = take_distinct_experts(self.target.model, fits)
                if fits:
                    observe_costs(self.controller, t1 - t0, target_s, drafts, sched, distinct, self._catchup, pairs)
                if not sched.prefills:  # the realised goodput check compares pure-decode steps only
                    self.controller.observe_goodput(self.stats.num_emitted_tokens - before[2],
                                                    time.perf_counter() - start)
            except Exception as e:  # a failed step fails only the sequences in it; the engine keeps serving
                log.exception("engine step failed; failing %d sequences", len(seqs))
                self.last_step_error = e
                drafts = {}
                for seq in seqs:
                    if seq.status is not SeqStatus.FINISHED:
                        self._finish(seq, "error")
            self.last_step = StepStats(
                batch_size=len(seqs), num_prefills=len(sched.prefills),
                num_drafted=self.stats.num_draft_tokens - before[0],
                num_accepted=self.stats.num_accepted_tokens - before[1],
                num_emitted=self.stats.num_emitted_tokens - before[2],
                k=max((len(p.token_ids) for p in drafts.values()), default=0),
                duration_s=time.perf_counter() - start, k_policy=decision.reason,
                expected_tokens=decision.expected_tokens, predicted_step_s=decision.predicted_step_s)
            report(self.last_step)
        self.num_steps += 1
        # A chunk that did not finish its prompt made no visible progress: nothing to report.
        return self._collect(s for s in seqs if not s.num_prompt_tokens_left or s.status is SeqStatus.FINISHED)

    def _k_for(self, seq: Sequence, speculate: bool) -> int:
        """Draft length this step: no drafting past max_tokens or the context window."""
        if not speculate:
            return 0
        remaining = seq.params.max_tokens - seq.num_output_tokens - 1
        room = self.max_model_len - seq.num_tokens - 1
        return max(0, min(seq.k, remaining, room))

    def _decode_cost(self, seq: Sequence, speculate: bool) -> int:
        return 1 + self._k_for(seq, speculate)  # the cap: the controller may choose less

    def _plan(self, sched: SchedulerOutput, prefill_pairs: float) -> Decision:
        """Each decoding sequence's draft length this step, from the controller (``prefill_pairs``:
        the chunks' attention work, :func:`engine.spec_cost.prefill_attention_pairs`)."""
        # Seeded sampling too: its tokens are races that no draft length changes (Sequence.race_seed).
        caps = {seq.seq_id: self._k_for(seq, sched.speculate) for seq in sched.decodes}
        base = sum(sched.chunks.values()) + len(sched.decodes)
        final = sum(1 for s in sched.prefills if sched.chunks[s.seq_id] == s.num_prompt_tokens_left)
        catchup = {s.seq_id: s.num_tokens - s.num_draft_seen for s in sched.decodes}
        remaining = {s.seq_id: s.params.max_tokens - s.num_output_tokens for s in sched.decodes}
        decision = self.controller.plan(caps, base, final, catchup, remaining,
                                        self.slo.tpot_slack(sched.decodes), prefill_pairs)
        for k in decision.k.values():
            self.draft_length_counts[k] += 1
        if sched.decodes and not any(decision.k.values()):
            self.num_spec_off_steps += 1
        return decision

    def _propose(self, decodes: list[Sequence], decision: Decision) -> dict[str, DraftProposal]:
        """Draft tokens for the sequences the decision gives k > 0; none at all otherwise (k = 0
        skips the drafter entirely: no call, no forward, no draft probabilities)."""
        reqs = [
            DraftRequest(seq.seq_id, seq.token_ids, k, seq.params.temperature, seq.params.top_k,
                         seq.params.top_p, seq.generator,
                         self.features.get(seq.seq_id) if self.features is not None else None,
                         race_seed=seq.race_seed)
            for seq in decodes
            if (k := decision.k.get(seq.seq_id, 0)) > 0
        ]
        if not reqs:
            return {}
        self._catchup = {}
        for seq in decodes:
            if decision.k.get(seq.seq_id, 0) > 0:
                self._catchup[seq.seq_id] = seq.num_tokens - seq.num_draft_seen
                seq.num_draft_seen = seq.num_tokens
        drafts = {r.seq_id: p for r, p in zip(reqs, self.drafter.propose(reqs))}
        used = sum(p.pipelined for p in drafts.values())  # a drafter keeps a window for one proposal
        self.num_pipelined_windows["used"] += used
        self.num_pipelined_windows["discarded"] += len(self._drafting_ahead) - used
        self._drafting_ahead = {sid for sid, p in drafts.items() if p.drafting_ahead}
        return drafts

    def _verify_and_emit(self, sched: SchedulerOutput, drafts) -> None:
        """One target forward over prefill chunks and decodes, then verification and emission.

        Batch order: chunks that do not finish their prompt (their one logit row is dropped: they
        emit nothing yet), then final prefill chunks, then the decodes with their drafts."""
        partial = [s for s in sched.prefills if sched.chunks[s.seq_id] < s.num_prompt_tokens_left]
        prefills = [s for s in sched.prefills if sched.chunks[s.seq_id] == s.num_prompt_tokens_left]
        decodes = sched.decodes
        chunks = [s.prompt_token_ids[s.num_cached: s.num_cached + sched.chunks[s.seq_id]] for s in partial + prefills]
        draft_lists = [[] for _ in prefills] + [drafts[s.seq_id].token_ids if s.seq_id in drafts else []
                                               for s in decodes]
        new_tokens = chunks + [[s.last_token_id] + d for s, d in zip(decodes, draft_lists[len(prefills):])]
        starts = [s.num_cached for s in partial + prefills + decodes]
        num_logits = [1] * len(chunks) + [len(t) for t in new_tokens[len(chunks):]]
        for seq, start, toks in zip(partial + prefills + decodes, starts, new_tokens):
            self.kv.reserve(seq.slot, start + len(toks))
        batch = ForwardBatch.build([s.slot for s in partial + prefills + decodes], new_tokens, starts,
                                   num_logits, self.target.model.device)
        feats = None
        with self.observer.phase(PHASE_TARGET):
            if self.feature_layers:  # features of every new token: only the rejected ones go unused
                logits, feats = self.target.model.forward_with_features(batch, self.kv, self.feature_layers)
                feats = list(feats.split(batch.query_lens))
            else:
                logits = self.target.model.forward(batch, self.kv)  # (sum(num_logits), vocab)
        for i, (seq, toks) in enumerate(zip(partial, chunks)):
            seq.num_cached += len(toks)
            if feats is not None:
                self.features.append(seq.seq_id, feats[i])
        logits, num_logits, starts = logits[len(partial):], num_logits[len(partial):], starts[len(partial):]
        new_tokens, seqs = new_tokens[len(partial):], prefills + decodes
        feats = feats[len(partial):] if feats is not None else None
        if not seqs:
            return
        with self.observer.phase(PHASE_VERIFY):
            batch = build_verify_batch(logits, num_logits, draft_lists, [drafts.get(s.seq_id) for s in seqs],
                                       [s.generator for s in seqs], [s.params for s in seqs],
                                       [(s.race_seed, s.num_tokens) if s.race_seed is not None else None
                                        for s in seqs])
            out_ids, num_acc = verify(batch)
            self._emit_all(seqs, starts, new_tokens, draft_lists, logits, num_logits, out_ids, num_acc, feats)

    def _emit_all(self, seqs, starts, new_tokens, draft_lists, logits, num_logits, out_ids, num_acc,
                  feats) -> None:
        """Emit each sequence's accepted run and roll its KV cache (and features) back to what it kept.

        ``logits``: the ``(sum(num_logits), V)`` logit rows, each sequence's ``num_logits`` rows in
        order; a sequence's rows are sliced only when it asked for logprobs."""
        ends = list(itertools.accumulate(num_logits))
        self.controller.observe_acceptances([(s.seq_id, len(d), a) for s, d, a in zip(seqs, draft_lists, num_acc)])
        for b, seq in enumerate(seqs):
            emitted = out_ids[b]
            kept_new = len(new_tokens[b]) - len(draft_lists[b]) + num_acc[b]
            kept_cache = starts[b] + kept_new
            self.kv.truncate(seq.slot, kept_cache)
            seq.num_cached = kept_cache
            if feats is not None:
                self.features.append(seq.seq_id, feats[b][:kept_new])
            if seq.seq_id in self._drafting_ahead and num_acc[b] == len(draft_lists[b]):
                self.controller.note_drafted_ahead(seq.seq_id, num_acc[b])  # its next window may be ready
            if PLACEHOLDER_TOKEN_ID in emitted:  # no token to sample (e.g. NaN logits): this sequence fails alone
                log.error("sequence %s sampled no token (step output %s); failing it", seq.seq_id, emitted)
                self._finish(seq, "error")
                continue
            own = logits[ends[b] - num_logits[b]: ends[b]] if seq.completion.logprobs is not None else None
            reason = emit_tokens(seq, emitted, own, len(draft_lists[b]), num_acc[b], self.stats)
            if reason is not None:
                self._finish(seq, reason, seq.state.stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Free everything the sequence holds, at once (KV slot, drafter state)."""
        self.scheduler.remove(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        self.drafter.release(seq.seq_id)
        if seq.seq_id in self._drafting_ahead:
            self._drafting_ahead.discard(seq.seq_id)
            self.num_pipelined_windows["discarded"] += 1
        if self.features is not None:
            self.features.release(seq.seq_id)
        self.controller.release(seq.seq_id)
        seq.completion.finish_reason = reason
        seq.completion.stop_reason = stop_reason
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        request = seq.request
        if all(o.finished for o in request.outputs):
            request.finished = True
            request.metrics.finished_time_s = time.monotonic()
            self.slo.record(request, seq.params)
            self._requests.pop(request.request_id, None)

    def _collect(self, seqs: Iterable[Sequence]) -> list[RequestOutput]:
        seen: dict[str, RequestOutput] = {}
        for seq in seqs:
            seen.setdefault(seq.request_id, seq.request)
        return list(seen.values())

    def get_metrics(self) -> dict:
        """Engine totals: spec-decode counters, steps, finished requests by reason, KV usage."""
        return {
            **self.stats.as_dict(),
            "num_steps": self.num_steps,
            "finished_by_reason": dict(self.finished_by_reason),
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_slots_used": self.kv.num_used,
            "kv_cache_usage": self.kv.usage(),
            "draft_length_counts": list(self.draft_length_counts),
            "num_spec_off_steps": self.num_spec_off_steps,
            "pipelined_windows": dict(self.num_pipelined_windows),
            "slo_attainment": self.slo.totals(),
        }
