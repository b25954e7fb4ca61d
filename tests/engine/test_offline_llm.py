"""The offline API's vLLM surface beyond generate: ``LLM.chat`` rendering exactly what
``/v1/chat/completions`` renders, ``get_tokenizer``, and ``None`` for max_tokens and top_k."""

import msgspec
import pytest
import torch

from actors.openai_protocol import ChatCompletionRequest, decode_request
from engine import LLM, SamplingParams
from engine.chat_template import ChatTemplate
from engine.request_ranges import RequestError
from tests.engine.bundled import TARGET

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TARGET)


def test_llm_chat_generates_from_the_prompt_the_server_renders(llm):
    body = {"messages": MESSAGES}
    served = decode_request(msgspec.json.encode(body), ChatCompletionRequest)
    server_prompt = ChatTemplate(None).render(served.conversation())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.chat(MESSAGES, params)
    (ref,) = llm.generate(server_prompt, params)
    assert out.prompt == server_prompt == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) == 8


def test_llm_chat_takes_a_batch_a_template_and_its_variables(llm):
    convs = [[{"role": "user", "content": "def f():"}], [{"role": "user", "content": "import os"}]]
    template = "{% for m in messages %}{{ prefix }}{{ m.content }}{% endfor %}"
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), chat_template=template,
                    chat_template_kwargs={"prefix": "# "})
    assert [o.prompt for o in outs] == ["# def f():", "# import os"]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


@pytest.mark.parametrize(("messages", "match", "param"), [
    ([{"content": "no role"}], "string 'role'", "messages[0].role"),
    (["just text"], "a list of message dicts", "messages"),
    ([[{"role": "user", "content": "a"}], "b"], "a list of message dicts", "messages"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "got type 'image_url'", "messages[1].content[0]"),
    # The server's 400s, which LLM.chat rendered and generated from (a trial, 2026-12-06):
    ([{"role": "user"}], "has no 'content'", "messages[0].content"),
    ([{"role": "user", "content": None}], "has no 'content'", "messages[0].content"),
    ([{"role": "wizard", "content": "hi"}], "must be one of system, user", "messages[0].role"),
    ([[], [{"role": "user", "content": "a"}]], "must not be empty", "messages"),
])
def test_llm_chat_refuses_a_malformed_conversation_by_name(llm, messages, match, param):
    with pytest.raises(RequestError, match=match) as err:
        llm.chat(messages)
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_vllms_none_means_up_to_the_window_and_no_top_k(llm):
    params = SamplingParams(temperature=0.0, max_tokens=None, top_k=None, ignore_eos=True)
    assert params.top_k == 0 and params.max_tokens is None  # resolved per request, by its prompt
    prompt = llm.get_tokenizer().encode("def f(x):\n").ids
    (out,) = llm.generate([prompt], params)
    assert len(prompt) + len(out.outputs[0].token_ids) == llm.engine.max_model_len
    assert out.outputs[0].finish_reason == "length" and params.max_tokens is None  # the caller's object unchanged


def test_dtype_auto_is_the_checkpoints_own(tmp_path):
    import json
    import shutil

    from engine.args import EngineArgs
    from engine.errors import ConfigError

    args = EngineArgs(model="relative/to/another/cwd", dtype="auto")  # `serve run` converts in another cwd
    assert args.dtype == "auto"
    args = EngineArgs(model=TARGET, dtype="auto")
    args.check_checkpoints()  # the start-up's check, with the final paths
    assert args.dtype == "bfloat16"  # the bundled target's config.json
    assert LLM(TARGET, dtype="auto").engine.target.model.dtype == torch.bfloat16
    shutil.copytree(TARGET, tmp_path / "f32", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    cfg.pop("dtype", None)
    (tmp_path / "f32" / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float64"}))
    args = EngineArgs(model=str(tmp_path / "f32"), dtype="auto")
    args.resolve_auto_dtype()
    assert args.dtype == "float32"  # not one we run: float32
    with pytest.raises(ConfigError, match="dtype: 'float64' is not one of"):
        EngineArgs(model=TARGET, dtype="float64")


def test_llm_chat_leaves_the_bos_to_the_template_as_the_server_does():
    """A tokenizer whose post-processor adds a BOS (Llama 3's) put one before the rendered chat
    too, on top of the template's own; completions keep it (vLLM's and transformers' rules)."""
    from tokenizers.processors import TemplateProcessing

    llm = LLM(TARGET)
    llm.tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    chat = llm.chat([{"role": "user", "content": "Sort a list."}], params, chat_template="<|endoftext|>{{ messages[0].content }}")
    assert chat[0].prompt_token_ids == [0] + llm.tokenizer.encode("Sort a list.", add_special_tokens=False).ids
    completion = llm.generate("Sort a list.", params)
    assert completion[0].prompt_token_ids == chat[0].prompt_token_ids
