"""Chat prompts: the checkpoint's jinja2 chat template, or specmoe's documented plain template."""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors.openai_protocol import ChatMessage, ProtocolError

# Used when the checkpoint has no chat_template (e.g. the bundled code models):
#   <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    """Renders message lists to a prompt string (sandboxed, as transformers does)."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.source = template or PLAIN_CHAT_TEMPLATE
        self._template = env.from_string(self.source)
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[ChatMessage]) -> str:
        """Raises ProtocolError (400) if the template rejects the conversation."""
        msgs = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self._template.render(messages=msgs, add_generation_prompt=True, **self._special)
        except TemplateError as e:
            raise ProtocolError(f"chat template error: {e}", "messages") from e
