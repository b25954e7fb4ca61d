"""The verifier's request loop around an injected engine: no Ray here, so it is unit-testable.

Engine steps run on one worker thread (the engine thread, which also makes every hop the engine
needs); the event loop only moves requests in and outputs out. While any request is unfinished the
engine thread steps back to back (a burst, like vLLM's engine core busy loop): handing each step's
outputs to the event loop does not wait for it, so the thread never idles while the event loop
gets the GIL and a core to ship them. Requests are added and aborted between steps (never while a
step runs). A step that runs longer than ``step_timeout_s`` makes :meth:`EngineLoop.check_health`
fail, so Serve replaces a replica whose engine thread hangs (Ray Serve LLM's
``LLMServer.check_health`` asks its engine the same question).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from actors.stream_items import error_item, ship, step_item, unavailable_item
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


SHUTTING_DOWN = "the server is shutting down; retry the request"


class EngineHung(RuntimeError):
    """The engine thread has been inside one step for longer than the configured bound."""


class EngineLoop:
    """Streams engine outputs per request, stepping the engine while any request is unfinished.

    Args:
        engine: the engine (anything with :class:`LLMEngine`'s request and step methods, and
            ``get_metrics`` when ``on_change`` is given).
        executor: the engine thread (one worker); the engine is only touched there, and on the
            event loop only while no burst runs.
        step_timeout_s: longest healthy step, seconds.
        on_change: called on the event loop after every step and every add/abort batch with the
            engine's metrics as of then (``get_metrics()``, taken on the engine thread: a running
            step may resize its dicts).
        carriers: request id -> W3C trace carrier map shared with the engine's step observer.
        stream_batching_interval_s: a streamed request's items after its first tokens go at most
            once per this many seconds, each carrying the steps emitted since the last (0: every
            step as soon as the consumer takes it). Ray Serve LLM's ``stream_batching_interval_ms``:
            every item wakes this replica's event loop, the ingress and the HTTP proxy, CPU the
            engine thread and the expert actors need (docs/TRANSPORT.md, "Stream batching").
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor, step_timeout_s: float = 60.0,
                 on_change: Callable[[dict], None] | None = None, carriers: dict | None = None,
                 stream_batching_interval_s: float = 0.0) -> None:
        self.engine, self.executor, self.step_timeout_s = engine, executor, step_timeout_s
        self.stream_batching_interval_s = stream_batching_interval_s
        self.on_change = on_change
        self.carriers = carriers if carriers is not None else {}
        self._streams: dict[str, asyncio.Queue] = {}
        # ("add", ...), ("abort", rid), ("call", fn, future): appended on the event loop only,
        # popped on the engine thread only (deque append and popleft are thread-safe).
        self._ops: deque[tuple] = deque()
        self._wakeup = asyncio.Event()
        self._step_started: float | None = None  # time.monotonic() of the running step
        self._ids = itertools.count()
        self.draining = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Event loop: give the engine thread one burst while there is work, else sleep until an op
        is queued."""
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            # No burst runs here and every op is appended on this thread, so this check cannot miss
            # an op queued while the last burst was returning.
            if not self._ops and not self.engine.has_unfinished_requests():
                await self._wakeup.wait()
                continue
            try:
                await loop.run_in_executor(self.executor, self._burst, loop)
            except Exception:  # engine.step fails sequences itself; this is a last resort
                log.exception("engine step crashed")
                await asyncio.sleep(0.01)

    def _burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Engine thread: apply queued ops and step, back to back, until no request is unfinished.

        Stream items are built here because the engine reuses a request's output object in its
        next step; they and the metrics snapshot go to the event loop with
        ``call_soon_threadsafe``, which does not wait for it."""
        while True:
            answers = self._apply_ops()
            if answers is not None:  # gauges move on add/abort too
                loop.call_soon_threadsafe(self._publish, answers, self._snapshot())
            if not self.engine.has_unfinished_requests():
                return
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            finally:
                self._step_started = None
            now_s = time.monotonic()
            items = [(out.request_id, step_item(out, now_s)) for out in outputs]
            loop.call_soon_threadsafe(self._publish, items, self._snapshot())

    def _apply_ops(self) -> list[tuple[str, dict]] | None:
        """Engine thread: run the queued ops in order. Returns each add's answer (``accepted``
        or its error item: the request is checked here, where no step is running, since the
        checks read the scheduler's queues and the controller's state), or None if no request
        was added or aborted."""
        answers: list[tuple[str, dict]] | None = None
        while self._ops:
            op, *args = self._ops.popleft()
            if op == "call":
                _run_call(*args)
                continue
            answers = [] if answers is None else answers
            try:
                if op == "add":
                    self.engine.add_request(*args)
                    answers.append((args[0], {"type": "accepted", "request_id": args[0]}))
                else:
                    self.engine.abort_request(*args)
            except Exception as e:  # a bad or duplicate request, a full queue, an unmeetable TTFT
                answers.append((args[0], error_item(e)))
        return answers

    def _snapshot(self) -> dict | None:
        """Engine thread: the engine's metrics, if anyone listens for them."""
        return self.engine.get_metrics() if self.on_change is not None else None

    def _publish(self, items: list[tuple[str, dict]], metrics: dict | None) -> None:
        """Event loop: queue each item on its request's stream (if still open); report new metrics."""
        for rid, item in items:
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(item)
        if metrics is not None:
            self.on_change(metrics)

    def call_between_steps(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread between two steps (an executor job would wait for the
        whole burst); the returned future gets its result or exception. Call on the event loop."""
        future: Future = Future()  # settled on the engine thread; wrap_future hops to the event loop
        self._ops.append(("call", fn, future))
        self._wakeup.set()
        return asyncio.wrap_future(future)

    async def generate(self, prompt_token_ids: list[int], params: dict, prompt: str | None = None,
                       request_id: str | None = None, carrier: dict | None = None,
                       stream: bool = True) -> AsyncIterator[dict]:
        """Stream engine outputs for one request.

        Args:
            prompt_token_ids: the prompt's token ids; params: :class:`SamplingParams` as builtins.
            stream: the client streams. If not, only the first item with tokens (the ingress's
                TTFT) and then the finished one are sent, the steps between merged into it.

        Yields:
            ``{"type": "accepted"}`` or an error item (HTTP status + message) first, once the
            engine thread has checked and added the request between two steps; then step
            items (``actors.stream_items.step_item``), the last one finished. Steps that queued
            up while the consumer was busy go as one merged item (``merge_step_items``): each item
            crossing the Serve hop costs this replica's event loop and the ingress CPU that the
            engine thread needs. A streamed request's steps after its first tokens are also held
            for up to ``stream_batching_interval_s`` since its last item, unless finished. Closing
            the stream early (client gone) aborts the request and frees its KV slots within one step.
        """
        rid = request_id or f"req-{next(self._ids)}"
        if self.draining:
            yield unavailable_item(SHUTTING_DOWN)
            return
        try:
            sp = msgspec.convert(params, SamplingParams)
            if rid in self._streams:  # its stream would take this one's items
                raise ValueError(f"request id {rid!r} is already running")
        except (ValueError, msgspec.ValidationError) as e:
            yield error_item(e)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        if carrier:
            self.carriers[rid] = carrier
        self._ops.append(("add", rid, prompt_token_ids, sp, prompt, time.monotonic()))
        self._wakeup.set()
        finished = False
        try:
            answer = await queue.get()  # "accepted" or an error item, from the engine thread
            finished = answer["type"] != "accepted"
            yield answer
            held: list[dict] = []  # step items not sent yet
            first_sent = False  # the first item with tokens has gone (TTFT)
            shipped_s = 0.0  # time.monotonic() of the last item sent
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if stream and first_sent:
                    await self._hold(queue, batch, shipped_s + self.stream_batching_interval_s)
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
                            first_sent, shipped_s = True, time.monotonic()
                            yield ship(held, shipped_s)
                            held = []
                    if finished:
                        break
                if held and (stream or finished):
                    shipped_s = time.monotonic()
                    yield ship(held, shipped_s)
                    held = []
        finally:
            self._streams.pop(rid, None)
            self.carriers.pop(rid, None)
            if not finished:
                self._ops.append(("abort", rid))
                self._wakeup.set()

    @staticmethod
    async def _hold(queue: asyncio.Queue, batch: list[dict], until_s: float) -> None:
        """Add to ``batch`` what the engine emits until ``until_s`` (time.monotonic()), unless it
        ends in a finished (or non-step) item: a stream's last tokens and errors are never held."""
        while batch[-1]["type"] == "step" and not batch[-1]["finished"]:
            remaining_s = until_s - time.monotonic()
            if remaining_s <= 0:
                return
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining_s))
            except TimeoutError:
                return
            while not queue.empty():
                batch.append(queue.get_nowait())

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
            self._ops.append(("abort", rid))  # the stream ends "finished": it would not abort itself
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


def _run_call(fn: Callable[[], Any], future: Future) -> None:
    """Engine thread: run a queued call, unless its caller stopped waiting, into its future."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
