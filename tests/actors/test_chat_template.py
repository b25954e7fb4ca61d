"""Chat prompts from a checkpoint's own chat template (tokenizer_config.json, as transformers reads
it), the documented plain template when there is none, and a template's refusal as a 400."""

import json
import shutil
from pathlib import Path

import pytest

from actors.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplate
from actors.openai_protocol import ChatMessage, ProtocolError
from engine.loader import encode_text, load_tokenizer

# A ChatML-style template of the kind Qwen checkpoints ship, with a transformers-style refusal.
CHATML = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [ChatMessage("system", "Be brief."), ChatMessage("user", [{"type": "text", "text": "hi"}])]


@pytest.fixture
def checkpoint_with_template(tmp_path) -> Path:
    src = Path("checkpoints/stdlib-moe-target")
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return tmp_path


def test_the_checkpoints_template_renders_the_conversation(checkpoint_with_template):
    tokenizer, template = load_tokenizer(checkpoint_with_template)
    assert template == CHATML
    prompt = ChatTemplate(template).render(MESSAGES)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode(prompt).ids) == prompt
    assert encode_text(tokenizer, prompt) == tokenizer.encode(prompt).ids  # the special tokens too


def test_no_template_uses_the_plain_one():
    _, template = load_tokenizer(Path("checkpoints/stdlib-moe-target"))
    chat = ChatTemplate(template)
    assert template is None and chat.source == PLAIN_CHAT_TEMPLATE
    assert chat.render(MESSAGES) == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"


def test_a_template_refusal_is_a_400_naming_messages():
    with pytest.raises(ProtocolError, match="chat template error") as err:
        ChatTemplate(CHATML).render([ChatMessage("tool", "x")])
    assert (err.value.status, err.value.param) == (400, "messages")
