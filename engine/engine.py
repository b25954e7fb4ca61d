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

import logging
import os
import time
from collections.abc import Iterable

import torch

from engine.detokenizer import SequenceOutputState
from engine.drafters.base import Drafter, DraftProposal, DraftRequest
from engine.errors import SpecmoeError
from engine.loader import LoadedModel
from engine.model import ForwardBatch
from engine.observer import PHASE_DRAFT, PHASE_TARGET, PHASE_VERIFY, NullStepObserver, StepObserver, StepStats
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeStats, TokenLogprob
from engine.sampling import make_generator, top_logprobs
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SeqStatus, Sequence
from engine.verification import build_verify_batch, verify
from kernels.rejection import PLACEHOLDER_TOKEN_ID

log = logging.getLogger(__name__)


class QueueFull(SpecmoeError):
    """The waiting queue is at ``max_waiting``; retry later (HTTP 503)."""


class LLMEngine:
    """Continuous-batching engine over a loaded target and a drafter.

    Args:
        target: the target model (its experts may live in other processes).
        drafter: proposes draft tokens (draft model, n-gram, or none).
        num_speculative_tokens: default draft length k (0..16); a request may override it.
        scheduler_config: batching limits; ``max_num_seqs`` sizes the target KV cache.
        max_model_len: context window (defaults to the target's ``max_position_embeddings``).
        observer: step/phase hooks (tracing); defaults to none.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        num_speculative_tokens: int = 0,
        scheduler_config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        observer: StepObserver | None = None,
    ) -> None:
        self.target = target
        self.observer = observer or NullStepObserver()
        self.last_step = StepStats()
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.scheduler = Scheduler(scheduler_config or SchedulerConfig())
        self.max_model_len = max_model_len or target.config.max_position_embeddings
        self.kv = target.model.new_kv_cache(self.scheduler.config.max_num_seqs, self.max_model_len)
        self.stats = SpecDecodeStats()
        self.num_steps = 0
        self.finished_by_reason: dict[str, int] = {}
        self._requests: dict[str, list[Sequence]] = {}

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
                the context window, or a duplicate request id.
            QueueFull: the waiting queue is full.
        """
        self.check_request(request_id, prompt_token_ids, params)
        request = RequestOutput(request_id, prompt, list(prompt_token_ids), [],
                                metrics=RequestMetrics(arrival_time_s or time.monotonic()))
        k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        seqs = []
        for i in range(params.n):
            completion = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
            request.outputs.append(completion)
            seed = (params.seed + i) % (MAX_SEED + 1) if params.seed is not None else int.from_bytes(os.urandom(7), "little")
            state = SequenceOutputState(self.target.tokenizer, params, self.target.eos_token_id, prompt_token_ids)
            gen = None if params.greedy else make_generator(seed)
            seqs.append(Sequence(f"{request_id}-{i}", i, request, params, state, gen, k, completion))
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return request

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      num_pending_seqs: int = 0) -> None:
        """Raise what :meth:`add_request` would raise, without adding anything.

        Args:
            num_pending_seqs: sequences about to be added before this one (queued by a caller that
                adds requests between steps).

        Raises:
            ValueError: bad prompt, parameters or duplicate id; QueueFull: no room.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context window of {self.max_model_len} tokens"
            )
        if not self.scheduler.can_accept(params.n + num_pending_seqs):
            raise QueueFull(f"the server is at capacity ({self.scheduler.config.max_num_seqs} running + "
                            f"{self.scheduler.config.max_waiting} waiting sequences); retry later")

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
        sched = self.scheduler.schedule(self.kv.num_free, self._decode_cost)
        if sched.empty:
            return []
        for seq in sched.prefills:
            seq.slot = self.kv.allocate()
            if seq.request.metrics.first_scheduled_time_s is None:
                seq.request.metrics.first_scheduled_time_s = time.monotonic()
        seqs = sched.prefills + sched.decodes
        for seq in seqs:  # every completion of a touched request: a finished sibling adds nothing
            for completion in seq.request.outputs:
                completion.new_text, completion.new_token_ids = "", []
        start = time.perf_counter()
        before = (self.stats.num_draft_tokens, self.stats.num_accepted_tokens, self.stats.num_emitted_tokens)
        with self.observer.step(sorted({s.request_id for s in seqs})) as report:
            try:
                with self.observer.phase(PHASE_DRAFT):
                    drafts = self._propose(sched.decodes, sched.speculate)
                self._verify_and_emit(sched.prefills, sched.decodes, drafts)
            except Exception:  # a failed step fails only the sequences in it; the engine keeps serving
                log.exception("engine step failed; failing %d sequences", len(seqs))
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
                duration_s=time.perf_counter() - start)
            report(self.last_step)
        self.num_steps += 1
        return self._collect(seqs)

    def _k_for(self, seq: Sequence, speculate: bool) -> int:
        """Draft length this step: no drafting past max_tokens or the context window."""
        if not speculate:
            return 0
        remaining = seq.params.max_tokens - seq.num_output_tokens - 1
        room = self.max_model_len - seq.num_tokens - 1
        return max(0, min(seq.k, remaining, room))

    def _decode_cost(self, seq: Sequence, speculate: bool) -> int:
        return 1 + self._k_for(seq, speculate)

    def _propose(self, decodes: list[Sequence], speculate: bool) -> dict[str, DraftProposal]:
        reqs = [
            DraftRequest(seq.seq_id, seq.token_ids, k, seq.params.temperature, seq.params.top_k,
                         seq.params.top_p, seq.generator)
            for seq in decodes
            if (k := self._k_for(seq, speculate)) > 0
        ]
        if not reqs:
            return {}
        return {r.seq_id: p for r, p in zip(reqs, self.drafter.propose(reqs))}

    def _verify_and_emit(self, prefills: list[Sequence], decodes: list[Sequence], drafts) -> None:
        seqs = prefills + decodes
        draft_lists = [[] for _ in prefills] + [drafts[s.seq_id].token_ids if s.seq_id in drafts else []
                                               for s in decodes]
        new_tokens = [s.prompt_token_ids for s in prefills] + [
            [s.last_token_id] + d for s, d in zip(decodes, draft_lists[len(prefills):])
        ]
        starts = [0] * len(prefills) + [s.num_cached for s in decodes]
        num_logits = [1] * len(prefills) + [len(t) for t in new_tokens[len(prefills):]]
        for seq, start, toks in zip(seqs, starts, new_tokens):
            self.kv.reserve(seq.slot, start + len(toks))
        batch = ForwardBatch.build([s.slot for s in seqs], new_tokens, starts, num_logits, self.target.model.device)
        with self.observer.phase(PHASE_TARGET):
            logits = self.target.model.forward(batch, self.kv)  # (sum(num_logits), vocab)
        with self.observer.phase(PHASE_VERIFY):
            batch = build_verify_batch(logits, num_logits, draft_lists, [drafts.get(s.seq_id) for s in seqs],
                                       [s.generator for s in seqs], [s.params for s in seqs])
            out_ids, num_acc = verify(batch)
            rows = torch.split(logits, num_logits)
            self._emit_all(seqs, starts, new_tokens, draft_lists, rows, out_ids, num_acc)

    def _emit_all(self, seqs, starts, new_tokens, draft_lists, rows, out_ids, num_acc) -> None:
        """Emit each sequence's accepted run and roll its KV cache back to what it kept."""
        for b, seq in enumerate(seqs):
            emitted = out_ids[b]
            kept_cache = starts[b] + len(new_tokens[b]) - len(draft_lists[b]) + num_acc[b]
            self.kv.truncate(seq.slot, kept_cache)
            seq.num_cached = kept_cache
            self._emit(seq, emitted, rows[b], len(draft_lists[b]), num_acc[b])

    def _emit(self, seq: Sequence, tokens: list[int], logit_rows: torch.Tensor, num_drafted: int,
              num_accepted: int) -> None:
        assert PLACEHOLDER_TOKEN_ID not in tokens
        result = seq.state.append(tokens)
        kept = result.num_kept
        comp = seq.completion
        comp.new_token_ids = tokens[:kept]
        comp.token_ids = list(seq.state.token_ids)
        comp.new_text = result.text_delta
        comp.text = seq.state.text
        if comp.logprobs is not None and kept:
            tok_lp, top_ids, top_lps = top_logprobs(logit_rows[:kept], torch.tensor(tokens[:kept],
                                                    device=logit_rows.device), seq.params.logprobs)
            tok_lp, top_ids, top_lps = tok_lp.cpu(), top_ids.cpu(), top_lps.cpu()  # small, explicit
            for i in range(kept):
                top = dict(zip(top_ids[i].tolist(), top_lps[i].tolist()))
                comp.logprobs.append(TokenLogprob(tokens[i], float(tok_lp[i]), top))
        comp.spec_stats.record(num_drafted, min(num_accepted, kept))
        comp.spec_stats.num_emitted_tokens += kept
        self.stats.record(num_drafted, min(num_accepted, kept))
        self.stats.num_emitted_tokens += kept
        if kept and seq.request.metrics.first_token_time_s is None:
            seq.request.metrics.first_token_time_s = time.monotonic()
        if result.finish_reason is not None:
            self._finish(seq, result.finish_reason, seq.state.stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Free everything the sequence holds, at once (KV slot, drafter state)."""
        self.scheduler.remove(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        self.drafter.release(seq.seq_id)
        seq.completion.finish_reason = reason
        seq.completion.stop_reason = stop_reason
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        request = seq.request
        if all(o.finished for o in request.outputs):
            request.finished = True
            request.metrics.finished_time_s = time.monotonic()
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
        }
