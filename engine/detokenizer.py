"""Incremental detokenisation and stop checking for one output sequence.

Speculative decoding emits runs of tokens per step, and a sequence may have to stop *inside* a run
(EOS, a stop token, a stop string, max_tokens). :class:`SequenceOutputState` therefore walks the
tokens one by one, in the order vLLM checks them: EOS/stop token, then stop strings in the new
text, then the length limit.

Text is decoded incrementally with a sliding window (the prefix/read offsets of vLLM's
``detokenize_incrementally`` and HF's ``TextStreamer``): only the tokens since the last complete
character, plus a few tokens of left context, are decoded per token, never the whole sequence.
The left context starts in the prompt, so a tokenizer whose decoder strips a leading space at the
start of a text (SentencePiece ``Metaspace``) still emits the space the output continues the prompt
with; for byte-level BPE the text is exactly ``tokenizer.decode(kept output tokens)``.

Streamed deltas are held back while they could still change: an incomplete UTF-8 character (a
byte-level token can end mid-character; the window's text then ends with U+FFFD) and any suffix that
could be the start of a stop string. Everything held is flushed when the sequence finishes, so the
deltas always concatenate to the final text.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import tokenizers

from engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Tokens of left context decoded with the newest ones (vLLM uses the same 5): enough for decoders
# that look at neighbours (leading-space stripping, byte fallback) to see a typical boundary.
_CONTEXT_TOKENS = 5


class AppendResult(NamedTuple):
    """Outcome of :meth:`SequenceOutputState.append`.

    Attributes:
        num_kept: how many of the appended tokens were kept (the rest fell after a finish).
        finish_reason: "stop", "length", or None while the sequence runs.
        text_delta: newly releasable text (valid, complete characters only).
    """

    num_kept: int
    finish_reason: str | None
    text_delta: str


class SequenceOutputState:
    """Output tokens, streamed text and the finish decision of one sequence.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``; None (``skip_tokenizer_init``) keeps only
            token ids: the text stays empty and there are no stop strings to match.
        params: the request's sampling parameters (stop, stop_token_ids, ignore_eos, max_tokens).
        eos_token_ids: the model's end-of-sequence ids (any of them ends the sequence; may be empty).
        prompt_token_ids: the prompt; its last few tokens are decoding context only.

    Attributes:
        token_ids: output tokens kept so far (a finishing EOS/stop token included).
        text: text emitted so far, the concatenation of all deltas.
        finish_reason: "stop" | "length" | None.
        stop_reason: the stop token id or stop string that matched (None for EOS and "length",
            as in vLLM).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer | None, params: SamplingParams, eos_token_ids: Collection[int],
                 prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._stop_token_ids = frozenset(params.stop_token_ids)
        # The decoding window: _window[_prefix:_read] is already decoded (its text _prefix_text);
        # _window[_read:] are tokens whose text is not final yet (an unfinished character).
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character; decoding it as context would misalign the output's
            # first character, so decode the output on its own.
            context, context_text = [], ""
        self._window: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        self._committed = ""  # output text of _window[:_read]
        # Visible text: _committed plus the complete characters already decoded from the unread
        # tokens (a token can carry a space *and* the first byte of a character). Stop strings are
        # searched here, so a stop string is found at the token that completes it.
        self._decoded = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_ids: list[int]) -> AppendResult:
        """Add tokens in order, stopping at the first finish condition; return the text delta.

        Per token: keep it; EOS (unless ``ignore_eos``) or a stop token id -> "stop" (its text only
        with ``include_stop_str_in_output``, as in vLLM);
        else decode it, and if a stop string now occurs -> truncate the text before it, "stop";
        then ``max_tokens`` reached -> "length". Tokens after a finish are dropped. Appending to a
        finished sequence keeps nothing.
        """
        emitted_before = len(self.text)
        kept = 0
        for token in token_ids:
            if self.finish_reason is not None:
                break
            kept += 1
            self._append_one(token)
        if self.finish_reason is None:
            self._release(self._decoded[: len(self._decoded) - self._stop_prefix_len()])
        return AppendResult(kept, self.finish_reason, self.text[emitted_before:])

    def _append_one(self, token: int) -> None:
        self.token_ids.append(token)
        eos = token in self.eos_token_ids and not self.params.ignore_eos
        if eos or token in self._stop_token_ids:
            if self.params.include_stop_str_in_output:  # vLLM keeps a stop token's text then too
                self._decode_next(token)
            # vLLM convention: EOS leaves stop_reason None; a stop token id is reported.
            self._finish("stop", None if eos else token)
            return
        searched_from = len(self._decoded)
        self._decode_next(token)
        if self._check_stop_strings(searched_from):
            return
        if len(self.token_ids) >= self.params.max_tokens:
            self._finish("length", None)

    def _decode_next(self, token: int) -> None:
        """Decode ``token`` in its window and extend the visible text with its complete characters."""
        self._window.append(token)
        new = self._decode(self._window[self._prefix:])[len(self._prefix_text):]
        if new and not new.endswith(_REPLACEMENT):
            self._committed += new
            self._decoded = self._committed
            # Slide: the tokens just read become the next step's left context.
            self._prefix, self._read = self._read, len(self._window)
            self._prefix_text = self._decode(self._window[self._prefix:self._read])
            if self._prefix > 4 * _CONTEXT_TOKENS:  # keep the window list short
                del self._window[: self._prefix]
                self._read -= self._prefix
                self._prefix = 0
        else:
            # An unfinished character decodes as trailing U+FFFD; what precedes it is final.
            stable = self._committed + new.rstrip(_REPLACEMENT)
            if len(stable) > len(self._decoded):
                self._decoded = stable

    def _check_stop_strings(self, searched_from: int) -> bool:
        """Finish if a stop string ends in the text added since ``searched_from``.

        Only the region new text can complete is searched. If several stop strings match, the one
        that is complete first wins (earliest end, then the longer one), which is what a
        character-by-character stream would see, independent of how tokens split the text.
        """
        if not self.params.stop or len(self._decoded) == searched_from:
            return False
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.params.stop:
            # A match must end in the new text, so it starts at most len(stop) - 1 before it.
            at = self._decoded.find(stop, max(0, searched_from - len(stop) + 1))
            if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
                best = (at + len(stop), -len(stop), stop)
        if best is None:
            return False
        end, _, stop = best
        self._decoded = self._decoded[: end if self.params.include_stop_str_in_output else end - len(stop)]
        self._finish("stop", stop)
        return True

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._decoded
        longest = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        if not isinstance(stop_reason, str):
            # Nothing more will come: flush an unfinished character as the tokenizer decodes it
            # (U+FFFD), so the text equals the decode of the kept tokens. (After a stop string,
            # anything pending lies beyond the cut and is dropped with the rest.)
            pending = self._decode(self._window[self._prefix:])[len(self._prefix_text):]
            self._decoded = self._committed + pending
        self._release(self._decoded)

    def _release(self, text: str) -> None:
        """Emit ``text`` beyond what was already emitted (text only ever grows)."""
        if len(text) > len(self.text):
            self.text = text
