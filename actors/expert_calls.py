"""What the expert router keeps about each call: its record (telemetry), its rows, its attempts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actors.expert_pool import Replica


@dataclass
class CallRecord:
    """One expert-group call of a layer dispatch (times: ``time.time()`` seconds)."""

    layer: int
    group: int
    expert_ids: list[int]
    counts: list[int]
    rows: int
    replica: str = ""
    transport: str = ""
    sent_s: float = 0.0
    done_s: float = 0.0
    attempts: int = 0
    hedges: int = 0  # extra replicas this call was sent to after its hedge deadline
    hedge_won: bool = False  # the answer came from a hedge, not the first send
    timing: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    span: Any = None

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.sent_s) * 1e3


class NullTelemetry:
    """Router hooks that do nothing (``actors.telemetry.RouterTelemetry`` plugs in here)."""

    def current_carrier(self) -> dict | None:
        return None

    def begin_dispatch(self, layer: int, num_tokens: int, records: list[CallRecord], parent: dict | None) -> Any:
        return None

    def call_carrier(self, dispatch_ctx: Any, record: CallRecord) -> dict | None:
        return None

    def abandon_call(self, record: CallRecord, reason: str) -> None:
        return None

    def hedge_call(self, record: CallRecord, from_replica: str, to_replica: str, waited_ms: float) -> None:
        return None

    def end_dispatch(self, dispatch_ctx: Any, layer: int, expert_counts: list[int], records: list[CallRecord],
                     error: str | None = None) -> None:
        return None


@dataclass
class Call:
    """One contiguous part of a group's rows in a layer: its record and rows (encoded per
    transport when sent), the layer rows ``[start, end)`` it fills, the replica planned for it."""

    record: CallRecord
    hidden: torch.Tensor  # (rows, hidden_size)
    weights: torch.Tensor  # (rows,) float32, on the host
    start: int = 0
    end: int = 0
    replica: Replica | None = None
    wire: Any = None  # ``hidden`` in the actor-call wire format, made once for every attempt
    carrier: dict | None = None  # trace context of the call span, shared by its attempts
    hint: list | None = None  # offload: [next layer, predicted experts] to prefetch


@dataclass
class Attempt:
    """One ``forward`` call in flight: the first send of a call or a hedge of it."""

    ref: Any
    call: Call
    replica: Replica
    sent_s: float  # time.time()
    sent_mono_s: float  # time.monotonic()
    hedge_at: float | None = None  # monotonic time to hedge at (first sends only)
    hedge: bool = False
    waited_ms: float = 0.0  # how long it had run when its hedge was sent (observed as its latency)


def record_answer(rec: CallRecord, replica: Replica, timing: dict, sent_s: float | None = None) -> float:
    """Record the answer of ``replica`` (its ``timing``: ``start_s`` wall seconds, ``compute_ms``)
    to a call sent at ``sent_s`` (default the record's first send; a hedge has its own); feeds
    the replica's latency EWMA and returns that attempt's own latency, milliseconds."""
    # The call's end is the actor's end of compute, so each call has its own latency even when
    # several arrive together (a compiled graph returns all of a layer at once).
    rec.done_s = max(rec.sent_s, timing["start_s"] + timing["compute_ms"] / 1e3)
    rec.timing, rec.replica = timing, replica.name
    own_ms = max(0.0, (rec.done_s - (rec.sent_s if sent_s is None else sent_s)) * 1e3)
    replica.observe_latency(own_ms)
    replica.fresh = False
    return own_ms
