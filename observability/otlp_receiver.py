"""A real OTLP/HTTP trace receiver (tests and benchmarks): ``http.server`` on 127.0.0.1 in a thread.

Accepts ``POST /v1/traces`` (binary protobuf, optionally gzip/deflate ``Content-Encoding``),
decodes it as ``ExportTraceServiceRequest`` and stores one flat ``ReceivedSpan`` per span.
``delay_s`` makes it a slow collector (each request waits before answering) and
``status_code`` makes it answer with an error (e.g. 503); both can be changed while running.

    with OtlpReceiver() as rx:
        setup_tracing("test", TracingConfig(endpoint=rx.endpoint))
        ...
        spans = rx.wait_for_spans(1, timeout_s=5)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    """One decoded span; ids are lowercase hex ('' for no parent)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_time_ns: int
    end_time_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (trace_id, span_id, attrs)


def any_value(v) -> Any:
    """Python value of an OTLP ``AnyValue``."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def flatten(req: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """All spans of an export request with their resource attributes attached."""
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    name=s.name, kind=s.kind, start_time_ns=s.start_time_unix_nano,
                    end_time_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes), resource=resource,
                    status_code=s.status.code,
                    events=[(e.name, _attrs(e.attributes)) for e in s.events],
                    links=[(lk.trace_id.hex(), lk.span_id.hex(), _attrs(lk.attributes)) for lk in s.links],
                ))
    return out


class OtlpReceiver:
    """OTLP/HTTP receiver on a random free port of 127.0.0.1.

    Args:
        delay_s: seconds each request waits before being answered (slow collector).
        status_code: HTTP status answered; 200 stores the spans, anything else drops them.
    """

    def __init__(self, delay_s: float = 0.0, status_code: int = 200) -> None:
        self.delay_s = delay_s
        self.status_code = status_code
        self.spans: list[ReceivedSpan] = []
        self.num_requests = 0
        self.errors: list[str] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                receiver._handle(self)

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a delayed handler must not hold up stop()
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"  # base URL; traces at endpoint + /v1/traces
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="otlp-receiver", daemon=True)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length", 0)))
        with self._cond:
            self.num_requests += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if h.path != "/v1/traces":
            return self._reply(h, 404, b"")
        if self.status_code != 200:
            return self._reply(h, self.status_code, b"")
        try:
            encoding = (h.headers.get("Content-Encoding") or "").lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            spans = flatten(req)
        except Exception as e:  # a malformed export is a test failure: keep it for assertions
            with self._cond:
                self.errors.append(repr(e))
            return self._reply(h, 400, b"")
        with self._cond:
            self.spans.extend(spans)
            self._cond.notify_all()
        self._reply(h, 200, ExportTraceServiceResponse().SerializeToString())

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, payload: bytes) -> None:
        try:
            h.send_response(code)
            h.send_header("Content-Type", "application/x-protobuf")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
        except OSError:  # the client gave up (timeout) while we were delaying
            pass

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for_spans(self, n: int, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """Block until at least ``n`` spans arrived (or the timeout); returns a copy of all."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.spans) < n and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return list(self.spans)

    def by_name(self, name: str) -> list[ReceivedSpan]:
        with self._cond:
            return [s for s in self.spans if s.name == name]


def unused_port() -> int:
    """A localhost port with nothing listening (bound then released; fine for a test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
