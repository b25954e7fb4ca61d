"""Ray Serve deployments: thin wrappers that give the servers in actors/ their Serve options.

No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class.
"""


import msgspec
from fastapi import Request
from ray import serve
from ray.serve.exceptions import RayServeException

from actors.config import ServeConfig
from actors.http_access import GuardedApp
from actors.ingress import IngressServer, app
from actors.metrics_hub import HubRef, MetricsPublisher, scrape_pages
from actors.verifier import VerifierServer
from observability.tracing import SERVICE_VERSION


def _publish(config: ServeConfig, render) -> MetricsPublisher | None:
    """This replica's metrics in every scrape of ``/metrics`` (``actors/metrics_hub.py``), named
    ``<deployment>-<replica id>``; None outside a Serve replica (a test driving the class alone).
    Serve runs a replica's constructor on its event loop."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return None
    hub = HubRef(config.experts.namespace, context.app_name, create=context.deployment == "ingress")
    publisher = MetricsPublisher(f"{context.deployment}-{context.replica_id.unique_id}", render, hub)
    publisher.start()
    return publisher


@serve.deployment(name="verifier")
class VerifierDeployment(VerifierServer):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.metrics_publisher = _publish(self.config, self.metrics_bytes)

    async def metrics_text(self) -> bytes:
        return await self.metrics_bytes()

    def __del__(self) -> None:
        # Serve calls this on replica shutdown (a downscale, a redeploy): out of the metrics pages now.
        if getattr(self, "metrics_publisher", None) is not None:
            self.metrics_publisher.stop()
        super().__del__()


@serve.deployment(name="ingress")
@serve.ingress(app)
class IngressDeployment:
    def __init__(self, config: dict, verifier) -> None:
        self.server = IngressServer(msgspec.convert(config, ServeConfig), verifier)
        self.metrics_publisher = _publish(self.server.config, self.server.own_metrics)

    def __del__(self) -> None:
        # Serve calls this on replica shutdown, after the ASGI app's own: out of the metrics pages now.
        if getattr(self, "metrics_publisher", None) is not None:
            self.metrics_publisher.stop()

    def __serve_build_asgi_app__(self):
        """Serve's hook, called in the replica after ``__init__`` and before the app serves: the
        app inside the config's API key check and CORS (``actors/http_access.py``)."""
        return GuardedApp(self.app, self.server.config.http)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.server.chat_completions(request)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self.server.tokenizer_routes.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self.server.tokenizer_routes.detokenize(request)

    @app.get("/v1/models")
    async def models(self):
        return await self.server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        return await self.server.model(model_id)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health(self):
        return await self.server.health()

    @app.get("/metrics")
    async def metrics(self):
        publisher = self.metrics_publisher
        pages = await scrape_pages(publisher.hub) if publisher is not None else None
        return await self.server.metrics_text(pages)

    @app.get("/version")  # vLLM's; open with an API key too, as in vLLM (actors/http_access.py)
    async def version(self):
        return {"version": SERVICE_VERSION}


def _options(d) -> dict:
    return dict(num_replicas=d.num_replicas, max_ongoing_requests=d.max_ongoing_requests,
                graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
                graceful_shutdown_wait_loop_s=d.graceful_shutdown_wait_loop_s,
                health_check_period_s=d.health_check_period_s, health_check_timeout_s=d.health_check_timeout_s,
                ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus, "resources": dict(d.resources)})


def build_app(config: ServeConfig):
    """The bound application: ingress -> verifier (each verifier replica makes its serving unit's
    draft actor and expert actors)."""
    cfg = msgspec.to_builtins(config)
    verifier = VerifierDeployment.options(**_options(config.verifier)).bind(cfg)
    return IngressDeployment.options(**_options(config.ingress)).bind(cfg, verifier)
