"""The machine a benchmark ran on, as its JSON result records it (no torch import: the load
generator stays light).

The CPU model and the load average matter here: the project's VM has changed CPU between
sessions (an in-process engine ran 2x faster on one than the other) and results taken while
another process loads the cores are not comparable (two OpenMP threads on two busy cores made
every op ~15x slower in one in-process run).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_facts() -> dict:
    """``platform``, ``cpu_model``, ``num_cpus`` and ``load_avg`` (1, 5 and 15 min) of this host."""
    return {"platform": platform.platform(), "cpu_model": cpu_model(), "num_cpus": os.cpu_count(),
            "load_avg": list(os.getloadavg())}
