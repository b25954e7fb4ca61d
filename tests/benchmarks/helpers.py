"""Shared helpers of the serving-benchmark tests: prompt files, the stub's expected timings, runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving.client import RequestOptions
from benchmarks.serving.dataset import Prompt
from benchmarks.serving.loadgen import LoadShape
from benchmarks.serving.metrics import LatencySummary, summarize
from benchmarks.serving.runner import BenchmarkRun, run_benchmark
from tests.benchmarks.stub_server import SCRIPTS, TTFT_MS, StubServer

TOL_S = 0.015  # timing tolerance for anything measured against real sleeps
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


def scripted(key: str, ttft_ms: float = TTFT_MS) -> dict:
    """Expected client-side timings of one scripted request, in seconds."""
    gaps_s = [g / 1e3 for g in SCRIPTS[key].chunk_gaps_ms]
    offsets = list(np.cumsum([ttft_ms / 1e3] + gaps_s))
    tokens = SCRIPTS[key].output_tokens
    tpot = (offsets[-1] - offsets[0]) / (tokens - 1) if tokens > 1 else None
    return {"offsets": offsets, "e2e": offsets[-1], "itls": gaps_s, "tpot": tpot}


def scripted_starts(keys: list[str], concurrency: int) -> tuple[list[float], float]:
    """Send times of a closed loop with ``concurrency`` workers taking prompts in order, and the
    makespan (scripted failures take ~0 s)."""
    free_at = [0.0] * concurrency
    starts = []
    for key in keys:
        worker = min(range(concurrency), key=free_at.__getitem__)
        starts.append(free_at[worker])
        free_at[worker] += scripted(key)["e2e"] if SCRIPTS[key].fail_status is None else 0.0
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
