"""Continuous batching: admit waiting sequences between steps under a token budget.

Each step every decoding sequence runs first (1 + k tokens through the target: its newest token
and up to k draft tokens); the remaining token budget then goes to prefills, first come first
served, while KV slots and ``max_num_seqs`` allow (Orca, Yu et al. 2022; vLLM's scheduler). With
chunked prefill (the default) a prompt is split across steps into chunks that fill what the
decodes leave of the budget, so a long prompt never stalls the running decodes for a whole
prefill (Sarathi-Serve's stall-free batching, Agrawal et al. 2024): a partly prefilled sequence
continues before new ones are admitted, except with ``scheduling_policy: slo``, where started and
waiting prompts share one earliest-deadline-first order.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from engine.sequence import SeqStatus, Sequence
from engine.slo import SLOClass

MIN_PREFILL_CHUNK = 32  # tokens a started chunked prefill gets per step at least


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Batching limits.

    Attributes:
        max_num_seqs: running sequences at most (also the KV cache slot count).
        max_num_batched_tokens: target tokens per step (prefill tokens + decode/verify tokens); a
            prompt longer than the budget is still admitted when it is the only work.
        max_waiting: sequences that may wait beyond the free running slots;
            :meth:`Scheduler.can_accept` is False beyond it (HTTP 503).
        spec_disable_batch_size: speculation is off in steps whose running batch has at least this
            many sequences (draft positions activate extra experts on MoE, so at large batch
            speculation costs more than it saves); 0 never disables it.
        enable_chunked_prefill: split prompts into chunks that fit the step's token budget left
            after the decodes. Off: a prompt is prefilled whole, and one longer than the budget
            only when it is the only work.
        scheduling_policy: order of the waiting queue: "fcfs" (arrival), "priority" (request
            priority, lower first, then arrival) or "slo" (priority, then earliest TTFT deadline:
            arrival + the class's ttft_ms).
        slo_classes: latency budget per class name (:class:`engine.slo.SLOClass`).
        default_slo_class: the class of a request that names none (None: no budget).
        refuse_unattainable_ttft: refuse a request (HTTP 503 + Retry-After) whose TTFT budget the
            queue ahead of it already makes unattainable, instead of serving it late.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    spec_disable_batch_size: int = 0
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    slo_classes: dict[str, SLOClass] = msgspec.field(default_factory=dict)
    default_slo_class: str | None = None
    refuse_unattainable_ttft: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's rule: each running sequence a token
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens must be >= max_num_seqs "
                             f"({self.max_num_seqs}), got {self.max_num_batched_tokens}")
        if self.spec_disable_batch_size < 0:
            raise ValueError("SchedulerConfig.spec_disable_batch_size must be >= 0")
        for name, slo in self.slo_classes.items():
            slo.check(f"slo_classes.{name}")
        if self.default_slo_class is not None and self.default_slo_class not in self.slo_classes:
            raise ValueError(f"SchedulerConfig.default_slo_class: {self.default_slo_class!r} is not one of "
                             f"slo_classes {sorted(self.slo_classes)}")

    def slo_for(self, name: str | None) -> tuple[str | None, SLOClass | None]:
        """(class name, budget) of a request naming ``name`` (None: the default class)."""
        name = name if name is not None else self.default_slo_class
        return name, self.slo_classes.get(name) if name is not None else None


@dataclass
class SchedulerOutput:
    """One step's work.

    Attributes:
        prefills: sequences prefilling a chunk of their prompt this step (newly admitted or
            continuing), in order; ``chunks[seq_id]`` is the chunk's token count.
        decodes: sequences whose prompt is fully prefilled.
        speculate: whether drafting is allowed this step (``spec_disable_batch_size``).
    """

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    speculate: bool = True
    chunks: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """The waiting queue (ordered by ``scheduling_policy``) and the running set."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: list[Sequence] = []
        self._keys: list[tuple] = []  # sort key of each waiting sequence, same order
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self._key_of: dict[str, tuple] = {}  # seq_id -> its sort key, waiting or running

    def _key(self, seq: Sequence) -> tuple:
        order = next(self._arrivals)
        policy = self.config.scheduling_policy
        if policy == "fcfs":
            return (order,)
        if policy == "priority":
            return (seq.params.priority, order)
        slo = self.config.slo_for(seq.params.slo_class)[1]
        ttft_s = slo.ttft_ms / 1e3 if slo is not None and slo.ttft_ms is not None else math.inf
        return (seq.params.priority, seq.request.metrics.arrival_time_s + ttft_s, order)

    def can_accept(self, num_seqs: int = 1) -> bool:
        """Whether ``num_seqs`` more sequences fit: the free running slots plus ``max_waiting``
        (a burst that the next step will admit is not counted as waiting)."""
        free_running = self.config.max_num_seqs - len(self.running)
        return len(self.waiting) + num_seqs <= self.config.max_waiting + free_running

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        key = self._key_of[seq.seq_id] = self._key(seq)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self.waiting.insert(i, seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it (finished, aborted or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            i = self.waiting.index(seq)
            del self.waiting[i], self._keys[i]
        self._key_of.pop(seq.seq_id, None)
        seq.status = SeqStatus.FINISHED

    def key_of(self, seq: Sequence) -> tuple:
        """The sequence's place in ``scheduling_policy`` order (smaller runs earlier)."""
        return self._key_of[seq.seq_id]

    def prompts_ahead(self, priority: int, ttft_deadline_s: float) -> list[Sequence]:
        """Prompts the scheduler would prefill (the rest of) before a request arriving now with
        this priority and TTFT deadline (monotonic s): every started and waiting prompt under
        "fcfs"; started ones and those of no greater priority under "priority"; under "slo" those
        with an earlier or equal (priority, deadline)."""
        started = [s for s in self.running if s.num_prompt_tokens_left]
        policy = self.config.scheduling_policy
        if policy == "fcfs":
            return started + self.waiting
        if policy == "priority":
            return started + [s for s in self.waiting if self.key_of(s)[0] <= priority]
        return [s for s in started + self.waiting if self.key_of(s)[:2] <= (priority, ttft_deadline_s)]

    def prefill_budget(self, decode_tokens: int, prefill_limit: int | None) -> int:
        """Prefill tokens a step has beside decodes of ``decode_tokens`` target tokens: what they
        leave of ``max_num_batched_tokens``, capped by ``prefill_limit`` with chunked prefill."""
        budget = self.config.max_num_batched_tokens - decode_tokens
        if prefill_limit is not None and self.config.enable_chunked_prefill:
            budget = min(budget, prefill_limit)
        return budget

    def prefill_tokens_per_step(self, decode_tokens: int, prefill_limit: int | None) -> int:
        """Prefill tokens the oldest prompt gets in such a step: the budget, or with chunked
        prefill ``MIN_PREFILL_CHUNK`` when the budget is smaller."""
        budget = self.prefill_budget(decode_tokens, prefill_limit)
        return max(budget, MIN_PREFILL_CHUNK) if self.config.enable_chunked_prefill else budget

    def _prefill_order(self, started: list[Sequence], deferred: Collection[str]) -> list[Sequence]:
        """Prompts to prefill this step, in order: with "slo" started and waiting prompts by
        earliest TTFT deadline (a long prompt mid-prefill does not hold back one due sooner), the
        ``deferred`` waiting ones after the others of their priority; otherwise started prompts
        first (oldest first), then the waiting queue."""
        if self.config.scheduling_policy != "slo":
            return started + self.waiting
        return sorted(started + self.waiting, key=lambda s: (self.key_of(s)[0], s.seq_id in deferred, self.key_of(s)))

    def schedule(self, num_free_slots: int, decode_cost: Callable[[Sequence, bool], int],
                 prefill_limit: int | None = None, deferred: Collection[str] = ()) -> SchedulerOutput:
        """Pick this step's work.

        Args:
            num_free_slots: KV cache slots available for new sequences.
            decode_cost: target tokens a running sequence needs this step, given whether
                speculation is on.
            prefill_limit: prefill tokens at most this step (chunked prefill), e.g. what the
                running decodes' TPOT budgets leave; None: only the token budget limits.
            deferred: seq ids of waiting prompts admitted only after the others of their
                priority ("slo"; see :meth:`engine.slo.SLOPolicy.deferred_prompts`).
        """
        cfg = self.config
        speculate = not (cfg.spec_disable_batch_size and len(self.running) >= cfg.spec_disable_batch_size)
        out = SchedulerOutput(speculate=speculate)
        for seq in self.running:
            (out.prefills if seq.num_prompt_tokens_left else out.decodes).append(seq)
        budget = self.prefill_budget(sum(decode_cost(s, speculate) for s in out.decodes), prefill_limit)
        started, out.prefills, admitted = out.prefills, [], []
        for seq in self._prefill_order(started, deferred):
            # The first prefill of a step always progresses, even when the decodes' draft caps
            # use the whole budget.
            floor = MIN_PREFILL_CHUNK if not out.prefills else 0
            if seq.status is SeqStatus.RUNNING:  # a started chunked prefill continues
                chunk = min(seq.num_prompt_tokens_left, max(budget, floor))
            elif not (num_free_slots > 0 and len(self.running) + len(admitted) < cfg.max_num_seqs):
                continue
            elif cfg.enable_chunked_prefill:
                chunk = min(len(seq.prompt_token_ids), max(budget, floor))
            else:  # whole prompts only; a long one when it is the only work
                need = len(seq.prompt_token_ids)
                chunk = need if need <= budget or (not admitted and not self.running) else 0
            if chunk <= 0:
                if seq.status is SeqStatus.RUNNING:
                    continue
                break  # the queue stays in order: nothing behind an unadmitted prompt is admitted
            if seq.status is not SeqStatus.RUNNING:
                i = self.waiting.index(seq)
                del self.waiting[i], self._keys[i]
                seq.status = SeqStatus.RUNNING
                admitted.append(seq)
                num_free_slots -= 1
            out.prefills.append(seq)
            out.chunks[seq.seq_id] = chunk
            budget -= chunk
        self.running.extend(admitted)
        return out
