"""Result types of the engine and the offline API (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters; only tokens actually emitted count as accepted.

    Attributes:
        num_drafts: verification steps that checked at least one draft token.
        num_draft_tokens: draft tokens proposed and checked.
        num_accepted_tokens: accepted draft tokens that were emitted.
        accepted_per_position: accepted count at draft position 0, 1, ... (len = max k seen).
        num_emitted_tokens: all output tokens (accepted + recovered/bonus + plain decode).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verification step (the 1 is the
        recovered or bonus token); 0 when nothing was drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position += [0] * (n - len(self.accepted_per_position))
        for i, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += c

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class TokenLogprob:
    """Target log-probability of an emitted token and its top alternatives (raw logits)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class CompletionOutput:
    """One sampled sequence of a request.

    ``text``/``token_ids`` are cumulative; ``new_text``/``new_token_ids`` are what the latest engine
    step added (for streaming).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times in seconds (``time.monotonic``) of the request's milestones."""

    arrival_time_s: float
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None


@dataclass
class RequestOutput:
    """A request's state after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Counters summed over the request's sequences."""
        total = SpecDecodeStats()
        for out in self.outputs:
            total.merge(out.spec_stats)
        return total
