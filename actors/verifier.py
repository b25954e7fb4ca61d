"""Verifier deployment: the target's non-expert weights, its KV cache, and the engine loop.

A shim over an injected engine (Ray Serve LLM's ``LLMServer`` shape): by default an
:class:`engine.engine.LLMEngine` whose MoE layers reach this replica's expert actors through
:class:`ExpertRouter` (a compiled graph, or actor calls) and whose drafter is this replica's draft
actor (:class:`RemoteDrafter`). The request loop is :class:`actors.engine_loop.EngineLoop`
(Ray-free, unit-tested alone): engine steps run in one worker thread, which also makes every hop
itself, so the event loop never blocks and never carries a hop. A request's stream lives on this
replica for the request's whole life.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import torch

from actors.config import ServeConfig
from actors.engine_loop import SHUTTING_DOWN, EngineLoop
from actors.stream_items import unavailable_item
from engine.config import context_window
from engine.engine import LLMEngine

log = logging.getLogger(__name__)


class VerifierServer:
    """Runs the continuous-batching speculative loop for requests sent by the ingress.

    Args:
        config: :class:`ServeConfig` as builtins (Serve passes plain data between processes).
        engine_factory: builds the engine on the engine thread (default: the target with this
            replica's expert actors and draft actor, :meth:`build_engine`).
    """

    def __init__(self, config: dict, engine_factory: Callable[[], LLMEngine] | None = None) -> None:
        from actors.telemetry import VerifierTelemetry
        from observability import EngineMetrics, StragglerDetector, setup_tracing

        self.config = msgspec.convert(config, ServeConfig)
        torch.set_num_threads(1)
        setup_tracing("verifier", self.config.tracing)
        self.metrics = EngineMetrics(self.config.model_name)
        self.telemetry = VerifierTelemetry()
        self.stragglers = StragglerDetector(self.config.experts.straggler_multiple,
                                            self.config.experts.straggler_floor_ms)
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.router = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._aux_executor = ThreadPoolExecutor(1, thread_name_prefix="verifier-aux")  # never the engine's
        self._start_lock = asyncio.Lock()
        self._engine_factory = engine_factory or self.build_engine
        self.pool = None
        self.draining = False
        self._in_ray = engine_factory is None  # an injected engine is a test without Ray
        if engine_factory is None:
            self._build_pool()
        self._drain_watch: asyncio.Task | None = None

    def _build_pool(self) -> None:
        from actors.expert_pool import ExpertPool
        from engine.config import load_model_config

        e, x = self.config.engine, self.config.experts
        self.tag = _replica_tag()
        target_config = load_model_config(e.model)
        self.metrics.declare_slo_classes(list(e.scheduler.slo_classes))
        self.pool = None
        if target_config.is_moe:
            tracing = msgspec.to_builtins(self.config.tracing) if self.config.tracing else None
            private = x.transport == "compiled_graph"  # an actor can be in one compiled graph only
            prefix = f"specmoe-experts-{self.tag}" if private else "specmoe-experts"
            self.pool = ExpertPool(e.model, target_config.moe.num_experts, x, e.dtype, e.device,
                                   prefix=prefix, tracing=tracing, detached=not private)
            self.pool.start()
            self.metrics.declare_experts(target_config.moe.sparse_layers, target_config.moe.num_experts)

    async def _ensure_started(self) -> None:
        """Build the engine on the engine thread, once (the first request, stats or health call),
        within ``verifier_start_timeout_s``."""
        if self.loop is not None:
            return
        async with self._start_lock:
            if self.loop is not None:
                return
            loop = asyncio.get_running_loop()
            build = loop.run_in_executor(self._executor, self._build_loaded)
            self.engine = await asyncio.wait_for(build, self.config.verifier_start_timeout_s)
            self.loop = EngineLoop(self.engine, self._executor, self.config.engine_step_timeout_s,
                                   on_change=self._sync_metrics, carriers=self.telemetry.carriers,
                                   stream_batching_interval_s=self.config.stream_batching_interval_ms / 1e3)
            if self._in_ray:
                self._watch_drain()

    def _build_loaded(self) -> LLMEngine:
        """The engine, returned only once its remote parts hold their weights: the expert actors
        (:meth:`ExpertPool.wait_loaded`) and a drafter that has them elsewhere (``wait_loaded``,
        e.g. :class:`RemoteDrafter`). Serve's initial health check awaits this build, so a replica
        whose experts are still loading is never routed a request. Engine thread.

        Raises:
            ray.exceptions.GetTimeoutError: weights not loaded within ``verifier_start_timeout_s``
                (counted from the start of the build).
        """
        deadline = time.monotonic() + self.config.verifier_start_timeout_s
        engine = self._engine_factory()
        drafter_wait = getattr(getattr(engine, "drafter", None), "wait_loaded", None)
        for wait in (self.pool.wait_loaded if self.pool else None, drafter_wait):
            if wait is not None:
                wait(max(0.0, deadline - time.monotonic()))
        return engine

    def _watch_drain(self) -> None:
        """Drain when the process that deployed the app shuts it down (``actors/cluster.py``); a
        replica that has not started its engine has no streams to end."""
        from actors.cluster import wait_for_drain

        self._drain_watch = asyncio.get_running_loop().create_task(
            wait_for_drain(self.config.experts.namespace, self.drain))

    def _sync_metrics(self, engine_metrics: dict) -> None:
        # The loop's snapshot, taken on the engine thread: reading the engine here could race a step.
        self.metrics.sync_from_engine(engine_metrics)
        if self.router is not None:  # plain counters the engine thread bumps: reading them here races nothing
            self.metrics.sync_graph_events(self.router.graph_events())

    def build_engine(self) -> LLMEngine:
        """The default engine: target with expert actors, drafter per ``engine.speculative_method``."""
        from actors.draft_server import DraftActorSpec, RemoteDrafter
        from actors.expert_router import ExpertRouter
        from actors.telemetry import RouterTelemetry
        from engine.drafters.base import NoneDrafter
        from engine.drafters.ngram import NgramDrafter
        from engine.loader import load_model, resolve_dtype
        from engine.model.eagle3 import load_eagle3_config

        e, x = self.config.engine, self.config.experts
        router = None
        if self.pool:
            router = ExpertRouter(self.pool, resolve_dtype(e.dtype), RouterTelemetry(self.metrics, self.stragglers),
                                  graph=x.transport == "compiled_graph")
        target = load_model(e.model, e.dtype, e.device, experts=router, skip_tokenizer_init=e.skip_tokenizer_init,
                            compile=e.compile)
        if e.speculative_method in ("draft", "eagle3"):
            d = self.config.draft
            tracing = msgspec.to_builtins(self.config.tracing) if self.config.tracing else None
            # EAGLE-3: the head's fit to the target is checked here, before any actor starts.
            layers = load_eagle3_config(Path(e.draft_model), target.config).layer_ids \
                if e.speculative_method == "eagle3" else ()
            spec = DraftActorSpec(e.draft_model, e.dtype, e.device, e.scheduler.max_num_seqs, e.max_model_len, tracing,
                                  f"specmoe-draft-{self.tag}", x.namespace, d.num_cpus, d.num_gpus,
                                  e.speculative_method, e.model, layers,
                                  e.pipelined_drafting)
            # A head whose tensors do not load is refused at start-up (_build_loaded waits for it).
            graph = x if self.config.draft_transport == "compiled_graph" else None
            drafter = RemoteDrafter(spec, self.config.draft.call_timeout_s, graph_config=graph)
        elif e.speculative_method == "ngram":
            drafter = NgramDrafter(e.ngram_min_n, e.ngram_max_n)
        else:
            drafter = NoneDrafter()
        self.router = router
        max_len = context_window(e.max_model_len, target.config.max_position_embeddings)
        return LLMEngine(target, drafter, e.num_speculative_tokens, e.scheduler, max_len, self.telemetry,
                         e.speculative_policy)

    async def generate(self, prompt_token_ids: list[int], params: dict, prompt: str | None = None,
                       request_id: str | None = None, carrier: dict | None = None,
                       stream: bool = True) -> AsyncIterator[dict]:
        """Stream engine outputs for one request (see :meth:`EngineLoop.generate`)."""
        if self.draining:  # shutting down: no engine build for a request that cannot finish
            yield unavailable_item(SHUTTING_DOWN)
            return
        await self._ensure_started()
        async for item in self.loop.generate(prompt_token_ids, params, prompt, request_id, carrier, stream):
            yield item

    def drain(self) -> int:
        """End in-flight streams with a 503 and refuse new requests (shutdown; see
        :meth:`EngineLoop.drain`). Returns the number of streams ended."""
        self.draining = True
        return self.loop.drain() if self.loop is not None else 0

    async def stats(self) -> dict:
        """Engine totals and pool state (tests, /health, benchmarks), read on the engine thread
        between two steps: a running step changes both (a hung step: /health times out)."""
        await self._ensure_started()
        return await self.loop.call_between_steps(self._stats_now)

    def _stats_now(self) -> dict:
        m = self.engine.get_metrics()
        m["expert_retries"] = self.router.actor_calls.num_retries if self.router else 0
        m["expert_hedges"] = self.router.actor_calls.num_hedges + self.router.num_graph_hedges if self.router else 0
        m["expert_probes"] = self.router.num_probes if self.router else 0
        m["expert_replication"] = self.router.replication_stats() if self.router else {}
        drafter_graph = getattr(self.engine.drafter, "graph", None)
        m["draft_transport"] = {"live": drafter_graph.live, **drafter_graph.stats.as_dict()} if drafter_graph else {}
        m["transport"] = {
            "kind": self.config.experts.transport,
            "graph_layers": self.router.num_graph_layers if self.router else 0,
            "overlapped_layers": self.router.num_overlapped_layers if self.router else 0,
            "call_layers": self.router.num_call_layers if self.router else 0,
            "graph_live": False, "graph_parked": False, "graph_members": [],
            **(self.router.graph_stats() if self.router else {}),
        }
        m["straggler_counts"] = {f"{layer}/{call}": n for (layer, call), n in self.stragglers.counts().items()}
        m["draft_failures"] = getattr(self.engine.drafter, "num_failures", 0)
        return m

    async def expert_actor_names(self) -> list[str]:
        return [r.name for r in self.pool.all_replicas()] if self.pool else []

    async def set_expert_delay_ms(self, group: int, delay_ms: float, replica: int | None = None) -> None:
        """Make every replica of one expert group (or only its replica ``replica``) sleep ``delay_ms``
        per call (a configured artificial straggler, for tests and demos)."""
        replicas = self.pool.replicas[group] if replica is None else [self.pool.replicas[group][replica]]
        await asyncio.gather(*[r.handle.set_delay_ms.remote(delay_ms) for r in replicas])

    async def set_expert_hedging(self, enabled: bool) -> None:
        """Turn hedged expert calls on or off and forget the router's latency views (replica
        EWMAs, hedge windows), so benchmark phases start alike. Runs on the engine thread between
        two steps (:meth:`EngineLoop.call_between_steps`)."""
        await self._ensure_started()

        def apply() -> None:
            if self.router is not None:
                self.router.actor_calls.hedging.enabled = enabled
                self.router.actor_calls.hedging.windows.clear()
                for r in self.pool.all_replicas():
                    r.ewma_latency_ms = 0.0

        await self.loop.call_between_steps(apply)

    async def metrics_bytes(self) -> bytes:
        """Prometheus text of this replica's engine metrics (rendered off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._aux_executor, self.metrics.render)

    def __del__(self) -> None:
        # Serve calls this on replica shutdown: leave no compiled graph polling on the actors.
        engine = getattr(self, "engine", None)
        for part in (getattr(self, "router", None), getattr(engine, "drafter", None)):
            close = getattr(part, "close", None)
            if close is not None:
                close()

    async def check_health(self) -> None:
        """Serve's health check: the engine builds and the expert and draft actors load their
        weights within ``verifier_start_timeout_s`` (:meth:`_build_loaded`; until then this does
        not return), its loop is alive and no step has hung (see :meth:`EngineLoop.check_health`)."""
        await self._ensure_started()
        self.loop.check_health()


def _replica_tag() -> str:
    """A name part unique to this verifier replica (its Serve replica id, else the process id)."""
    import os

    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid{os.getpid()}"
