"""Straggler detection for one MoE layer dispatch, and per-replica latency tracking.

The rule (``StragglerDetector.flag``), applied to the calls of ONE dispatch (one layer, one
step): a call is a straggler iff

    latency > multiple * median(latencies of that dispatch)   AND   latency > floor_ms

* Both comparisons are strict: a latency exactly at either threshold is not flagged.
* The median of an even number of calls is the mean of the two middle values.
* Fewer than 2 valid calls: nothing is flagged (there is nothing to compare against).
* With exactly 2 calls the median is their mean, so the slower one can be flagged only if
  ``multiple < 2`` (b > m(a+b)/2 needs m < 2 when a >= 0): with the default 3.0 a 2-call
  dispatch never has a straggler.
* The floor keeps sub-millisecond jitter on tiny calls from counting as straggling.
* NaN, infinite or negative latencies are ignored (neither compared nor flagged).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Hashable, Mapping
from typing import TypeVar

logger = logging.getLogger("observability")

K = TypeVar("K", bound=Hashable)


class StragglerDetector:
    """Flags slow expert calls within a dispatch and counts flags per (layer, expert).

    Args:
        multiple: a call is slow if its latency exceeds ``multiple`` x the dispatch median.
        floor_ms: ...and exceeds this absolute latency, milliseconds.
    """

    def __init__(self, multiple: float = 3.0, floor_ms: float = 5.0) -> None:
        if not multiple > 0 or not floor_ms >= 0:
            raise ValueError(f"need multiple > 0 and floor_ms >= 0, got {multiple}, {floor_ms}")
        self.multiple = float(multiple)
        self.floor_ms = float(floor_ms)
        self._counts: dict[tuple[Hashable, Hashable], int] = {}
        self._dispatches = 0
        self._lock = threading.Lock()

    def flag(self, latencies_ms: Mapping[K, float], layer: Hashable | None = None) -> set[K]:
        """Keys of ``latencies_ms`` (call latency, ms, of each call of one dispatch) that are
        stragglers under the module's rule. Counts each flag under ``(layer, key)``.
        Never raises (returns an empty set on bad input)."""
        try:
            valid = {k: float(v) for k, v in latencies_ms.items() if _valid(v)}
            flagged: set[K] = set()
            if len(valid) >= 2:
                threshold = max(self.multiple * statistics.median(valid.values()), self.floor_ms)
                flagged = {k for k, v in valid.items() if v > threshold}
            with self._lock:
                self._dispatches += 1
                for k in flagged:
                    self._counts[(layer, k)] = self._counts.get((layer, k), 0) + 1
            return flagged
        except Exception:
            logger.debug("straggler detection failed", exc_info=True)
            return set()

    def counts(self) -> dict[tuple[Hashable, Hashable], int]:
        """``{(layer, expert): times flagged}`` since creation or ``reset``."""
        with self._lock:
            return dict(self._counts)

    @property
    def num_dispatches(self) -> int:
        """Dispatches examined (including those with < 2 calls)."""
        return self._dispatches

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._dispatches = 0


def _valid(v: object) -> bool:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(f) and f >= 0.0
