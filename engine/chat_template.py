"""Chat prompts: the checkpoint's jinja2 chat template, or specmoe's documented plain template.

One renderer for both entry points: the HTTP ingress (``/v1/chat/completions``) and the offline
``LLM.chat``. Messages are OpenAI's shape, ``{"role": str, "content": str | [text parts] | None}``;
the template sees each as ``{"role", "content"}`` with the text parts joined by newlines, as vLLM
gives them to transformers' ``apply_chat_template``. A tool call or a tool's result in the history is
refused (this server implements no tools).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError
from engine.request_ranges import RequestError

# Used when the checkpoint has no chat_template (e.g. the bundled code models):
#   <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ChatTemplateSource:
    """A checkpoint's chat template as transformers reads it: the jinja2 source (None: the
    checkpoint has none) and the ``bos_token``/``eos_token`` strings its template may use."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""


def read_chat_template(path: Path) -> ChatTemplateSource:
    """The chat template of the checkpoint directory ``path``, as transformers finds it:
    ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template`` (a
    string, or a list of ``{"name", "template"}``: the one named ``default``, or the only one), and
    that file's ``bos_token``/``eos_token`` (a string or an ``{"content": str}`` added token).

    Raises:
        CheckpointError: ``tokenizer_config.json`` is not JSON, or a template list has several
            templates and none named ``default`` (the file named).
    """
    cfg_file, jinja_file = path / "tokenizer_config.json", path / "chat_template.jinja"
    try:
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    source = jinja_file.read_text() if jinja_file.is_file() else cfg.get("chat_template")
    if isinstance(source, list):  # named templates (e.g. default / tool_use)
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        # transformers' rule: the one named default, else the only one there is.
        source = named.get("default") or (next(iter(named.values())) if len(named) == 1 else None)
        if not isinstance(source, str):
            raise CheckpointError(f"{cfg_file}: chat_template lists no template named 'default' "
                                  f"(names: {sorted(map(str, named))})")
    return ChatTemplateSource(source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))


def _token_text(token: Any) -> str:
    return token.get("content", "") if isinstance(token, dict) else token if isinstance(token, str) else ""


# A tool-calling conversation's parts: the role of a tool's result, and the assistant turn's field
# that carries its calls (each also in OpenAI's legacy functions form). This server implements no
# tools, and a template is given only each message's role and text, so these would render as
# something else (an empty assistant turn, a result with no call before it): they are refused, by
# name, instead.
TOOL_RESULT_ROLES = {"tool": "a tool's result", "function": "a function's result, OpenAI's legacy form"}
TOOL_CALL_FIELDS = {"tool_calls": "tool calls", "function_call": "a function call, OpenAI's legacy form"}


# The roles a conversation may hold, as /v1/chat/completions takes them ("tool" and "function",
# OpenAI's legacy tool result, are then refused as results of tools this server does not have).
CHAT_ROLES = ("system", "user", "assistant", "tool", "function", "developer")


def check_conversation(messages: Sequence[Any]) -> None:
    """A conversation as ``/v1/chat/completions`` and ``LLM.chat`` accept it.

    Raises:
        RequestError: no message (param ``messages``); a message that is not a dict with a string
            role (``messages[i]``, ``messages[i].role``) or whose role is not one of
            :data:`CHAT_ROLES` (``messages[i].role``); a message other than an assistant turn
            without content (``messages[i].content``).
    """
    if not messages:
        raise RequestError("'messages' must not be empty", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            where = f"messages[{i}].role" if isinstance(m, Mapping) else f"messages[{i}]"
            raise RequestError(f"{where}: each message must be a dict with a string 'role', got {m!r:.60}", where)
        if m["role"] not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r:.40}",
                               f"messages[{i}].role")
        if m.get("content") is None and m["role"] != "assistant":  # only an assistant turn may omit it
            raise RequestError(f"messages[{i}] ({m['role']}) has no 'content'", f"messages[{i}].content")


