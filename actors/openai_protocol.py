"""OpenAI-compatible request bodies, decoded and validated with msgspec.

Unknown fields are ignored, as OpenAI does, and null means the default; out-of-range values and
parameters specmoe does not implement (:data:`UNSUPPORTED`, unless their value asks for nothing)
raise :class:`ProtocolError`, which the ingress turns into HTTP 400 naming the parameter. The ranges are the engine's own table
(:data:`engine.request_ranges.RANGES`), so the server and the offline engine accept the same values.
specmoe extensions (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``num_speculative_tokens``, ``priority``, and ``slo_class`` (the request's latency budget class,
see ``engine.scheduler.slo_classes``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from engine.chat_template import CHAT_ROLES, check_conversation
from engine.request_ranges import RequestError, check_range, check_stop, is_token_ids
from engine.sampling_params import SamplingParams

# Parameters specmoe does not implement (OpenAI's, then vLLM's sampling extensions), each with the
# values that ask for nothing (what clients send by default): any other value is a 400 naming the
# parameter rather than silently ignored, since it would change the output.
UNSUPPORTED: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "logit_bias": ({},), "suffix": ("",), "echo": (False,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "length_penalty": (1,),
    "min_p": (0,), "min_tokens": (0,), "use_beam_search": (False,), "prompt_logprobs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "logits_processors": ([],), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
}
# Definitions that a choice of "none" makes inert (OpenAI: the model calls no tool), accepted and
# not shown to the model then, as vLLM does with --exclude-tools-when-tool-choice-none: a client
# that always sends its tool list and turns tools off per request keeps working.
INERT_WHEN: dict[str, tuple[str, str]] = {"tools": ("tool_choice", "none"), "functions": ("function_call", "none")}
# The same for vLLM's chat-only request fields (a template or turn handling of the request's own).
UNSUPPORTED_CHAT: dict[str, tuple] = {
    "chat_template": (), "chat_template_kwargs": ({},), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "documents": (),
    # OpenAI's chat outputs other than text (audio) and its built-in web search.
    "modalities": (["text"],), "audio": (), "web_search_options": (),
}


class ProtocolError(ValueError):
    """A request field is invalid; ``param`` names it, ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@contextmanager
