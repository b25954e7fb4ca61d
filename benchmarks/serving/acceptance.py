"""Speculative-decoding acceptance from the server's Prometheus counters.

The server's ``/metrics`` is read before and after the measured run; acceptance comes from the
deltas, so warm-up and earlier traffic do not count:

- acceptance rate = accepted tokens / draft tokens,
- mean acceptance length = 1 + accepted tokens / drafts (tokens emitted per target forward pass,
  counting the bonus token),
- per-position acceptance = tokens accepted at draft position i / drafts.

Counters are summed over every label set (e.g. several engines), except ``position`` for the
per-position counter. Anything missing yields None, which reports print as "n/a".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "specmoe:spec_decode_num_drafts_total"
DRAFT_TOKENS = "specmoe:spec_decode_num_draft_tokens_total"
ACCEPTED = "specmoe:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "specmoe:spec_decode_num_accepted_tokens_per_pos_total"
_SCALARS = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted_tokens"}


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Spec-decode counter values (or deltas); None where the server did not expose the counter."""

    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AcceptanceMetrics:
    """Counter deltas of a run and the acceptance figures derived from them (None = n/a)."""

    num_drafts: float | None
    num_draft_tokens: float | None
    num_accepted_tokens: float | None
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: dict[int, float]


def parse_spec_decode_counters(text: str | None) -> SpecDecodeCounters | None:
    """Sum the spec-decode counters in a Prometheus text exposition; None if unreadable or absent."""
    if text is None:
        return None
    sums: dict[str, float] = defaultdict(float)
    per_pos: dict[int, float] = defaultdict(float)
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception:  # noqa: BLE001 - arbitrary server text; a broken page means n/a, not a crash
        return None
    for sample in samples:
        if sample.name in _SCALARS:
            sums[_SCALARS[sample.name]] += sample.value
        elif sample.name == ACCEPTED_PER_POS:
            position = sample.labels.get("position", "")
            if position.isdigit():
                per_pos[int(position)] += sample.value
    return SpecDecodeCounters(
        drafts=sums.get("drafts"),
        draft_tokens=sums.get("draft_tokens"),
        accepted_tokens=sums.get("accepted_tokens"),
        accepted_per_pos=dict(sorted(per_pos.items())),
    )


def _delta(before: float | None, after: float | None) -> float | None:
    """after - before. A counter absent before counts as 0 (labelled counters appear on first
    increment); absent after, or smaller after (server restarted), gives None."""
    if after is None:
        return None
    delta = after - (before or 0.0)
    return delta if delta >= 0 else None


def counter_deltas(before: SpecDecodeCounters | None, after: SpecDecodeCounters | None) -> SpecDecodeCounters:
    """Per-counter ``after - before``; all None when either scrape failed."""
    if before is None or after is None:
        return SpecDecodeCounters()
    per_pos = {}
    for pos, value in after.accepted_per_pos.items():
        delta = _delta(before.accepted_per_pos.get(pos), value)
        if delta is not None:
            per_pos[pos] = delta
    return SpecDecodeCounters(
        drafts=_delta(before.drafts, after.drafts),
        draft_tokens=_delta(before.draft_tokens, after.draft_tokens),
        accepted_tokens=_delta(before.accepted_tokens, after.accepted_tokens),
        accepted_per_pos=per_pos,
    )


def add_counters(a: SpecDecodeCounters, b: SpecDecodeCounters) -> SpecDecodeCounters:
    """Element-wise sum (e.g. the deltas of every run of one sweep configuration); None wins."""

    def plus(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else x + y

    positions = sorted(set(a.accepted_per_pos) | set(b.accepted_per_pos))
    return SpecDecodeCounters(
        drafts=plus(a.drafts, b.drafts),
        draft_tokens=plus(a.draft_tokens, b.draft_tokens),
        accepted_tokens=plus(a.accepted_tokens, b.accepted_tokens),
        accepted_per_pos={
            p: a.accepted_per_pos.get(p, 0.0) + b.accepted_per_pos.get(p, 0.0) for p in positions
        },
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def acceptance_metrics(delta: SpecDecodeCounters) -> AcceptanceMetrics:
    """Acceptance rate, mean acceptance length and per-position acceptance from counter deltas."""
    per_drafts = _ratio(delta.accepted_tokens, delta.drafts)
    per_position = {}
    for pos, accepted in delta.accepted_per_pos.items():
        ratio = _ratio(accepted, delta.drafts)
        if ratio is not None:
            per_position[pos] = ratio
    return AcceptanceMetrics(
        num_drafts=delta.drafts,
        num_draft_tokens=delta.draft_tokens,
        num_accepted_tokens=delta.accepted_tokens,
        acceptance_rate=_ratio(delta.accepted_tokens, delta.draft_tokens),
        mean_acceptance_length=None if per_drafts is None else 1.0 + per_drafts,
        per_position=per_position,
    )
