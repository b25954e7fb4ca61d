"""Online replication of hot expert groups from the routed rows (EPLB-like; ``experts.replication``).

DeepSeek-V3's expert-parallel load balancer (EPLB) gives heavily loaded experts redundant copies
on devices with spare capacity, so their tokens are split over more devices. Here the unit is an
expert group and the device an expert actor: a *guest* replica of a hot group is hosted by another
group's actor (``ExpertWorker.host_experts``), and the router splits the group's rows over all of
its replicas (:mod:`actors.replica_choice`). The rule, thresholds and hysteresis are in
:class:`actors.expert_config.ReplicationConfig`.

Safe mid-request: the :class:`Rebalancer` runs on the engine thread between two layer dispatches,
so no call is in flight on the actor-call path except hedge losers and probes. A new guest takes
rows only once its host has loaded the experts (its load ref is done); a removed guest first
drains (no new rows) and its host drops the experts only when nothing of it is in flight. Every
change bumps the pool's version, so the router rebuilds its compiled graph over the new replicas
(the old graph never carries rows for a guest that is not usable).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from actors.expert_config import ReplicationConfig
from actors.expert_pool import ExpertPool, Replica

log = logging.getLogger(__name__)


class Rebalancer:
    """Adds and removes guest replicas of an :class:`ExpertPool` from its groups' routed rows.

    Args:
        pool: the started pool (static replicas are never removed).
        config: the ``experts.replication`` section.
        ray_module: the ``ray`` module the router uses (``wait``, ``get``; a fake in tests).
    """

    def __init__(self, pool: ExpertPool, config: ReplicationConfig, ray_module: Any) -> None:
        self.pool, self.config, self.ray = pool, config, ray_module
        self.loads: list[float] | None = None  # EWMA of rows per dispatch, per group
        self._window = [0] * len(pool.groups)
        self._dispatches = 0
        self._hot_checks = 0
        self._cold_checks: dict[int, int] = {}  # id(guest) -> consecutive cold checks
        self._last_change_s = float("-inf")
        self._loading: dict[Any, Replica] = {}  # host_experts ref -> its guest
        self._draining: list[Replica] = []
        self.num_added = self.num_removed = 0

    def observe(self, group_rows: list[int]) -> None:
        """One dispatch's routed rows per group."""
        for g, n in enumerate(group_rows):
            self._window[g] += n
        self._dispatches += 1

    def step(self, now_s: float | None = None) -> None:
        """Between dispatches: finish loads and drains; every ``check_every_dispatches``, check."""
        self._poll_loading()
        self._finish_draining()
        if self._dispatches < self.config.check_every_dispatches:
            return
        rows = [w / self._dispatches for w in self._window]
        self._window, self._dispatches = [0] * len(self.pool.groups), 0
        a = self.config.load_alpha
        self.loads = rows if self.loads is None else [a * x + (1 - a) * y for x, y in zip(rows, self.loads)]
        self._check(time.monotonic() if now_s is None else now_s)

    def actor_loads(self) -> dict[int, tuple[Replica, float]]:
        """``id(stats) -> (the actor's own replica, expected rows per dispatch)``: each group's
        load spread evenly over its usable replicas."""
        loads = self.loads or [0.0] * len(self.pool.groups)
        out = {id(r.stats): (r, 0.0) for r in self.pool.actors() if r.alive}
        for g, load in enumerate(loads):
            usable = self.pool.alive(g)
            for r in usable:
                own, total = out.get(id(r.stats), (r.host or r, 0.0))
                out[id(r.stats)] = (own, total + load / len(usable))
        return out

    def _check(self, now_s: float) -> None:
        actors = self.actor_loads()
        if not actors or self.loads is None:
            return
        mean = sum(self.loads) / len(actors)
        peak = max(load for _, load in actors.values())
        self._hot_checks = self._hot_checks + 1 if peak > self.config.hot_factor * mean else 0
        cold = self._cold_guests(mean)
        if now_s - self._last_change_s < self.config.min_interval_s:
            return
        if cold:  # first: a guest that is not needed may itself be what makes its host hot
            self._drain(cold[0])
            self._last_change_s = now_s
        elif self._hot_checks >= self.config.patience_checks and self._add(actors, peak):
            self._hot_checks, self._last_change_s = 0, now_s

    def _cold_guests(self, mean: float) -> list[Replica]:
        """Guests cold for ``patience_checks`` checks: without them their group would stay below
        ``cold_factor`` x the mean actor load."""
        out, seen = [], set()
        for g, load in enumerate(self.loads):
            usable = self.pool.alive(g)
            for r in (r for r in usable if r.host is not None):
                seen.add(id(r))
                cold = load / max(1, len(usable) - 1) < self.config.cold_factor * mean
                self._cold_checks[id(r)] = self._cold_checks.get(id(r), 0) + 1 if cold else 0
                if self._cold_checks[id(r)] >= self.config.patience_checks:
                    out.append(r)
        self._cold_checks = {k: v for k, v in self._cold_checks.items() if k in seen}
        return out

    def _add(self, actors: dict[int, tuple[Replica, float]], peak: float) -> bool:
        """One more replica of the heaviest group of the most loaded actor, on the least loaded
        actor with a free guest slot that does not serve it yet, if that lowers the peak."""
        hot_id = max(actors, key=lambda k: actors[k][1])
        groups = [g for g in range(len(self.pool.groups)) if any(id(r.stats) == hot_id for r in self.pool.alive(g))]
        group = max(groups, key=lambda g: self.loads[g] / len(self.pool.alive(g)))
        serving = {id(r.stats) for r in self.pool.replicas[group] if r.alive}
        cap = self.config.max_replicas_per_group or len(actors)
        if len(serving) >= cap:
            return False
        guests = {}
        for r in self.pool.all_replicas():
            if r.host is not None and r.alive:
                guests[id(r.stats)] = guests.get(id(r.stats), 0) + 1
        hosts = [(load, own) for k, (own, load) in actors.items()
                 if k not in serving and guests.get(k, 0) < self.config.guest_slots_per_actor]
        if not hosts:
            return False
        load, host = min(hosts, key=lambda x: (x[0], x[1].stats.expected_ms(), x[1].group, x[1].index))
        if load + self.loads[group] / (len(serving) + 1) >= peak:
            return False
        guest, ref = self.pool.add_guest(group, host)
        self._loading[ref] = guest
        self.num_added += 1
        log.info("replicating expert group %d on %s (group load %.1f rows/dispatch, actor mean %.1f)",
                 group, host.name, self.loads[group], sum(self.loads) / len(actors))
        return True

    def _drain(self, guest: Replica) -> None:
        log.info("removing cold replica %s", guest.name)
        self.pool.drain_guest(guest)
        self._draining.append(guest)
        self._cold_checks.pop(id(guest), None)

    def remove(self, guest: Replica) -> None:
        """Drain and remove ``guest`` now, whatever its load (tests, operators)."""
        self._drain(guest)
        self._finish_draining()

    def _poll_loading(self) -> None:
        if not self._loading:
            return
        done, _ = self.ray.wait(list(self._loading), num_returns=len(self._loading), timeout=0)
        for ref in done:
            guest = self._loading.pop(ref)
            try:
                self.ray.get(ref)
            except Exception as e:  # the host died or could not load: forget the guest
                log.warning("replica %s failed to load (%s: %s)", guest.name, type(e).__name__, e)
                self.pool.remove_guest(guest)
                continue
            self.pool.mark_ready(guest)

    def _finish_draining(self) -> None:
        still = []
        for guest in self._draining:
            if guest.inflight:  # a hedge loser or probe of it still runs there
                still.append(guest)
                continue
            self.pool.remove_guest(guest)
            self.num_removed += 1
        self._draining = still
