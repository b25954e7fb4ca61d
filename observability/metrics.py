"""Prometheus metrics, vLLM naming style: ``specmoe:<name>`` labelled by ``model_name``.

Each component owns its registry (``RequestMetrics`` in the ingress, ``EngineMetrics`` in the
verifier); the ingress serves ``render(ingress_registry, verifier_text)`` where
``verifier_text`` is the verifier's ``render(engine_registry)`` fetched over its handle.

Both names ``specmoe:num_requests_running`` / ``_waiting`` exist on both sides (ingress: in
flight at the ingress; engine: the scheduler's view). ``render`` keeps the first source's series,
so pass ``include_state_gauges=False`` to ``RequestMetrics`` if the engine's should be served.

Every recording method is exception-safe (logs, returns None). Times are seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from observability._safe import safe
from observability.exposition import CONTENT_TYPE, render
from observability.request_metrics import LATENCY_BUCKETS_S, RequestMetrics, RequestTracker

__all__ = ["CONTENT_TYPE", "EXPERT_LATENCY_BUCKETS_S", "LATENCY_BUCKETS_S", "EngineMetrics", "RequestMetrics",
           "RequestTracker", "render"]

logger = logging.getLogger("observability")

P = "specmoe:"
# Expert calls are a Ray round trip: ~100 us (same node, tiny batch) to seconds (overloaded).
EXPERT_LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                            0.25, 0.5, 1.0, 2.5, 5.0)
# Expert-cache counters of offloading expert actors (engine.expert_cache.CacheStats field -> help).
CACHE_COUNTERS = {
    "hits": "Expert uses whose weights were resident (loaded or prefetched in time).",
    "misses": "Expert uses that waited for a load (absent, or its prefetch still in flight).",
    "loads": "Experts loaded from the slow tier (demand and prefetch).",
    "evictions": "Resident experts evicted to make room.",
    "prefetches": "Expert prefetches started from predicted next-layer routing.",
    "prefetches_used": "Prefetched experts used before eviction.",
    "prefetches_wasted": "Prefetched experts evicted (or failed) before any use.",
}
# max/mean tokens per expert: 1 = perfectly balanced, num_experts = everything on one expert.
# Draft length the speculation controller chose for a decoding sequence in one step (0 = not drafted).
DRAFT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
IMBALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)


class EngineMetrics:
    """Verifier-side metrics: engine state, speculative decoding, MoE expert load and latency.

    Args:
        model_name: value of the ``model_name`` label.
        registry: where to register; default a new private ``CollectorRegistry``.
        per_expert_latency: label ``expert_call_latency_seconds`` by (layer, expert); with
            False only by layer. Per expert costs layers x experts x 17 series: turn it off for
            large models (e.g. 48 layers x 128 experts).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 per_expert_latency: bool = True) -> None:
        self.model_name = model_name
        self.per_expert_latency = per_expert_latency
        self._last_totals: dict[str, object] = {}
        self._last_graph_events: dict[str, int] = {}
        self._expert_series: dict[tuple[int, int], tuple] = {}  # (layer, expert) -> :meth:`_new_expert_series`
        self.registry = registry if registry is not None else CollectorRegistry()
        try:
            self._build(self.registry)
        except Exception:  # e.g. registered twice in one registry: keep working, unserved
            logger.error("EngineMetrics: registering failed; using a private registry", exc_info=True)
            self.registry = CollectorRegistry()
            self._build(self.registry)

    def _build(self, r: CollectorRegistry) -> None:
        model_name, m, per_expert_latency = self.model_name, ["model_name"], self.per_expert_latency
        self._kv = Gauge(P + "kv_cache_usage_perc", "KV cache usage, fraction 0..1 (1 = full).",
                         m, registry=r).labels(model_name)
        self._running = Gauge(P + "num_requests_running", "Requests in the engine's running batch.",
                              m, registry=r).labels(model_name)
        self._waiting = Gauge(P + "num_requests_waiting", "Requests queued in the engine scheduler.",
                              m, registry=r).labels(model_name)
        self._drafts = Counter(P + "spec_decode_num_drafts_total",
                               "Verification steps of a sequence that checked >= 1 draft token.",
                               m, registry=r).labels(model_name)
        self._draft_tokens = Counter(P + "spec_decode_num_draft_tokens_total", "Draft tokens proposed and checked.",
                                     m, registry=r).labels(model_name)
        self._accepted = Counter(P + "spec_decode_num_accepted_tokens_total", "Draft tokens accepted and emitted.",
                                 m, registry=r).labels(model_name)
        self._per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos_total",
                                "Accepted draft tokens by draft position (0 = first drafted token).",
                                m + ["position"], registry=r)
        self._draft_length = Histogram(P + "spec_decode_draft_length",
                                       "Draft length chosen per decoding sequence and step (0 = not drafted).",
                                       m, buckets=DRAFT_LENGTH_BUCKETS, registry=r).labels(model_name)
        self._spec_off_steps = Counter(P + "spec_decode_off_steps_total",
                                       "Engine steps with decoding sequences in which nothing was drafted.",
                                       m, registry=r).labels(model_name)
        self._pipelined = Counter(P + "spec_decode_pipelined_windows_total",
                                  "Draft windows drafted ahead during verification (pipelined drafting), by "
                                  "outcome: used by the next step, or discarded (not fully accepted).",
                                  m + ["outcome"], registry=r)
        for outcome in ("used", "discarded"):  # exported at 0 before any window: dashboards see it exists
            self._pipelined.labels(model_name, outcome)
        self._slo = Counter(P + "slo_requests_total",
                            "Finished requests per SLO class; met=true if every budget of the class was met.",
                            m + ["slo_class", "met"], registry=r)
        le = m + ["layer", "expert"]
        self._expert_tokens = Counter(P + "expert_tokens_total", "Tokens processed per expert (expert calls).",
                                      le, registry=r)
        self._expert_latency = Histogram(P + "expert_call_latency_seconds",
                                         "Router-observed expert call latency (round trip), seconds.",
                                         le if per_expert_latency else m + ["layer"],
                                         buckets=EXPERT_LATENCY_BUCKETS_S, registry=r)
        self._stragglers = Counter(P + "expert_stragglers_total", "Expert calls flagged as stragglers.",
                                   le, registry=r)
        self._hedges = Counter(P + "expert_hedges_total",
                               "Expert calls also sent to another replica after their hedge deadline.",
                               le, registry=r)
        self._graph_events = Counter(P + "expert_graph_events_total",
                                     "Compiled expert graph events: build, rebuild, failure, late (an execution "
                                     "given up at its hedge deadline), takeover (by the standby graph).",
                                     m + ["event"], registry=r)
        self._cache = {name: Counter(P + f"expert_cache_{name}_total", doc, m, registry=r).labels(model_name)
                       for name, doc in CACHE_COUNTERS.items()}
        self._cache_stall = Counter(P + "expert_cache_stall_seconds_total",
                                    "Seconds expert calls waited for expert loads (offload).",
                                    m, registry=r).labels(model_name)
        self._imbalance = Gauge(P + "moe_load_imbalance",
                                "max/mean tokens per expert of the layer's latest dispatch (1 = balanced).",
                                m + ["layer"], registry=r)
        self._imbalance_hist = Histogram(P + "moe_dispatch_load_imbalance",
                                         "max/mean tokens per expert per dispatch, all layers.",
                                         m, buckets=IMBALANCE_BUCKETS, registry=r).labels(model_name)

    @safe
    def set_engine_state(self, running: int, waiting: int, kv_usage: float) -> None:
        """Scheduler state after a step; ``kv_usage`` is a fraction in 0..1."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv.set(kv_usage)

    @safe
    def record_step(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                    accepted_per_position: Sequence[int] = ()) -> None:
        """Add one step's speculative-decoding counts (deltas, not totals).
        ``accepted_per_position[i]``: sequences whose draft token i was accepted this step."""
        if num_drafts:
            self._drafts.inc(num_drafts)
        if num_draft_tokens:
            self._draft_tokens.inc(num_draft_tokens)
        if num_accepted:
            self._accepted.inc(num_accepted)
        for pos, n in enumerate(accepted_per_position):
            child = self._per_pos.labels(self.model_name, str(pos))
            if n:
                child.inc(n)

    @safe
    def sync_from_engine(self, totals: Mapping[str, object]) -> None:
        """Update from ``LLMEngine.get_metrics()`` (cumulative totals): counters advance by the
        change since the previous call, gauges are set. A total that went down (engine
        restarted) counts from zero again."""
        prev = self._last_totals
        d = {k: _delta(totals.get(k, 0), prev.get(k, 0))
             for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        cur_pos = list(totals.get("accepted_per_position") or [])
        old_pos = list(prev.get("accepted_per_position") or [])
        per_pos = [_delta(c, old_pos[i] if i < len(old_pos) else 0) for i, c in enumerate(cur_pos)]
        self.record_step(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"], per_pos)
        self._record_draft_lengths(totals.get("draft_length_counts") or [], prev.get("draft_length_counts") or [])
        off = _delta(totals.get("num_spec_off_steps", 0), prev.get("num_spec_off_steps", 0))
        if off:
            self._spec_off_steps.inc(off)
        self._record_slo(totals.get("slo_attainment") or {}, prev.get("slo_attainment") or {})
        for outcome, n in (totals.get("pipelined_windows") or {}).items():
            d = _delta(n, (prev.get("pipelined_windows") or {}).get(outcome, 0))
            if d:
                self._pipelined.labels(self.model_name, outcome).inc(d)
        self._last_totals = {k: _snapshot(v) for k, v in totals.items()}
        if "num_running" in totals:
            self.set_engine_state(int(totals["num_running"]), int(totals.get("num_waiting", 0)),
                                  float(totals.get("kv_cache_usage", 0.0)))

    def _record_draft_lengths(self, cur: Sequence[int], old: Sequence[int]) -> None:
        """``cur[k]``: decoding sequences that drafted k tokens in a step, cumulative."""
        for k, c in enumerate(cur):
            for _ in range(_delta(c, old[k] if k < len(old) else 0)):
                self._draft_length.observe(k)

    def _record_slo(self, cur: Mapping[str, Sequence[int]], old: Mapping[str, Sequence[int]]) -> None:
        """``cur[class] = [met, finished]`` cumulative (engine.slo.SLOPolicy.totals)."""
        for name, (met, total) in cur.items():
            old_met, old_total = old.get(name, (0, 0))
            d_met, d_total = _delta(met, old_met), _delta(total, old_total)
            if d_met:
                self._slo.labels(self.model_name, name, "true").inc(d_met)
            if d_total - d_met > 0:
                self._slo.labels(self.model_name, name, "false").inc(d_total - d_met)

    @safe
    def record_dispatch(self, layer: int, tokens_per_expert: Sequence[int] | Mapping[int, int],
                        num_experts: int | None = None) -> float | None:
        """Load imbalance of one MoE layer dispatch; returns max/mean (None if no tokens).

        ``tokens_per_expert``: a sequence indexed by expert id (every expert, zeros included) or
        a mapping of the experts hit; the mean is over ``num_experts`` if given, else over the
        entries passed. Expert token counts are recorded by ``record_expert_call``, not here.
        """
        counts = list(tokens_per_expert.values()) if isinstance(tokens_per_expert, Mapping) else list(tokens_per_expert)
        n = num_experts or len(counts)
        total = sum(counts)
        if not n or total <= 0:
            return None
        ratio = max(counts) / (total / n)
        self._imbalance.labels(self.model_name, str(layer)).set(ratio)
        self._imbalance_hist.observe(ratio)
        return ratio

    @safe
    def declare_slo_classes(self, names: Sequence[str]) -> None:
        """Create each class's ``slo_requests_total`` series (met true and false) at zero."""
        for name in names:
            for met in ("true", "false"):
                self._slo.labels(self.model_name, name, met)

    def declare_experts(self, layers: Sequence[int], num_experts: int) -> None:
        """Create every per-(layer, expert) series at zero, so dashboards and alerts see them
        before the first request (Prometheus' advice for known label sets)."""
        for layer in layers:
            self._imbalance.labels(self.model_name, str(layer))
            for expert in range(num_experts):
                key = (self.model_name, str(layer), str(expert))
                self._expert_series[(layer, expert)] = self._new_expert_series(layer, expert)
                self._stragglers.labels(*key)
                self._hedges.labels(*key)

    @safe
    def record_expert_call(self, layer: int, expert: int, num_tokens: int, latency_s: float,
                           straggler: bool = False) -> None:
        """One finished expert call as the router saw it (round trip, seconds)."""
        # Values first: a bad call must fail before it creates any series.
        num_tokens, latency_s = int(num_tokens), float(latency_s)
        series = self._expert_series.get((layer, expert))
        if series is None:  # the children looked up once: ``labels()`` costs more than the update
            series = self._expert_series[(layer, expert)] = self._new_expert_series(layer, expert)
        tokens, hist = series
        if num_tokens:
            tokens.inc(num_tokens)
        hist.observe(max(0.0, latency_s))
        if straggler:
            self._stragglers.labels(self.model_name, str(layer), str(expert)).inc()

    def _new_expert_series(self, layer: int, expert: int) -> tuple:
        """The ``expert_tokens_total`` and ``expert_call_latency_seconds`` children of (layer, expert)."""
        key = (self.model_name, str(layer), str(expert))
        hist = self._expert_latency.labels(*key) if self.per_expert_latency else \
            self._expert_latency.labels(self.model_name, str(layer))
        return self._expert_tokens.labels(*key), hist

    @safe
    def record_hedge(self, layer: int, expert: int) -> None:
        """One hedge of a call that carried rows of ``expert`` (counted when it is sent)."""
        self._hedges.labels(self.model_name, str(layer), str(expert)).inc()

    @safe
    def sync_graph_events(self, totals: Mapping[str, int]) -> None:
        """Advance ``expert_graph_events_total`` to the router's cumulative counts by event
        (:meth:`actors.router_graphs.RouterGraphs.graph_events`); a count that went down (a new
        router) counts from zero again."""
        if totals == self._last_graph_events:
            return  # nearly every step (it runs at each engine step's metrics sync)
        for event, total in totals.items():
            d = _delta(total, self._last_graph_events.get(event, 0))
            child = self._graph_events.labels(self.model_name, event)  # every event shows, 0 included
            if d:
                child.inc(d)
        self._last_graph_events = dict(totals)

    @safe
    def record_expert_cache(self, stats: Mapping[str, float]) -> None:
        """Add an expert actor's cache counter deltas (:class:`engine.expert_cache.CacheStats` as a
        dict, reported with each answer of an offloading actor)."""
        for name, counter in self._cache.items():
            if stats.get(name):
                counter.inc(int(stats[name]))
        if stats.get("stall_s"):
            self._cache_stall.inc(max(0.0, float(stats["stall_s"])))

    def render(self) -> bytes:
        """This registry as Prometheus text (what the verifier hands to the ingress)."""
        return render(self.registry)


def _snapshot(value: object) -> object:
    """A copy of a totals value that later engine updates cannot change (lists, dicts of lists)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _delta(cur: object, prev: object) -> int:
    c, p = int(cur or 0), int(prev or 0)  # type: ignore[call-overload]
    return c - p if c >= p else c
