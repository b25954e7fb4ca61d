"""The expert router's compiled graphs: which replicas a graph binds, hedging and replacing a live
graph, and a parked standby graph to switch to.

A graph is dropped when an execution fails, misses its hedge deadline, or a member turns into a
straggler; until another is live (a build takes ~0.15-0.5 s of CPU, and an old graph's teardown
first waits behind the straggler's queued executions) the layers go by actor calls, ~10x slower a
step on the 2-core VM. Where every expert group has a replica outside the live graph (two or more
replicas a group, no guests), :class:`RouterGraphs` keeps a **standby graph** over them: built once
the live one has run for a while, parked at once (its actors block, nothing polls), and switched to
when the live graph is dropped: the next layer wakes it (~5 ms) instead of waiting for a build. A
new standby is then built over the replicas left, once probes have had time to measure them (the
straggler just left out is then seen slow: :meth:`RouterGraphs._standby_slow`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from statistics import median_high

from actors.compiled_graph import ActorGraph
from actors.expert_calls import Call
from actors.expert_pool import ExpertPool, Replica
from actors.replica_choice import is_avoided, straggler_bound_ms, unsuspected

log = logging.getLogger(__name__)

# Least time between two hedged graph executions: each drops the graph and builds another (~0.15 s
# of CPU on the 2-core dev VM), so a load spike that makes many executions late costs one rebuild.
GRAPH_HEDGE_INTERVAL_S = 2.0


def _warmup(n: int) -> list:
    return [None, [None] * n, 0.0]


def _fastest(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda r: (r.stats.expected_ms(), r.index))


def _by_group(members: list[Replica]) -> dict[int, list[Replica]]:
    groups: dict[int, list[Replica]] = {}
    for m in members:
        groups.setdefault(m.group, []).append(m)
    return groups


class RouterGraphs:
    """Graph state and rules of :class:`actors.expert_router.ExpertRouter` (a mixin: the router
    owns ``pool``, ``actor_calls`` and ``telemetry``; every method runs on the engine thread except
    the members functions, which run on a graph's build thread)."""

    pool: ExpertPool

    def _init_graphs(self, graph: bool) -> None:
        config = self.pool.config
        teardowns: list[threading.Thread] = []  # shared: an actor leaves one graph before joining the other
        self.graph = self._new_graph("expert", teardowns) if graph else None
        # Replication adds guests only, and a standby needs none: so two replicas a group from the start.
        with_standby = graph and config.graph_standby and config.replicas >= 2
        self.standby = self._new_graph("expert-standby", teardowns) if with_standby else None
        if self.standby is not None:
            self.standby.park_when_built = True
        self._graph_version = -1  # the pool version the live graph was made from, or last found current for
        self._standby_after_s = 0.0  # time.monotonic() before which no standby is built
        self.num_graph_takeovers = 0  # live graphs dropped and replaced at once by the standby
        self._graph_latency_ms: dict[int, deque] = {}  # each actor's last call latencies in the live graph
        self._graph_seen: tuple = ()  # (graph, builds) when _graph_latency_ms was started
        self.num_graph_hedges = 0  # graph executions given up at their hedge deadline
        self._suspects: list = []  # ActorStats of the latest late execution's members
        self._suspected_in: tuple = ()  # (graph, builds) of the graph they were suspected in
        self._graph_hedged_s = -GRAPH_HEDGE_INTERVAL_S  # time.monotonic() of the latest

    def _new_graph(self, name: str, teardowns: list) -> ActorGraph:
        holder: list[ActorGraph] = []
        graph = ActorGraph.from_config(name, lambda: self._members_of(holder[0]), _warmup, self.pool.config, teardowns)
        holder.append(graph)
        return graph

    # ------------------------------------------------------------------ members
    def _members_of(self, graph: ActorGraph) -> tuple[list[Replica], str]:
        """What ``graph`` binds, by its role now: the live graph's members or the standby's."""
        return self._graph_members() if graph is self.graph else self._standby_members()

    def _graph_members(self) -> tuple[list[Replica], str]:
        """The fastest live replica of every group outside the standby, then every usable guest
        (its host's actor is bound once more: a guest call is a second task of that actor per
        execution)."""
        taken = self.standby.bound() if self.standby is not None else []
        own = [[r for r in self.pool.alive(g) if r.host is None and not any(r is t for t in taken)]
               for g in range(len(self.pool.groups))]
        if not all(own):
            raise RuntimeError("an expert group has no live replica outside the standby graph yet")
        self._graph_version = self.pool.version
        return [_fastest(unsuspected(rs)) for rs in own] + self._guests(), "forward_graph"

    def _standby_members(self) -> tuple[list[Replica], str]:
        chosen = self._standby_candidates(self.graph.bound())
        if chosen is None:
            raise RuntimeError("not every expert group has a measured, usable replica outside the live graph")
        return chosen, "forward_graph"

    def _standby_candidates(self, live: list[Replica]) -> list[Replica] | None:
        """One replica of every group outside ``live`` (the live graph's members), or None: a group
        has none that is its own actor (no guests anywhere: a guest's host is bound in the live
        graph), measured, not a suspect and not slow (:meth:`_standby_slow`)."""
        if not live or self._guests():
            return None
        by_group, chosen = _by_group(live), []
        for g in range(len(self.pool.groups)):
            mine = by_group.get(g, [])
            usable = [r for r in self.pool.alive(g) if not any(r is m for m in mine) and r.stats.ewma_latency_ms
                      and not r.stats.suspect and not self._standby_slow(r, mine)]
            if not usable:
                return None
            chosen.append(_fastest(usable))
        return chosen

    # ------------------------------------------------------------------ lifecycle
    def _live_members(self) -> list[Replica] | None:
        if self.graph is None:
            return None
        if self._suspects and self.graph.live and (self.graph, self.graph.stats.builds) != self._suspected_in:
            for stats in self._suspects:  # a graph without them (built or taken over) is live
                stats.suspect = False
            self._suspects = []
        if not self.graph.live and not self._take_over():
            self.graph.request_build()  # in the background; this layer goes by actor calls
            return None
        return self.graph.members

    def _maintain_graphs(self) -> None:
        """Between dispatches (no execution out): rebuild a stale live graph, retire a standby that
        no longer fits, build one where it can."""
        if self.graph is None or not self.graph.live:
            return
        standby = self.standby
        if self._graph_stale():
            if standby is not None:
                standby.retire()  # before the rebuild, which may bind its actors
            self.graph.rebuild()  # this and the next layers go by actor calls until it is live again
            return
        if standby is None:
            return
        if standby.live and not self._standby_fits():
            standby.retire()
        elif (not standby.live and not standby.building and time.monotonic() >= self._standby_after_s
              and self._standby_candidates(self.graph.members) is not None):
            standby.build_now()

    def _guests(self) -> list[Replica]:
        return [r for g in range(len(self.pool.groups)) for r in self.pool.alive(g) if r.host is not None]

    def _graph_stale(self) -> bool:
        """Whether the replicas changed since the live graph was made (``pool.version``) in a way
        that concerns it: a member gone, or the usable guests changed. A replica re-created outside
        it (a dead one found by an actor call or probe, or the member a standby took over from)
        does not: that graph stays."""
        if self._graph_version == self.pool.version:
            return False
        members = self.graph.members
        bound = {id(m) for m in members if m.host is not None}
        if any(not m.alive for m in members) or bound != {id(r) for r in self._guests()}:
            return True
        self._graph_version = self.pool.version
        return False

    def _standby_fits(self) -> bool:
        """Whether the live standby can take over: no guests (they bind the live graph's actors),
        every member alive and not slow (:meth:`_standby_slow`)."""
        by_group = _by_group(self.graph.members)
        return not self._guests() and all(
            m.alive and not self._standby_slow(m, by_group.get(m.group, [])) for m in self.standby.members)

    def _standby_slow(self, replica: Replica, live: list[Replica]) -> bool:
        """The straggler rule against ``live`` (the live graph's members of the replica's group),
        with ``experts.graph_hedge_floor_ms`` as its floor: a standby member is measured by probes
        (one actor call each, a few ms on a busy 2-core VM); with the 5 ms straggler floor, standbys
        were rebuilt 1-4 times in most 16-request benchmark phases with nothing slow (each a
        compile's CPU; docs/BENCHMARKS.md). One slower than the live member by less than the graph
        floor still beats actor-call layers."""
        cfg = self.pool.config
        return is_avoided(replica, live, cfg, floor_ms=cfg.graph_hedge_floor_ms)

    def _standby_ready(self) -> bool:
        return self.standby is not None and self.standby.live and self._standby_fits()

    def _take_over(self) -> bool:
        """Switch to the live standby graph (the live graph is gone); whether it did."""
        standby = self.standby
        if self.graph.live or not self._standby_ready():
            return False
        self.graph, self.standby = standby, self.graph
        self.graph.park_when_built, self.standby.park_when_built = False, True
        self._graph_version = -1  # checked against the pool at the next dispatch (_graph_stale)
        self.num_graph_takeovers += 1
        log.info("the standby expert graph took over (%s)", ", ".join(r.name for r in self.graph.members))
        # A new standby once the replicas left have been probed (a probe goes out within one
        # interval of a replica's last call), so that a straggler just left out is seen as one.
        self._standby_after_s = time.monotonic() + 2 * self.pool.config.probe_interval_s
        return True

    def _replace_graph(self) -> None:
        """Drop the live graph (a member straggles): the standby takes over, or a rebuild starts."""
        if self._standby_ready():
            self.graph.retire()
            self._take_over()
        else:
            self.graph.rebuild()

    # ------------------------------------------------------------------ hedging and stragglers
    def _graph_hedge_ms(self, calls: list[Call]) -> float | None:
        """How long after its submission an execution carrying ``calls`` is hedged: the largest of
        its groups' hedge deadlines (:class:`actors.hedging.HedgePolicy`), at least
        ``experts.graph_hedge_floor_ms``, or None when hedging is
        off, a group has no other live replica or too few latencies, or the graph was hedged less
        than ``GRAPH_HEDGE_INTERVAL_S`` ago (each hedge costs a rebuild: load spikes must not
        make a storm of them)."""
        hedging = self.actor_calls.hedging
        if not hedging.enabled or not calls or time.monotonic() - self._graph_hedged_s < GRAPH_HEDGE_INTERVAL_S:
            return None  # checked first: this runs at every graph layer
        longest_ms = self.pool.config.graph_hedge_floor_ms
        for g in {c.record.group for c in calls}:
            deadline_ms = hedging.deadline_ms(g, len(self.pool.alive(g)))
            if deadline_ms is None:
                return None
            longest_ms = max(longest_ms, deadline_ms)
        return longest_ms

    def _graph_late(self, calls: list[Call], hedge_ms: float, graph: ActorGraph) -> None:
        """An execution on ``graph`` missed its hedge deadline: that graph is gone (its outputs
        cannot be read), this layer goes by actor calls, and the standby takes over or a graph is
        built at once without the straggler.

        Which member was late cannot be read, so every member that had rows is a suspect
        (``ActorStats.suspect``): no call or graph goes to it while its group has another usable
        replica, until a graph without it is live. Its latency view alone would not do: raised to
        the deadline, it was still within the straggler rule of a loaded replica, and the rebuilt
        graph took the straggler back (measured). A member wrongly suspected is used again then."""
        self._graph_hedged_s = time.monotonic()
        self.num_graph_hedges += 1
        for c in calls:
            c.record.hedges += 1
            c.replica.stats.suspect = True
            self._suspects.append(c.replica.stats)
            self.telemetry.hedge_call(c.record, c.replica.name, "another replica", hedge_ms)
        self._suspected_in = (graph, graph.stats.builds)
        if graph is self.graph and not self._take_over():
            self.graph.build_now()

    def _graph_straggler(self, members: list[Replica]) -> Replica | None:
        """A member of the live graph to replace: in each of its last two executions of *this*
        graph it was slower than the straggler rule allows against the median of the other
        members' latest (the same executions, under the same load: machine-wide slowness alone
        flags nobody, one scheduling hiccup neither, and views from before this graph, e.g. of
        actor calls during its build, do not count), and a replica of its group outside the graph
        is never measured or faster by the same rule."""
        samples, cfg = self._graph_samples(), self.pool.config
        own = [m for m in members if m.host is None]
        for m in own:
            mine = samples.get(id(m.stats), ())
            others = [samples[id(x.stats)][-1] for x in own if x is not m and id(x.stats) in samples]
            if len(mine) < 2 or not others or min(mine) <= straggler_bound_ms(cfg, median_high(others)):
                continue
            self.actor_calls.losers.reap()  # probes of the replicas outside, answered meanwhile
            outside = [r for r in self.pool.alive(m.group) if r.host is None and not any(r is x for x in members)]
            if any(not r.stats.ewma_latency_ms or is_avoided(m, [r], cfg) for r in outside):
                return m
        return None

    def _graph_samples(self) -> dict[int, deque]:
        """Each actor's last two call latencies (ms) in the live graph, by ``id(stats)``; empty
        for a graph built or taken over since (no evidence about it yet)."""
        seen = (self.graph, self.graph.stats.builds)
        if self._graph_seen != seen:
            self._graph_seen, self._graph_latency_ms = seen, {}
        return self._graph_latency_ms

    def graph_stats(self) -> dict:
        """The live graph's state and members, the standby's, and both graphs' counters summed
        (:class:`actors.graph_records.GraphStats` fields: the two swap roles)."""
        if self.graph is None:
            return {}
        return {"graph_live": self.graph.live, "graph_parked": self.graph.parked,
                "graph_members": [r.name for r in self.graph.members],
                "standby_enabled": self.standby is not None, "standby_live": bool(self.standby and self.standby.live),
                "standby_members": [r.name for r in self.standby.members] if self.standby else [],
                "graph_takeovers": self.num_graph_takeovers, **self._graph_totals()}

    def _graph_totals(self) -> dict[str, int]:
        graphs = [g.stats.as_dict() for g in (self.graph, self.standby) if g is not None]
        return {k: sum(g[k] for g in graphs) for k in graphs[0]}

    def graph_events(self) -> dict[str, int]:
        """Cumulative counts of the graphs' lifecycle events (``specmoe:expert_graph_events_total``):
        builds, rebuilds, failures, late executions, takeovers; empty without a graph."""
        if self.graph is None:
            return {}
        stats = self._graph_totals()
        return {"build": stats["builds"], "rebuild": stats["rebuilds"], "failure": stats["failures"],
                "late": stats["late"], "takeover": self.num_graph_takeovers}

    def _close_graphs(self) -> None:
        for graph in (self.graph, self.standby):
            if graph is not None:
                graph.close()
