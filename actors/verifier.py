"""Verifier deployment: the target's non-expert weights, its KV cache, and the engine loop.

A shim over :class:`engine.engine.LLMEngine`: the MoE layers reach expert actors through
:class:`ExpertRouter` (a compiled graph over this replica's own expert actors, or actor calls), the
drafter is the draft deployment (:class:`RemoteDrafter`). Engine steps run in one worker thread,
which also makes every hop (expert dispatch, draft call) itself; the event loop only moves
requests in and outputs out, so it never blocks and never carries a hop. Requests are added and aborted between steps (never while a step runs), and a request's
stream lives on this replica for the request's whole life.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from actors.config import ServeConfig
from actors.stream_items import error_item, step_item
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class VerifierServer:
    """Runs the continuous-batching speculative loop for requests sent by the ingress.

    Args:
        config: :class:`ServeConfig` as builtins (Serve passes plain data between processes).
    """

    def __init__(self, config: dict) -> None:
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
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._aux_executor = ThreadPoolExecutor(1, thread_name_prefix="verifier-aux")  # never the engine's
        self.router = None
        self._ids = itertools.count()
        self._start_lock = asyncio.Lock()
        self._build_pool()

    def _build_pool(self) -> None:
        from actors.expert_pool import ExpertPool
        from engine.config import load_model_config

        e, x = self.config.engine, self.config.experts
        self.tag = _replica_tag()
        target_config = load_model_config(e.model)
        self.pool = None
        if target_config.is_moe:
            tracing = msgspec.to_builtins(self.config.tracing) if self.config.tracing else None
            private = x.transport == "compiled_graph"  # an actor can be in one compiled graph only
            prefix = f"specmoe-experts-{self.tag}" if private else "specmoe-experts"
            self.pool = ExpertPool(e.model, target_config.moe.num_experts, x, e.dtype, e.device,
                                   prefix=prefix, tracing=tracing, detached=not private)
            self.pool.start()

    async def _ensure_started(self) -> None:
        """Build the engine on the engine thread, once (the first request or stats call)."""
        if self.engine is not None:
            return
        async with self._start_lock:
            if self.engine is not None:
                return
            loop = asyncio.get_running_loop()
            self.engine = await loop.run_in_executor(self._executor, self._build_engine)
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run())

    def _build_engine(self) -> LLMEngine:
        from actors.draft_server import DraftActorSpec, RemoteDrafter
        from actors.expert_router import ExpertRouter
        from actors.telemetry import RouterTelemetry
        from engine.drafters.base import NoneDrafter
        from engine.drafters.ngram import NgramDrafter
        from engine.loader import load_model, resolve_dtype

        e, x = self.config.engine, self.config.experts
        router = None
        if self.pool:
            router = ExpertRouter(self.pool, resolve_dtype(e.dtype), RouterTelemetry(self.metrics, self.stragglers),
                                  graph=x.transport == "compiled_graph")
        target = load_model(e.model, e.dtype, e.device, experts=router)
        if e.speculative_method == "draft":
            d = self.config.draft
            tracing = msgspec.to_builtins(self.config.tracing) if self.config.tracing else None
            spec = DraftActorSpec(e.draft_model, e.dtype, e.device, e.scheduler.max_num_seqs, e.max_model_len, tracing,
                                  f"specmoe-draft-{self.tag}", x.namespace, d.num_cpus, d.num_gpus)
            drafter = RemoteDrafter(spec, x.call_timeout_s, graph=x.transport == "compiled_graph",
                                    idle_teardown_s=x.graph_idle_teardown_s, buffer_size_bytes=x.graph_buffer_size_bytes)
        elif e.speculative_method == "ngram":
            drafter = NgramDrafter(e.ngram_min_n, e.ngram_max_n)
        else:
            drafter = NoneDrafter()
        self.router = router
        max_len = e.max_model_len or target.config.max_position_embeddings
        return LLMEngine(target, drafter, e.num_speculative_tokens, e.scheduler, max_len, self.telemetry)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:  # engine.step fails sequences itself; this is a last resort
                log.exception("engine step crashed")
                await asyncio.sleep(0.01)
                continue
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(step_item(out))
            self.metrics.sync_from_engine(self.engine.get_metrics())

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        for op, *args in pending:
            try:
                if op == "add":
                    self.engine.add_request(*args)
                else:
                    self.engine.abort_request(*args)
            except Exception as e:  # e.g. the queue filled up since validation
                queue = self._streams.get(args[0])
                if queue is not None:
                    queue.put_nowait(error_item(e))
        self.metrics.sync_from_engine(self.engine.get_metrics())  # gauges move on add/abort too

    async def generate(self, prompt_token_ids: list[int], params: dict, prompt: str | None = None,
                       request_id: str | None = None, carrier: dict | None = None) -> AsyncIterator[dict]:
        """Stream engine outputs for one request.

        The first item is ``{"type": "accepted"}`` or an error item (HTTP status + message); then
        one item per engine step that advanced the request, the last one finished. Closing the
        stream early (client gone) aborts the request and frees its KV slots within one step.
        """
        await self._ensure_started()
        rid = request_id or f"req-{next(self._ids)}"
        try:
            sp = msgspec.convert(params, SamplingParams)
            pending_seqs = sum(a[2].n for op, *a in self._pending if op == "add")
            self.engine.check_request(rid, prompt_token_ids, sp, pending_seqs)
        except (ValueError, msgspec.ValidationError) as e:
            yield error_item(e)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        if carrier:
            self.telemetry.carriers[rid] = carrier
        self._pending.append(("add", rid, prompt_token_ids, sp, prompt, time.monotonic()))
        self._wakeup.set()
        finished = False
        try:
            yield {"type": "accepted", "request_id": rid}
            while not finished:
                item = await queue.get()
                finished = item.get("finished", True)
                yield item
        finally:
            self._streams.pop(rid, None)
            self.telemetry.carriers.pop(rid, None)
            if not finished:
                self._pending.append(("abort", rid))
                self._wakeup.set()

    async def stats(self) -> dict:
        """Engine totals and pool state (tests, /health, benchmarks)."""
        await self._ensure_started()
        m = self.engine.get_metrics()
        m["expert_retries"] = self.router.num_retries if self.router else 0
        drafter_graph = getattr(self.engine.drafter, "graph", None)
        m["draft_transport"] = drafter_graph.stats.as_dict() if drafter_graph else {}
        m["transport"] = {
            "kind": self.config.experts.transport,
            "graph_layers": self.router.num_graph_layers if self.router else 0,
            "call_layers": self.router.num_call_layers if self.router else 0,
            "graph_live": bool(self.router and self.router.graph and self.router.graph.live),
            **(self.router.graph.stats.as_dict() if self.router and self.router.graph else {}),
        }
        m["straggler_counts"] = {f"{layer}/{call}": n for (layer, call), n in self.stragglers.counts().items()}
        m["draft_failures"] = getattr(self.engine.drafter, "num_failures", 0)
        return m

    async def expert_actor_names(self) -> list[str]:
        return [r.name for r in self.pool.all_replicas()] if self.pool else []

    async def set_expert_delay_ms(self, group: int, delay_ms: float) -> None:
        """Make every replica of one expert group sleep ``delay_ms`` per call (a configured
        artificial straggler, for tests and demos)."""
        await asyncio.gather(*[r.handle.set_delay_ms.remote(delay_ms) for r in self.pool.replicas[group]])

    async def metrics_bytes(self) -> bytes:
        """Prometheus text of this replica's engine metrics (rendered off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._aux_executor, self.metrics.render)

    def __del__(self) -> None:
        # Serve calls this on replica shutdown: leave no compiled graph polling on the actors.
        for part in (getattr(self, "router", None), getattr(self.engine, "drafter", None) if getattr(self, "engine", None) else None):
            close = getattr(part, "close", None)
            if close is not None:
                close()

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive once started."""
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError("engine loop stopped")


def _replica_tag() -> str:
    """A name part unique to this verifier replica (its Serve replica id, else the process id)."""
    import os

    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid{os.getpid()}"
