"""Ray Serve deployments: thin wrappers that give the servers in actors/ their Serve options.

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class.
"""


import logging
import threading
import time

import msgspec
from fastapi import Request
from ray import serve

from actors.config import ServeConfig
from actors.ingress import IngressServer, app
from actors.verifier import VerifierServer

log = logging.getLogger(__name__)
FLUSH_S = 0.5  # after a drain: time for the ingress and proxy to send the streams' last chunks


@serve.deployment(name="verifier")
class VerifierDeployment(VerifierServer):
    async def metrics_text(self) -> bytes:
        return await self.metrics_bytes()

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's ``user_config`` hook, applied to every replica in place: ``{"draining": true}``
        ends the replica's in-flight streams with a 503 and refuses new requests (shutdown). Async,
        so it runs on the replica's event loop, where the streams' queues live."""
        if user_config.get("draining"):
            self.drain()


@serve.deployment(name="ingress")
@serve.ingress(app)
class IngressDeployment:
    def __init__(self, config: dict, verifier) -> None:
        self.server = IngressServer(msgspec.convert(config, ServeConfig), verifier)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.server.chat_completions(request)

    @app.get("/v1/models")
    async def models(self):
        return await self.server.models()

    @app.get("/health")
    async def health(self):
        return await self.server.health()

    @app.get("/metrics")
    async def metrics(self):
        return await self.server.metrics_text()


def _options(d) -> dict:
    return dict(num_replicas=d.num_replicas, max_ongoing_requests=d.max_ongoing_requests,
                graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
                graceful_shutdown_wait_loop_s=d.graceful_shutdown_wait_loop_s,
                ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus})


def build_app(config: ServeConfig, draining: bool = False):
    """The bound application: ingress -> verifier (each verifier replica makes its serving unit's
    draft actor and expert actors). ``draining`` deploys the same app with the verifiers told to
    end their streams (see :func:`drain_app`)."""
    cfg = msgspec.to_builtins(config)
    verifier = VerifierDeployment.options(**_options(config.verifier), user_config={"draining": draining}).bind(cfg)
    return IngressDeployment.options(**_options(config.ingress)).bind(cfg, verifier)


def drain_app(config: ServeConfig, app_name: str, timeout_s: float) -> bool:
    """End every in-flight stream of the running app cleanly (an error chunk and ``[DONE]``, a 503
    for a request still waiting for its first token) before Serve shuts down, which kills the HTTP
    proxies at once. Serve's broadcast to every replica is a ``user_config`` update (``reconfigure``
    on each replica in place, no restart); ``serve.run`` waits for it, so it runs on a side thread
    bounded by ``timeout_s``.

    Returns:
        True when every verifier replica acknowledged within ``timeout_s``.
    """
    def redeploy() -> None:
        try:
            serve.run(build_app(config, draining=True), name=app_name, route_prefix="/", blocking=False)
        except Exception as e:  # shutting down anyway: the streams are then cut instead
            log.warning("draining %s failed (%s: %s)", app_name, type(e).__name__, e)

    thread = threading.Thread(target=redeploy, name="specmoe-drain", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("draining %s took longer than %.1f s; shutting down anyway", app_name, timeout_s)
        return False
    time.sleep(FLUSH_S)
    return True