def protocol_errors(rename: dict[str, str] | None = None) -> Iterator[None]:
    """Turn the engine's :class:`~engine.request_ranges.RequestError` into a 400 ProtocolError.

    Args:
        rename: reported parameter names to replace (chat prompts come from ``messages``).
    """
    try:
        yield
    except RequestError as e:
        raise ProtocolError(str(e), (rename or {}).get(e.param, e.param), code=e.code) from e


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (not implemented: a 400)


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the served model (vLLM makes it optional too)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    stop_token_ids: list[int] | None = None
    num_speculative_tokens: int | None = None
    priority: int | None = 0  # vLLM's request field: lower is scheduled earlier (scheduling_policy priority|slo)
    slo_class: str | None = None  # latency budget class of engine.scheduler.slo_classes
    # vLLM's: the tokenizer's own special tokens (a BOS) around the prompt; None: true for
    # completions, false for chat, whose template writes its own (true there doubled the BOS).
    add_special_tokens: bool | None = None
    user: str | None = None  # OpenAI's end-user id: typed so that a non-string is a 400, otherwise unused
    best_of: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    suffix: str | None = None
    echo: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    # Fields a client may send as null for "the default" (OpenAI's schema marks them nullable).
    null_means_default: ClassVar[dict[str, object]] = {"n": 1, "stream": False, "ignore_eos": False, "priority": 0,
                                                              "include_stop_str_in_output": False}

    def __post_init__(self) -> None:
        for name, default in self.null_means_default.items():
            if getattr(self, name) is None:
                setattr(self, name, default)

    def check_unsupported(self) -> None:
        for name, no_op in self.unsupported.items():
            value = getattr(self, name)
            if name in INERT_WHEN and getattr(self, INERT_WHEN[name][0]) == INERT_WHEN[name][1]:
                continue
            if value is not None and value not in no_op:  # (the field types keep bools from equalling 0)
                only = f" (only {', '.join(msgspec.json.encode(v).decode() for v in no_op)})" if no_op else ""
                if name in INERT_WHEN:
                    only += f", unless '{INERT_WHEN[name][0]}' is \"{INERT_WHEN[name][1]}\""
                raise ProtocolError(f"'{name}' is not supported by this server{only}", name)
        if self.best_of is not None and self.best_of < self.n:  # OpenAI's and vLLM's rule
            raise ProtocolError(f"'best_of' must be >= n ({self.n}), got {self.best_of}", "best_of")
        if self.best_of not in (None, self.n):
            raise ProtocolError("'best_of' is not supported (only equal to n)", "best_of")

    def check_ranges(self) -> None:
        """Unsupported parameters, then every field against the engine's range table.

        Raises:
            ProtocolError: 400 naming the parameter.
        """
        self.check_unsupported()
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer
            raise ProtocolError("'stream_options' is only allowed with 'stream': true", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ProtocolError("'stream_options.continuous_usage_stats' is not supported by this server (only "
                                "false; 'include_usage' gives the usage in a last chunk)", "stream_options")
        with protocol_errors():
            for name in ("max_tokens", "temperature", "top_p", "n", "top_k", "seed", "stop_token_ids",
                         "num_speculative_tokens", "priority"):
                check_range(name, getattr(self, name))
            check_stop([self.stop] if isinstance(self.stop, str) else self.stop or [])

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, num_speculative_tokens=self.num_speculative_tokens,
            priority=self.priority, slo_class=self.slo_class,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: one prompt (a string or a list of token ids) or a batch of them (a
    list of strings or of token-id lists, as OpenAI and vLLM take; :meth:`prompts`)."""

    # msgspec unions allow one array type: the element types are checked in validate().
    prompt: str | list
    logprobs: int | None = None

    def validate(self) -> None:
        """Ranges, then the prompt's shape (each of a batch's prompts named by its position).

        Raises:
            ProtocolError: 400 naming ``prompt``, or ``prompt[i]`` for a batch's element ``i``.
        """
        self.check_ranges()
        with protocol_errors():
            check_range("logprobs", self.logprobs)
        if isinstance(self.prompt, list) and not self.prompt:
            raise ProtocolError("'prompt' must not be empty", "prompt")
        if isinstance(self.prompt, list) and _looks_like_token_ids(self.prompt) and not is_token_ids(self.prompt):
            raise ProtocolError("'prompt' token ids must be integers", "prompt")
        prompts = self.prompts()
        for i, prompt in enumerate(prompts):
            _check_prompt(prompt, f"prompt[{i}]" if self.is_batch else "prompt")
        if len({isinstance(p, str) for p in prompts}) > 1:  # vLLM's prompt type has no mixed list either
            raise ProtocolError("'prompt' must be a list of strings or a list of token-id lists, not a mix of both",
                                "prompt")

    @property
    def is_batch(self) -> bool:
        """Whether ``prompt`` is a batch (a list of strings or of token-id lists, even of one),
        whose prompt ``i`` errors name ``prompt[i]``; a string or a flat list of ids is not."""
        return isinstance(self.prompt, list) and not is_token_ids(self.prompt)

    def prompts(self) -> list[str | list]:
        """The request's prompts: the batch's elements, else ``[prompt]`` (a string, or a flat list
        of token ids)."""
        return list(self.prompt) if self.is_batch else [self.prompt]


def _check_prompt(prompt: object, param: str) -> None:
    """One prompt: a non-empty string or a non-empty list of integer token ids.

    Raises:
        ProtocolError: 400 naming ``param`` (``prompt``, or ``prompt[i]`` in a batch).
    """
    if isinstance(prompt, list) and prompt and _looks_like_token_ids(prompt) and not is_token_ids(prompt):
        raise ProtocolError(f"'{param}' token ids must be integers", param)
    # The type before emptiness: an element may be anything ([null], [{}]).
    if not isinstance(prompt, str) and not is_token_ids(prompt):
        raise ProtocolError(f"'{param}' must be a string or a list of token ids", param)
    if not prompt:
        raise ProtocolError(f"'{param}' must not be empty", param)


def _looks_like_token_ids(value: list) -> bool:
    return all(isinstance(t, (int, float)) for t in value)


class ChatMessage(msgspec.Struct):
    # "function" (OpenAI's legacy tool result) is decoded so that it is refused as a tool result.
    role: Literal[CHAT_ROLES]
    content: str | list[dict] | None = None
    # Decoded (any shape) so that the chat template refuses a history of tool calls by name rather
    # than render it without them.
    tool_calls: Any = None
    function_call: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    null_means_default: ClassVar[dict[str, object]] = {**_Sampling.null_means_default, "logprobs": False}
    unsupported: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **UNSUPPORTED_CHAT}

    def validate(self) -> None:
        if self.max_completion_tokens is not None:
            with protocol_errors():
                check_range("max_tokens", self.max_completion_tokens, "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens  # OpenAI's newer name wins over max_tokens
        self.check_ranges()
        check_messages(self.messages)
        with protocol_errors():
            check_range("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("'top_logprobs' requires 'logprobs': true", "top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        """The messages as a chat template takes them (:func:`conversation`)."""
        return conversation(self.messages)


def check_messages(messages: list[ChatMessage]) -> None:
    """A conversation, by the engine's rule (:func:`engine.chat_template.check_conversation`), so
    that ``LLM.chat`` accepts what the server accepts.

    Raises:
        ProtocolError: 400 naming ``messages``, or ``messages[i].content`` for a message without it.
    """
    with protocol_errors():
        check_conversation(conversation(messages))


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as a chat template takes them (:meth:`engine.chat_template.ChatTemplate.render`,
    which joins their text parts and refuses the others, and tool calls and results)."""
    return [msgspec.structs.asdict(m) for m in messages]


def unknown_model(requested: str, served: str) -> ProtocolError:
    """404 (OpenAI's ``model_not_found``) for a ``model`` other than the served one."""
    return ProtocolError(f"The model '{requested}' does not exist (serving '{served}')", "model", 404,
                         "model_not_found")


RequestT = TypeVar("RequestT", bound=msgspec.Struct)


def _error_param(message: str) -> str | None:
    """The field a msgspec validation message is about, as its path in the body, so that an element
    of a list is named and not only the list (``... - at `$.messages[2].role` `` -> ``messages[2].role``),
    a missing field included (``Object missing required field `role` - at `$.messages[0]` `` ->
    ``messages[0].role``; ``Object missing required field `model` `` -> ``model``)."""
    at = re.search(r"- at `\$\.?([^`]*)`", message)
    path = at.group(1) if at else ""
    missing = re.search(r"missing required field `([^`]+)`", message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def decode_request(body: bytes, schema: type[RequestT]) -> RequestT:
    """Decode + validate (the schema's ``validate()``); raises ProtocolError (400) naming the parameter."""
    try:
        req = msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid request: {e}", _error_param(str(e))) from e
    except msgspec.DecodeError as e:
        raise ProtocolError(f"invalid JSON body: {e}") from e
    except RecursionError as e:  # msgspec's decoder recurses per nesting level (~1000 deep fails)
        raise ProtocolError("invalid JSON body: nested too deeply") from e
    req.validate()
    return req
