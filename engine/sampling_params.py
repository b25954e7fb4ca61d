"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and defaults)."""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 5
MAX_N = 8
MAX_SPECULATIVE_TOKENS = 16
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; per-sequence seeds wrap inside this range
MAX_INT32 = 2**31 - 1


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one request samples and when it stops.

    Attributes:
        n: completions per prompt, 1..8; each draws from its own generator (seed + index).
        max_tokens: output tokens at most, >= 1; the run is cut there (finish_reason "length").
        temperature: >= 0; 0 means greedy (argmax, ties to the lower token id).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: seeds this request's own ``torch.Generator``; None draws a random seed.
        stop: strings that end the sequence; the matched string is not part of the text.
        stop_token_ids: token ids that end the sequence (kept in token_ids, not in text).
        ignore_eos: keep going past the model's end-of-sequence token.
        logprobs: number of top alternatives (0..5) whose target log-probabilities are returned
            per output token; None returns none.
        num_speculative_tokens: draft length k for this request (0..16); None uses the engine's.
        priority: scheduling priority with ``scheduling_policy`` "priority" or "slo"; lower runs
            earlier (vLLM's convention), ties first come first served.
        slo_class: latency budget class (``SchedulerConfig.slo_classes``); None: the default class.

    Raises:
        ValueError: from :meth:`validate`, naming the offending field.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    num_speculative_tokens: int | None = None
    priority: int = 0
    slo_class: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check ranges; raise ValueError naming the field."""
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k <= MAX_INT32, f"must be -1, 0 (disabled) or in [1, {MAX_INT32}]"),
            ("seed", self.seed is None or 0 <= self.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("num_speculative_tokens",
             self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"must be in [0, {MAX_SPECULATIVE_TOKENS}]"),
            ("priority", -MAX_INT32 - 1 <= self.priority <= MAX_INT32, "must be a 32-bit integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(0 <= t <= MAX_INT32 for t in self.stop_token_ids), f"must be in [0, {MAX_INT32}]"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")
