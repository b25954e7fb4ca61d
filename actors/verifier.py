"""Verifier deployment: the target's non-expert weights, its KV cache, and the engine loop.

A shim over :class:`engine.engine.LLMEngine`: the MoE layers reach expert actors through
:class:`AsyncExpertRouter`, the drafter is the draft deployment (:class:`RemoteDrafter`). Engine
steps run in one worker thread; the event loop only moves requests in and outputs out, so it never
blocks. Requests are added and aborted between steps (never while a step runs), and a request's
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
        draft_handle: handle of the draft deployment, or None for no model drafter.
    """

    def __init__(self, config: dict, draft_handle=None) -> None:
        from actors.telemetry import VerifierTelemetry
        from observability import EngineMetrics, StragglerDetector, setup_tracing

        self.config = msgspec.convert(config, ServeConfig)
        torch.set_num_threads(1)
        setup_tracing("verifier", self.config.tracing)
        self.metrics = EngineMetrics(self.config.model_name)
        self.telemetry = VerifierTelemetry()
        self.stragglers = StragglerDetector(self.config.experts.straggler_multiple,
                                            self.config.experts.straggler_floor_ms)
        self.draft_handle = draft_handle
        self.engine: LLMEngine | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._ids = itertools.count()
        self._start_lock = asyncio.Lock()
        self._build_pool()

    def _build_pool(self) -> None:
        from actors.expert_pool import ExpertPool
        from engine.config import load_model_config

        e = self.config.engine
        target_config = load_model_config(e.model)
        self.pool = None
        if target_config.is_moe:
            tracing = msgspec.to_builtins(self.config.tracing) if self.config.tracing else None
            self.pool = ExpertPool(e.model, target_config.moe.num_experts, self.config.experts, e.dtype, e.device,
                                   tracing=tracing)
            self.pool.start()

    async def _ensure_started(self) -> None:
        """Build the engine on the replica's running loop (the router and drafter need it)."""
        if self.engine is not None:
            return
        async with self._start_lock:
            if self.engine is not None:
                return
            loop = asyncio.get_running_loop()
            self.engine = await loop.run_in_executor(self._executor, self._build_engine, loop)
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run())

    def _build_engine(self, loop: asyncio.AbstractEventLoop) -> LLMEngine:
        from actors.draft_server import RemoteDrafter
        from actors.expert_router import AsyncExpertRouter
        from actors.telemetry import RouterTelemetry
        from engine.drafters.base import NoneDrafter
        from engine.drafters.ngram import NgramDrafter
        from engine.loader import load_model, resolve_dtype

        e = self.config.engine
        router = None
        if self.pool:
            router = AsyncExpertRouter(self.pool, loop, resolve_dtype(e.dtype),
                                       RouterTelemetry(self.metrics, self.stragglers))
        target = load_model(e.model, e.dtype, e.device, experts=router)
        if e.speculative_method == "draft" and self.draft_handle is not None:
            drafter = RemoteDrafter(self.draft_handle, loop)
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
        """Prometheus text of this replica's engine metrics."""
        return self.metrics.render()

    async def check_health(self) -> None:
        """Serve's health check: the engine loop must be alive once started."""
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError("engine loop stopped")
