"""Goodput and per-class SLO attainment (vLLM bench / DistServe semantics).

- ``--goodput ttft:MS tpot:MS e2el:MS``: a request is *good* iff it completed and every listed SLO
  is met (``value <= SLO``, inclusive as in vLLM); goodput = good requests / benchmark duration
  (req/s). TPOT is the metrics module's (e2e - TTFT) / (tokens - 1); a request with one output token
  has no TPOT and, as in vLLM, counts as TPOT 0 (it meets any TPOT SLO).
- ``--slo-file``: per-class SLOs ``{class: {ttft_ms, tpot_ms, e2el_ms}}`` (YAML or JSON); a class's
  entry overrides the ``--goodput`` value metric by metric, other classes use ``--goodput`` alone.
  Once any SLO is given, a class without budgets has nothing to miss: its completed requests are
  good ("every listed SLO is met" holds vacuously).
- SLO attainment of a class: good requests / requests *sent* of that class. Failed requests (an HTTP
  503 refusal included) count as misses: refusing work must not look like meeting the budget.

Per-class TTFT/TPOT/e2e summaries reuse ``metrics.latency_samples_s`` and ``metrics.summarize``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from benchmarks.serving.client import RequestResult
from benchmarks.serving.metrics import (
    LatencySummary,
    latency_samples_s,
    per_second,
    summarize,
    tpot_s,
    ttft_s,
)

UNCLASSIFIED = "default"  # class name of requests whose prompt row carries no slo_class
_CLI_NAMES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass(frozen=True)
class Slo:
    """Latency budgets of one class in milliseconds; None = not part of the SLO."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def merged(self, override: Slo) -> Slo:
        """This SLO with every budget ``override`` sets replaced by the override's."""
        budgets = {f.name: getattr(override, f.name) for f in fields(override)}
        return replace(self, **{name: v for name, v in budgets.items() if v is not None})


@dataclass(frozen=True)
class SloConfig:
    """The default SLO (``--goodput``) and per-class overrides (``--slo-file``)."""

    default: Slo = field(default_factory=Slo)
    per_class: dict[str, Slo] = field(default_factory=dict)

    def for_class(self, name: str) -> Slo:
        override = self.per_class.get(name)
        return self.default if override is None else self.default.merged(override)

    def is_empty(self) -> bool:
        return self.default.is_empty() and all(s.is_empty() for s in self.per_class.values())


def _budget_ms(value: object, where: str) -> float:
    try:
        budget = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: SLO must be a number of milliseconds, got {value!r}") from None
    if budget <= 0:
        raise ValueError(f"{where}: SLO must be > 0 ms, got {budget:g}")
    return budget


def parse_goodput_args(items: Sequence[str]) -> Slo:
    """``["ttft:500", "tpot:50"]`` -> Slo(ttft_ms=500, tpot_ms=50); ValueError on unknown keys."""
    budgets: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in _CLI_NAMES:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {sorted(_CLI_NAMES)}")
        budgets[_CLI_NAMES[key]] = _budget_ms(value, f"--goodput {item}")
    return Slo(**budgets)


def load_slo_file(path: str | Path) -> dict[str, Slo]:
    """``{class: {ttft_ms, tpot_ms, e2el_ms}}`` from YAML/JSON; ValueError on unknown fields."""
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping {{class: {{ttft_ms, tpot_ms, e2el_ms}}}}")
    known = {f.name for f in fields(Slo)}
    out = {}
    for name, entry in data.items():
        unknown = set(entry) - known if isinstance(entry, dict) else {"<not a mapping>"}
        if unknown:
            raise ValueError(
                f"{path}: class {name!r}: unknown field(s) {sorted(unknown)}; use {sorted(known)}"
            )
        out[str(name)] = Slo(**{k: _budget_ms(v, f"{path}: {name}.{k}") for k, v in entry.items()})
    return out


def request_latencies_ms(result: RequestResult) -> dict[str, float] | None:
    """TTFT, TPOT (0 for one output token, as vLLM) and e2e latency of a completed request, in ms."""
    first_s = ttft_s(result.chunk_offsets_s)
    if not result.success or first_s is None or result.e2e_s is None or result.output_tokens is None:
        return None
    per_token_s = tpot_s(result.e2e_s, first_s, result.output_tokens)
    return {"ttft_ms": first_s * 1e3, "tpot_ms": (per_token_s or 0.0) * 1e3, "e2el_ms": result.e2e_s * 1e3}


def is_good(result: RequestResult, slo: Slo) -> bool:
    """Completed and within every budget ``slo`` sets (``<=``)."""
    latencies = request_latencies_ms(result)
    if latencies is None:
        return False
    budgets = {f.name: getattr(slo, f.name) for f in fields(slo)}
    return all(latencies[name] <= budget for name, budget in budgets.items() if budget is not None)


def class_of(result: RequestResult) -> str:
    return result.slo_class or UNCLASSIFIED


@dataclass(frozen=True)
class ClassReport:
    """One request class: counts, SLO attainment (None without an SLO) and latency summaries (s)."""

    name: str
    slo: Slo
    requests: int
    completed: int
    good: int | None
    slo_attainment: float | None
    ttft: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary


@dataclass(frozen=True)
class GoodputMetrics:
    """Goodput of a run (req/s; None without any SLO) and the per-class reports, in class order."""

    good: int | None
    goodput_req_per_s: float | None
    slo_attainment: float | None
    classes: list[ClassReport]


def _class_report(name: str, results: Sequence[RequestResult], slo: Slo, judged: bool) -> ClassReport:
    """``judged``: the run has SLOs, so good/attainment are counted (None otherwise)."""
    samples = latency_samples_s(results)
    good = sum(is_good(r, slo) for r in results) if judged else None
    return ClassReport(
        name=name,
        slo=slo,
        requests=len(results),
        completed=sum(r.success for r in results),
        good=good,
        slo_attainment=None if good is None or not results else good / len(results),
        ttft=summarize(samples["ttft"]),
        tpot=summarize(samples["tpot"]),
        e2e=summarize(samples["e2e"]),
    )


def compute_goodput(results: Sequence[RequestResult], duration_s: float, slos: SloConfig) -> GoodputMetrics:
    """Per-class reports (classes in order of first appearance) and the run's goodput."""
    by_class: dict[str, list[RequestResult]] = {}
    for r in results:
        by_class.setdefault(class_of(r), []).append(r)
    judged = not slos.is_empty()
    classes = [_class_report(name, rs, slos.for_class(name), judged) for name, rs in by_class.items()]
    if not judged:
        return GoodputMetrics(None, None, None, classes)
    good = sum(c.good or 0 for c in classes)
    return GoodputMetrics(
        good=good,
        goodput_req_per_s=per_second(good, duration_s),
        slo_attainment=good / len(results) if results else None,
        classes=classes,
    )