def _refuse_tool_turns(message: Mapping[str, Any], i: int) -> None:
    """Raises:
        RequestError: message ``i`` is a tool's or function's result (param ``messages[i].role``)
            or carries calls (``messages[i].tool_calls`` or ``messages[i].function_call``).
    """
    role = message["role"]
    if role in TOOL_RESULT_ROLES:
        _refuse_tools(f"messages[{i}].role", f"a {role!r} message ({TOOL_RESULT_ROLES[role]})")
    for field, what in TOOL_CALL_FIELDS.items():
        if message.get(field):  # null or empty: no call
            _refuse_tools(f"messages[{i}].{field}", what)


def _refuse_tools(param: str, what: str) -> None:
    raise RequestError(f"{param}: {what} cannot be rendered: this server implements no tools (tool definitions "
                       "are only accepted with tool_choice \"none\")", param)


def _raise_exception(message: str):
    """transformers' ``raise_exception`` for templates: refuses the conversation with ``message``."""
    raise TemplateError(message)


def message_text(content: str | Sequence[Mapping[str, Any]] | None, param: str) -> str:
    """A message's text: the string itself, or its text content parts (``[{"type": "text", "text":
    str}, ...]``, OpenAI's parts) joined by newlines; None is empty.

    Args:
        param: the content's name in errors (``messages[i].content``).

    Raises:
        RequestError: a part that is not text, or a text part without a string ``text`` (param
            ``{param}[j]``, the part).
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestError(f"{where}: only text content parts are supported, got type {kind!r}", where)
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: a text content part needs a string 'text'", where)
        parts.append(part["text"])
    # vLLM's join (its "string" content format), so that a conversation of parts is the same prompt
    # here as on vLLM; joined with nothing between them, one part's last word ran into the next's.
    return "\n".join(parts)


class ChatTemplate:
    """Renders message lists to a prompt string (sandboxed, as transformers does).

    Args:
        template: jinja2 source (a checkpoint's ``tokenizer_config.json`` ``chat_template``), or
            None for :data:`PLAIN_CHAT_TEMPLATE`.
        bos_token, eos_token: the values of the template variables of those names.
    """

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # The helpers transformers gives templates (its apply_chat_template's globals).
        env.globals.update(raise_exception=_raise_exception,
                           strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        self.source = template or PLAIN_CHAT_TEMPLATE
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise RequestError(f"chat template error: {e}", "chat_template") from e
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def of(cls, checkpoint: ChatTemplateSource | None, override: str | None = None) -> ChatTemplate:
        """The checkpoint's template (``override``: another source, with its special tokens)."""
        checkpoint = checkpoint or ChatTemplateSource()
        return cls(override if override is not None else checkpoint.source, checkpoint.bos_token,
                   checkpoint.eos_token)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **template_kwargs: Any) -> str:
        """The prompt text of a conversation.

        Args:
            messages: ``[{"role": str, "content": ...}]`` (see :func:`message_text`).
            add_generation_prompt: end with the assistant's turn opening (as transformers).
            template_kwargs: further template variables (vLLM's ``chat_template_kwargs``).

        Raises:
            RequestError: the template refusing the conversation (its ``raise_exception``), param
                ``messages``; a malformed conversation (:func:`check_conversation`), a tool or
                function call or result, param naming it (``messages[i].role``,
                ``messages[i].content[j]``, ``messages[i].tool_calls``).
        """
        check_conversation(messages)
        msgs = []
        for i, m in enumerate(messages):
            _refuse_tool_turns(m, i)
            msgs.append({"role": m["role"], "content": message_text(m.get("content"), f"messages[{i}].content")})
        try:
            return self._template.render({**template_kwargs, "messages": msgs,
                                          "add_generation_prompt": add_generation_prompt, **self._special})
        except TemplateError as e:
            raise RequestError(f"chat template error: {e}", "messages") from e
