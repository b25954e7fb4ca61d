"""Printed tables and the JSON result (times are seconds in JSON, milliseconds in tables)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from benchmarks.serving.acceptance import AcceptanceMetrics
from benchmarks.serving.goodput import UNCLASSIFIED, GoodputMetrics, Slo
from benchmarks.serving.metrics import LatencySummary
from benchmarks.serving.runner import BenchmarkRun
from benchmarks.serving.sweep import BaselineRatios, SweepFailure

NA = "n/a"
WIDTH = 52


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """``value * scale`` with ``digits`` decimals, or "n/a" for None."""
    return NA if value is None else f"{value * scale:.{digits}f}"


def _row(name: str, value: str) -> str:
    return f"{name + ':':<40}{value:>12}"


def _section(title: str) -> str:
    return f"{' ' + title + ' ':-^{WIDTH}}"


def _latency_rows(title: str, short: str, summary: LatencySummary) -> list[str]:
    """Mean/median/p90/p99 rows of one latency, in milliseconds."""
    return [
        _section(title),
        _row(f"Mean {short} (ms)", fmt(summary.mean_s, 1e3)),
        _row(f"Median {short} (ms)", fmt(summary.median_s, 1e3)),
        _row(f"P90 {short} (ms)", fmt(summary.p90_s, 1e3)),
        _row(f"P99 {short} (ms)", fmt(summary.p99_s, 1e3)),
    ]


def _acceptance_rows(acc: AcceptanceMetrics) -> list[str]:
    rows = [
        _section("Speculative decoding (/metrics deltas)"),
        _row("Drafts", fmt(acc.num_drafts, digits=0)),
        _row("Draft tokens", fmt(acc.num_draft_tokens, digits=0)),
        _row("Accepted tokens", fmt(acc.num_accepted_tokens, digits=0)),
        _row("Acceptance rate", fmt(acc.acceptance_rate, digits=4)),
        _row("Mean acceptance length", fmt(acc.mean_acceptance_length, digits=4)),
    ]
    if not acc.per_position:
        rows.append(_row("Acceptance per position", NA))
    rows += [
        _row(f"Acceptance at position {pos}", fmt(value, digits=4)) for pos, value in acc.per_position.items()
    ]
    return rows


def shape_text(run: BenchmarkRun) -> str:
    """'concurrency 4' / 'Poisson 2 req/s, max concurrency 4' / 'Gamma(0.5) 2 req/s' for headers."""
    shape = run.shape
    if shape.request_rate_per_s is None:
        return f"concurrency {shape.concurrency}"
    cap = f", max concurrency {shape.concurrency}" if shape.concurrency else ""
    process = "Poisson" if shape.burstiness == 1.0 else f"Gamma({shape.burstiness:g})"
    if shape.class_burstiness:
        process += " [" + ", ".join(f"{k}: {v:g}" for k, v in shape.class_burstiness.items()) + "]"
    return f"{process} {shape.request_rate_per_s:g} req/s{cap}"


def slo_text(slo: Slo) -> str:
    """'TTFT<=500 TPOT<=50' (ms), '-' for no SLO."""
    parts = [
        f"{label}<={value:g}"
        for label, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2EL", slo.e2el_ms))
        if value is not None
    ]
    return " ".join(parts) or "-"


def has_goodput(g: GoodputMetrics | None) -> bool:
    """Worth reporting: SLOs were given or the requests carry classes."""
    return g is not None and (g.good is not None or any(c.name != UNCLASSIFIED for c in g.classes))


def _goodput_rows(g: GoodputMetrics | None) -> list[str]:
    """Goodput and one block per request class (omitted for an unclassified run without SLOs)."""
    if g is None or not has_goodput(g):
        return []
    rows = [_section("Goodput and SLO attainment")]
    if g.good is not None:
        rows += [
            _row("Good requests", str(g.good)),
            _row("Goodput (req/s)", fmt(g.goodput_req_per_s)),
            _row("SLO attainment", fmt(g.slo_attainment, digits=4)),
        ]
    for c in g.classes:
        rows += [
            f"  class {c.name} ({slo_text(c.slo)} ms): {c.requests} sent, {c.completed} ok, "
            f"attainment {fmt(c.slo_attainment, digits=4)}",
            f"    TTFT p50/p99 {fmt(c.ttft.median_s, 1e3)}/{fmt(c.ttft.p99_s, 1e3)} ms, "
            f"TPOT p50/p99 {fmt(c.tpot.median_s, 1e3)}/{fmt(c.tpot.p99_s, 1e3)} ms",
        ]
    return rows


def format_run(run: BenchmarkRun) -> str:
    """The human-readable result table of one run."""
    m = run.metrics
    rows = [
        f"{' Serving benchmark: ' + run.label + ' ':=^{WIDTH}}",
        _row("Base URL", run.base_url),
        _row("Endpoint / load", f"{' + '.join(run.endpoints) or run.options.endpoint}, {shape_text(run)}"),
        _row("Successful requests", str(m.completed)),
        _row("Failed requests", str(m.failed)),
    ]
    rows += [f"  {count} x {reason}" for reason, count in m.failure_reasons.items()]
    if run.not_sent:
        rows.append(_row("Not sent (time limit)", str(run.not_sent)))
    if run.warmup_failed:
        rows.append(_row("Failed warm-up requests", str(run.warmup_failed)))
    rows += [
        _row("Benchmark duration (s)", fmt(m.duration_s)),
        _row("Total input tokens", str(m.total_prompt_tokens)),
        _row("Total generated tokens", str(m.total_output_tokens)),
        _row("Request throughput (req/s)", fmt(m.request_throughput_per_s)),
        _row("Output token throughput (tok/s)", fmt(m.output_throughput_tok_per_s)),
    ]
    rows += _latency_rows("Time to First Token", "TTFT", m.ttft)
    rows += _latency_rows("Time per Output Token (excl. 1st)", "TPOT", m.tpot)
    rows += _latency_rows("Inter-token Latency", "ITL", m.itl)
    rows += _latency_rows("End-to-end Latency", "E2E", m.e2e)
    rows += _goodput_rows(run.goodput)
    rows += _acceptance_rows(run.acceptance)
    return "\n".join(rows + ["=" * WIDTH])


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned to their widest cell (the first column left-aligned)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = []
    for cells in [header, *rows]:
        first = f"{cells[0]:<{widths[0]}}"
        lines.append("  ".join([first] + [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True)]))
    return "\n".join(lines)


def format_sweep(runs: Sequence[BenchmarkRun], failures: Sequence[SweepFailure]) -> str:
    """One line per (configuration, concurrency): throughputs, latencies in ms, acceptance."""
    header = [
        "config",
        "conc",
        "req/s in",
        "ok",
        "fail",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p99",
        "accept",
        "mean len",
    ]
    rows = []
    for run in runs:
        m, a = run.metrics, run.acceptance
        rows.append(
            [
                run.label,
                str(run.shape.concurrency),
                _rate(run.shape.request_rate_per_s),
                str(m.completed),
                str(m.failed),
                fmt(m.request_throughput_per_s),
                fmt(m.output_throughput_tok_per_s),
                fmt(m.ttft.median_s, 1e3),
                fmt(m.itl.median_s, 1e3),
                fmt(m.itl.p99_s, 1e3),
                fmt(m.tpot.median_s, 1e3),
                fmt(m.tpot.p99_s, 1e3),
                fmt(m.e2e.p99_s, 1e3),
                fmt(a.acceptance_rate, digits=3),
                fmt(a.mean_acceptance_length, digits=3),
            ]
        )
    text = "Sweep results (latencies in ms)\n" + _table(header, rows)
    for failure in failures:
        text += f"\nFAILED configuration {failure.name}: {failure.reason}"
    return text


def format_goodput_sweep(runs: Sequence[BenchmarkRun]) -> str:
    """One line per (configuration, load point, class): attainment and TTFT/TPOT p50/p99 in ms,
    and the run's goodput ('' when no run has SLOs or classes)."""
    header = [
        "config",
        "conc",
        "req/s in",
        "goodput",
        "class",
        "sent",
        "attain",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
    ]
    rows = []
    for run in runs:
        g = run.goodput
        for c in g.classes if g is not None and has_goodput(g) else []:
            rate = run.shape.request_rate_per_s
            rows.append(
                [
                    run.label,
                    str(run.shape.concurrency),
                    _rate(rate),
                    fmt(g.goodput_req_per_s),
                    c.name,
                    str(c.requests),
                    fmt(c.slo_attainment, digits=3),
                    fmt(c.ttft.median_s, 1e3),
                    fmt(c.ttft.p99_s, 1e3),
                    fmt(c.tpot.median_s, 1e3),
                    fmt(c.tpot.p99_s, 1e3),
                ]
            )
    if not rows:
        return ""
    return "Goodput (req/s) and SLO attainment per class (latencies in ms)\n" + _table(header, rows)


