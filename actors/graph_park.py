"""Parking an idle compiled graph instead of tearing it down (the actor side).

Ray 2.60's channel readers spin (``sched_yield``) while they wait for the next execution, so an
idle live graph costs each actor most of a core, and a teardown plus rebuild costs ~2 s of CPU and
leaks the graph's channel buffers (``benchmarks/graph_channel_leak.py``). A *parking* execution
(request :data:`PARK`) makes every bound method block on a semaphore instead: the actor then sits
in a plain ``acquire`` (no spinning; measured 0.05 against 4.5 CPU s per 3 idle s for a two-actor
graph on the 2-core VM) until the driver releases it with an ordinary actor call
(:meth:`GraphParking.wake_graph`, which runs on the actor's second concurrency slot) and reads the
parking execution's result: ~5 ms, against ~0.4-1.2 s for a first request that rebuilt the graph.
"""

from __future__ import annotations

import threading

PARK = "specmoe-park-graph"  # the request of a parking execution (compared by value: it is pickled)
MAX_PARK_S = 24 * 3600.0  # a parked method returns after this long anyway (a lost wake-up)


class GraphParking:
    """Base of actors bound in a compiled graph: ``_parked(request)`` inside the bound method;
    subclasses call ``super().__init__()`` (the semaphore must exist before either thread uses it)."""

    def __init__(self) -> None:
        self._graph_semaphore = threading.Semaphore(0)

    def _parked(self, request) -> bool:
        """True (after the wake-up) if ``request`` was the parking execution's."""
        if not (isinstance(request, str) and request == PARK):
            return False
        self._graph_semaphore.acquire(timeout=MAX_PARK_S)
        return True

    def wake_graph(self, bindings: int = 1) -> None:
        """Release the parked executions of this actor's ``bindings`` bound methods (an actor
        bound twice, as a guest replica's host is, parks twice). A release before the park is
        kept, so the order of the wake call and the parking execution does not matter."""
        self._graph_semaphore.release(bindings)
