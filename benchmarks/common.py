"""Shared bits of the benchmark scripts: prompts, timing, tables, JSON results."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.serving.host import host_facts

ROOT = Path(__file__).resolve().parents[1]
TARGET = str(ROOT / "checkpoints/stdlib-moe-target")
DRAFT = str(ROOT / "checkpoints/stdlib-draft")
EAGLE3 = str(ROOT / "checkpoints/stdlib-eagle3")
PROMPTS = ROOT / "benchmarks/data/stdlib_heldout.jsonl"


def load_prompts(n: int, offset: int = 0) -> list[dict]:
    """The first ``n`` held-out prompt rows after ``offset`` (the production prompt mix)."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    return rows[offset: offset + n]


def machine() -> dict:
    """:func:`benchmarks.serving.host.host_facts` (CPU model, load average) plus torch's version,
    threads and CUDA device."""
    return {**host_facts(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on a CUDA ``device`` (nothing elsewhere), so timers include it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Wall-clock seconds of a block: ``with Timer() as t: ...; t.elapsed_s``."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.elapsed_s = time.perf_counter() - self.start


def call_times_ms(iters: int, fn, *args) -> tuple[float, float]:
    """Median and p99 milliseconds of ``fn(*args)`` (wall clock, host side: sync inside ``fn`` for
    device work), after 20 uncounted calls."""
    for _ in range(20):
        fn(*args)
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - t) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def save_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
