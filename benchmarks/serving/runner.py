"""One complete benchmark run against one server: warm-up, /metrics before, load, /metrics after."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from benchmarks.serving.acceptance import (
    AcceptanceMetrics,
    SpecDecodeCounters,
    acceptance_metrics,
    counter_deltas,
    parse_spec_decode_counters,
)
from benchmarks.serving.client import RequestOptions, RequestResult, fetch_text, resolve_model
from benchmarks.serving.dataset import Prompt
from benchmarks.serving.goodput import GoodputMetrics, SloConfig, compute_goodput
from benchmarks.serving.loadgen import LoadShape, run_load
from benchmarks.serving.metrics import ServingMetrics, compute_metrics

CONNECT_TIMEOUT_S = 30.0


@dataclass
class BenchmarkRun:
    """Everything measured in one run (``label`` names the server configuration)."""

    label: str
    base_url: str
    shape: LoadShape
    options: RequestOptions
    results: list[RequestResult]
    metrics: ServingMetrics
    counter_deltas: SpecDecodeCounters
    acceptance: AcceptanceMetrics
    not_sent: int
    warmup_failed: int
    goodput: GoodputMetrics | None = None  # per-class reports; goodput itself only with SLOs
    endpoints: tuple[str, ...] = ()  # the endpoints the prompts went to (a dataset row may name its own)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect once, then freeze every existing object out of the garbage collector's reach.

    Why: a full collection walks every live object (with torch or matplotlib imported, ~100 ms);
    one landing mid-request would add that pause to a measured TTFT or ITL. Frozen objects are
    skipped, so collections during the run only walk what the run itself allocated.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def make_client(options: RequestOptions, concurrency: int | None) -> httpx.AsyncClient:
    """An HTTP client sized for the load: one connection per concurrent request."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(options.request_timeout_s, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        # Talk only to the given base URL: proxy settings from the environment must not reroute it.
        trust_env=False,
    )


async def run_benchmark(
    base_url: str,
    prompts: Sequence[Prompt],
    options: RequestOptions,
    shape: LoadShape,
    warmup_prompts: Sequence[Prompt] = (),
    label: str = "default",
    show_progress: bool = True,
    slos: SloConfig | None = None,
) -> BenchmarkRun:
    """Warm up (not counted), then measure ``prompts`` under ``shape`` and read acceptance deltas.

    ``slos``: the latency budgets goodput and per-class attainment are judged against.

    The model name is asked of ``GET /v1/models`` when ``options.model`` is None. Warm-up uses the
    same concurrency (closed loop, so it does not wait for Poisson arrivals) and time limit.
    """
    base_url = base_url.rstrip("/")
    async with make_client(options, shape.concurrency) as client:
        if options.model is None:
            options = dataclasses.replace(options, model=await resolve_model(client, base_url))
        warmup_failed = 0
        if warmup_prompts:
            warm_shape = LoadShape(concurrency=shape.concurrency or 1, time_limit_s=shape.time_limit_s)
            warm = await run_load(client, base_url, warmup_prompts, options, warm_shape)
            warmup_failed = sum(not r.success for r in warm.results)
        before = parse_spec_decode_counters(await fetch_text(client, base_url + "/metrics"))
        with tqdm(total=len(prompts), desc=label, disable=not show_progress, unit="req") as bar, gc_frozen():
            load = await run_load(client, base_url, prompts, options, shape, on_done=lambda _: bar.update(1))
        after = parse_spec_decode_counters(await fetch_text(client, base_url + "/metrics"))
    deltas = counter_deltas(before, after)
    return BenchmarkRun(
        label=label,
        base_url=base_url,
        shape=shape,
        options=options,
        results=load.results,
        metrics=compute_metrics(load.results, load.duration_s),
        counter_deltas=deltas,
        acceptance=acceptance_metrics(deltas),
        not_sent=load.not_sent,
        warmup_failed=warmup_failed,
        goodput=compute_goodput(load.results, load.duration_s, slos or SloConfig()),
        endpoints=tuple(sorted({p.endpoint or options.endpoint for p in prompts})),
    )
