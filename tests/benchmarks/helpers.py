"""Shared helpers of the serving-benchmark tests: prompt files, the stub's expected timings, runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving.client import RequestOptions, RequestResult
from benchmarks.serving.dataset import Prompt
from benchmarks.serving.loadgen import LoadShape
from benchmarks.serving.metrics import LatencySummary, summarize
from benchmarks.serving.runner import BenchmarkRun, run_benchmark
from tests.benchmarks.stub_server import SCRIPTS, TTFT_MS, StubServer

TOL_S = 0.015  # a client's timing vs the stub's logged send (loopback, a thread hop, connection setup)
MEASURED = ["alpha", "beta", "gamma", "delta", "fail"]


def write_prompts(path: Path, ids: Sequence[str], max_tokens: int = 16) -> Path:
    """A JSONL dataset whose prompt texts are stub script keys (row format of stdlib_heldout.jsonl)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, key in enumerate(ids):
            row = {
                "id": f"{key}-{i}",
                "module": "stub",
                "prompt": key,
                "num_prompt_tokens": SCRIPTS[key].prompt_tokens,
                "max_tokens": max_tokens + i,
            }
            f.write(json.dumps(row) + "\n")
    return path


def _timings(offsets_s: list[float], e2e_s: float, tokens: int) -> dict:
    tpot = (offsets_s[-1] - offsets_s[0]) / (tokens - 1) if tokens > 1 else None
    return {"offsets": offsets_s, "e2e": e2e_s, "itls": list(np.diff(offsets_s)), "tpot": tpot}


def scripted(key: str, ttft_ms: float = TTFT_MS) -> dict:
    """Client-side timings the script asks for, in seconds: chunk offsets, e2e, ITLs and TPOT."""
    gaps_s = [g / 1e3 for g in SCRIPTS[key].chunk_gaps_ms]
    offsets = [float(t) for t in np.cumsum([ttft_ms / 1e3] + gaps_s)]
    return _timings(offsets, offsets[-1], SCRIPTS[key].output_tokens)


def served(server: StubServer, key: str) -> dict:
    """What the stub actually did for its last stream of prompt ``key`` (the ``scripted`` keys),
    in seconds from the request's arrival: the ground truth a client's measurement is held to,
    whatever a loaded machine did to the stub's sleeps."""
    log = [s for s in server.streams if s.prompt == key][-1]
    assert log.done_sent_s is not None, f"{key}: the stream did not end with [DONE]"
    offsets = [t - log.arrived_s for t in log.chunk_sent_s]
    return _timings(offsets, log.done_sent_s - log.arrived_s, SCRIPTS[key].output_tokens)


def assert_client_saw(result: RequestResult, exp: dict) -> None:
    """``result``'s chunk and [DONE] times against the stub's sends of that stream (``served``):
    never before the send (one clock in one process), every lag within ``TOL_S`` of the others
    (receipt jitter), and the common lag (connection setup and the request's trip) under 2 TOL_S."""
    lags_s = np.array(result.chunk_offsets_s + [result.e2e_s]) - np.array(exp["offsets"] + [exp["e2e"]])
    assert lags_s.min() >= 0.0, (result.prompt_id, lags_s)
    assert lags_s.max() - lags_s.min() <= TOL_S, (result.prompt_id, lags_s)
    assert lags_s.min() <= 2 * TOL_S, (result.prompt_id, lags_s)


def closed_loop_starts(durations_s: Sequence[float], concurrency: int) -> tuple[list[float], float]:
    """Send times of a closed loop whose ``concurrency`` workers take requests in order, each
    lasting its duration, and the makespan, in seconds."""
    free_at = [0.0] * concurrency
    starts = []
    for duration_s in durations_s:
        worker = min(range(concurrency), key=free_at.__getitem__)
        starts.append(free_at[worker])
        free_at[worker] += duration_s
    return starts, max(free_at)


def run(
    server: StubServer, keys: list[str], shape: LoadShape, warmup: Sequence[str] = (), **options
) -> BenchmarkRun:
    """Measure ``keys`` (prompt = script key, max_tokens 16) against ``server``; ``options`` go to RequestOptions."""
    prompts = [Prompt(key, key, max_tokens=16) for key in keys]
    warmup_prompts = [Prompt(f"warmup-{key}", key, max_tokens=16) for key in warmup]
    return asyncio.run(
        run_benchmark(
            server.base_url,
            prompts,
            RequestOptions(**options),
            shape,
            warmup_prompts=warmup_prompts,
            show_progress=False,
        )
    )


def assert_summary_exact(summary: LatencySummary, values: list[float]) -> None:
    """Independent recomputation (numpy, linear percentiles) from the recorded values."""
    assert summary.count == len(values)
    assert summary.mean_s == float(np.mean(values))
    assert [summary.median_s, summary.p90_s, summary.p99_s] == [
        float(v) for v in np.percentile(values, [50, 90, 99])
    ]


def assert_summary_close(summary: LatencySummary, values: list[float], tol_s: float = TOL_S) -> None:
    """Against the script: every statistic within the timing tolerance."""
    expected = summarize(values)
    for field in ("mean_s", "median_s", "p90_s", "p99_s"):
        assert getattr(summary, field) == pytest.approx(getattr(expected, field), abs=tol_s), field
