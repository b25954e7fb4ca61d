"""Continuous batching: admit waiting sequences between steps under a token budget.

Each step every decoding sequence runs first (1 + k tokens through the target: its newest token
and up to k draft tokens); the remaining token budget then goes to prefills, first come first
served, while KV slots and ``max_num_seqs`` allow (Orca, Yu et al. 2022; vLLM's scheduler). With
chunked prefill (the default) a prompt is split across steps into chunks that fill what the
decodes leave of the budget, so a long prompt never stalls the running decodes for a whole
prefill (Sarathi-Serve's stall-free batching, Agrawal et al. 2024): a partly prefilled sequence
continues before new ones are admitted.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
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
        if self.spec_disable_batch_size < 0:
            raise ValueError("SchedulerConfig.spec_disable_batch_size must be >= 0")
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
        key = self._key(seq)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self.waiting.insert(i, seq)

    def _pop_waiting(self) -> Sequence:
        self._keys.pop(0)
        return self.waiting.pop(0)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it (finished, aborted or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            i = self.waiting.index(seq)
            del self.waiting[i], self._keys[i]
        seq.status = SeqStatus.FINISHED

    def schedule(self, num_free_slots: int, decode_cost: Callable[[Sequence, bool], int],
                 prefill_limit: int | None = None) -> SchedulerOutput:
        """Pick this step's work.

        Args:
            num_free_slots: KV cache slots available for new sequences.
            decode_cost: target tokens a running sequence needs this step, given whether
                speculation is on.
            prefill_limit: prefill tokens at most this step (chunked prefill), e.g. what the
                running decodes' TPOT budgets leave; None: only the token budget limits.
        """
        cfg = self.config
        speculate = not (cfg.spec_disable_batch_size and len(self.running) >= cfg.spec_disable_batch_size)
        out = SchedulerOutput(speculate=speculate)
        for seq in self.running:
            (out.prefills if seq.num_prompt_tokens_left else out.decodes).append(seq)
        budget = cfg.max_num_batched_tokens - sum(decode_cost(s, speculate) for s in out.decodes)
        if prefill_limit is not None and cfg.enable_chunked_prefill:
            budget = min(budget, prefill_limit)
        for i, seq in enumerate(out.prefills):  # continuing chunked prefills before new admissions
            # The oldest always progresses, even when the decodes' draft caps use the whole budget.
            room = max(budget, MIN_PREFILL_CHUNK if i == 0 else 0)
            out.chunks[seq.seq_id] = n = min(seq.num_prompt_tokens_left, room)
            budget -= n
        out.prefills = [s for s in out.prefills if out.chunks[s.seq_id]]
        admitted = []
        while self.waiting and num_free_slots > 0 and len(self.running) + len(admitted) < cfg.max_num_seqs:
            need = len(self.waiting[0].prompt_token_ids)
            if cfg.enable_chunked_prefill:
                # The first prefill of a step always progresses (as a continuing one does).
                floor = MIN_PREFILL_CHUNK if not out.prefills and not admitted else 0
                chunk = min(need, max(budget, floor))
            else:  # whole prompts only; a long one when it is the only work
                chunk = need if need <= budget or (not admitted and not self.running) else 0
            if chunk <= 0:
                break
            seq = self._pop_waiting()
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
            out.chunks[seq.seq_id] = chunk
            budget -= chunk
            num_free_slots -= 1
        out.prefills += admitted
        self.running.extend(admitted)
        return out
