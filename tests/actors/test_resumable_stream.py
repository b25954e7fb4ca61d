"""A request's verifier stream (actors/failover.py) when its waiter is cancelled (the client left):
Serve answers a cancelled wait with its own error, which must end the wait as cancelled, not as a
failure nobody reads (asyncio then logs "Task exception was never retrieved": one traceback per
prompt of every dropped batch request, an abuse trial found, 2026-12-06). No Ray."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from actors.failover import ResumableStream
from actors.fanout import next_item


class RequestCancelledError(Exception):
    """What Serve's response generator raises when the wait on it is cancelled."""


class ServeLikeStream:
    """Never answers; a cancelled wait on it ends in :class:`RequestCancelledError`, as Serve's does."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RequestCancelledError("the request was cancelled") from None

    def cancel(self) -> None:
        self.cancelled = True


def test_a_cancelled_wait_ends_cancelled_with_nothing_left_unretrieved():
    async def run() -> list[dict]:
        unhandled: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
        served = ServeLikeStream()
        stream = ResumableStream(lambda ids, params: served, [1, 2, 3], {"max_tokens": 8, "n": 1},
                                 can_resume=lambda e: False)
        waiter = asyncio.ensure_future(next_item(stream, time.monotonic() + 60))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        stream.cancel()
        assert served.cancelled
        await asyncio.sleep(0.01)
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        await asyncio.sleep(0.01)
        return unhandled

    # Earlier tests' garbage is collected first, while no loop runs: an HTTP client of another
    # test, collected inside this loop, would schedule its close here and fail on its own closed
    # loop (seen once in CI: "Task exception was never retrieved ... Event loop is closed").
    gc.collect()
    assert asyncio.run(run()) == []


def test_a_failure_of_a_wait_nobody_cancelled_still_reaches_the_caller():
    class Failing(ServeLikeStream):
        async def __anext__(self) -> dict:
            raise RequestCancelledError("cancelled by someone else")

    stream = ResumableStream(lambda ids, params: Failing(), [1], {"max_tokens": 8, "n": 1},
                             can_resume=lambda e: False)
    with pytest.raises(RequestCancelledError):
        asyncio.run(next_item(stream, time.monotonic() + 60))
