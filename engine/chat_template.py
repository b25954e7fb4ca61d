"""Chat prompts: the checkpoint's jinja2 chat template, or specmoe's documented plain template.

One renderer for both entry points: the HTTP ingress (``/v1/chat/completions``) and the offline
``LLM.chat``. Messages are OpenAI's shape, ``{"role": str, "content": str | [text parts] | None}``;
the template sees each as ``{"role", "content"}`` with the text parts joined, as transformers'
``apply_chat_template`` is given them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.request_ranges import RequestError

# Used when the checkpoint has no chat_template (e.g. the bundled code models):
#   <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def message_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's text: the string itself, or its text content parts joined (``[{"type": "text",
    "text": str}, ...]``, OpenAI's parts); None is empty.

    Raises:
        RequestError: a part that is not text, or a text part without a string ``text`` (param
            ``messages``).
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestError(f"only text content parts are supported, got type {kind!r}", "messages")
        if not isinstance(part.get("text"), str):
            raise RequestError("a text content part needs a string 'text'", "messages")
        parts.append(part["text"])
    return "".join(parts)


class ChatTemplate:
    """Renders message lists to a prompt string (sandboxed, as transformers does).

    Args:
        template: jinja2 source (a checkpoint's ``tokenizer_config.json`` ``chat_template``), or
            None for :data:`PLAIN_CHAT_TEMPLATE`.
        bos_token, eos_token: the values of the template variables of those names.
    """

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.source = template or PLAIN_CHAT_TEMPLATE
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise RequestError(f"chat template error: {e}", "chat_template") from e
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **template_kwargs: Any) -> str:
        """The prompt text of a conversation.

        Args:
            messages: ``[{"role": str, "content": ...}]`` (see :func:`message_text`).
            add_generation_prompt: end with the assistant's turn opening (as transformers).
            template_kwargs: further template variables (vLLM's ``chat_template_kwargs``).

        Raises:
            RequestError: a malformed message, or the template refusing the conversation (its
                ``raise_exception``), param ``messages``.
        """
        msgs = []
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise RequestError(f"each message must be a dict with a string 'role', got {m!r:.60}", "messages")
            msgs.append({"role": m["role"], "content": message_text(m.get("content"))})
        try:
            return self._template.render({**template_kwargs, "messages": msgs,
                                          "add_generation_prompt": add_generation_prompt, **self._special})
        except TemplateError as e:
            raise RequestError(f"chat template error: {e}", "messages") from e
