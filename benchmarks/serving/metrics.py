"""Pure serving metrics computed from client-side timestamps (all times in seconds).

Definitions (the usual ones, as in vLLM's benchmark_serving):

- TTFT: request sent -> first content chunk.
- ITL (inter-token latency): time between successive content chunks of one request; the ITLs of
  all requests are pooled before summarising. Under speculative decoding a chunk may carry
  several tokens, so ITL is really inter-chunk latency.
- TPOT (time per output token): (e2e - TTFT) / (output tokens - 1), only for requests with more
  than one output token; output tokens come from the usage chunk, not from counting chunks.
- e2e latency: request sent -> end of stream.
- Request throughput: completed requests / benchmark duration. Output token throughput: output
  tokens of completed requests / benchmark duration.

Summaries are mean, median, p90 and p99 with ``numpy.percentile``'s default (linear) interpolation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from benchmarks.serving.client import RequestResult


@dataclass(frozen=True)
class LatencySummary:
    """Mean/median/p90/p99 of a list of latencies in seconds; all None when the list is empty."""

    count: int
    mean_s: float | None
    median_s: float | None
    p90_s: float | None
    p99_s: float | None


@dataclass(frozen=True)
class ServingMetrics:
    """Aggregate results of one benchmark run (times in seconds, throughputs per second)."""

    duration_s: float
    completed: int
    failed: int
    failure_reasons: dict[str, int]
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput_per_s: float | None
    output_throughput_tok_per_s: float | None
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    # Raw pooled values, kept for the CDF plots and the JSON result.
    samples_s: dict[str, list[float]] = field(default_factory=dict, repr=False)


def summarize(values_s: Sequence[float]) -> LatencySummary:
    """Mean, median, p90, p99 (numpy linear interpolation) of ``values_s``."""
    if len(values_s) == 0:
        return LatencySummary(0, None, None, None, None)
    arr = np.asarray(values_s, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return LatencySummary(len(arr), float(arr.mean()), float(p50), float(p90), float(p99))


def ttft_s(chunk_offsets_s: Sequence[float]) -> float | None:
    """Time to first content chunk: the first arrival offset (None when nothing arrived)."""
    return chunk_offsets_s[0] if chunk_offsets_s else None


def inter_chunk_latencies_s(chunk_offsets_s: Sequence[float]) -> list[float]:
    """Gaps between successive content-chunk arrival offsets (one fewer than the chunks)."""
    return [later - earlier for earlier, later in pairwise(chunk_offsets_s)]


def tpot_s(e2e_s: float, first_token_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - TTFT) / (tokens - 1); None for <= 1 token."""
    if output_tokens <= 1:
        return None
    return (e2e_s - first_token_s) / (output_tokens - 1)


def per_second(amount: float, duration_s: float) -> float | None:
    """``amount / duration_s``; None for a zero or negative duration (nothing ran)."""
    return amount / duration_s if duration_s > 0 else None


def latency_samples_s(results: Iterable[RequestResult]) -> dict[str, list[float]]:
    """Pooled TTFT/TPOT/ITL/e2e values of the successful requests, in request order."""
    samples: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2e": []}
    for r in results:
        if not r.success or r.e2e_s is None or r.output_tokens is None:
            continue
        first = ttft_s(r.chunk_offsets_s)
        if first is None:
            continue
        samples["ttft"].append(first)
        samples["e2e"].append(r.e2e_s)
        samples["itl"].extend(inter_chunk_latencies_s(r.chunk_offsets_s))
        per_token = tpot_s(r.e2e_s, first, r.output_tokens)
        if per_token is not None:
            samples["tpot"].append(per_token)
    return samples


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> ServingMetrics:
    """Aggregate a run's request results over a benchmark lasting ``duration_s`` seconds."""
    ok = [r for r in results if r.success]
    failures = Counter(r.error or "unknown error" for r in results if not r.success)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    samples = latency_samples_s(results)
    return ServingMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        failure_reasons=dict(failures.most_common()),
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=output_tokens,
        request_throughput_per_s=per_second(len(ok), duration_s),
        output_throughput_tok_per_s=per_second(output_tokens, duration_s),
        ttft=summarize(samples["ttft"]),
        tpot=summarize(samples["tpot"]),
        itl=summarize(samples["itl"]),
        e2e=summarize(samples["e2e"]),
        samples_s=samples,
    )
