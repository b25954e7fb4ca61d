"""A completion request's prompts as several verifier streams: their first items gathered, then
their items interleaved as they come (``POST /v1/completions`` with a batch of prompts).

Each prompt is its own engine request with its own :class:`~actors.failover.ResumableStream`
(failover per prompt); the ingress keeps one deadline for all of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

_END = object()  # a stream's end, as a task result (StopAsyncIteration cannot cross a task)


async def next_item(stream, deadline: float) -> dict:
    """The stream's next item before ``deadline`` (monotonic s); StopAsyncIteration at its end.

    Raises:
        asyncio.TimeoutError: the deadline passed first.
    """
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise TimeoutError
    return await asyncio.wait_for(stream.__anext__(), remaining_s)


async def _next_or_end(stream, deadline: float) -> dict | object:
    try:
        return await next_item(stream, deadline)
    except StopAsyncIteration:
        return _END


async def first_items(streams: Sequence, deadline: float) -> list[dict]:
    """Every stream's first item, awaited together (a batch's prompts are admitted at once).

    Raises:
        Exception: the first failure in prompt order (a stream that raised, or timed out); the
            other waits are cancelled. An error item is returned like any other.
    """
    if len(streams) == 1:
        return [await next_item(streams[0], deadline)]
    tasks = [asyncio.ensure_future(next_item(s, deadline)) for s in streams]
    try:
        await asyncio.wait(tasks)  # every one finished (each has the deadline)
    finally:
        _settle(tasks)  # those still waiting when the caller left are cancelled
    failed = next((task.exception() for task in tasks if task.exception() is not None), None)
    if failed is not None:
        raise failed
    return [task.result() for task in tasks]


async def interleave(streams: Sequence, deadline: float) -> AsyncIterator[tuple[int, dict]]:
    """``(prompt index, item)`` of all streams in the order their items arrive, until each ends.

    Raises:
        Exception: a stream's failure (or asyncio.TimeoutError past ``deadline``), as soon as it
            happens; the other streams' waits are cancelled (the caller cancels the streams).
    """
    if len(streams) == 1:  # one prompt: no tasks, each item awaited where the caller awaits
        while (item := await _next_or_end(streams[0], deadline)) is not _END:
            yield 0, item
        return
    pending = {asyncio.ensure_future(_next_or_end(s, deadline)): p for p, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # same-moment items in prompt order
                p = pending.pop(task)
                item = task.result()
                if item is _END:
                    continue
                yield p, item
                pending[asyncio.ensure_future(_next_or_end(streams[p], deadline))] = p
    finally:
        _settle(pending)


def _settle(tasks) -> None:
    """Cancel the tasks still running; mark the finished ones' exceptions as seen (asyncio logs
    "exception was never retrieved" otherwise: a batch's failure is reported once, by its caller)."""
    for task in tasks:
        if not task.done():
            task.cancel()
            # A cancelled wait may still end in the stream's own error (Serve's
            # RequestCancelledError): retrieve it once it does.
            task.add_done_callback(_retrieve)
        else:
            _retrieve(task)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