def format_ratios(rows: Sequence[BaselineRatios], baseline: str) -> str:
    """Ratios against the baseline (value / baseline; > 1 means more throughput or more latency)."""
    if not rows:
        return f"No ratios: no run of baseline configuration {baseline!r}."
    header = ["config", "conc", "req/s in", "out tok/s", "ITL p50", "ITL p99", "TPOT p50", "TPOT p99"]
    body = [
        [
            r.name,
            str(r.concurrency),
            _rate(r.request_rate_per_s),
            fmt(r.output_throughput, digits=3),
            fmt(r.itl_p50, digits=3),
            fmt(r.itl_p99, digits=3),
            fmt(r.tpot_p50, digits=3),
            fmt(r.tpot_p99, digits=3),
        ]
        for r in rows
    ]
    return f"Ratios vs baseline {baseline!r} (config / baseline)\n" + _table(header, body)


def _jsonable(obj: Any) -> Any:
    """dataclasses -> dicts with string keys (JSON object keys must be strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def run_to_dict(run: BenchmarkRun, include_requests: bool = True) -> dict[str, Any]:
    """JSON-ready result of one run; per-request records (timestamps in s) when asked."""
    data = _jsonable(run)
    data["metrics"].pop("samples_s", None)  # the per-request records hold the same data
    if not include_requests:
        data.pop("results")
    return data


def sweep_to_dict(
    runs: Sequence[BenchmarkRun],
    failures: Sequence[SweepFailure],
    ratios: Sequence[BaselineRatios],
    acceptance: dict[str, AcceptanceMetrics],
    baseline: str,
) -> dict[str, Any]:
    """JSON-ready result of a sweep."""
    return {
        "baseline": baseline,
        "runs": [run_to_dict(r) for r in runs],
        "failures": _jsonable(list(failures)),
        "ratios_vs_baseline": _jsonable(list(ratios)),
        "acceptance_by_config": _jsonable(acceptance),
    }


def _rate(rate_per_s: float | None) -> str:
    """A load point's offered request rate (req/s), or n/a for a fixed-concurrency run."""
    return NA if rate_per_s is None else f"{rate_per_s:g}"
