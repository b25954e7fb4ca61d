"""OpenAI-compatible HTTP ingress (FastAPI): validates, tokenizes, streams from a verifier.

``IngressServer`` holds the logic and takes the verifier handle as an argument, so it can be driven
by any object with the same ``generate``/``stats`` methods; ``actors/deployments.py`` turns it into
a Ray Serve deployment with ``@serve.ingress``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
import uuid
from contextlib import aclosing
from typing import NamedTuple

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.config import ServeConfig
from actors.failover import ResumableStream
from actors.fanout import first_items, interleave
from actors.http_errors import (
    CLIENT_CLOSED_REQUEST,
    UNAVAILABLE_RETRY_AFTER_S,
    RequestFailed,
    error_response,
    failure,
    raise_if_engine_failed,
    read_body,
    verifier_gone,
)
from actors.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
    protocol_errors,
    unknown_model,
)
from actors.responses import ResponseBuilder, sse
from actors.telemetry import RequestTelemetry, Telemetries
from actors.tokenizer_routes import TokenizerRoutes
from engine.chat_template import ChatTemplate
from engine.loader import encode_text, max_chars_per_token, special_tokens_for
from engine.request_ranges import check_prompt, check_prompt_chars, check_without_tokenizer
from engine.sampling_params import SamplingParams
from observability import CONTENT_TYPE, RequestMetrics, render, setup_tracing
from observability import semconv as sc
from observability.tracing import SERVICE_VERSION

log = logging.getLogger(__name__)
# FastAPI >= 0.165 traces every request itself on OpenTelemetry's global tracer provider, which
# setup_tracing installs in this replica: its spans were a second trace per request beside the
# request's own HTTP span (RequestTelemetry), whose trace reaches down to the expert calls.
_NO_NATIVE_SPANS = ({"telemetry": {"tracing": False, "operation_spans": False}}
                    if "telemetry" in inspect.signature(FastAPI).parameters else {})
# No interactive docs: the API is OpenAI's, and every route answers errors in OpenAI's shape.
app = FastAPI(title="specmoe", version=SERVICE_VERSION, docs_url=None, redoc_url=None, openapi_url=None,
              **_NO_NATIVE_SPANS)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405) etc. in OpenAI's error shape."""
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


