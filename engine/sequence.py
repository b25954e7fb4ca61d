"""A sequence being generated: one of a request's ``n`` samples, with its own generator and KV slot."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

from engine.detokenizer import SequenceOutputState
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import make_generator
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
        race_seed: a seeded sampled sequence's seed: its token at each position is the
            exponential race of :func:`engine.sampling.race_noise` (the same with or without
            drafts, whatever k), so the seed reproduces its output whatever the draft lengths
            the controller picks. None: greedy, or sampled without a seed (the rejection sampler
            with this sequence's generator).
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
    race_seed: int | None = None

    @classmethod
    def sample_of(cls, request: RequestOutput, index: int, params: SamplingParams, k: int, tokenizer,
                  eos_token_ids: frozenset[int]) -> Sequence:
        """Sample ``index`` of ``request`` (``params.n`` in all), its completion appended to the
        request's outputs. A seeded request's samples use ``seed + index`` (vLLM's rule for ``n``
        seeded samples) as their ``race_seed``, others a random generator seed; greedy ones need
        no generator."""
        completion = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
        request.outputs.append(completion)
        # Modulo 2**64: every signed 64-bit seed its own stream (modulo 2**63, -1 was 2**63 - 1's).
        seed = (params.seed + index) % 2**64 if params.seed is not None \
            else int.from_bytes(os.urandom(7), "little")
        state = SequenceOutputState(tokenizer, params, eos_token_ids, request.prompt_token_ids)
        gen = None if params.greedy else make_generator(seed)
        race_seed = seed if params.seed is not None and not params.greedy else None
        return cls(f"{request.request_id}-{index}", index, request, params, state, gen, k, completion,
                   race_seed=race_seed)

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
