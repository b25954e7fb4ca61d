"""vLLM's --api-key and CORS options on the ingress deployment's own app (its routes and its
``__serve_build_asgi_app__``, driven without Ray): 401 in OpenAI's shape for the /v1 routes,
/tokenize and /detokenize without the key, /health, /metrics and /version open, the key never in a
response or a log line; CORS headers only with http.allowed_origins."""

import asyncio
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from ray import serve

from actors.deployments import IngressDeployment
from tests.actors.conftest import DRAFT, MODEL_NAME, TARGET
from tests.actors.test_ingress_failures import FakeStream, FakeVerifier, _step

# The deployment class's __del__ is a coroutine (Serve awaits it); garbage collection here cannot.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited:RuntimeWarning")
KEY = "sk-test-0123456789"
ORIGIN = "https://app.example"


def _requests(http: dict, requests: list[tuple[str, str, dict]], monkeypatch, verifier=None) -> list:
    """The responses of the ingress deployment (built as Serve builds it) to ``(method, path,
    headers)`` requests (POST bodies: a small completion / tokenize request)."""
    verifier = verifier or FakeVerifier()
    cls = IngressDeployment.func_or_class

    async def run():
        deployment = cls.__new__(cls)
        await deployment.__init__({"model_name": MODEL_NAME, "engine": {"model": TARGET, "draft_model": DRAFT},
                                   "http": http}, verifier)
        # the class-based routes find their instance through Serve's replica context
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=deployment))
        app = deployment.__serve_build_asgi_app__()
        bodies = {"/v1/completions": {"prompt": "x", "max_tokens": 1}, "/tokenize": {"prompt": "x"},
                  "/detokenize": {"tokens": [5]}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.request(method, path, headers=headers,
                                         json=bodies.get(path) if method == "POST" else None)
                    for method, path, headers in requests]

    return asyncio.run(run())


def _finishing_verifier(n: int) -> FakeVerifier:
    verifier = FakeVerifier()
    verifier.streams = [FakeStream([{"type": "accepted"}, _step("a", finish="length")]) for _ in range(n)]
    return verifier


PROTECTED = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}"), ("POST", "/v1/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize")]


def test_without_a_key_every_route_is_open_and_no_cors_headers(monkeypatch):
    responses = _requests({}, [(m, p, {"Origin": ORIGIN}) for m, p in PROTECTED], monkeypatch, _finishing_verifier(1))
    assert [r.status_code for r in responses] == [200] * 5
    assert not any(k.startswith("access-control-") for r in responses for k in r.headers)


@pytest.mark.parametrize("source", ["config", "env"])
def test_with_a_key_the_v1_and_tokenizer_routes_need_it(monkeypatch, caplog, source):
    http = {"api_key": KEY} if source == "config" else {}
    if source == "env":
        monkeypatch.setenv("SPECMOE_API_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    wrong = {"Authorization": "Bearer sk-wrong-key"}
    requests = ([(m, p, {}) for m, p in PROTECTED] + [(m, p, wrong) for m, p in PROTECTED]
                + [(m, p, {"Authorization": f"Bearer {KEY}"}) for m, p in PROTECTED]
                + [("GET", "/v1/models", {"Authorization": f"bearer {KEY}"}),  # the scheme in any case
                   ("GET", "/v1/models", {"Authorization": KEY}), ("GET", "/health", {}), ("GET", "/metrics", {}),
                   ("GET", "/v1/nothing-here", {}), ("GET", "/v1/nothing-here", {"Authorization": f"Bearer {KEY}"})])
    verifier = _finishing_verifier(1)
    responses = _requests(http, requests, monkeypatch, verifier)
    missing, refused, allowed = responses[:5], responses[5:10], responses[10:15]
    lower, no_scheme, health, metrics, unknown, unknown_with_key = responses[15:]
    for r in missing:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": "Missing API key: send the header 'Authorization: Bearer <your API "
                                                 "key>'", "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
    for r in refused + [no_scheme]:
        assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided"
    assert [r.status_code for r in allowed] == [200] * 5 and allowed[1].json()["id"] == MODEL_NAME
    assert len(verifier.calls) == 1  # only the authorized completion reached the verifier
    assert (lower.status_code, health.status_code, metrics.status_code) == (200, 200, 200)
    assert (unknown.status_code, unknown_with_key.status_code) == (401, 404)
    for r in responses:  # neither the key nor what a client sent comes back, nor is logged
        assert KEY not in r.text and "sk-wrong-key" not in r.text
    assert KEY not in caplog.text and "sk-wrong-key" not in caplog.text


def test_cors_with_allowed_origins_and_its_headers_on_a_401(monkeypatch):
    http = {"allowed_origins": [ORIGIN], "allow_credentials": True, "api_key": KEY}
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok, other_origin, unauthorized, pre = _requests(http, [
        ("GET", "/v1/models", {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}),
        ("GET", "/v1/models", {"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"}),
        ("GET", "/v1/models", {"Origin": ORIGIN}),
        ("OPTIONS", "/v1/chat/completions", preflight)], monkeypatch)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert other_origin.status_code == 200 and "access-control-allow-origin" not in other_origin.headers
    # a browser can read the 401 (CORS outside the key check), and a preflight needs no key
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ORIGIN
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]


def test_version_is_the_installed_packages_and_open_without_the_key(monkeypatch):
    """vLLM's ``GET /version``: ``{"version": ...}``, outside the key check as all but ``/v1`` are
    in vLLM (a probe or a dashboard asks it with no key)."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    want = re.search(r'^version = "([^"]+)"$', pyproject, re.M).group(1)
    without_key, with_key, wrong_key = _requests({"api_key": KEY}, [
        ("GET", "/version", {}), ("GET", "/version", {"Authorization": f"Bearer {KEY}"}),
        ("GET", "/version", {"Authorization": "Bearer sk-wrong-key"})], monkeypatch)
    for r in (without_key, with_key, wrong_key):
        assert (r.status_code, r.json()) == (200, {"version": want})
