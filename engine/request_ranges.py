"""The one table of per-request limits, used by the engine and the HTTP ingress alike.

:class:`engine.sampling_params.SamplingParams` validates itself with :func:`check_range` /
:func:`check_stop`, :meth:`engine.engine.LLMEngine.add_request` checks prompts with
:func:`check_prompt` (and draft lengths and stop token ids with :func:`check_draft_length` and
:func:`check_stop_ids`), and ``actors/openai_protocol.py`` / ``actors/ingress.py`` call the same
functions before building ``SamplingParams``, turning :class:`RequestError` into HTTP 400 in
OpenAI's error shape (``param`` names the field, ``code`` is e.g. ``context_length_exceeded``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.errors import SpecmoeError

MAX_LOGPROBS = 5
MAX_N = 8
MAX_SPECULATIVE_TOKENS = 16
# Any signed 64-bit seed, as vLLM takes (OpenAI's schema sets no bound); a sequence's generator gets
# (seed + index) mod 2**63, inside torch's 64-bit seeds.
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound


class RequestError(SpecmoeError):
    """A request field is out of range.

    Attributes:
        param: the offending field's (OpenAI/vLLM) name, e.g. ``"temperature"``.
        code: a machine-readable reason (``"context_length_exceeded"``) or None.
    """

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class Range(NamedTuple):
    """Closed interval ``[lo, hi]``; ``lo_open`` makes it ``(lo, hi]``. ``note`` ends the message."""

    lo: float
    hi: float
    lo_open: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        return (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi

    def describe(self) -> str:
        lo, hi = (f"{b:g}" if isinstance(b, float) else str(b) for b in (self.lo, self.hi))
        return f"must be in {'(' if self.lo_open else '['}{lo}, {hi}]{self.note}"


RANGES: dict[str, Range] = {
    "n": Range(1, MAX_N),
    "max_tokens": Range(1, MAX_INT32),
    "temperature": Range(0.0, MAX_TEMPERATURE),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, MAX_INT32, note=" (-1 or 0 disables it)"),
    "seed": Range(-MAX_SEED - 1, MAX_SEED),
    "logprobs": Range(0, MAX_LOGPROBS),
    "top_logprobs": Range(0, MAX_LOGPROBS),
    "num_speculative_tokens": Range(0, MAX_SPECULATIVE_TOKENS),
    "stop_token_ids": Range(0, MAX_INT32, note=" (each id)"),  # per element
    "priority": Range(-MAX_INT32 - 1, MAX_INT32),
}
"""Request field -> allowed values (``max_completion_tokens`` shares ``max_tokens``' range)."""


def check_range(name: str, value: float | Sequence[int] | None, param: str | None = None) -> None:
    """Check ``value`` (None passes; a list is checked per element) against ``RANGES[name]``.

    Args:
        name: key of :data:`RANGES`.
        param: the name reported (defaults to ``name``), e.g. ``"max_completion_tokens"``.

    Raises:
        RequestError: naming ``param`` and the allowed range.
    """
    if value is None:
        return
    rng = RANGES[name]
    values = value if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in values if not rng.contains(v)]
    if bad:
        param = param or name
        raise RequestError(f"'{param}' {rng.describe()}, got {bad[0] if len(values) > 1 else value!r}", param)


def check_stop(stop: Sequence[str]) -> None:
    """Stop strings: non-empty strings, at most :data:`MAX_STOP_SEQUENCES`.

    Raises:
        RequestError: naming ``stop``.
    """
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must not contain empty strings", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop' takes at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}", "stop")


def check_without_tokenizer(text_prompt: bool, stop: Sequence[str], chat: bool = False) -> None:
    """What an engine or server started with ``skip_tokenizer_init`` cannot do.

    Args:
        text_prompt: the prompt arrived as text rather than token ids.
        stop: the request's stop strings (matching them needs detokenized text).
        chat: the prompt is a conversation (a chat template renders text, which needs a tokenizer).

    Raises:
        RequestError: ``param`` "messages" for a conversation, "prompt" for a text prompt, "stop"
            for stop strings.
    """
    if chat:
        raise RequestError("chat needs a tokenizer and this model was loaded with skip_tokenizer_init: send "
                           "token ids as a completion prompt instead", "messages")
    if text_prompt:
        raise RequestError("this model was loaded with skip_tokenizer_init (no tokenizer): send the prompt as a "
                           "list of token ids", "prompt")
    if stop:
        raise RequestError("'stop' strings need a tokenizer (skip_tokenizer_init is set): use 'stop_token_ids'",
                           "stop")


