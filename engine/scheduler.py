"""Continuous batching: admit waiting sequences between steps under a token budget.

Each step every running sequence decodes (1 + k tokens through the target: its newest token and k
draft tokens); the remaining token budget admits waiting sequences for prefill, first come first
served, while KV slots and ``max_num_seqs`` allow (Orca, Yu et al. 2022; vLLM's scheduler).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from engine.sequence import SeqStatus, Sequence


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
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    spec_disable_batch_size: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.spec_disable_batch_size < 0:
            raise ValueError("SchedulerConfig.spec_disable_batch_size must be >= 0")


@dataclass
class SchedulerOutput:
    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    speculate: bool = True

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """FCFS waiting queue and the running set."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def can_accept(self, num_seqs: int = 1) -> bool:
        """Whether ``num_seqs`` more sequences fit: the free running slots plus ``max_waiting``
        (a burst that the next step will admit is not counted as waiting)."""
        free_running = self.config.max_num_seqs - len(self.running)
        return len(self.waiting) + num_seqs <= self.config.max_waiting + free_running

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it (finished, aborted or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self, num_free_slots: int, decode_cost: Callable[[Sequence, bool], int]) -> SchedulerOutput:
        """Pick this step's work.

        Args:
            num_free_slots: KV cache slots available for new sequences.
            decode_cost: target tokens a running sequence needs this step, given whether
                speculation is on.
        """
        cfg = self.config
        speculate = not (cfg.spec_disable_batch_size and len(self.running) >= cfg.spec_disable_batch_size)
        out = SchedulerOutput(decodes=list(self.running), speculate=speculate)
        budget = cfg.max_num_batched_tokens - sum(decode_cost(s, speculate) for s in self.running)
        while self.waiting and num_free_slots > 0 and len(self.running) + len(out.prefills) < cfg.max_num_seqs:
            need = len(self.waiting[0].prompt_token_ids)
            alone = not out.prefills and not self.running
            if need > budget and not alone:
                break
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            out.prefills.append(seq)
            budget -= need
            num_free_slots -= 1
        self.running.extend(out.prefills)
        return out
