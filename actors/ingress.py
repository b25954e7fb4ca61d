"""OpenAI-compatible HTTP ingress (FastAPI): validates, tokenizes, streams from a verifier.

``IngressServer`` holds the logic and takes the verifier handle as an argument, so it can be driven
by any object with the same ``generate``/``stats`` methods; ``actors/deployments.py`` turns it into
a Ray Serve deployment with ``@serve.ingress``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.chat_template import ChatTemplate
from actors.config import ServeConfig
from actors.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
    protocol_errors,
)
from actors.responses import ResponseBuilder, error_body, sse
from actors.telemetry import RequestTelemetry
from engine.request_ranges import check_prompt, check_without_tokenizer
from observability import CONTENT_TYPE, RequestMetrics, render, setup_tracing
from observability import semconv as sc

log = logging.getLogger(__name__)
# No interactive docs: the API is OpenAI's, and every route answers errors in OpenAI's shape.
app = FastAPI(title="specmoe", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 4 * 1024 * 1024  # larger bodies get 413 before any parsing or tokenizing


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405) etc. in OpenAI's error shape."""
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    err_type = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                503: "server_overloaded", 500: "internal_error"}.get(status, "invalid_request_error")
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


class IngressServer:
    """Request handling for the OpenAI routes; ``verifier`` is a Serve handle (or a test double)."""

    def __init__(self, config: ServeConfig, verifier) -> None:
        from ray.serve.handle import DeploymentHandle

        from engine.config import load_model_config
        from engine.loader import load_tokenizer

        self.config, self.verifier = config, verifier
        # A Serve handle must be asked for a stream; a test double streams as it is.
        self._verifier_stream = verifier.options(stream=True) if isinstance(verifier, DeploymentHandle) else verifier
        self.model_name = config.model_name
        model_path = config.engine.model
        model_config = load_model_config(model_path)
        self.max_model_len = config.engine.max_model_len or model_config.max_position_embeddings
        self.vocab_size = model_config.vocab_size
        from pathlib import Path

        # skip_tokenizer_init: no tokenizer; token-id prompts only, token ids in the responses.
        self.tokenizer, template = (None, None) if config.engine.skip_tokenizer_init else load_tokenizer(Path(model_path))
        self.chat_template = ChatTemplate(template)
        self._ids = itertools.count()
        setup_tracing("ingress", config.tracing)
        # The engine's running/waiting gauges are the ones served (include_state_gauges=False).
        self.metrics = RequestMetrics(self.model_name, include_state_gauges=False)

    # ------------------------------------------------------------------ routes
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "specmoe", "max_model_len": self.max_model_len}]}

    async def health(self) -> Response:
        try:
            await self.verifier.stats.remote()
        except Exception as e:
            return _error(503, f"verifier unavailable: {e}")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        parts = [self.metrics.registry]
        try:
            parts.append(await self.verifier.metrics_text.remote())
        except Exception as e:  # metrics never fail the endpoint
            log.warning("verifier metrics unavailable: %s", e)
        return Response(render(*parts), media_type=CONTENT_TYPE)

    # ----------------------------------------------------------------- handling
    def _prepare(self, body: bytes, kind: str):
        schema = CompletionRequest if kind == "completion" else ChatCompletionRequest
        req = decode_request(body, schema)
        if req.model != self.model_name:
            raise ProtocolError(f"The model '{req.model}' does not exist (serving '{self.model_name}')",
                                "model", 404, "model_not_found")
        if self.tokenizer is None:
            with protocol_errors(None if kind == "completion" else {"prompt": "messages"}):
                check_without_tokenizer(kind == "chat" or isinstance(req.prompt, str),
                                        [req.stop] if isinstance(req.stop, str) else req.stop or [])
        if kind == "completion":
            prompt_text = req.prompt if isinstance(req.prompt, str) else None
            ids = self.tokenizer.encode(req.prompt).ids if prompt_text is not None else list(req.prompt)
            logprobs = req.logprobs
        else:
            prompt_text = self.chat_template.render(req.messages)
            ids = self.tokenizer.encode(prompt_text).ids
            logprobs = req.num_logprobs
        # The engine's own prompt rules (engine.request_ranges), answered here as 400s.
        with protocol_errors(None if kind == "completion" else {"prompt": "messages"}):
            check_prompt(ids, None, self.vocab_size, self.max_model_len)
            max_tokens = req.max_tokens or (DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion"
                                            else self.max_model_len - len(ids))
            check_prompt(ids, max_tokens, self.vocab_size, self.max_model_len)
        with protocol_errors():
            params = req.sampling_params(max_tokens, logprobs)
        return req, ids, prompt_text, params, logprobs is not None

    async def _handle(self, request: Request, kind: str) -> Response:
        route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        op = sc.GEN_AI_OPERATION_TEXT_COMPLETION if kind == "completion" else sc.GEN_AI_OPERATION_CHAT
        tel = RequestTelemetry(self.metrics, route, dict(request.headers), op, self.model_name, time.monotonic())
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        try:
            body = await request.body()
            if len(body) > MAX_BODY_BYTES:
                raise ProtocolError(f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES} bytes", status=413)
            # Tokenizing a long prompt is CPU work: off the event loop, so other requests keep flowing.
            req, ids, prompt_text, params, want_lp = await asyncio.to_thread(self._prepare, body, kind)
        except ProtocolError as e:
            tel.finish(e.status, rid)
            return _error(e.status, str(e), e.param, e.code)
        tel.trace.request(sc.gen_ai_request_attributes(op, self.model_name, max_tokens=params.max_tokens,
                                                       temperature=params.temperature, top_p=params.top_p,
                                                       seed=params.seed))
        stream = self._verifier_stream.generate.remote(ids, msgspec.to_builtins(params), prompt_text, rid,
                                                         tel.trace.carrier())
        try:
            first = await stream.__anext__()
        except Exception as e:
            log.exception("verifier failed to accept %s", rid)
            tel.finish(500, rid)
            return _error(500, f"internal error: {type(e).__name__}")
        if first["type"] == "error":
            tel.finish(first["status"], rid)
            headers = {"Retry-After": "1"} if first["status"] == 503 else None
            return _error(first["status"], first["message"], None, None, headers)
        builder = ResponseBuilder(kind, self.model_name, rid, params.n, self.tokenizer, want_lp)
        if req.stream:
            return StreamingResponse(self._sse(stream, builder, req.include_usage, tel),
                                     media_type="text/event-stream")
        status = 200
        try:
            async for item in stream:
                self._absorb(builder, item, tel)
            if "error" in builder.finish:
                raise RuntimeError("the engine failed this request")
        except Exception as e:
            log.exception("request %s failed", rid)
            status = 500
            return _error(500, f"internal error: {type(e).__name__}")
        finally:
            stream.cancel()
            tel.finish(status, rid)
        return JSONResponse(builder.final())

    def _absorb(self, builder: ResponseBuilder, item: dict, tel: RequestTelemetry) -> list[dict]:
        if item["type"] == "error":
            raise RuntimeError(item["message"])
        chunks = builder.add(item)
        tel.on_item(item)
        return chunks

    async def _sse(self, stream, builder: ResponseBuilder, include_usage: bool, tel: RequestTelemetry):
        status = 200
        try:
            async for item in stream:
                for chunk in self._absorb(builder, item, tel):
                    yield sse(chunk)
            if include_usage:
                yield sse(builder.usage_chunk())
        except Exception as e:  # mid-stream failure: tell the client in-band, then end the stream
            log.exception("stream %s failed", builder.id)
            status = 500
            yield sse(error_body(f"internal error: {type(e).__name__}", "internal_error"))
        finally:
            stream.cancel()  # client gone or done: the verifier aborts an unfinished request
            tel.finish(status, builder.id)
        yield sse("[DONE]")


