"""Who may call the HTTP API: vLLM's ``--api-key`` and its CORS options (``--allowed-origins`` ...).

With an API key (``http.api_key`` or ``$SPECMOE_API_KEY``, :meth:`HttpConfig.resolved_api_key`),
every ``/v1`` route, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer <key>``, else a
401 in OpenAI's error shape (``code: invalid_api_key``). As in vLLM, ``/health``, ``/metrics``
and ``/version`` stay open (probes and scrapers carry no key) and so does a CORS preflight
(``OPTIONS``); unlike vLLM, ``/tokenize`` and ``/detokenize`` need the key too. The key is kept
only as its SHA-256 digest and compared in constant time; neither it nor what a client sent
appears in a response or a log line.

With ``http.allowed_origins``, Starlette's own CORSMiddleware answers browsers, outside the key
check so that a 401 carries the CORS headers a browser needs to read it.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from actors.config import HttpConfig
from actors.http_errors import error_response

PROTECTED_EXACT = ("/v1", "/tokenize", "/detokenize")


def is_protected(path: str) -> bool:
    """Whether a request to ``path`` needs the API key: ``/v1`` and below, ``/tokenize``, ``/detokenize``."""
    return path in PROTECTED_EXACT or path.startswith("/v1/")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeyMiddleware:
    """Pure ASGI middleware: refuses a protected request without the right bearer key (401).

    Args:
        app: the application it guards.
        key_digest: SHA-256 of the key (the key itself is never held here).
    """

    def __init__(self, app: ASGIApp, key_digest: bytes) -> None:
        self.app, self.key_digest = app, key_digest

    def authorized(self, headers: Headers) -> bool:
        """Whether ``Authorization`` is ``Bearer <the key>`` (scheme case-insensitive, constant time)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self.key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = Headers(scope=scope)
        if is_protected(path) and not self.authorized(headers):
            sent = "authorization" in headers
            message = ("Incorrect API key provided" if sent else
                       "Missing API key: send the header 'Authorization: Bearer <your API key>'")
            response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class GuardedApp:
    """The ingress's app inside the API key check and CORS middleware that ``http`` asks for.

    A wrapper rather than ``app.add_middleware``: the app is one object per process (Serve's
    frozen copy), which must not collect middleware once per deployment instance. Serve registers
    its 503 handlers through :meth:`add_exception_handler`, which reaches the app itself.
    """

    def __init__(self, app: FastAPI, http: HttpConfig) -> None:
        self.app = app
        asgi: ASGIApp = app
        key = http.resolved_api_key()
        if key is not None:
            asgi = ApiKeyMiddleware(asgi, key_digest=_digest(key))
        if http.allowed_origins is not None:  # outermost, so that 401s carry CORS headers too
            asgi = CORSMiddleware(asgi, allow_origins=list(http.allowed_origins),
                                  allow_methods=list(http.allowed_methods), allow_headers=list(http.allowed_headers),
                                  allow_credentials=http.allow_credentials)
        self._asgi = asgi

    def add_exception_handler(self, exc_class_or_status_code, handler) -> None:
        self.app.add_exception_handler(exc_class_or_status_code, handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)
