"""Where a benchmark's CPU time goes: CPU seconds of every process of a tree over a stretch.

On the 2-core machine a Ray Serve request's tokens cost CPU in many processes (the HTTP proxy, the
ingress and verifier replicas, the expert and draft actors, the raylet, the client itself), and
their sum against the wall time shows how much of the machine each path uses: time the engine
thread waits is invisible in traces, but a poller spinning while it waits shows up here.

:class:`CpuAccount` reads ``/proc`` through psutil (user + system time of each process; threads
included) when entered and when left, and attributes the difference to the process's label
(:func:`benchmarks.serving.process_sampler.process_label`). A process started in between counts from
zero; one that exits before the end is not counted (its time cannot be read any more).
"""

from __future__ import annotations

import os
import time

import psutil

from benchmarks.serving.process_sampler import process_label
from benchmarks.serving.server_process import process_tree


def cpu_by_process(pid: int) -> dict[int, tuple[str, float]]:
    """``{pid: (label, user + system CPU seconds)}`` of ``pid`` and its live descendants."""
    out = {}
    for p in process_tree(pid):
        try:
            times = p.cpu_times()
            out[p.pid] = (process_label(p.cmdline()), times.user + times.system)
        except psutil.Error:  # exited while being read
            continue
    return out


class CpuAccount:
    """CPU seconds per process label of the tree rooted at ``pid`` (default: this process) while
    the ``with`` block runs.

    Attributes (after the block):
        wall_s: wall-clock seconds of the block.
        cpu_s: ``{label: CPU seconds}``, largest first (processes of one label summed).
    """

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.wall_s = 0.0
        self.cpu_s: dict[str, float] = {}
        self._start: dict[int, tuple[str, float]] = {}

    def __enter__(self) -> CpuAccount:
        self._start = cpu_by_process(self.pid)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        totals: dict[str, float] = {}
        for pid, (label, seconds) in cpu_by_process(self.pid).items():
            used = seconds - self._start.get(pid, (label, 0.0))[1]
            totals[label] = totals.get(label, 0.0) + used
        self.cpu_s = dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def per_token_ms(self, num_tokens: int, top: int = 8) -> dict[str, float]:
        """CPU milliseconds per output token by label (the ``top`` largest, the rest as "other"),
        with ``total`` and ``wall x cores`` (the machine's capacity over the block, per token)."""
        n = max(num_tokens, 1)
        labels = list(self.cpu_s.items())
        out = {label: seconds * 1e3 / n for label, seconds in labels[:top]}
        rest = sum(seconds for _, seconds in labels[top:])
        if rest:
            out["other"] = rest * 1e3 / n
        out["total"] = sum(self.cpu_s.values()) * 1e3 / n
        out["wall x cores"] = self.wall_s * (os.cpu_count() or 1) * 1e3 / n
        return out
