"""The serve application's YAML schema (msgspec Structs: errors name the field path)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from actors.api_key import ApiKeyHolder
from actors.expert_config import ExpertPoolConfig, check_actor_resources, require, require_finite
from engine.args import EngineArgs
from observability.tracing import TracingConfig


class DraftActorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Resources of each verifier replica's draft actor (``draft`` in the serve config). There is
    no replica count: the draft actor is part of its verifier's serving unit, one per verifier
    replica, so ``verifier.num_replicas`` scales both.

    Attributes:
        call_timeout_s: longest wait for one proposal (a draft call takes milliseconds, a long
            prompt's catch-up tens); past it the step runs without speculation and the actor is
            re-created. A (re-)started actor's first call may take up to 30 s (its warm-up), and
            until a re-created actor is up steps run without speculation.
    """

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    call_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        check_actor_resources({}, num_cpus=self.num_cpus, num_gpus=self.num_gpus)
        require_finite("draft.call_timeout_s", self.call_timeout_s, 0)


class DeploymentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Ray Serve options of one deployment (a Serve config file's ``deployments[]`` override them).

    Attributes:
        graceful_shutdown_timeout_s: how long a replica being removed (scale-down, redeploy) may
            finish its requests before Serve kills it. Shutting the server down ends streams first
            (a drain), so this bound does not add to the exit time.
        graceful_shutdown_wait_loop_s: how often a stopping replica checks for finished requests
            (Serve's default of 2 s would add up to 2 s to every exit).
        resources: custom Ray resources each replica asks for (e.g. pin the ingress to nodes
            that advertise ``{ingress: 1}``).
        health_check_period_s, health_check_timeout_s: Serve's health checks (3 failures in a row
            replace a replica); a hung verifier served nothing for 125 s at Serve's 10 s and 30 s, 46 s at these.
    """

    num_replicas: int = 1
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256
    graceful_shutdown_timeout_s: float = 20.0
    graceful_shutdown_wait_loop_s: float = 0.2
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        require(self.num_replicas >= 1, "num_replicas", ">= 1", self.num_replicas)
        for name in ("health_check_period_s", "health_check_timeout_s"):
            require_finite(name, getattr(self, name), 0)
        check_actor_resources(self.resources, num_cpus=self.num_cpus, num_gpus=self.num_gpus)
        require(self.max_ongoing_requests >= 1, "max_ongoing_requests", ">= 1", self.max_ongoing_requests)
        require_finite("graceful_shutdown_timeout_s", self.graceful_shutdown_timeout_s, 0, strict=False)
        require_finite("graceful_shutdown_wait_loop_s", self.graceful_shutdown_wait_loop_s, 0)


_Text = Annotated[str, msgspec.Meta(min_length=1)]
_CORS_DEFAULTS = {"allowed_methods": ("*",), "allowed_headers": ("*",), "allow_credentials": False}


class HttpConfig(ApiKeyHolder, msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Where Serve's HTTP proxies listen (``serve_app.py`` only; a Serve config file has its own
    ``http_options``/``proxy_location``), and who may call the API (``actors/http_access.py``).

    Attributes:
        proxy_location: Serve's ``EveryNode`` (a proxy on every node with a replica) or
            ``HeadOnly`` (several Ray nodes on one machine would all bind the same port).
        api_key: vLLM's ``--api-key`` (else ``$SPECMOE_API_KEY``; never in a repr, see
            ``actors/api_key.py``). allowed_origins (None: no
            CORS), allowed_methods, allowed_headers, allow_credentials: vLLM's CORS options.
    """

    host: _Text = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    api_key: _Text | None = None
    allowed_origins: tuple[_Text, ...] | None = None
    allowed_methods: tuple[_Text, ...] = ("*",)
    allowed_headers: tuple[_Text, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        """Raises ValueError for a CORS option set without ``allowed_origins`` (no CORS then)."""
        for name, default in _CORS_DEFAULTS.items():
            require(self.allowed_origins is not None or getattr(self, name) == default, name,
                     f"left at its default {default!r} unless allowed_origins is set (no CORS without it)",
                     getattr(self, name))

class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Top-level config of ``serve_app.py`` (see ``configs/embedded.yaml``).

    Attributes:
        model_name: the name clients pass as ``model`` (and the metrics' model_name label).
        engine: target/draft checkpoints, speculation and scheduler settings.
        experts: expert actor pool.
        verifier, ingress: deployment options.
        draft: resources of each verifier replica's draft actor (:class:`DraftActorConfig`).
        http: where the HTTP proxy listens.
        request_timeout_s: a request still running this long after it arrived is cancelled (its KV
            slots freed): a 504 in OpenAI's error shape, or an error chunk and ``[DONE]`` when its
            stream has already started.
        body_timeout_s: a request body not all received this long after the ingress started reading
            it gets 408 (a stalled client held an ingress slot for as long as it kept its connection).
        verifier_start_timeout_s: longest engine build (weights, draft actor) of a verifier replica.
        engine_step_timeout_s: a step running longer than this fails the replica's health check
            (Serve then replaces the replica).
        stream_batching_interval_ms: a streamed request's tokens after its first go out at most
            once per this many milliseconds, each chunk with what the engine emitted since the last
            (0: each engine step as its own chunk, as soon as the ingress takes it). Ray Serve LLM's
            ``stream_batching_interval_ms`` (50 ms by default there): every chunk wakes the
            verifier's event loop, the ingress and the HTTP proxy, CPU the engine thread needs.
            At most every SLO class's ``itl_ms``, so batching alone never breaks an ITL budget
            (a class with only ``tpot_ms`` is not checked: TPOT is a mean over the request,
            which batching does not change). A one-token step is held too; with ``n`` > 1 each
            interval sends one chunk per choice. Server-side ITL and TPOT metrics keep each
            step's own emission time, a lone held step's included.
        serve_transport: how Ray Serve carries requests and stream items from the HTTP proxy to
            the ingress and from the ingress to the verifier. ``grpc`` (default): Serve's gRPC
            transport between replicas (one of the pieces of its throughput-optimized mode); the
            ingress's verifier handle is by value (``_by_reference=False``) and ``serve_app.py``
            starts Ray with ``RAY_SERVE_PROXY_USE_GRPC=1`` for the proxy (on a cluster started
            elsewhere, that variable belongs in the Ray nodes' environment). ``actor_calls``:
            Serve's default, Ray actor calls with results as object refs. Measured in
            docs/TRANSPORT.md (concurrency 8: ~10-25 % more output tokens/s with ``grpc``).
        draft_transport: how the engine thread reaches its draft actor each step.
            ``compiled_graph`` (default): a compiled graph with the ``experts`` section's graph
            settings (~0.1-0.5 ms a hop). ``actor_calls``: a plain actor call (~1.5-2 ms), and
            no draft actor polling for work: a graph's idle reader spins (``sched_yield``), and
            with the expert actor's reader and the engine thread's own wait that is one spinner
            more than a 2-core machine has cores (docs/TRANSPORT.md, "Draft transport").
        tracing: OpenTelemetry settings (see :mod:`observability.tracing`); None = environment only.
    """

    model_name: Annotated[str, msgspec.Meta(min_length=1)]
    engine: EngineArgs
    experts: ExpertPoolConfig = msgspec.field(default_factory=ExpertPoolConfig)
    verifier: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    draft: DraftActorConfig = msgspec.field(default_factory=DraftActorConfig)
    ingress: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    request_timeout_s: float = 600.0
    body_timeout_s: float = 10.0
    verifier_start_timeout_s: float = 300.0
    engine_step_timeout_s: float = 60.0
    stream_batching_interval_ms: float = 0.0
    serve_transport: Literal["grpc", "actor_calls"] = "grpc"
    draft_transport: Literal["compiled_graph", "actor_calls"] = "compiled_graph"
    tracing: TracingConfig | None = None

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "body_timeout_s", "verifier_start_timeout_s", "engine_step_timeout_s"):
            require_finite(name, getattr(self, name), 0)
        interval_ms = self.stream_batching_interval_ms
        require(interval_ms >= 0, "stream_batching_interval_ms", ">= 0", interval_ms)
        # .inf would hold a stream's tokens until it ends: that is stream=false, not batching.
        require(math.isfinite(interval_ms), "stream_batching_interval_ms", "finite", interval_ms)
        for name, slo in self.engine.scheduler.slo_classes.items():
            if slo.itl_ms:
                require(interval_ms <= slo.itl_ms, "stream_batching_interval_ms",
                         f"<= engine.scheduler.slo_classes.{name}.itl_ms ({slo.itl_ms:g})", interval_ms)
