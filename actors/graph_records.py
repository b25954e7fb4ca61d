"""What an :class:`actors.compiled_graph.ActorGraph` records: the counters of its life
(:class:`GraphStats`) and each execution submitted to it (:class:`Execution`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GraphStats:
    """Counters of the graph's life (verifier stats, tests, benchmarks)."""

    builds: int = 0
    build_failures: int = 0
    executions: int = 0
    failures: int = 0
    parks: int = 0  # idle periods spent parked (actors blocked, not polling)
    oversize: int = 0  # messages too large for the channels, sent another way
    rebuilds: int = 0
    late: int = 0  # executions past their hedge deadline (the graph dropped, the caller hedged)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Execution:
    """One submitted graph execution: the graph it went to, its result reference, when it was
    submitted (``time.monotonic()``), and whether :meth:`actors.compiled_graph.ActorGraph.wait`
    gave up on it at its hedge deadline (``late``) or after the graph's whole ``timeout_s``
    (``timed_out``: a member is hung or very slow)."""

    dag: Any
    ref: Any
    sent_mono_s: float = 0.0
    late: bool = False
    timed_out: bool = False
