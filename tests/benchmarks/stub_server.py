"""A scripted OpenAI-compatible streaming server for testing the serving benchmark.

Raw asyncio HTTP/1.1 (one request per connection), so chunk timing is under the test's control:
for a prompt whose text is a key of ``SCRIPTS``, the first content chunk is sent ``ttft_ms`` after
the request arrived and each later one after the scripted gap (scaled by ``itl_scale``), measured
from the request's arrival so sleeps do not accumulate drift. Then a usage chunk and ``[DONE]``.
Chat streams also start with a role-only chunk at once, which must not count as the first token.

Every stream's arrival and content-chunk send times (``time.perf_counter()``, the client's clock:
both run in one process) are logged in ``StubServer.streams``, so tests compare what the client
measured with what the stub actually did, not with a sleep that a loaded machine may overshoot.

``/metrics`` exposes specmoe spec-decode counters (prometheus_client text) that each successful
request increments by its scripted amounts just before its usage chunk.

Run standalone (for sweep tests): ``python -m tests.benchmarks.stub_server --port 8123``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, generate_latest

TTFT_MS = 100.0
MODEL = "stub-model"


@dataclass(frozen=True)
class Script:
    """What the stub does for one prompt. Gaps in ms after the first content chunk; tokens per chunk."""

    chunk_gaps_ms: tuple[float, ...] = ()
    chunk_tokens: tuple[int, ...] = (1,)
    prompt_tokens: int = 1
    engine: str = "0"  # label of the spec-decode counters this request increments
    drafts: int = 0
    draft_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()  # accepted tokens = their sum
    fail_status: int | None = None  # answer with this HTTP status and an OpenAI error body
    fail_message: str = ""
    mid_stream_error: str | None = None  # after the first chunk, send an error event instead
    raw_event: str | None = None  # after the first chunk, send this (malformed) data instead
    truncate: bool = False  # after the first chunk, end the body cleanly but without usage or [DONE]
    stall_s: float = 0.0  # sleep before anything is sent (timeouts)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)


SCRIPTS: dict[str, Script] = {
    # 5 chunks, one carrying 2 tokens (as speculative decoding does): 6 tokens.
    "alpha": Script((20, 20, 40, 20), (1, 2, 1, 1, 1), 11, "0", 4, 12, (3, 1, 1)),
    "beta": Script((40, 40), (1, 1, 1), 7, "1", 2, 6, (1, 0, 0)),
    "gamma": Script((), (1,), 5, "0", 1, 3, (0, 0, 0)),  # one token: no TPOT
    "delta": Script((20, 20, 20, 20, 20), (2, 1, 2, 1, 1, 1), 13, "1", 5, 15, (4, 2, 0)),
    "fail": Script(fail_status=400, fail_message="scripted failure: prompt is too long"),
    "broken": Script((20,), (1, 1), mid_stream_error="scripted mid-stream failure"),
    "garbage": Script((20,), (1, 1), raw_event="{not json"),
    "truncated": Script((20,), (1, 1), truncate=True),
    "stall": Script(stall_s=5.0),
}


class SpecCounters:
    """The spec-decode counters, named as specmoe exposes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["engine"]
        self.drafts = Counter("specmoe:spec_decode_num_drafts", "drafts", labels, registry=self.registry)
        self.draft_tokens = Counter(
            "specmoe:spec_decode_num_draft_tokens", "d", labels, registry=self.registry
        )
        self.accepted = Counter(
            "specmoe:spec_decode_num_accepted_tokens", "a", labels, registry=self.registry
        )
        self.per_pos = Counter(
            "specmoe:spec_decode_num_accepted_tokens_per_pos",
            "p",
            labels + ["position"],
            registry=self.registry,
        )
        # An unrelated metric, which the parser must ignore.
        Counter("specmoe:request_success", "ok", registry=self.registry).inc(3)

    def record(self, s: Script) -> None:
        self.drafts.labels(s.engine).inc(s.drafts)
        self.draft_tokens.labels(s.engine).inc(s.draft_tokens)
        self.accepted.labels(s.engine).inc(sum(s.accepted_per_pos))
        for pos, n in enumerate(s.accepted_per_pos):
            self.per_pos.labels(s.engine, str(pos)).inc(n)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


@dataclass
class StreamLog:
    """One served stream, times in ``time.perf_counter()`` seconds: arrival, each content chunk's
    send, and the send of ``[DONE]`` (None if the stream ended otherwise)."""

    prompt: str
    arrived_s: float
    chunk_sent_s: list[float] = field(default_factory=list)
    done_sent_s: float | None = None


@dataclass
class StubConfig:
    ttft_ms: float = TTFT_MS
    itl_scale: float = 1.0
    spec_metrics: bool = True  # False: /metrics has no spec-decode counters (speculation off)
    metrics_status: int = 200  # e.g. 404: a server without /metrics
    requests: list[dict] = field(default_factory=list)  # bodies received on /v1/*


def _response_head(status: int, content_type: str, extra: str = "") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    return f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{extra}Connection: close\r\n\r\n".encode()