PROBE_INTERVAL_S = 0.5  # how often a gone verifier is asked whether it is back
# /health's wait for the verifier: a load balancer's probe gives up after a few seconds (Kubernetes'
# default: 1 s), and a step of the embedded config lasts tens of ms, so 2 s is a hung or absent engine.
HEALTH_TIMEOUT_S = 2.0


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
        # POST /tokenize and /detokenize (vLLM's), with the same tokenizer and template
        self.tokenizer_routes = TokenizerRoutes(self.model_name, self.tokenizer, self.chat_template,
                                                self.max_model_len, self.vocab_size, self.config.body_timeout_s,
                                                self.max_chars_per_token)
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
            return error_response(e.status, str(e), e.param, e.code)
        return JSONResponse(self._model_card())

    def _unknown_model(self, name: str) -> ProtocolError:
        return unknown_model(name, self.model_name)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specmoe",
                "max_model_len": self.max_model_len}

    async def health(self) -> Response:
        """200 once the verifier answers between two engine steps; 503 within ``HEALTH_TIMEOUT_S``
        otherwise (still starting: the handle would queue the call until a replica is up; restarting;
        or a hung engine step), never a wait as long as a start may take."""
        if self._probe is not None:
            return error_response(503, "verifier unavailable (restarting)", headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        try:
            await asyncio.wait_for(self.verifier.stats.remote(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return error_response(503, f"verifier not answering within {HEALTH_TIMEOUT_S:g} s (starting, or a step hung)",
                          headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        except Exception as e:
            return error_response(503, f"verifier unavailable: {type(e).__name__}: {e}")
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

    async def own_metrics(self) -> bytes:
        """Prometheus text of this replica's request metrics (rendered off the event loop)."""
        return await asyncio.to_thread(render, self.metrics.registry)

    async def metrics_text(self, pages: list | None = None) -> Response:
        """``GET /metrics``: ``pages`` (every replica's, labelled; ``actors/metrics_hub.py``), or
        without them (no hub, or none of its replicas heard from yet) this replica's request metrics
        and one verifier replica's engine metrics."""
        if not pages:
            pages = [self.metrics.registry]
            try:
                pages.append(await self.verifier.metrics_text.remote())
            except Exception as e:  # metrics never fail the endpoint
                log.warning("verifier metrics unavailable: %s", e)
        return Response(await asyncio.to_thread(render, *pages), media_type=CONTENT_TYPE)

    # ----------------------------------------------------------------- handling
    def _prepare(self, body: bytes, kind: str) -> tuple[CompletionRequest | ChatCompletionRequest, list[Prompt]]:
        """The request and its prompts (one per engine request: a completion's batch has several).

        Raises:
            ProtocolError: the request or one of its prompts is invalid (before anything is
                submitted); a batch's prompt ``i`` is named ``prompt[i]``.
        """
        schema = CompletionRequest if kind == "completion" else ChatCompletionRequest
        req = decode_request(body, schema)
        if req.model is not None and req.model != self.model_name:
            raise self._unknown_model(req.model)
        if self.tokenizer is None:
            with protocol_errors():
                check_without_tokenizer(kind == "completion" and any(isinstance(p, str) for p in req.prompts()),
                                        [req.stop] if isinstance(req.stop, str) else req.stop or [], kind == "chat")
        prompts = req.prompts() if kind == "completion" else None
        self._check_capacity(len(prompts) if prompts is not None else 1, req.n)
        if prompts is None:  # chat: one prompt, the rendered conversation
            with protocol_errors():
                prompt_text = self.chat_template.render(req.conversation())
            return req, [self._prompt(req, prompt_text, req.num_logprobs, "messages")]
        if not req.is_batch:
            return req, [self._prompt(req, prompts[0], req.logprobs)]
        return req, [self._prompt(req, prompt, req.logprobs, f"prompt[{i}]") for i, prompt in enumerate(prompts)]

    def _check_capacity(self, num_prompts: int, n: int) -> None:
        """Refuses (400) a request of more sequences than the verifier replicas can ever hold at
        once (``max_num_seqs`` running + ``max_waiting`` waiting each): its 503 would repeat on every
        retry, and its prompts would all be submitted first (20,000 prompts stalled the server for a
        minute). Checked before any prompt is tokenized."""
        sched = self.config.engine.scheduler
        limit = (sched.max_num_seqs + sched.max_waiting) * self.config.verifier.num_replicas
        if num_prompts * n > limit:
            what = f"{num_prompts} prompts x n = {n}" if num_prompts > 1 else f"n = {n}"
            raise ProtocolError(f"{what} is {num_prompts * n} sequences, more than the {limit} the server can hold "
                                f"at once (engine.scheduler.max_num_seqs + max_waiting per verifier replica); "
                                f"send fewer per request", "prompt" if num_prompts > 1 else "n")

    def _prompt(self, req: CompletionRequest | ChatCompletionRequest, prompt: str | list[int], logprobs: int | None,
                param: str = "prompt") -> Prompt:
        """One prompt's token ids and sampling parameters, checked by the engine's own prompt rules
        (``engine.request_ranges``).

        Args:
            param: what the prompt is called in errors: ``prompt``, ``messages`` (a chat's
                rendered conversation) or ``prompt[i]`` (a batch's prompt ``i``, also named at
                the start of the message, since an error about it may name ``max_tokens``).

        Raises:
            ProtocolError: 400 for a prompt too long or out of the vocabulary, or an invalid
                sampling parameter.
        """
        text = prompt if isinstance(prompt, str) else None
        try:
            with protocol_errors({"prompt": param}):
                if text is not None:
                    check_prompt_chars(len(text), self.max_chars_per_token, self.max_model_len)
                special = special_tokens_for(isinstance(req, ChatCompletionRequest), req.add_special_tokens)
                ids = encode_text(self.tokenizer, text, special) if text is not None else list(prompt)
                check_prompt(ids, None, self.vocab_size, self.max_model_len)
                max_tokens = req.max_tokens or (DEFAULT_COMPLETION_MAX_TOKENS if isinstance(req, CompletionRequest)
                                                else self.max_model_len - len(ids))
                check_prompt(ids, max_tokens, self.vocab_size, self.max_model_len, not req.max_tokens)
        except ProtocolError as e:
            if not param.startswith("prompt["):
                raise
            raise ProtocolError(f"{param}: {e}", e.param, e.status, e.code) from e
        with protocol_errors():
            params = req.sampling_params(max_tokens, logprobs)
        return Prompt(ids, text, params)

    async def _handle(self, request: Request, kind: str) -> Response:
        route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        op = sc.GEN_AI_OPERATION_TEXT_COMPLETION if kind == "completion" else sc.GEN_AI_OPERATION_CHAT
        tel_start_s = time.monotonic()
        tel = RequestTelemetry(self.metrics, route, dict(request.headers), op, self.model_name, tel_start_s)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        try:
            body = await read_body(request, self.config.body_timeout_s)
            # Tokenizing a long prompt is CPU work: off the event loop, so other requests keep flowing.
            req, prompts = await asyncio.to_thread(self._prepare, body, kind)
        except ProtocolError as e:
            tel.finish(e.status, rid)
            return error_response(e.status, str(e), e.param, e.code)
        except asyncio.CancelledError:  # the client left before its request was read: no engine request
            tel.finish(CLIENT_CLOSED_REQUEST, rid)
            raise
        # One telemetry per prompt (each is an engine request), all in this request's HTTP span.
        tels = Telemetries([tel] + [tel.for_another_prompt() for _ in prompts[1:]], rid)
        params = prompts[0].params
        for t, p in zip(tels, prompts):
            t.prompt_tokens = len(p.ids)  # counted if the client leaves after the first token
            t.trace.request(sc.gen_ai_request_attributes(op, self.model_name, max_tokens=params.max_tokens,
                                                         temperature=params.temperature, top_p=params.top_p,
                                                         seed=params.seed))
        if self._probe is not None:
            failed = RequestFailed(503, "the model server is restarting; retry shortly", UNAVAILABLE_RETRY_AFTER_S)
            tels.finish(503)
            return failed.response()
        deadline = tel_start_s + self.config.request_timeout_s
        # A batch's prompts are engine requests of their own: request ids unique per prompt.
        streams = [self._submit(p, rid if len(prompts) == 1 else f"{rid}-{i}", t.trace.carrier(), req.stream)
                   for i, (p, t) in enumerate(zip(prompts, tels))]
        try:  # every prompt admitted (or the whole request refused) before anything is sent
            for first in await first_items(streams, deadline):
                if first["type"] == "error":
                    raise RequestFailed.from_item(first)
        except asyncio.CancelledError:  # the client left before the first items: aborted requests
            _cancel(streams)
            tels.finish(200)  # as a stream the client leaves: finished_reason "abort"
            raise
        except Exception as e:
            _cancel(streams)
            failed = self._failed(e, rid)
            tels.finish(failed.status, failed.code)  # a 503's code: why it was refused
            return failed.response()
        builder = ResponseBuilder(kind, self.model_name, rid, params.n, self.tokenizer, params.logprobs is not None,
                                  num_prompts=len(prompts))
        if req.stream:
            return StreamingResponse(self._sse(streams, builder, req.include_usage, tels, deadline),
                                     media_type="text/event-stream")
        return await self._whole(streams, builder, tels, deadline)

    async def _whole(self, streams: list, builder: ResponseBuilder, tels: Telemetries, deadline: float) -> Response:
        """A non-streaming response: the whole streams, then one body (or an error)."""
        status = 200
        try:
            async with aclosing(interleave(streams, deadline)) as items:  # closed at once if this ends early
                async for prompt, item in items:
                    self._absorb(builder, prompt, item, tels)
            raise_if_engine_failed(builder.finish)
        except Exception as e:
            failed = self._failed(e, builder.id)
            status = failed.status
            return failed.response()
        finally:
            _cancel(streams)  # done, failed or timed out: the verifier aborts an unfinished request
            tels.finish(status)
        return JSONResponse(builder.final())

    def _submit(self, prompt: Prompt, rid: str, carrier: dict | None, stream: bool) -> ResumableStream:
        """The prompt's verifier stream; it fails over to another verifier replica when its own
        dies (``actors/failover.py``). A request the client does not stream gets its first tokens
        and then the rest in one item (``stream=False``, see ``EngineLoop.generate``)."""
        def submit(prompt_ids: list[int], wire_params: dict):
            # a resubmission has no prompt text
            text = prompt.text if len(prompt_ids) == len(prompt.ids) else None
            return self._verifier_stream.generate.remote(prompt_ids, wire_params, text, rid, carrier, stream)

        return ResumableStream(submit, prompt.ids, msgspec.to_builtins(prompt.params), verifier_gone)

    def _failed(self, e: BaseException, rid: str) -> RequestFailed:
        failed = failure(e, self.config.request_timeout_s)
        if failed.status == 500:
            log.error("request %s failed", rid, exc_info=e)
        elif verifier_gone(e):
            self._verifier_lost()
        return failed

    @staticmethod
    def _absorb(builder: ResponseBuilder, prompt: int, item: dict, tels: Telemetries) -> list[dict]:
        if item["type"] == "error":
            raise RequestFailed.from_item(item)
        chunks = builder.add(item, prompt)
        tels[prompt].on_item(item)
        return chunks

    async def _sse(self, streams: list, builder: ResponseBuilder, include_usage: bool, tels: Telemetries,
                   deadline: float):
        status = 200
        try:
            async with aclosing(interleave(streams, deadline)) as items:  # closed at once if the client leaves
                async for prompt, item in items:
                    for chunk in self._absorb(builder, prompt, item, tels):
                        if include_usage:  # OpenAI's: every chunk before the usage chunk says "usage": null
                            chunk["usage"] = None
                        yield sse(chunk)
            raise_if_engine_failed(builder.finish)
            if include_usage:
                yield sse(builder.usage_chunk())
        except Exception as e:  # mid-stream failure: tell the client in-band, then end the stream
            failed = self._failed(e, builder.id)
            status = failed.status
            yield sse(failed.chunk())
        finally:
            _cancel(streams)  # client gone, done or timed out: the verifier aborts an unfinished request
            tels.finish(status)
        yield sse("[DONE]")


class Prompt(NamedTuple):
    """One engine request of an HTTP request: its prompt's token ids and text (None for token ids)
    and its sampling parameters."""

    ids: list[int]
    text: str | None
    params: SamplingParams


def _cancel(streams: list) -> None:
    for stream in streams:
        stream.cancel()
