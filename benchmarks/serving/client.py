"""One streaming request against an OpenAI-compatible server, timed on the client.

All timestamps come from ``time.perf_counter()`` and are stored as offsets in seconds from the
moment the request was sent, so the pure functions in ``metrics`` derive TTFT/ITL/e2e from them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.serving.dataset import Prompt

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestOptions:
    """Request settings shared by every request of a run."""

    endpoint: str = "completions"  # "completions" or "chat"
    model: str | None = None  # omitted from the body when None
    temperature: float = 0.0
    ignore_eos: bool = False  # only sent when True: not every server knows the field
    request_timeout_s: float = 300.0  # whole request, first byte to [DONE]
    # Send each prompt's class as the body field ``slo_class`` (specmoe ignores unknown fields).
    send_slo_class: bool = True


@dataclass
class RequestResult:
    """What the client observed for one request.

    ``chunk_offsets_s``: arrival time of every content chunk (a chunk carrying non-empty text),
    seconds since the request was sent. ``e2e_s``: seconds until the stream ended. Token counts
    come from the final usage chunk. ``start_s``: when the request was sent, seconds since the
    benchmark started (set by the load generator).
    """

    prompt_id: str
    success: bool = False
    start_s: float = 0.0
    e2e_s: float | None = None
    chunk_offsets_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    slo_class: str | None = None  # the prompt's request class (set by the load generator)


def build_payload(prompt: Prompt, options: RequestOptions) -> tuple[str, dict[str, Any]]:
    """(URL path, JSON body) for one streaming request with a final usage chunk.

    A prompt's own ``endpoint``/``temperature`` win over the run's options; ``seed`` and
    ``slo_class`` are sent only when the prompt has them (``slo_class`` unless turned off).
    """
    temperature = options.temperature if prompt.temperature is None else prompt.temperature
    body: dict[str, Any] = {
        "max_tokens": prompt.max_tokens,
        "temperature": temperature,
        "stream": True,
        # The usage chunk is the only source of the output token count (chunks may carry several
        # tokens each under speculative decoding).
        "stream_options": {"include_usage": True},
    }
    if options.model is not None:
        body["model"] = options.model
    if options.ignore_eos:
        body["ignore_eos"] = True
    if prompt.seed is not None:
        body["seed"] = prompt.seed
    if prompt.slo_class is not None and options.send_slo_class:
        body["slo_class"] = prompt.slo_class
    endpoint = prompt.endpoint or options.endpoint
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
        return CHAT_PATH, body
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}: use 'completions' or 'chat'")
    body["prompt"] = prompt.prompt
    return COMPLETIONS_PATH, body


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, None for anything else (blank lines, comments, events)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text in a completions or chat chunk ('' for role-only or usage-only chunks)."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            parts.append(text)
    return "".join(parts)


def openai_error_message(payload: Any) -> str | None:
    """The message of an OpenAI-style error object ``{"error": {"message": ...}}``; None if absent."""
    err = payload.get("error", payload) if isinstance(payload, dict) else None
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    return err if isinstance(err, str) else None


def error_reason(status_code: int, body: bytes) -> str:
    """'HTTP <status>: <message>' from an OpenAI-style error body (the raw body text otherwise)."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        message = openai_error_message(json.loads(text)) or text
    except ValueError:
        message = text
    return f"HTTP {status_code}: {message[:500]}"


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult) -> None:
    """Send the request and fill ``result`` as chunks arrive (success only once [DONE] is seen)."""
    sent = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = error_reason(response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data is None or not data:
                continue
            if data == "[DONE]":
                result.e2e_s = time.perf_counter() - sent
                result.success = True
                return
            now = time.perf_counter() - sent
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"SSE data is not a JSON object: {data[:200]}")
            if chunk.get("error"):
                result.error = f"stream error: {openai_error_message(chunk) or data[:500]}"
                return
            if chunk_text(chunk):
                result.chunk_offsets_s.append(now)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                result.output_tokens = usage.get("completion_tokens")
                result.prompt_tokens = usage.get("prompt_tokens")
    result.error = "stream ended without [DONE]"


async def send_request(
    client: httpx.AsyncClient, base_url: str, prompt: Prompt, options: RequestOptions
) -> RequestResult:
    """Run one streaming request to completion; never raises for server or network faults.

    A failure is recorded in ``result.error`` (HTTP status + message, stream errors, timeouts) and
    ``result.success`` stays False. A successful stream without any content or usage chunk is a
    failure too, because TTFT and the token count would be undefined.
    """
    path, body = build_payload(prompt, options)
    result = RequestResult(prompt_id=prompt.id, slo_class=prompt.slo_class)
    try:
        # wait_for bounds the whole request: httpx's own timeout is per read, and a server that
        # trickles chunks forever would never trip it.
        await asyncio.wait_for(_stream(client, base_url + path, body, result), options.request_timeout_s)
    except TimeoutError:
        result.success, result.error = False, f"timeout after {options.request_timeout_s:g} s"
    except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: malformed chunk
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    if result.success and not result.chunk_offsets_s:
        result.success, result.error = False, "no content chunks received"
    elif result.success and result.output_tokens is None:
        result.success, result.error = False, "no usage chunk received (stream_options.include_usage)"
    return result


async def fetch_text(client: httpx.AsyncClient, url: str, timeout_s: float = 10.0) -> str | None:
    """GET ``url`` as text; None on any error or non-200 status (callers report 'n/a')."""
    try:
        response = await client.get(url, timeout=timeout_s)
    except (httpx.HTTPError, OSError):
        return None
    return response.text if response.status_code == 200 else None


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id listed by ``GET /v1/models``; None if the server does not list any."""
    text = await fetch_text(client, base_url + "/v1/models")
    try:
        data = json.loads(text) if text else {}
        return str(data["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
