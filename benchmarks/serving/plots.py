"""PNG figures: latency CDFs, and for sweeps throughput / p99 latency vs concurrency, acceptance
per draft position, and goodput / per-class TTFT and TPOT vs offered load (request-rate sweeps).
matplotlib is imported lazily (Agg backend) so the rest runs without it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.serving.acceptance import AcceptanceMetrics
from benchmarks.serving.runner import BenchmarkRun

_CDF_PANELS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E latency"))
_P99_PANELS = (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _run_label(run: BenchmarkRun) -> str:
    return f"{run.label} c={run.shape.concurrency}"


def plot_latency_cdfs(runs: Sequence[BenchmarkRun], out_dir: Path) -> Path:
    """``latency_cdf.png``: empirical CDFs of TTFT, ITL and e2e latency (ms), one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_CDF_PANELS), figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, _CDF_PANELS, strict=True):
        for run in runs:
            values_ms = np.sort(np.asarray(run.metrics.samples_s.get(key, []))) * 1e3
            if len(values_ms):
                ax.step(
                    values_ms,
                    np.arange(1, len(values_ms) + 1) / len(values_ms),
                    where="post",
                    label=_run_label(run),
                )
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, plt, out_dir / "latency_cdf.png")


def _by_config(runs: Sequence[BenchmarkRun]) -> dict[str, list[BenchmarkRun]]:
    groups: dict[str, list[BenchmarkRun]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    return {name: sorted(rs, key=lambda r: r.shape.concurrency or 0) for name, rs in groups.items()}


def plot_throughput(runs: Sequence[BenchmarkRun], out_dir: Path) -> Path:
    """``throughput_vs_concurrency.png``: output tok/s and req/s vs concurrency per configuration."""
    plt = _pyplot()
    fig, (ax_tok, ax_req) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rs in _by_config(runs).items():
        xs = [r.shape.concurrency for r in rs]
        ax_tok.plot(xs, [r.metrics.output_throughput_tok_per_s or np.nan for r in rs], marker="o", label=name)
        ax_req.plot(xs, [r.metrics.request_throughput_per_s or np.nan for r in rs], marker="o", label=name)
    ax_tok.set(title="Output token throughput", xlabel="concurrency", ylabel="tokens/s")
    ax_req.set(title="Request throughput", xlabel="concurrency", ylabel="requests/s")
    for ax in (ax_tok, ax_req):
        _concurrency_axis(ax, runs)
    ax_tok.legend(fontsize="small")
    return _save(fig, plt, out_dir / "throughput_vs_concurrency.png")


def plot_p99_latency(runs: Sequence[BenchmarkRun], out_dir: Path) -> Path:
    """``p99_latency_vs_concurrency.png``: p99 TTFT/ITL/TPOT/e2e (ms) vs concurrency per configuration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_P99_PANELS), figsize=(18, 4.5))
    groups = _by_config(runs)
    for ax, (key, title) in zip(axes, _P99_PANELS, strict=True):
        for name, rs in groups.items():
            p99_ms = [(getattr(r.metrics, key).p99_s or np.nan) * 1e3 for r in rs]
            ax.plot([r.shape.concurrency for r in rs], p99_ms, marker="o", label=name)
        ax.set(title=f"p99 {title}", xlabel="concurrency", ylabel="ms")
        _concurrency_axis(ax, runs)
    axes[0].legend(fontsize="small")
    return _save(fig, plt, out_dir / "p99_latency_vs_concurrency.png")


def plot_acceptance(acceptance: dict[str, AcceptanceMetrics], out_dir: Path) -> Path | None:
    """``acceptance_per_position.png``: accepted-at-position / drafts per configuration; None
    when no configuration reported per-position counters."""
    with_data = {name: acc for name, acc in acceptance.items() if acc.per_position}
    if not with_data:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, acc in with_data.items():
        positions = sorted(acc.per_position)
        ax.plot(positions, [acc.per_position[p] for p in positions], marker="o", label=name)
    ax.set(
        title="Acceptance per draft position",
        xlabel="draft position",
        ylabel="accepted / drafts",
        ylim=(0, 1.02),
    )
    ax.set_xticks(sorted({p for acc in with_data.values() for p in acc.per_position}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, plt, out_dir / "acceptance_per_position.png")


_CLASS_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"))


def plot_goodput(runs: Sequence[BenchmarkRun], out_dir: Path) -> Path | None:
    """``goodput_vs_load.png``: goodput (req/s) vs offered load per configuration, and per class
    p50 (dashed) / p99 (solid) TTFT and TPOT (ms) vs offered load; None unless the sweep varied
    the request rate."""
    swept = [r for r in runs if r.shape.request_rate_per_s is not None and r.goodput is not None]
    if len({r.shape.request_rate_per_s for r in swept}) < 2:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 1 + len(_CLASS_PANELS), figsize=(18, 4.8))
    groups: dict[str, list[BenchmarkRun]] = {}
    for run in swept:
        groups.setdefault(run.label, []).append(run)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.shape.request_rate_per_s)
        rates = [r.shape.request_rate_per_s for r in rs]
        goodput = [r.goodput.goodput_req_per_s for r in rs]
        goodput = [np.nan if g is None else g for g in goodput]
        axes[0].plot(rates, goodput, marker="o", label=name)
        classes = dict.fromkeys(c.name for r in rs for c in r.goodput.classes)
        for ax, (key, title) in zip(axes[1:], _CLASS_PANELS, strict=True):
            for cls in classes:
                by_rate = [{c.name: c for c in r.goodput.classes}.get(cls) for r in rs]
                color = None  # p50 and p99 of one (configuration, class) share a colour
                for stat, style, label in (("median_s", "--", "p50"), ("p99_s", "-", "p99")):
                    values_s = [None if c is None else getattr(getattr(c, key), stat) for c in by_rate]
                    values_ms = [np.nan if v is None else v * 1e3 for v in values_s]
                    (line,) = ax.plot(
                        rates,
                        values_ms,
                        style,
                        color=color,
                        marker="o",
                        markersize=3,
                        label=f"{name} {cls} {label}",
                    )
                    color = line.get_color()
            ax.set(
                title=f"{title} per class (p50 dashed, p99 solid)", xlabel="offered load (req/s)", ylabel="ms"
            )
    all_rates = sorted({r.shape.request_rate_per_s for r in swept})
    axes[0].plot(all_rates, all_rates, ":", color="grey", label="offered load")
    axes[0].set(title="Goodput (requests meeting every SLO)", xlabel="offered load (req/s)", ylabel="req/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    return _save(fig, plt, out_dir / "goodput_vs_load.png")


def plot_slo_attainment(runs: Sequence[BenchmarkRun], out_dir: Path, targets: Sequence[float] = (0.9, 0.99)) -> Path | None:
    """``slo_attainment_vs_load.png``: the fraction of requests sent that met every SLO vs offered
    load, per configuration (runs of one configuration and rate averaged), with the ``targets``
    as dotted lines; None unless the sweep varied the request rate and had SLOs."""
    swept = [r for r in runs if r.shape.request_rate_per_s is not None and r.goodput and r.goodput.good is not None]
    if len({r.shape.request_rate_per_s for r in swept}) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, rs in _by_config(swept).items():
        by_rate: dict[float, list[float]] = {}
        for r in rs:
            by_rate.setdefault(r.shape.request_rate_per_s, []).append(r.goodput.slo_attainment)
        rates = sorted(by_rate)
        ax.plot(rates, [100 * float(np.mean(by_rate[x])) for x in rates], marker="o", label=name)
    for t in targets:
        ax.axhline(100 * t, linestyle=":", color="grey")
    ax.set(title="SLO attainment (requests sent meeting every SLO)", xlabel="offered load (req/s)", ylabel="%")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, plt, out_dir / "slo_attainment_vs_load.png")


def _concurrency_axis(ax, runs: Sequence[BenchmarkRun]) -> None:
    """Log-2 x axis with a plain-number tick at every concurrency that was run."""
    ax.set_xscale("log", base=2)
    ticks = sorted({r.shape.concurrency for r in runs if r.shape.concurrency})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
