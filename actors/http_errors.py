"""HTTP errors in OpenAI's shape: statuses the ingress answers, the failure of a request, the
request body read within its size limit."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from actors.openai_protocol import ProtocolError
from actors.responses import error_body

MAX_BODY_BYTES = 4 * 1024 * 1024  # larger bodies get 413 before any parsing or tokenizing
ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 408: "timeout", 413: "invalid_request_error",
               503: "server_overloaded", 504: "timeout", 500: "internal_error"}
RETRY_AFTER_S = {503: 1}  # Retry-After of a full queue or a shutting-down replica
UNAVAILABLE_RETRY_AFTER_S = 5  # while the verifier is gone: about a replica restart
# A request's span status when its client left before the request was read (nginx's 499): not a
# finished request (no engine request was made), not a server error.
CLIENT_CLOSED_REQUEST = 499


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """A JSON response of ``status`` in OpenAI's error shape."""
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
        return error_response(self.status, self.message, self.param, self.code, headers=self.headers)

    def chunk(self) -> dict:
        """The in-band error of a stream whose 200 is already sent."""
        return error_body(self.message, ERROR_TYPES.get(self.status, "internal_error"), self.param, self.status)


def verifier_gone(e: BaseException) -> bool:
    """The verifier replica died or cannot be reached (not a bug in a request)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return isinstance(e, (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError))


def raise_if_engine_failed(finish_reasons) -> None:
    """A choice the engine failed (finish_reason "error": e.g. a step that sampled no token) fails
    the request: a 500 body, or in a stream the error chunk after that choice's last chunk.

    Raises:
        RequestFailed: 500, when ``finish_reasons`` holds "error".
    """
    if "error" in finish_reasons:
        raise RequestFailed(500, "the engine failed this request (the server log says why)")


def failure(e: BaseException, timeout_s: float) -> RequestFailed:
    """What the client gets for ``e``: 504 past ``timeout_s``, 503 while the verifier is gone, else
    500 (a :class:`RequestFailed` as it is)."""
    if isinstance(e, RequestFailed):
        return e
    if isinstance(e, asyncio.TimeoutError):
        return RequestFailed(504, f"the request did not finish within request_timeout_s = {timeout_s:g} s")
    if verifier_gone(e):
        return RequestFailed(503, f"the model server is unavailable ({type(e).__name__}); retry shortly",
                             UNAVAILABLE_RETRY_AFTER_S)
    return RequestFailed(500, f"internal error: {type(e).__name__}")


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The request body, refused (413) once it is known to exceed :data:`MAX_BODY_BYTES`: from
    its ``Content-Length`` before reading, else while it streams in (nothing larger is kept); and
    refused (408) when it has not all arrived within ``timeout_s`` seconds. Without the deadline
    a client that sent headers and part of a body held one of the ingress's in-flight slots for as
    long as it kept the connection open, and 260 such connections stopped the server (``/health``
    included) until they closed (a slowloris trial, 2026-12-06). A body declared as anything but
    JSON (``Content-Type`` other than ``application/json`` or ``*/*+json``; none is taken as JSON)
    gets 415 before it is read, as FastAPI's JSON bodies (vLLM's) refuse it: a form-encoded
    ``curl -d`` was parsed as JSON and answered, and a ``text/plain`` POST is one that any web page
    can send cross-site without a CORS preflight.

    Raises:
        ProtocolError: 415, 413 or 408 as above.
    """
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise ProtocolError(f"Content-Type {content_type!r} is not JSON: send the body as application/json",
                            status=415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ProtocolError(f"request body of {declared} bytes exceeds {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ProtocolError(f"request body of more than {MAX_BODY_BYTES} bytes", status=413)
                chunks.append(chunk)
    except TimeoutError:
        raise ProtocolError(f"the request body did not arrive within body_timeout_s = {timeout_s:g} s "
                            f"({size} bytes came)", status=408) from None
    return b"".join(chunks)
