"""vLLM's POST /tokenize and /detokenize: the ids the completion routes submit for the same prompt
or conversation, the text back from ids, and 400s in OpenAI's shape (a test double verifier, no
Ray)."""

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

from engine.loader import load_tokenizer
from tests.actors.conftest import MODEL_NAME, TARGET
from tests.actors.test_ingress_failures import FakeStream, FakeVerifier, _server, _step

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


def _app():
    verifier = FakeVerifier()
    server, app = _server(verifier)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.chat_completions(request)

    app.post("/tokenize")(server.tokenizer_routes.tokenize)
    app.post("/detokenize")(server.tokenizer_routes.detokenize)
    return app, verifier


def _post(app: FastAPI, *requests: tuple[str, dict]) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.post(path, json=body, timeout=5) for path, body in requests]

    return asyncio.run(run())


def test_tokenize_gives_the_ids_the_completion_routes_submit():
    app, verifier = _app()
    verifier.streams = [FakeStream([{"type": "accepted"}, _step("a", finish="length")]) for _ in range(2)]
    prompt = "def fibonacci(n):\n    return n"
    tok, chat, completion, chat_completion = _post(
        app, ("/tokenize", {"model": MODEL_NAME, "prompt": prompt}),
        ("/tokenize", {"model": MODEL_NAME, "messages": MESSAGES, "add_generation_prompt": True}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}))
    tokenizer, _ = load_tokenizer(Path(TARGET))
    want = tokenizer.encode(prompt).ids
    assert tok.status_code == 200
    assert tok.json() == {"count": len(want), "max_model_len": 1024, "tokens": want, "token_strs": None}
    assert len(want) > 3
    assert completion.status_code == chat_completion.status_code == 200 and len(verifier.calls) == 2
    assert verifier.calls[0][0] == want
    assert chat.status_code == 200 and chat.json()["tokens"] == verifier.calls[1][0]
    assert chat.json()["count"] > len(tokenizer.encode("You write Python.Sort a list.").ids)


def test_tokenize_options_and_detokenize_round_trip():
    app, _ = _app()
    no_gen, gen, strs = _post(
        app, ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}),
        ("/tokenize", {"messages": MESSAGES}), ("/tokenize", {"prompt": "import os", "return_token_strs": True}))
    tokenizer, _ = load_tokenizer(Path(TARGET))
    assert tokenizer.decode(gen.json()["tokens"]).endswith("<|assistant|>\n")  # the plain template's opening
    assert gen.json()["tokens"][:no_gen.json()["count"]] == no_gen.json()["tokens"]
    assert gen.json()["count"] > no_gen.json()["count"]
    assert "".join(strs.json()["token_strs"]) == "import os" and len(strs.json()["token_strs"]) == strs.json()["count"]
    text = "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
    tokens = _post(app, ("/tokenize", {"prompt": text}))[0].json()["tokens"]
    back, = _post(app, ("/detokenize", {"model": MODEL_NAME, "tokens": tokens}))
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_bad_input_answers_openai_errors():
    app, _ = _app()
    oov, not_ints, other_model, neither, both, no_content = _post(
        app, ("/detokenize", {"tokens": [5, 70000, -1]}), ("/detokenize", {"tokens": ["a"]}),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}), ("/tokenize", {"model": MODEL_NAME}),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}), ("/tokenize", {"messages": [{"role": "user"}]}))
    assert oov.status_code == 400
    assert oov.json()["error"] == {"message": "token ids [70000, -1] are outside the vocabulary [0, 4096)",
                                   "type": "invalid_request_error", "param": "tokens", "code": None}
    assert (not_ints.status_code, not_ints.json()["error"]["param"]) == (400, "tokens[0]")
    assert other_model.status_code == 404
    assert other_model.json()["error"] == {"message": f"The model 'gpt-4' does not exist (serving '{MODEL_NAME}')",
                                           "type": "not_found_error", "param": "model", "code": "model_not_found"}
    assert (neither.status_code, neither.json()["error"]["param"]) == (400, "prompt")
    assert neither.json()["error"]["message"] == "send either 'prompt' or 'messages'"
    assert (both.status_code, both.json()["error"]["param"]) == (400, "messages")
    assert (no_content.status_code, no_content.json()["error"]["param"]) == (400, "messages[0].content")


CALL = {"id": "call_1", "type": "function", "function": {"name": "sort", "arguments": "{}"}}
NO_TOOLS = "cannot be rendered: this server implements no tools (tool definitions are only accepted with tool_choice \"none\")"


