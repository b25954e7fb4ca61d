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

from actors.config import ServeConfig
from actors.failover import ResumableStream
from actors.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
    protocol_errors,
)
from actors.responses import ResponseBuilder, error_body, sse
from actors.telemetry import RequestTelemetry
from engine.chat_template import ChatTemplate
from engine.loader import encode_text, max_chars_per_token
from engine.request_ranges import check_prompt, check_prompt_chars, check_without_tokenizer
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


ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               503: "server_overloaded", 504: "timeout", 500: "internal_error"}
RETRY_AFTER_S = {503: 1}  # Retry-After of a full queue or a shutting-down replica
UNAVAILABLE_RETRY_AFTER_S = 5  # while the verifier is gone: about a replica restart
PROBE_INTERVAL_S = 0.5  # how often a gone verifier is asked whether it is back
# /health's wait for the verifier: a load balancer's probe gives up after a few seconds (Kubernetes'
# default: 1 s), and a step of the embedded config lasts tens of ms, so 2 s is a hung or absent engine.
HEALTH_TIMEOUT_S = 2.0


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    err_type = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


class RequestFailed(Exception):
    """A request that cannot complete: the HTTP status and message the client gets."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s if retry_after_s is not None else RETRY_AFTER_S.get(status)

    @classmethod
    def from_item(cls, item: dict) -> RequestFailed:
        """The failure a verifier's error item (``actors.stream_items``) reports."""
        return cls(item["status"], item["message"], param=item.get("param"), code=item.get("code"))

    @property
    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.param, self.code, headers=self.headers)

    def chunk(self) -> dict:
        """The in-band error of a stream whose 200 is already sent."""
        return error_body(self.message, ERROR_TYPES.get(self.status, "internal_error"), self.param, self.status)


