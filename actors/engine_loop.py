"""The verifier's request loop around an injected engine: no Ray here, so it is unit-testable.

Engine steps run on one worker thread (the engine thread, which also makes every hop the engine
needs); the event loop only moves requests in and outputs out. Requests are added and aborted
between steps (never while a step runs). A step that runs longer than ``step_timeout_s`` makes
:meth:`EngineLoop.check_health` fail, so Serve replaces a replica whose engine thread hangs
(Ray Serve LLM's ``LLMServer.check_health`` asks its engine the same question).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from actors.stream_items import error_item, ship, step_item, unavailable_item
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


SHUTTING_DOWN = "the server is shutting down; retry the request"


class EngineHung(RuntimeError):
    """The engine thread has been inside one step for longer than the configured bound."""


class EngineLoop:
    """Streams engine outputs per request, stepping the engine while any request is unfinished.

    Args:
        engine: the engine (anything with :class:`LLMEngine`'s request and step methods).
        executor: the engine thread (one worker); the engine is only touched there and between
            steps on the event loop.
        step_timeout_s: longest healthy step, seconds.
        on_change: called on the event loop after every step and every add/abort batch (metrics).
        carriers: request id -> W3C trace carrier map shared with the engine's step observer.
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor, step_timeout_s: float = 60.0,
                 on_change: Callable[[], None] | None = None, carriers: dict | None = None) -> None:
        self.engine, self.executor, self.step_timeout_s = engine, executor, step_timeout_s
        self.on_change = on_change or (lambda: None)
        self.carriers = carriers if carriers is not None else {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []
        self._wakeup = asyncio.Event()
        self._step_started: float | None = None  # time.monotonic() of the running step
        self._ids = itertools.count()
        self.draining = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception:  # engine.step fails sequences itself; this is a last resort
                log.exception("engine step crashed")
                await asyncio.sleep(0.01)
                continue
            finally:
                self._step_started = None
            now_s = time.monotonic()
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(step_item(out, now_s))
            self.on_change()

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
        self.on_change()  # gauges move on add/abort too

    async def generate(self, prompt_token_ids: list[int], params: dict, prompt: str | None = None,
                       request_id: str | None = None, carrier: dict | None = None,
                       stream: bool = True) -> AsyncIterator[dict]:
        """Stream engine outputs for one request.

        Args:
            prompt_token_ids: the prompt's token ids; params: :class:`SamplingParams` as builtins.
            stream: the client streams. If not, only the first item with tokens (the ingress's
                TTFT) and then the finished one are sent, the steps between merged into it.

        Yields:
            ``{"type": "accepted"}`` or an error item (HTTP status + message) first; then step
            items (``actors.stream_items.step_item``), the last one finished. Steps that queued
            up while the consumer was busy go as one merged item (``merge_step_items``): each item
            crossing the Serve hop costs this replica's event loop and the ingress CPU that the
            engine thread needs. Closing the stream early (client gone) aborts the request and
            frees its KV slots within one step.
        """
        rid = request_id or f"req-{next(self._ids)}"
        if self.draining:
            yield unavailable_item(SHUTTING_DOWN)
            return
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
            self.carriers[rid] = carrier
        self._pending.append(("add", rid, prompt_token_ids, sp, prompt, time.monotonic()))
        self._wakeup.set()
        finished = False
        try:
            yield {"type": "accepted", "request_id": rid}
            held: list[dict] = []  # step items not sent yet
            first_sent = False  # the first item with tokens has gone (TTFT)
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for item in batch:
                    finished = item.get("finished", True)
                    if item["type"] != "step":
                        if held:
                            yield ship(held, time.monotonic())
                            held = []
                        yield item
                    else:
                        held.append(item)
                        if not first_sent and any(c["new_token_ids"] for c in item["choices"]):
                            first_sent = True
                            yield ship(held, time.monotonic())
                            held = []
                    if finished:
                        break
                if held and (stream or finished):
                    yield ship(held, time.monotonic())
                    held = []
        finally:
            self._streams.pop(rid, None)
            self.carriers.pop(rid, None)
            if not finished:
                self._pending.append(("abort", rid))
                self._wakeup.set()

    def drain(self) -> int:
        """End every open stream with a 503 item, abort its request (frees its KV slots within one
        step) and refuse new requests: the server is shutting down. Call on the event loop.

        Returns:
            The number of streams ended.
        """
        self.draining = True
        streams = list(self._streams.items())
        for rid, queue in streams:
            queue.put_nowait(unavailable_item(SHUTTING_DOWN))
            self._pending.append(("abort", rid))  # the stream ends "finished": it would not abort itself
        self._wakeup.set()
        return len(streams)

    def check_health(self) -> None:
        """Raises:
            RuntimeError: the loop task stopped.
            EngineHung: the current step has run longer than ``step_timeout_s``.
        """
        if self._task.done():
            raise RuntimeError("engine loop stopped")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.step_timeout_s:
            raise EngineHung(f"engine step running for {time.monotonic() - started:.1f} s "
                             f"(> {self.step_timeout_s:.1f} s)")