async def _send_body(writer: asyncio.StreamWriter, status: int, content_type: str, body: str) -> None:
    data = body.encode()
    writer.write(_response_head(status, content_type, f"Content-Length: {len(data)}\r\n") + data)
    await writer.drain()


async def _send_event(writer: asyncio.StreamWriter, payload: str) -> None:
    """One SSE event as one HTTP chunk, flushed at once."""
    data = f"data: {payload}\n\n".encode()
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


def _chunk(chat: bool, text: str | None, usage: dict | None = None, role: bool = False) -> str:
    if usage is not None:
        choices = []
    elif chat:
        choices = [{"index": 0, "delta": {"role": "assistant", "content": ""} if role else {"content": text}}]
    else:
        choices = [{"index": 0, "text": text}]
    return json.dumps({"id": "cmpl-stub", "model": MODEL, "choices": choices, "usage": usage})


class StubServer:
    """The scripted server on 127.0.0.1; ``start()`` runs it in a daemon thread with its own loop."""

    def __init__(self, config: StubConfig | None = None, port: int = 0) -> None:
        self.config = config or StubConfig()
        self.counters = SpecCounters()
        self.port = port
        self.streams: list[StreamLog] = []  # in arrival order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrived = time.perf_counter()  # one clock for the schedule and the log
        try:
            method, target, _ = (await reader.readline()).decode().split(" ", 2)
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                key, value = line.decode().split(":", 1)
                headers[key.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            await self._route(method, target.split("?")[0], body, writer, arrived)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, writer, arrived: float) -> None:
        if path == "/health":
            return await _send_body(writer, 200, "text/plain", "ok")
        if path == "/v1/models":
            return await _send_body(writer, 200, "application/json", json.dumps({"data": [{"id": MODEL}]}))
        if path == "/metrics":
            text = self.counters.text() if self.config.spec_metrics else "# no spec decode\n"
            return await _send_body(writer, self.config.metrics_status, "text/plain", text)
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            request = json.loads(body)
            self.config.requests.append(request)
            return await self._stream(request, path.endswith("chat/completions"), writer, arrived)
        await _send_body(writer, 404, "application/json", json.dumps({"error": {"message": "not found"}}))

    async def _stream(self, request: dict, chat: bool, writer, arrived: float) -> None:
        prompt = request["messages"][-1]["content"] if chat else request["prompt"]
        script = SCRIPTS[prompt]
        log = StreamLog(prompt, arrived)
        self.streams.append(log)
        await asyncio.sleep(script.stall_s)
        if script.fail_status is not None:
            error = {
                "error": {
                    "message": script.fail_message,
                    "type": "BadRequestError",
                    "code": script.fail_status,
                }
            }
            return await _send_body(writer, script.fail_status, "application/json", json.dumps(error))
        writer.write(_response_head(200, "text/event-stream", "Transfer-Encoding: chunked\r\n"))
        if chat:
            await _send_event(writer, _chunk(chat, None, role=True))
        due_s = arrived + self.config.ttft_ms / 1e3
        gaps_ms = (0.0,) + tuple(script.chunk_gaps_ms)
        for i, (gap_ms, tokens) in enumerate(zip(gaps_ms, script.chunk_tokens, strict=True)):
            due_s += gap_ms * self.config.itl_scale / 1e3
            await asyncio.sleep(max(0.0, due_s - time.perf_counter()))
            if i == 1 and script.mid_stream_error:
                return await _send_event(writer, json.dumps({"error": {"message": script.mid_stream_error}}))
            if i == 1 and script.raw_event is not None:
                return await _send_event(writer, script.raw_event)
            if i == 1 and script.truncate:
                writer.write(b"0\r\n\r\n")
                return await writer.drain()
            log.chunk_sent_s.append(time.perf_counter())
            await _send_event(writer, _chunk(chat, "tok" * tokens))
        self.counters.record(script)
        usage = {
            "prompt_tokens": script.prompt_tokens,
            "completion_tokens": script.output_tokens,
            "total_tokens": script.prompt_tokens + script.output_tokens,
        }
        await _send_event(writer, _chunk(chat, None, usage=usage))
        log.done_sent_s = time.perf_counter()
        await _send_event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def serve(self, ready: threading.Event | None = None) -> None:
        """Listen until ``stop()``; ``ready`` is set once ``self.port`` is known."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = server.sockets[0].getsockname()[1]
        if ready is not None:
            ready.set()
        await self._stop.wait()
        # Close the listener only: handlers still sleeping (a stalled request) are cancelled by
        # asyncio.run on exit instead of being waited for.
        server.close()

    def start(self) -> StubServer:
        """Serve from a daemon thread with its own event loop; returns once the port is bound."""
        ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.serve(ready)), name="stub-openai-server", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout=10):
            raise RuntimeError("stub server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--itl-scale", type=float, default=1.0)
    p.add_argument("--ttft-ms", type=float, default=TTFT_MS)
    args = p.parse_args()
    asyncio.run(StubServer(StubConfig(ttft_ms=args.ttft_ms, itl_scale=args.itl_scale), args.port).serve())


if __name__ == "__main__":
    main()
