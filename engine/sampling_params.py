"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and defaults)."""

from __future__ import annotations

import msgspec

from engine.field_types import check_field_types
from engine.request_ranges import (  # noqa: F401  (re-exported: the limits' historical home)
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_SPECULATIVE_TOKENS,
    RANGES,
    RequestError,
    check_range,
    check_stop,
)

# A temperature below this is greedy, as vLLM's sampler treats it (``_SAMPLING_EPS``): below it a
# logit gap of 1e-3 leaves the runner-up under e^-100 of the argmax, and logits / t overflows
# float32 below ~1e-37 (softmax of inf: NaN, no token sampled).
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one request samples and when it stops.

    Attributes:
        n: completions per prompt, 1..8; each draws from its own generator (seed + index).
        max_tokens: output tokens at most, >= 1; the run is cut there (finish_reason "length").
            None: up to the context window (vLLM's meaning; the engine sets it when the request
            is added).
        temperature: in [0, 2] (OpenAI's range); 0 means greedy (argmax, ties to the lower token id),
            and so does anything below :data:`GREEDY_BELOW_TEMPERATURE` (set to 0 by :meth:`validate`).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0, -1 or None disables it.
        seed: seeds this request's own ``torch.Generator``; None draws a random seed.
        stop: up to 4 non-empty strings that end the sequence (one string: that one); the matched
            string is not part of the text unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the sequence (kept in token_ids; in the text only with
            ``include_stop_str_in_output``).
        ignore_eos: keep going past the model's end-of-sequence token.
        include_stop_str_in_output: keep the matched stop string, or the stop token's text, at the
            end of the text (vLLM's extension; the text is still cut right after it).
        logprobs: number of top alternatives (0..5) whose target log-probabilities are returned
            per output token; None returns none.
        num_speculative_tokens: draft length k for this request (0..16, at most the engine's); None
            uses the engine's.
        priority: scheduling priority with ``scheduling_policy`` "priority" or "slo"; lower runs
            earlier (vLLM's convention), ties first come first served.
        slo_class: latency budget class (``SchedulerConfig.slo_classes``); None: the default class.

    The ranges are :data:`engine.request_ranges.RANGES`, the table the HTTP ingress checks too.

    Raises:
        engine.request_ranges.RequestError: (a ValueError) from :meth:`validate`, naming the field.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    num_speculative_tokens: int | None = None
    priority: int = 0
    slo_class: str | None = None

    def __post_init__(self) -> None:
        # vLLM's conveniences: one stop string, and None for "no stop strings / ids".
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.top_k = 0 if self.top_k is None else self.top_k
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field's type and range (:data:`~engine.request_ranges.RANGES`); raise
        RequestError naming it. The engine calls this again when a request is added: the struct is
        mutable, and a field changed after construction skipped the checks. A temperature below
        :data:`GREEDY_BELOW_TEMPERATURE` becomes 0 (greedy)."""
        check_field_types(self, lambda name, message: RequestError(f"'{name}': {message}", name))
        for name in RANGES:
            if hasattr(self, name):
                check_range(name, getattr(self, name))
        check_stop(self.stop)
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0  # greedy: every path tests temperature == 0