def _verifier_gone(e: BaseException) -> bool:
    """The verifier replica died or cannot be reached (not a bug in a request)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return isinstance(e, (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError))


def _failure(e: BaseException, timeout_s: float) -> RequestFailed:
    if isinstance(e, RequestFailed):
        return e
    if isinstance(e, asyncio.TimeoutError):
        return RequestFailed(504, f"the request did not finish within request_timeout_s = {timeout_s:g} s")
    if _verifier_gone(e):
        return RequestFailed(503, f"the model server is unavailable ({type(e).__name__}); retry shortly",
                             UNAVAILABLE_RETRY_AFTER_S)
    return RequestFailed(500, f"internal error: {type(e).__name__}")


async def _read_body(request: Request) -> bytes:
    """The request body, refused (413) once it is known to exceed :data:`MAX_BODY_BYTES`: from
    its ``Content-Length`` before reading, else while it streams in (nothing larger is kept)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ProtocolError(f"request body of {declared} bytes exceeds {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ProtocolError(f"request body of more than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


class IngressServer:
    """Request handling for the OpenAI routes; ``verifier`` is a Serve handle (or a test double)."""

    def __init__(self, config: ServeConfig, verifier) -> None:
        from ray.serve.handle import DeploymentHandle

        from engine.config import context_window, load_model_config
        from engine.loader import load_tokenizer

        self._verifier_stream = verifier  # a test double is used as it is (and streams as it is)
        self.created = int(time.time())  # the model card's `created`: when this replica started serving it
        if isinstance(verifier, DeploymentHandle):
            # By value = Serve's gRPC transport between replicas (ServeConfig.serve_transport);
            # a Serve handle must be asked for a stream.
            verifier = verifier.options(_by_reference=config.serve_transport != "grpc")
            self._verifier_stream = verifier.options(stream=True)
        self.config, self.verifier = config, verifier
        self.model_name = config.model_name
        model_path = config.engine.model
        model_config = load_model_config(model_path)
        self.max_model_len = context_window(config.engine.max_model_len, model_config.max_position_embeddings)
        self.vocab_size = model_config.vocab_size
        from pathlib import Path

        # skip_tokenizer_init: no tokenizer; token-id prompts only, token ids in the responses.
        self.tokenizer, template = (None, None) if config.engine.skip_tokenizer_init else load_tokenizer(Path(model_path))
        self.chat_template = ChatTemplate.of(template)
        # A prompt too long for the window is refused before tokenising where the tokenizer allows.
        self.max_chars_per_token = None if self.tokenizer is None else max_chars_per_token(self.tokenizer)
        self._ids = itertools.count()
        setup_tracing("ingress", config.tracing)
        # The engine's running/waiting gauges are the ones served (include_state_gauges=False).
        self.metrics = RequestMetrics(self.model_name, include_state_gauges=False)
        self._probe: asyncio.Task | None = None  # set while the verifier is gone: asks until it is back

    # ------------------------------------------------------------------ routes
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> Response:
        """``GET /v1/models/{model}``: the served model's card, or 404 in OpenAI's shape."""
        if model_id != self.model_name:
            e = self._unknown_model(model_id)
            return _error(e.status, str(e), e.param, e.code)
        return JSONResponse(self._model_card())

    def _unknown_model(self, name: str) -> ProtocolError:
        return ProtocolError(f"The model '{name}' does not exist (serving '{self.model_name}')", "model", 404,
                             "model_not_found")

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specmoe",
                "max_model_len": self.max_model_len}

    async def health(self) -> Response:
        """200 once the verifier answers between two engine steps; 503 within ``HEALTH_TIMEOUT_S``
        otherwise (still starting: the handle would queue the call until a replica is up; restarting;
        or a hung engine step), never a wait as long as a start may take."""
        if self._probe is not None:
            return _error(503, "verifier unavailable (restarting)", headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        try:
            await asyncio.wait_for(self.verifier.stats.remote(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return _error(503, f"verifier not answering within {HEALTH_TIMEOUT_S:g} s (starting, or a step hung)",
                          headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        except Exception as e:
            return _error(503, f"verifier unavailable: {type(e).__name__}: {e}")
        return Response(status_code=200)

    def _verifier_lost(self) -> None:
        """Answer 503 at once from now on (a handle would queue requests until a replica is back),
        and ask the verifier in the background until it answers again."""
        if self._probe is None:
            log.warning("the verifier is gone; answering 503 until it is back")
            self._probe = asyncio.get_running_loop().create_task(self._wait_verifier_back())

    async def _wait_verifier_back(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                await asyncio.wait_for(self.verifier.stats.remote(), self.config.verifier_start_timeout_s)
            except Exception as e:  # still restarting
                log.debug("verifier not back yet (%s)", type(e).__name__)
                continue
            log.warning("the verifier is back")
            self._probe = None
            return

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
        if req.model is not None and req.model != self.model_name:
            raise self._unknown_model(req.model)
        if self.tokenizer is None:
            with protocol_errors():
                check_without_tokenizer(kind == "completion" and isinstance(req.prompt, str),
                                        [req.stop] if isinstance(req.stop, str) else req.stop or [], kind == "chat")
        if kind == "completion":
            prompt_text = req.prompt if isinstance(req.prompt, str) else None
            logprobs = req.logprobs
        else:
            with protocol_errors():
                prompt_text = self.chat_template.render(req.conversation())
            logprobs = req.num_logprobs
        # The engine's own prompt rules (engine.request_ranges), answered here as 400s.
        with protocol_errors(None if kind == "completion" else {"prompt": "messages"}):
            if prompt_text is not None:
                check_prompt_chars(len(prompt_text), self.max_chars_per_token, self.max_model_len)
            ids = encode_text(self.tokenizer, prompt_text) if prompt_text is not None else list(req.prompt)
            check_prompt(ids, None, self.vocab_size, self.max_model_len)
            max_tokens = req.max_tokens or (DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion"
                                            else self.max_model_len - len(ids))
            check_prompt(ids, max_tokens, self.vocab_size, self.max_model_len, not req.max_tokens)
        with protocol_errors():
            params = req.sampling_params(max_tokens, logprobs)
        return req, ids, prompt_text, params, logprobs is not None

    async def _handle(self, request: Request, kind: str) -> Response:
        route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        op = sc.GEN_AI_OPERATION_TEXT_COMPLETION if kind == "completion" else sc.GEN_AI_OPERATION_CHAT
        tel_start_s = time.monotonic()
        tel = RequestTelemetry(self.metrics, route, dict(request.headers), op, self.model_name, tel_start_s)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        try:
            body = await _read_body(request)
            # Tokenizing a long prompt is CPU work: off the event loop, so other requests keep flowing.
            req, ids, prompt_text, params, want_lp = await asyncio.to_thread(self._prepare, body, kind)
        except ProtocolError as e:
            tel.finish(e.status, rid)
            return _error(e.status, str(e), e.param, e.code)
        tel.trace.request(sc.gen_ai_request_attributes(op, self.model_name, max_tokens=params.max_tokens,
                                                       temperature=params.temperature, top_p=params.top_p,
                                                       seed=params.seed))
        if self._probe is not None:
            failed = RequestFailed(503, "the model server is restarting; retry shortly", UNAVAILABLE_RETRY_AFTER_S)
            tel.finish(503, rid)
            return failed.response()
        deadline = tel_start_s + self.config.request_timeout_s
        stream = self._submit(ids, params, prompt_text, rid, tel.trace.carrier(), req.stream)
        try:
            first = await self._next(stream, deadline)
            if first["type"] == "error":
                raise RequestFailed.from_item(first)
        except asyncio.CancelledError:  # the client left before the first item
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            failed = self._failed(e, rid)
            tel.finish(failed.status, rid)
            return failed.response()
        builder = ResponseBuilder(kind, self.model_name, rid, params.n, self.tokenizer, want_lp)
        if req.stream:
            return StreamingResponse(self._sse(stream, builder, req.include_usage, tel, deadline),
                                     media_type="text/event-stream")
        return await self._whole(stream, builder, tel, deadline)

    async def _whole(self, stream, builder: ResponseBuilder, tel: RequestTelemetry, deadline: float) -> Response:
        """A non-streaming response: the whole stream, then one body (or an error)."""
        status = 200
        try:
            async for item in self._items(stream, deadline):
                self._absorb(builder, item, tel)
            if "error" in builder.finish:
                raise RuntimeError("the engine failed this request")
        except Exception as e:
            failed = self._failed(e, builder.id)
            status = failed.status
            return failed.response()
        finally:
            stream.cancel()  # done, failed or timed out: the verifier aborts an unfinished request
            tel.finish(status, builder.id)
        return JSONResponse(builder.final())

    def _submit(self, ids: list[int], params, prompt_text: str | None, rid: str, carrier: dict | None,
                stream: bool):
        """The request's verifier stream; it fails over to another verifier replica when its own
        dies (``actors/failover.py``). A request the client does not stream gets its first tokens
        and then the rest in one item (``stream=False``, see ``EngineLoop.generate``)."""
        def submit(prompt_ids: list[int], wire_params: dict):
            text = prompt_text if len(prompt_ids) == len(ids) else None  # a resubmission has no prompt text
            return self._verifier_stream.generate.remote(prompt_ids, wire_params, text, rid, carrier, stream)

        return ResumableStream(submit, ids, msgspec.to_builtins(params), _verifier_gone)

    def _failed(self, e: BaseException, rid: str) -> RequestFailed:
        failed = _failure(e, self.config.request_timeout_s)
        if failed.status == 500:
            log.error("request %s failed", rid, exc_info=e)
        elif _verifier_gone(e):
            self._verifier_lost()
        return failed

    @staticmethod
    async def _next(stream, deadline: float) -> dict:
        """The stream's next item before ``deadline`` (monotonic s); StopAsyncIteration at its end.

        Raises:
            asyncio.TimeoutError: the deadline passed first.
        """
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(stream.__anext__(), remaining_s)

    async def _items(self, stream, deadline: float):
        while True:
            try:
                item = await self._next(stream, deadline)
            except StopAsyncIteration:
                return
            yield item

    def _absorb(self, builder: ResponseBuilder, item: dict, tel: RequestTelemetry) -> list[dict]:
        if item["type"] == "error":
            raise RequestFailed.from_item(item)
        chunks = builder.add(item)
        tel.on_item(item)
        return chunks

    async def _sse(self, stream, builder: ResponseBuilder, include_usage: bool, tel: RequestTelemetry,
                   deadline: float):
        status = 200
        try:
            async for item in self._items(stream, deadline):
                for chunk in self._absorb(builder, item, tel):
                    yield sse(chunk)
            if include_usage:
                yield sse(builder.usage_chunk())
        except Exception as e:  # mid-stream failure: tell the client in-band, then end the stream
            failed = self._failed(e, builder.id)
            status = failed.status
            yield sse(failed.chunk())
        finally:
            stream.cancel()  # client gone, done or timed out: the verifier aborts an unfinished request
            tel.finish(status, builder.id)
        yield sse("[DONE]")
