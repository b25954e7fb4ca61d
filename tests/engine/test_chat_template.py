"""Chat prompts from a checkpoint's own chat template (tokenizer_config.json or chat_template.jinja,
as transformers reads them, with its special tokens), the documented plain template when there is
none, and a template's refusal."""

import json
import re
import shutil
from pathlib import Path

import pytest

from actors.openai_protocol import ProtocolError, protocol_errors
from engine.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplate, read_chat_template
from engine.errors import CheckpointError
from engine.loader import encode_text, load_tokenizer
from engine.request_ranges import RequestError
from tests.engine.bundled import TARGET

# A ChatML-style template of the kind Qwen checkpoints ship, with a transformers-style refusal.
CHATML = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.fixture
def checkpoint_with_template(tmp_path) -> Path:
    src = Path(TARGET)
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return tmp_path


def test_the_checkpoints_template_renders_the_conversation(checkpoint_with_template):
    tokenizer, template = load_tokenizer(checkpoint_with_template)
    assert template.source == CHATML
    prompt = ChatTemplate.of(template).render(MESSAGES)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode(prompt).ids) == prompt
    assert encode_text(tokenizer, prompt) == tokenizer.encode(prompt).ids  # the special tokens too
    assert ChatTemplate.of(template).render(MESSAGES, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_no_template_uses_the_plain_one():
    _, template = load_tokenizer(Path(TARGET))
    chat = ChatTemplate.of(template)
    assert template.source is None and chat.source == PLAIN_CHAT_TEMPLATE
    assert chat.render(MESSAGES) == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    parts = [{"type": "text", "text": "Write a function"}, {"type": "text", "text": " that reverses a list."}]
    assert ChatTemplate(None).render([{"role": "user", "content": parts}]) == (
        "<|user|>\nWrite a function\n that reverses a list.\n<|assistant|>\n")


LATE_SYSTEM = [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]


def test_a_template_refusal_is_a_400_naming_messages():
    with pytest.raises(RequestError, match="chat template error: System message must be at the beginning") as err:
        ChatTemplate(CHATML).render(LATE_SYSTEM)
    assert err.value.param == "messages"
    with pytest.raises(ProtocolError, match="chat template error") as http:  # what the ingress answers
        with protocol_errors():
            ChatTemplate(CHATML).render(LATE_SYSTEM)
    assert (http.value.status, http.value.param) == (400, "messages")


CALL = {"id": "call_1", "type": "function", "function": {"name": "reverse", "arguments": "{\"xs\": [1, 2]}"}}


@pytest.mark.parametrize(("turn", "param"), [
    ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": "Calling reverse.", "tool_calls": [CALL]}, "messages[1].tool_calls"),
    ({"role": "tool", "tool_call_id": "call_1", "content": "[2, 1]"}, "messages[1].role"),
    ({"role": "assistant", "content": None, "function_call": CALL["function"]}, "messages[1].function_call"),
    ({"role": "function", "name": "reverse", "content": "[2, 1]"}, "messages[1].role"),
])
def test_a_tool_call_or_result_in_the_history_is_refused_by_name(turn, param):
    # The template sees only role and text: the call would be an empty or plain assistant turn.
    for template in (None, CHATML):
        with pytest.raises(RequestError, match=rf"^{re.escape(param)}: .* this server implements no tools") as err:
            ChatTemplate(template).render([{"role": "user", "content": "Reverse [1, 2]."}, turn])
        assert err.value.param == param


def test_an_empty_or_null_tool_calls_is_no_call():
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []},
             {"role": "user", "content": "bye", "tool_calls": None, "function_call": None}]
    assert ChatTemplate(None).render(turns) == "<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\nbye\n<|assistant|>\n"


# Mixtral-instruct style (user/assistant turns only, the end-of-sequence token after each reply).
INST = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant turns') }}{% endif %}{% endfor %}"
)
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]


@pytest.mark.parametrize("layout", ["string", "named list", "jinja file"])
def test_a_checkpoints_template_comes_with_its_special_tokens_wherever_it_is_stored(tmp_path, layout):
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if layout == "string":
        cfg["chat_template"] = INST
    elif layout == "named list":
        cfg["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": INST}]
    else:
        cfg["chat_template"] = "an older template the .jinja file replaces"
        (tmp_path / "chat_template.jinja").write_text(INST)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    source = read_chat_template(tmp_path)
    assert (source.source, source.bos_token, source.eos_token) == (INST, "<s>", "</s>")
    assert ChatTemplate.of(source).render(TURNS) == "<s>[INST] hi [/INST]hello</s>[INST] bye [/INST]"


def test_a_templates_own_refusal_message_is_the_error():
    with pytest.raises(RequestError, match="only user and assistant turns"):
        ChatTemplate(INST).render([{"role": "system", "content": "x"}, *TURNS])


def test_a_template_list_without_a_default_is_a_checkpoint_error_unless_it_has_one_template(tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": [{"name": "rag", "template": INST}]}))
    assert read_chat_template(tmp_path).source == INST
    cfg.write_text(json.dumps({"chat_template": [{"name": "rag", "template": INST}, {"name": "tool_use"}]}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: chat_template lists no template named "
                                              r"'default' \(names: \['rag', 'tool_use'\]\)"):
        read_chat_template(tmp_path)
