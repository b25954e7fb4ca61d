"""A request's verifier stream that outlives its verifier replica.

When the replica serving a request dies mid-stream, :class:`ResumableStream` re-submits the request
to another replica as its prompt plus the tokens already emitted, with ``max_tokens`` reduced by
their number, and continues the stream from there: the client sees no duplicate and no gap, and a
greedy request's text is the undisturbed one. A sampled request continues from the same tokens
with a fresh generator (a seed restarts its random numbers), so it still follows the target's
distribution but is not the undisturbed text. Only single-choice requests (``n == 1``) fail over; a
stop string that would straddle the point of failure is not detected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class ResumableStream:
    """Iterates a request's stream items across replica deaths (the ingress's view of the verifier).

    Args:
        submit: ``submit(prompt_token_ids, params)`` starts a stream (a Serve handle's
            ``generate.remote`` with the request's other arguments bound).
        prompt_token_ids: the request's prompt.
        params: its :class:`SamplingParams` as builtins.
        can_resume: whether an exception means the replica is gone (rather than a bad request).
        max_resubmits: resubmissions per request before the failure reaches the client.
        accept_timeout_s: how long a resubmission may wait to be accepted; a handle queues requests
            while no replica is up, so with a single replica this bounds the wait before the 503.
    """

    def __init__(self, submit: Callable[[list[int], dict], object], prompt_token_ids: list[int], params: dict,
                 can_resume: Callable[[BaseException], bool], max_resubmits: int = 2,
                 accept_timeout_s: float = 2.0) -> None:
        self._submit, self.prompt_token_ids, self.params = submit, list(prompt_token_ids), params
        self._can_resume, self.max_resubmits, self.accept_timeout_s = can_resume, max_resubmits, accept_timeout_s
        self._stream = submit(self.prompt_token_ids, params)
        self.emitted: list[int] = []  # tokens streamed to the client so far (n == 1)
        self.resubmits = 0
        self._offset = 0  # tokens emitted before the current submission
        self._accepted = False  # the client has had its "accepted" item
        self._pending: dict | None = None  # a resubmission's "accepted", when the client has had none

    def __aiter__(self) -> ResumableStream:
        return self

    async def __anext__(self) -> dict:
        while True:
            if self._pending is not None:
                item, self._pending = self._pending, None
            else:
                try:
                    item = await self._stream.__anext__()
                except StopAsyncIteration:
                    raise
                except Exception as e:
                    if _being_cancelled():  # Serve answers a cancelled wait with its own error
                        raise asyncio.CancelledError from e
                    await self._resubmit(e)
                    continue
            if item["type"] == "accepted":
                if self._accepted:  # a resubmission's: the client already had one
                    continue
                self._accepted = True
                return item
            return self._account(item) if item["type"] == "step" else item

    def _account(self, item: dict) -> dict:
        """An item in the client's request's terms: token counts and usage include the tokens
        emitted before a failover; the prompt is the client's."""
        for c in item["choices"]:
            c["num_tokens"] += self._offset
            self.emitted += c["new_token_ids"]
        if item.get("usage") and self._offset:
            item["usage"] = {"prompt_tokens": len(self.prompt_token_ids),
                             "completion_tokens": item["usage"]["completion_tokens"] + self._offset}
        return item

    async def _resubmit(self, error: Exception) -> None:
        """Start the request again on another replica, or re-raise ``error`` when it cannot."""
        self._stream.cancel()
        remaining = self.params["max_tokens"] - len(self.emitted)
        if (not self._can_resume(error) or self.params.get("n", 1) != 1 or remaining < 1
                or self.resubmits >= self.max_resubmits):
            raise error
        self.resubmits += 1
        self._offset = len(self.emitted)
        log.warning("verifier replica lost (%s); re-submitting with %d emitted tokens (attempt %d)",
                    type(error).__name__, self._offset, self.resubmits)
        stream = self._submit(self.prompt_token_ids + self.emitted, {**self.params, "max_tokens": remaining})
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.accept_timeout_s)
        except Exception:  # no replica took it in time (or it died too): the original failure stands
            stream.cancel()
            raise error from None
        if first["type"] != "accepted":  # e.g. the survivor's queue is full: its answer is the client's
            self._pending = first
        elif not self._accepted:
            self._pending = first
        self._stream = stream

    def cancel(self) -> None:
        self._stream.cancel()


def _being_cancelled() -> bool:
    """Whether the running task has a cancellation pending (its waiter gave up: the client left,
    or ``asyncio.wait_for``'s deadline). Its wait must then end cancelled: an error instead would
    be a failure nobody retrieves (asyncio logs each) and, worse, a resubmission."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
