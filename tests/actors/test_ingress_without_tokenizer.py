"""The HTTP ingress of a server started with engine.skip_tokenizer_init, without Ray: the ingress
in a plain FastAPI app over an in-process EngineLoop. Token-id prompts answer token ids (text
empty); text prompts, chat and stop strings answer a clear 400 in OpenAI's error shape."""

import asyncio
import json

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request

from actors.config import ServeConfig
from actors.ingress import IngressServer
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.llm import build_engine
from tests.engine.test_skip_tokenizer_init import DRAFT, PROMPTS, TARGET, without_tokenizer
from tests.helpers.local_verifier import LocalVerifier


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> FastAPI:
    root = tmp_path_factory.mktemp("bare-http")
    target, draft = without_tokenizer(TARGET, root / "target"), without_tokenizer(DRAFT, root / "draft")
    engine = {"model": str(target), "draft_model": str(draft), "num_speculative_tokens": 3,
              "skip_tokenizer_init": True}
    config = msgspec.convert({"model_name": "m", "engine": engine}, ServeConfig)
    server = IngressServer(config, LocalVerifier(build_engine(msgspec.convert(engine, EngineArgs))))
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.chat_completions(request)

    app.post("/tokenize")(server.tokenizer_routes.tokenize)
    app.post("/detokenize")(server.tokenizer_routes.detokenize)
    return app


def _post(app: FastAPI, *requests: tuple[str, dict]) -> list[httpx.Response]:
    """The requests, one after the other, in one event loop."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.post(path, json=body, timeout=60) for path, body in requests]

    return asyncio.run(run())


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": "def f():"}, "prompt", "send the prompt as a list of token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages",
     "chat needs a tokenizer"),
    ("/v1/completions", {"prompt": PROMPTS[0], "stop": "\n"}, "stop", "use 'stop_token_ids'"),
])
def test_what_needs_a_tokenizer_answers_a_clear_400(app, path, body, param, says):
    [r] = _post(app, (path, {"model": "m", "max_tokens": 4, **body}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert "skip_tokenizer_init" in err["message"] and says in err["message"]


def test_token_id_prompts_answer_token_ids(app):
    reference = LLM(str(TARGET), draft_model=str(DRAFT), num_speculative_tokens=3)
    want = reference.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    r, stream = _post(app, ("/v1/completions", body), ("/v1/completions", {**body, "stream": True}))
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == want.token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert r.json()["usage"] == {"prompt_tokens": len(PROMPTS[1]), "completion_tokens": 8, "total_tokens": 15}
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": "def f():"}), ("/detokenize", {"tokens": [5]})])
def test_tokenize_and_detokenize_need_a_tokenizer(app, path, body):
    [r] = _post(app, (path, {"model": "m", **body}))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"{path} needs a tokenizer and this model was loaded with "
                                            "skip_tokenizer_init", "type": "invalid_request_error", "param": None,
                                 "code": None}
