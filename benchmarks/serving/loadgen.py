"""Load shapes: fixed concurrency or Gamma (Poisson by default) arrivals, each bounded by a request
count and a time limit.

Open-loop arrivals follow ``vllm bench serve``: inter-arrival gaps are Gamma-distributed with shape
``burstiness`` and mean ``1 / rate``, so the coefficient of variation of the gaps is
``1 / sqrt(burstiness)``: 1 is Poisson, < 1 burstier, > 1 more regular. With per-class shapes each
request class gets its own Gamma process at its share of the rate (its share of the requests), and
the processes are merged by time.

Both shapes stop sending new requests once ``time_limit_s`` has passed since the run started;
requests already in flight finish (each bounded by its own request timeout), so a run lasts at
most ``time_limit_s + request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from benchmarks.serving.client import RequestOptions, RequestResult, send_request
from benchmarks.serving.dataset import Prompt


@dataclass(frozen=True)
class LoadShape:
    """How requests are issued.

    ``request_rate_per_s`` None: closed loop, ``concurrency`` requests always in flight.
    Otherwise open loop: Gamma arrivals (shape ``burstiness``; 1 = Poisson) at that mean rate
    (seeded by ``seed``), with ``concurrency`` (when set) capping the requests in flight.
    ``class_burstiness`` (class -> shape) gives each request class its own arrival process;
    classes not in it use ``burstiness``.
    """

    concurrency: int | None = 1
    request_rate_per_s: float | None = None
    seed: int = 0
    time_limit_s: float = 600.0
    burstiness: float = 1.0
    class_burstiness: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.request_rate_per_s is None and not self.concurrency:
            raise ValueError("a fixed-concurrency run needs concurrency >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate_per_s is not None and self.request_rate_per_s <= 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate_per_s}")
        if min([self.burstiness, *self.class_burstiness.values()]) <= 0:
            raise ValueError("burstiness (Gamma shape) must be > 0")


@dataclass
class LoadOutput:
    """Results of the requests that were sent (in prompt order, which is dispatch order unless classes
    have their own arrival processes) and the run's wall time."""

    results: list[RequestResult]
    duration_s: float
    not_sent: int  # requests skipped because the time limit passed first


def gamma_arrival_offsets_s(num: int, rate_per_s: float, burstiness: float, seed: int | str) -> list[float]:
    """Send times (seconds after the start) of ``num`` Gamma arrivals; the first is at 0.

    Gaps have shape ``burstiness`` and scale ``1 / (rate_per_s * burstiness)`` (mean
    ``1 / rate_per_s``), drawn from ``random.Random(seed)``, so the same seed gives the same
    schedule. Shape 1 draws exponential gaps with ``expovariate`` (the Poisson schedule).
    """
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(num):
        if i > 0:
            if burstiness == 1.0:
                now += rng.expovariate(rate_per_s)
            else:
                now += rng.gammavariate(burstiness, 1.0 / (rate_per_s * burstiness))
        offsets.append(now)
    return offsets


def poisson_arrival_offsets_s(num: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrivals: Gamma arrivals of shape 1 (exponential gaps with mean ``1 / rate_per_s``)."""
    return gamma_arrival_offsets_s(num, rate_per_s, 1.0, seed)


def class_arrival_offsets_s(
    classes: Sequence[str | None],
    rate_per_s: float,
    seed: int,
    burstiness: float = 1.0,
    class_burstiness: Mapping[str, float] | None = None,
) -> list[float]:
    """Send time of each request (same order as ``classes``, the requests' classes).

    Without ``class_burstiness``: one Gamma process over all requests in order (vllm bench).
    With it: one process per class at ``rate_per_s * (class requests / all requests)``, seeded by
    ``f"{seed}:{class}"``, each class's requests taking its arrivals in order; the result is then
    not sorted (the load generator dispatches by time).
    """
    if not class_burstiness:
        return gamma_arrival_offsets_s(len(classes), rate_per_s, burstiness, seed)
    members: dict[str | None, list[int]] = {}
    for index, name in enumerate(classes):
        members.setdefault(name, []).append(index)
    offsets = [0.0] * len(classes)
    for name, indices in members.items():
        shape = class_burstiness.get(name or "", burstiness)
        rate = rate_per_s * len(indices) / len(classes)
        for index, offset in zip(
            indices, gamma_arrival_offsets_s(len(indices), rate, shape, f"{seed}:{name}")
        ):
            offsets[index] = offset
    return offsets


async def _timed_request(
    client: httpx.AsyncClient, base_url: str, prompt: Prompt, options: RequestOptions, run_start: float
) -> RequestResult:
    """send_request with ``start_s`` set to the send time relative to ``run_start`` (perf_counter)."""
    start_s = time.perf_counter() - run_start
    result = await send_request(client, base_url, prompt, options)
    result.start_s = start_s
    return result


async def run_load(
    client: httpx.AsyncClient,
    base_url: str,
    prompts: Sequence[Prompt],
    options: RequestOptions,
    shape: LoadShape,
    on_done: Callable[[RequestResult], None] = lambda _: None,
) -> LoadOutput:
    """Send ``prompts`` with the given load shape; ``on_done`` is called as each request finishes."""
    run_start = time.perf_counter()
    deadline = run_start + shape.time_limit_s
    slots: list[RequestResult | None] = [None] * len(prompts)

    async def send(index: int) -> None:
        result = await _timed_request(client, base_url, prompts[index], options, run_start)
        slots[index] = result
        on_done(result)

    if shape.request_rate_per_s is None:
        await _closed_loop(send, len(prompts), shape.concurrency or 1, deadline)
    else:
        await _open_loop(send, [p.slo_class for p in prompts], shape, run_start, deadline)
    duration_s = time.perf_counter() - run_start
    results = [r for r in slots if r is not None]
    return LoadOutput(results=results, duration_s=duration_s, not_sent=len(prompts) - len(results))


async def _closed_loop(send: Callable, num: int, concurrency: int, deadline: float) -> None:
    """``concurrency`` workers, each sending the next unsent request as soon as its last one ends."""
    next_index = iter(range(num))  # shared: each index is taken by exactly one worker

    async def worker() -> None:
        for index in next_index:
            if time.perf_counter() >= deadline:
                return
            await send(index)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, num))))


async def _open_loop(
    send: Callable, classes: Sequence[str | None], shape: LoadShape, run_start: float, deadline: float
) -> None:
    """Dispatch at Gamma arrival times (in time order); an optional semaphore caps the requests in flight."""
    cap = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    tasks = []

    async def capped(index: int) -> None:
        if cap is None:
            return await send(index)
        async with cap:
            # A request queued behind the cap past the deadline is dropped, like an unsent one.
            if time.perf_counter() < deadline:
                await send(index)

    assert shape.request_rate_per_s is not None
    offsets_s = class_arrival_offsets_s(
        classes, shape.request_rate_per_s, shape.seed, shape.burstiness, shape.class_burstiness
    )
    for offset_s, index in sorted(zip(offsets_s, range(len(offsets_s)))):
        send_at = run_start + offset_s
        if send_at >= deadline:
            break
        await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
        tasks.append(asyncio.create_task(capped(index)))
    await asyncio.gather(*tasks)
