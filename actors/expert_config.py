"""The ``experts`` section of the serve config: the expert pool, its transport and replication
(msgspec Structs: errors name the field path), and the config checks the other sections share."""

from __future__ import annotations

import math
from typing import Literal

import msgspec


def require(ok: bool, field: str, rule: str, value: object) -> None:
    """A config check: ``ValueError("<field> must be <rule>, got <value>")`` unless ``ok`` (msgspec
    adds the path of the section, e.g. `` - at `$.experts` ``)."""
    if not ok:
        raise ValueError(f"{field} must be {rule}, got {value!r}")


def require_finite(field: str, value: float, low: float, strict: bool = True) -> None:
    """``value`` > ``low`` (``strict``) or >= ``low``, and finite (NaN fails too): a timeout or an
    interval of inf reaches a Ray call that cannot take it (``ray.wait``'s OverflowError)."""
    ok = (value > low if strict else value >= low) and value < math.inf
    require(ok, field, f"{'>' if strict else '>='} {low:g} and finite", value)


def check_actor_resources(resources: dict[str, float], prefix: str = "", **amounts: float) -> None:
    """``amounts`` (``num_cpus``, ``num_gpus``) >= 0 and custom ``resources`` > 0: Ray refuses
    others only when it places the actor, inside a replica's start."""
    for name, v in amounts.items():
        require(v >= 0, f"{prefix}{name}", ">= 0", v)
    for name, v in resources.items():
        require(v > 0, f"{prefix}resources.{name}", "> 0", v)


class ReplicationConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Online replication of hot expert groups (``experts.replication``; EPLB-like, DeepSeek-V3's
    redundant experts): a replica of a hot group is hosted by another expert actor with a free
    slot, so the group's rows are split over more actors. See docs/TRANSPORT.md.

    Every ``check_every_dispatches`` MoE dispatches the routed rows per group (summed over the
    window, smoothed by an EWMA of weight ``load_alpha``) are spread evenly over each group's
    replicas; an actor's load is the sum over the replicas it serves. When the most loaded actor
    stays above ``hot_factor`` x the mean actor load for ``patience_checks`` checks in a row, its
    heaviest group gets one more replica on the least loaded actor with a free guest slot (if that
    lowers the maximum). A guest replica whose group would stay below ``cold_factor`` x the mean
    without it for ``patience_checks`` checks is drained and removed. At most one change per
    ``min_interval_s`` (each change rebuilds the compiled graph). Static replicas
    (``experts.replicas``, ``experts.hot_expert_replicas``) are never removed.

    Attributes:
        enabled: replicate online at all.
        guest_slots_per_actor: replicas of other groups one actor may host (its spare capacity).
        max_replicas_per_group: most replicas of one group, static ones included (0: one per actor).
    """

    enabled: bool = False
    hot_factor: float = 1.25
    cold_factor: float = 1.1
    patience_checks: int = 3
    check_every_dispatches: int = 16
    load_alpha: float = 0.5
    min_interval_s: float = 5.0
    guest_slots_per_actor: int = 1
    max_replicas_per_group: int = 0

    def __post_init__(self) -> None:
        p = "experts.replication."
        if not self.hot_factor > 1:
            raise ValueError(f"{p}hot_factor must be > 1, got {self.hot_factor}")
        if not 0 <= self.cold_factor < self.hot_factor:
            raise ValueError(f"{p}cold_factor must be >= 0 and < {p}hot_factor, got {self.cold_factor}")
        require(self.patience_checks >= 1, f"{p}patience_checks", ">= 1", self.patience_checks)
        require(self.check_every_dispatches >= 1, f"{p}check_every_dispatches", ">= 1", self.check_every_dispatches)
        if not 0 < self.load_alpha <= 1:
            raise ValueError(f"{p}load_alpha must be in (0, 1], got {self.load_alpha}")
        if not self.min_interval_s >= 0:
            raise ValueError(f"{p}min_interval_s must be >= 0, got {self.min_interval_s}")
        require(self.guest_slots_per_actor >= 0, f"{p}guest_slots_per_actor", ">= 0", self.guest_slots_per_actor)
        require(self.max_replicas_per_group >= 0, f"{p}max_replicas_per_group", ">= 0", self.max_replicas_per_group)


class ExpertPoolConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How routed experts are spread over Ray actors.

    Attributes:
        experts_per_actor: experts one actor holds (for every MoE layer). One per expert on a GPU
            cluster; about one actor per CPU core on a small machine, where per-call overhead
            dominates (see docs).
        replicas: actors per expert group (hot experts may get more via ``hot_expert_replicas``).
        hot_expert_replicas: extra replicas for named groups: ``{group_index: replicas}``.
        call_timeout_s: per-call timeout; a slower call is retried on another replica (a re-created
            actor's first call waits at least ``actors.actor_calls.FRESH_ACTOR_START_S``, its start).
        max_attempts: tries per expert group before the step fails.
        num_gpus: GPU fraction each actor asks for (0 on CPU, where actors reserve no CPU and run
            torch with ``torch_threads`` threads).
        torch_threads: torch intra-op threads inside each expert actor.
        resources: custom Ray resources each expert actor asks for, e.g. ``{"expert_slot": 1}``:
            only nodes started with that resource (``ray start --resources``, a KubeRay worker
            group's ``rayStartParams.resources``) take expert actors, and its count bounds how
            many land on one node.
        scheduling_strategy: ``SPREAD`` places a unit's expert actors on as many nodes as
            possible (Ray's spread strategy); ``DEFAULT`` packs them where resources allow.
        straggler_multiple, straggler_floor_ms: a call slower than multiple x the dispatch's median
            and above the floor is flagged as a straggler.
        namespace: Ray namespace of the named expert actors.
        transport: how a MoE layer's rows reach the actors. ``compiled_graph`` (default): one Ray
            Compiled Graph over one replica of every group per verifier replica (shared-memory
            channels on a node; ~0.2-0.5 ms a layer on a 2-core VM), with ``actor_calls`` as the
            fallback while the graph builds or after it failed. ``actor_calls``: one Ray actor
            call per group, issued from the engine thread (~1.5-2 ms a layer); the actors are then
            named, detached and shared by every verifier replica. See docs/TRANSPORT.md.
        graph_idle_park_s: a compiled graph unused this long is parked, because its readers
            poll (each idle actor would burn a core): its actors block in a parking execution
            until the next step wakes them (~5 ms; no rebuild, no new channel buffers).
        graph_buffer_size_bytes: size of each compiled-graph channel; a layer whose rows would not
            fit goes by actor calls (Ray would leak a new buffer per such message; docs/TRANSPORT.md).
        graph_build_after_s: (re)build a graph only after this long of steady traffic without one
            (steps no more than ``graph_idle_park_s`` apart): a build costs ~2 s of CPU, more than
            a short burst loses by going over actor calls.
        graph_standby: where every expert group has a replica outside the live compiled graph (two
            or more replicas a group, no guests), keep a second graph over them, parked, and switch
            to it when the live one is dropped (a failure, a hedged execution, a straggling
            member) instead of serving by actor calls until a rebuild is live
            (actors/router_graphs.py).
        hedge: hedged expert calls. On the actor-call path (``actor_calls``, and the fallback while
            a compiled graph is not live) a call to a group with >= 2 live replicas that has not
            returned by its deadline is sent to another replica too, the first result is taken and
            the other is cancelled. On a live compiled graph whose groups all have >= 2 live
            replicas, an execution not back by the largest of its groups' deadlines is given up:
            the layer goes by actor calls to other replicas and the graph is rebuilt without the
            members that had rows (at most once per 2 s; no sooner than ``graph_hedge_floor_ms``).
            False: never hedge.
        graph_hedge_floor_ms: a compiled-graph execution is hedged no sooner than this, ms: a
            graph hedge costs a rebuild (an actor-call hedge one more call), and at the 10 ms
            ``hedge_floor_ms`` the 2-core dev VM's scheduling noise made them often (docs/TRANSPORT.md).
        hedge_quantile, hedge_factor, hedge_floor_ms: the deadline, milliseconds after sending, is
            ``max(hedge_floor_ms, hedge_factor x quantile(hedge_quantile))`` of the group's recent
            call latencies (each answered call's own round trip).
        hedge_window: recent latencies kept per group; hedge_min_samples: no hedge until a group
            has this many (its first calls load weights lazily and are slow anyway).
        max_resident_experts: expert offload: each actor keeps at most this many (layer, expert)
            weights resident (of ``experts_per_actor x MoE layers`` it holds), the rest in a slower
            tier (a memory-mapped spill file on CPU, pinned host memory on GPU) loaded on demand
            or ahead of need; at least ``experts_per_actor + pinned_hot_experts`` (one layer's
            experts must fit at once). None (default): everything resident. See docs/EXPERTS.md.
        max_resident_bytes: the same budget in bytes of resident weights (compute dtype); set at
            most one of the two.
        pinned_hot_experts: with offload, this many of the hottest resident entries are never evicted.
        prefetch: with offload, prefetch the experts predicted for the next MoE layer (pre-gating:
            the next layer's router applied to this layer's hidden state, sent with the dispatch);
            False: demand loads only.
        simulated_link_gbps: with offload, a labelled SIMULATION for benchmarks: every load takes at
            least one expert's checkpoint bytes at this many GB/s (a sleep after the real load), to
            model a slower link (PCIe, NVMe) than a small model on this machine has. None: real only.
        split_min_rows: a group's rows are split over up to ``rows // split_min_rows`` of its
            replicas (contiguous parts, even sizes); 0: one replica per call.
        probe_interval_s: a usable replica that got no call for this long gets a copy of a call
            of its group (result unread, nobody waits for it), so the router's latency view of an
            avoided straggler stays fresh and it is used again once it recovers.
        replication: online replication of hot groups (:class:`ReplicationConfig`).
        two_batch_overlap: while the compiled graph is live, split each forward's sequences into
            two micro-batches whose layers interleave, so one's attention runs on the verifier
            while the other's experts run on the expert actors and the hop is hidden too
            (DeepSeek-V3's and SGLang's two-batch overlap; output unchanged). False: one batch.

    Replica choice (both transports): a replica's expected completion is ``(calls in flight + 1)
    x its latency EWMA``; replicas above ``straggler_multiple`` x the group's best and above
    ``straggler_floor_ms`` are avoided (the straggler rule), the rest take the rows.
    """

    experts_per_actor: int = 4
    replicas: int = 1
    hot_expert_replicas: dict[int, int] = msgspec.field(default_factory=dict)
    call_timeout_s: float = 10.0
    max_attempts: int = 3
    num_gpus: float = 0.0
    torch_threads: int = 1
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    scheduling_strategy: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    straggler_multiple: float = 3.0
    straggler_floor_ms: float = 5.0
    namespace: str = "specmoe"
    transport: Literal["compiled_graph", "actor_calls"] = "compiled_graph"
    graph_idle_park_s: float = 2.0
    graph_buffer_size_bytes: int = 1_000_000
    graph_build_after_s: float = 1.0
    graph_standby: bool = True
    hedge: bool = True
    hedge_quantile: float = 0.95
    hedge_factor: float = 2.0
    hedge_floor_ms: float = 10.0
    graph_hedge_floor_ms: float = 50.0
    hedge_window: int = 64
    hedge_min_samples: int = 8
    max_resident_experts: int | None = None
    max_resident_bytes: int | None = None
    pinned_hot_experts: int = 0
    prefetch: bool = True
    simulated_link_gbps: float | None = None
    split_min_rows: int = 4
    probe_interval_s: float = 1.0
    replication: ReplicationConfig = msgspec.field(default_factory=ReplicationConfig)
    two_batch_overlap: bool = True

    def __post_init__(self) -> None:
        self._check_offload()
        require(self.experts_per_actor >= 1, "experts.experts_per_actor", ">= 1", self.experts_per_actor)
        require(self.replicas >= 1, "experts.replicas", ">= 1", self.replicas)
        check_actor_resources(self.resources, "experts.", num_gpus=self.num_gpus)
        require(self.torch_threads >= 1, "experts.torch_threads", ">= 1", self.torch_threads)
        for group, n in self.hot_expert_replicas.items():
            require(group >= 0, "experts.hot_expert_replicas", "keyed by group indexes >= 0", group)
            require(n >= 1, f"experts.hot_expert_replicas.{group}", ">= 1", n)
        require_finite("experts.call_timeout_s", self.call_timeout_s, 0)
        require(self.max_attempts >= 1, "experts.max_attempts", ">= 1", self.max_attempts)
        require_finite("experts.graph_idle_park_s", self.graph_idle_park_s, 0)
        require(self.graph_buffer_size_bytes >= 1024, "experts.graph_buffer_size_bytes", ">= 1024",
                 self.graph_buffer_size_bytes)
        require_finite("experts.graph_build_after_s", self.graph_build_after_s, 0, strict=False)
        if not 0 < self.hedge_quantile <= 1:
            raise ValueError(f"experts.hedge_quantile must be in (0, 1], got {self.hedge_quantile}")
        require_finite("experts.hedge_factor", self.hedge_factor, 1, strict=False)
        for name in ("hedge_floor_ms", "graph_hedge_floor_ms", "straggler_floor_ms"):
            require_finite(f"experts.{name}", getattr(self, name), 0, strict=False)
        # The straggler rule avoids replicas slower than this multiple of the group's best: under 1
        # it would avoid the best one too.
        require_finite("experts.straggler_multiple", self.straggler_multiple, 1, strict=False)
        if not 1 <= self.hedge_min_samples <= self.hedge_window:
            raise ValueError(f"experts.hedge_min_samples must be >= 1 and <= experts.hedge_window, got "
                             f"{self.hedge_min_samples} and {self.hedge_window}")
        require(self.split_min_rows >= 0, "experts.split_min_rows", ">= 0", self.split_min_rows)
        require_finite("experts.probe_interval_s", self.probe_interval_s, 0)


    def _check_offload(self) -> None:
        if self.max_resident_experts is not None and self.max_resident_bytes is not None:
            raise ValueError("experts.max_resident_experts and experts.max_resident_bytes: set at most one")
        floor = self.experts_per_actor + self.pinned_hot_experts
        if self.max_resident_experts is not None and self.max_resident_experts < floor:
            raise ValueError(f"experts.max_resident_experts must be >= experts.experts_per_actor + "
                             f"experts.pinned_hot_experts ({floor}: one layer's experts must fit), "
                             f"got {self.max_resident_experts}")
        if self.max_resident_bytes is not None and self.max_resident_bytes < 1:
            raise ValueError(f"experts.max_resident_bytes must be >= 1, got {self.max_resident_bytes}")
        if self.simulated_link_gbps is not None and not self.simulated_link_gbps > 0:
            raise ValueError(f"experts.simulated_link_gbps must be > 0, got {self.simulated_link_gbps}")
        if self.pinned_hot_experts < 0:
            raise ValueError(f"experts.pinned_hot_experts must be >= 0, got {self.pinned_hot_experts}")

    def offload_settings(self) -> dict | None:
        """The expert actors' ``offload`` argument (:class:`engine.expert_offload.OffloadedExpertStore`
        keywords), or None when every expert stays resident."""
        if self.max_resident_experts is None and self.max_resident_bytes is None:
            return None
        return {"max_resident": self.max_resident_experts, "max_resident_bytes": self.max_resident_bytes,
                "num_pinned": self.pinned_hot_experts, "prefetch": self.prefetch,
                "simulated_link_gbps": self.simulated_link_gbps}