@pytest.mark.parametrize(("turn", "param", "message"), [
    ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "messages[2].tool_calls",
     f"messages[2].tool_calls: tool calls {NO_TOOLS}"),
    # Legacy functions, turned off as README allows: a function's result is a tool result all the same.
    ({"role": "function", "name": "sort", "content": "[1, 2]"}, "messages[2].role",
     f"messages[2].role: a 'function' message (a function's result, OpenAI's legacy form) {NO_TOOLS}"),
])
def test_a_history_with_tool_calls_is_a_400_from_both_routes_before_anything_is_submitted(turn, param, message):
    history = [*MESSAGES, turn]
    functions = {"functions": [{"name": "sort", "parameters": {}}], "function_call": "none"}
    app, verifier = _app()
    verifier.streams = [FakeStream([_step("a", finish="length")])]  # were it submitted, it would end at once
    chat, tok = _post(app, ("/v1/chat/completions", {"model": MODEL_NAME, "messages": history, **functions}),
                      ("/tokenize", {"model": MODEL_NAME, "messages": history}))
    assert chat.status_code == tok.status_code == 400 and chat.json() == tok.json()
    assert chat.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert verifier.calls == []


def test_a_bad_message_is_named_by_its_index():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    bad_part = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    bad_role = [*MESSAGES, {"role": "wizard", "content": "x"}]
    app, verifier = _app()
    verifier.streams = [FakeStream([_step("a", finish="length")]) for _ in range(2)]  # were they submitted
    part, role = _post(app, ("/v1/chat/completions", {"model": MODEL_NAME, "messages": bad_part}),
                       ("/v1/chat/completions", {"model": MODEL_NAME, "messages": bad_role}))
    assert part.status_code == role.status_code == 400 and verifier.calls == []
    assert part.json()["error"] == {
        "message": "messages[0].content[1]: only text content parts are supported, got type 'image_url'",
        "type": "invalid_request_error", "param": "messages[0].content[1]", "code": None}
    assert role.json()["error"]["param"] == "messages[2].role"
    assert "Invalid enum value 'wizard'" in role.json()["error"]["message"]


def test_the_tokenizers_bos_goes_before_a_completion_prompt_but_not_a_rendered_chat():
    """vLLM's defaults: add_special_tokens true for completions, false for chat (whose template
    writes its own BOS; a model developer's Llama-3-like template got two). The request field
    overrides either; /tokenize follows the same defaults."""
    from tokenizers.processors import TemplateProcessing

    verifier = FakeVerifier()
    server, app = _server(verifier)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/tokenize")(server.tokenizer_routes.tokenize)
    bos = 0  # the bundled tokenizer's only special token; its post-processor now adds it, as Llama 3's does
    server.tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    verifier.streams = [FakeStream([{"type": "accepted"}, _step("a", finish="length")]) for _ in range(4)]
    one = {"model": MODEL_NAME, "max_tokens": 2}
    responses = _post(app, ("/v1/completions", {**one, "prompt": "def f():"}),
                      ("/v1/chat/completions", {**one, "messages": MESSAGES}),
                      ("/v1/completions", {**one, "prompt": "def f():", "add_special_tokens": False}),
                      ("/v1/chat/completions", {**one, "messages": MESSAGES, "add_special_tokens": True}),
                      ("/tokenize", {"model": MODEL_NAME, "prompt": "def f():"}),
                      ("/tokenize", {"model": MODEL_NAME, "messages": MESSAGES}))
    assert [r.status_code for r in responses] == [200] * 6
    completion, chat, bare, chat_bos = (ids for ids, *_ in verifier.calls)
    assert completion[0] == bos and bare == completion[1:]
    assert chat[0] != bos and chat_bos == [bos] + chat
    assert responses[4].json()["tokens"] == completion and responses[5].json()["tokens"] == chat


def test_tokenize_counts_past_the_context_window_but_not_without_bound():
    # Four context windows (1024 tokens each here) are counted; beyond, a 400 before tokenizing
    # (seven 1.9-million-token prompts held the ingress 31-37 s for every client).
    app, _ = _app()
    tokenizer, _ = load_tokenizer(Path(TARGET))
    line = "values = [item for item in range(10)]\n"
    per_line = len(tokenizer.encode(line * 50).ids) / 50
    measured, refused, huge, chat = _post(
        app, ("/tokenize", {"prompt": line * int(2.5 * 1024 / per_line)}),
        ("/tokenize", {"prompt": line * int(6 * 1024 / per_line)}),
        ("/tokenize", {"prompt": "a " * 1_900_000, "return_token_strs": True}),
        ("/tokenize", {"messages": [{"role": "user", "content": line * int(6 * 1024 / per_line)}]}))
    assert measured.status_code == 200 and 1024 < measured.json()["count"] <= 4 * 1024
    for response, param in ((refused, "prompt"), (huge, "prompt"), (chat, "messages")):
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert "/tokenize counts up to 4 context windows (4096 tokens)" in error["message"]
