"""A sequence being generated: one of a request's ``n`` samples, with its own generator and KV slot."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.detokenizer import SequenceOutputState
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Mutable state of one sequence.

    Attributes:
        num_cached: tokens of ``token_ids`` whose keys/values are in the target KV cache. Outside a
            step this is ``len(token_ids) - 1`` for a running sequence: the newest token is fed in
            the next step together with the draft tokens.
        slot: target KV cache slot while running, else None.
        num_draft_seen: ``num_tokens`` when the drafter last drafted for this sequence (0: never);
            what came since is the drafter's catch-up when it drafts again.
    """

    seq_id: str
    index: int
    request: RequestOutput
    params: SamplingParams
    state: SequenceOutputState
    generator: torch.Generator | None
    k: int
    completion: CompletionOutput
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_cached: int = 0
    num_draft_seen: int = 0
    logprob_rows: list = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the output tokens kept so far."""
        return self.request.prompt_token_ids + self.state.token_ids

    @property
    def num_tokens(self) -> int:
        """``len(self.token_ids)`` without building the list (asked every step)."""
        return len(self.request.prompt_token_ids) + len(self.state.token_ids)

    @property
    def last_token_id(self) -> int:
        out = self.state.token_ids
        return out[-1] if out else self.request.prompt_token_ids[-1]

    @property
    def num_prompt_tokens_left(self) -> int:
        """Prompt tokens not yet prefilled into the KV cache (chunked prefill); 0 once decoding."""
        return 0 if self.state.token_ids else len(self.request.prompt_token_ids) - self.num_cached

    @property
    def num_output_tokens(self) -> int:
        return len(self.state.token_ids)