def is_token_ids(value) -> bool:
    """A list or tuple of ints: a prompt as token ids (bools are not token ids)."""
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_prompt_chars(num_chars: int, max_chars_per_token: int | None, max_model_len: int) -> None:
    """Refuse a text prompt too long for the context window before tokenising it.

    Args:
        num_chars: the prompt text's length in characters.
        max_chars_per_token: :func:`engine.loader.max_chars_per_token` (None: no bound, no check).
        max_model_len: context window in tokens.

    Raises:
        RequestError: ``param`` "prompt", ``code`` "context_length_exceeded", when the prompt has
            at least ``ceil(num_chars / max_chars_per_token) >= max_model_len`` tokens (as
            :func:`check_prompt` would find after tokenising).
    """
    if max_chars_per_token is None:
        return
    at_least = -(-num_chars // max_chars_per_token)
    if at_least >= max_model_len:
        raise RequestError(f"the prompt has at least {at_least} tokens ({num_chars} characters); this model's "
                           f"context window is {max_model_len} tokens", "prompt", "context_length_exceeded")


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, vocab_size: int,
                 max_model_len: int, max_tokens_is_default: bool = False) -> None:
    """A prompt's token ids against the vocabulary and the context window.

    Args:
        prompt_token_ids: the prompt as token ids.
        max_tokens: requested output tokens; None checks the prompt alone.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_model_len: context window in tokens; prompt + max_tokens must fit, and the prompt
            must leave room for at least one output token.
        max_tokens_is_default: the request set no max_tokens; the error then says the value is
            the default, so a user who sent none knows where it came from.

    Raises:
        RequestError: ``param`` "prompt" (empty, out of vocabulary, too long) or "max_tokens"
            (prompt + max_tokens too long); ``code`` "context_length_exceeded" for the window.
    """
    if not prompt_token_ids:
        raise RequestError("the prompt is empty (no tokens)", "prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt")
    num = len(prompt_token_ids)
    if num >= max_model_len:
        raise RequestError(f"the prompt has {num} tokens; this model's context window is {max_model_len} tokens",
                           "prompt", "context_length_exceeded")
    if max_tokens is not None and num + max_tokens > max_model_len:
        default = ", the default when the request sets none" if max_tokens_is_default else ""
        raise RequestError(f"prompt ({num} tokens) + max_tokens ({max_tokens}{default}) exceeds the context window "
                           f"of {max_model_len} tokens", "max_tokens", "context_length_exceeded")


def check_draft_length(k: int | None, engine_k: int) -> None:
    """A request's draft length (None: the engine's) against the engine's ``num_speculative_tokens``.

    Raises:
        RequestError: ``param`` "num_speculative_tokens": above the engine's.
    """
    if k is not None and k > engine_k:
        raise RequestError(f"'num_speculative_tokens' must be at most {engine_k} (the "
                           f"engine's num_speculative_tokens), got {k}", param="num_speculative_tokens")


def check_stop_ids(stop_token_ids: Sequence[int] | None, vocab_size: int) -> None:
    """A request's stop token ids against the vocabulary.

    Raises:
        RequestError: ``param`` "stop_token_ids": an id at or above ``vocab_size``.
    """
    bad = [t for t in stop_token_ids or () if t >= vocab_size]
    if bad:  # the first few only: a long list must not come back whole in the error
        raise RequestError(f"'stop_token_ids' must be below the vocabulary size {vocab_size}, got "
                           f"{bad[:5]}{' ...' if len(bad) > 5 else ''}", param="stop_token_ids")


def check_n(n: int, max_num_seqs: int, max_waiting: int) -> None:
    """A request's ``n`` against what the scheduler can ever hold: beyond it no retry helps.

    Raises:
        RequestError: ``param`` "n": more sequences than ``max_num_seqs + max_waiting``.
    """
    if n > max_num_seqs + max_waiting:
        raise RequestError(f"'n' must be at most {max_num_seqs + max_waiting} (this server's {max_num_seqs} "
                           f"running + {max_waiting} waiting sequences), got {n}", param="n")


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request's ``priority`` only means something to a policy that orders by it (vLLM answers
    the same request with a 400: priority scheduling is not enabled).

    Raises:
        RequestError: ``param`` "priority": non-zero under ``fcfs``.
    """
    if priority and scheduling_policy == "fcfs":
        raise RequestError(f"'priority' {priority} needs priority scheduling; this engine schedules first come, "
                           f"first served (engine.scheduler.scheduling_policy: fcfs; offline: "
                           f"LLM(scheduling_policy='priority'))", param="priority")
