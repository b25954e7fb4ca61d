"""The pool of named, shared expert actors: groups of experts, replicas per group, re-creation, and
guest replicas (a replica of a hot group hosted by another group's actor, :mod:`actors.replication`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from actors.expert_actor import ExpertActor
from actors.expert_config import ExpertPoolConfig
from actors.teardown import kill_actor

log = logging.getLogger(__name__)


@dataclass
class ActorStats:
    """The router's view of one actor process, shared by every replica it serves (its own group's
    and its guests': they queue on the same process)."""

    outstanding_rows: int = 0
    outstanding_calls: int = 0
    ewma_latency_ms: float = 0.0
    last_call_s: float = 0.0  # time.monotonic() of the latest call or probe sent to it
    # In a compiled-graph execution given up at its hedge deadline: not chosen while its group has
    # another usable replica, until the router's next graph is built (actors/expert_router.py).
    suspect: bool = False

    def observe_latency(self, latency_ms: float, alpha: float = 0.2) -> None:
        self.ewma_latency_ms = latency_ms if self.ewma_latency_ms == 0 else (
            alpha * latency_ms + (1 - alpha) * self.ewma_latency_ms)

    def expected_ms(self, extra_calls: int = 0) -> float:
        """Expected completion of one more call: ``(calls in flight + 1) x latency EWMA``."""
        return (self.outstanding_calls + extra_calls + 1) * self.ewma_latency_ms


@dataclass(eq=False)  # identity: a replica is one actor slot, whatever its state
class Replica:
    """One replica of an expert group: its own actor, or a guest on ``host`` (another group's
    replica whose actor also holds this group's experts).

    ``ready``: a guest takes rows only once its host has loaded the experts; ``inflight``: calls of
    this replica not yet answered or reaped (a draining guest is dropped from its host at zero);
    ``fresh``: a re-created actor that has not answered yet (its first call waits for its start).
    """

    group: int
    index: int
    generation: int
    name: str
    handle: ray.actor.ActorHandle
    stats: ActorStats = field(default_factory=ActorStats)
    alive: bool = True
    host: Replica | None = None
    ready: bool = True
    inflight: int = 0
    fresh: bool = False

    @property
    def outstanding_rows(self) -> int:
        return self.stats.outstanding_rows

    @property
    def ewma_latency_ms(self) -> float:
        return self.stats.ewma_latency_ms

    @ewma_latency_ms.setter
    def ewma_latency_ms(self, value: float) -> None:
        self.stats.ewma_latency_ms = value

    def observe_latency(self, latency_ms: float) -> None:
        self.stats.observe_latency(latency_ms)

    def begin(self, rows: int, now_s: float) -> None:
        """A call of ``rows`` rows was sent to this replica at ``now_s`` (``time.monotonic()``)."""
        self.inflight += 1
        self.stats.outstanding_rows += rows
        self.stats.outstanding_calls += 1
        self.stats.last_call_s = now_s

    def end(self, rows: int) -> None:
        """A call of ``rows`` rows ended (answered, failed, timed out or reaped)."""
        self.inflight -= 1
        self.stats.outstanding_rows -= rows
        self.stats.outstanding_calls -= 1


@dataclass
class ExpertPool:
    """Expert actors of a verifier replica, or shared by every verifier replica.

    Groups are consecutive expert-id ranges of ``experts_per_actor`` experts, so the rows of one
    group are one contiguous slice of a layer's dispatch. Actors are named
    ``{prefix}-g{group}-r{replica}-v{generation}`` in the config's namespace and created with
    ``get_if_exists``. A shared pool (``detached``) outlives its creators: verifier replicas find the
    same actors, and after a death every replica re-creates the same next generation. A private
    pool (the compiled-graph transport: an actor can be in only one compiled graph) is owned by
    its verifier replica, named with that replica's prefix, and dies with it.
    """

    checkpoint: str
    num_experts: int
    config: ExpertPoolConfig
    dtype: str = "float32"
    device: str = "cpu"
    prefix: str = "specmoe-experts"
    tracing: dict | None = None  # TracingConfig as builtins, for the actors' own exporters
    detached: bool = True
    groups: list[list[int]] = field(default_factory=list)
    replicas: dict[int, list[Replica]] = field(default_factory=dict)
    version: int = 0  # bumped whenever the usable replicas change (the compiled graph is rebuilt)

    def start(self) -> None:
        """Create or look up every actor (non-blocking: actors load their weights lazily)."""
        per = self.config.experts_per_actor
        self.groups = [list(range(s, min(s + per, self.num_experts))) for s in range(0, self.num_experts, per)]
        for g in range(len(self.groups)):
            count = self.config.hot_expert_replicas.get(g, self.config.replicas)
            self.replicas[g] = [self._make(g, r, 0) for r in range(count)]

    def _make(self, group: int, index: int, generation: int) -> Replica:
        name = f"{self.prefix}-g{group}-r{index}-v{generation}"
        # max_concurrency 2: control calls (info, delays) and fallback calls still run while the
        # actor's compiled-graph loop occupies one thread.
        options = dict(name=name, namespace=self.config.namespace, get_if_exists=True,
                       lifetime="detached" if self.detached else None,
                       num_cpus=0, num_gpus=self.config.num_gpus, resources=dict(self.config.resources),
                       scheduling_strategy=self.config.scheduling_strategy, max_concurrency=2)
        handle = ExpertActor.options(**options).remote(
            self.checkpoint, self.groups[group], self.dtype, self.device, self.config.torch_threads, self.tracing,
            offload=self.config.offload_settings())
        return Replica(group, index, generation, name, handle)

    def wait_loaded(self, timeout_s: float) -> None:
        """Block until every actor holds all of its experts' weights (:meth:`ExpertWorker.load`;
        actors otherwise read them lazily, on their first calls).

        Raises:
            ray.exceptions.GetTimeoutError: not all loaded within ``timeout_s``.
            ray.exceptions.RayActorError: an actor died while loading.
        """
        ray.get([r.handle.load.remote() for r in self.all_replicas()], timeout=timeout_s)

    def group_of(self, expert: int) -> int:
        return expert // self.config.experts_per_actor

    def alive(self, group: int) -> list[Replica]:
        """The replicas of ``group`` that may take rows (alive; guests: loaded, not draining)."""
        return [r for r in self.replicas[group] if r.alive and r.ready]

    def recreate(self, dead: Replica, reason: str) -> Replica:
        """Replace a dead replica with the next generation (shared by name across verifiers);
        ``reason`` (what showed it dead or hung) goes into the warning an operator sees.

        A guest dies with its host: the host is re-created and every guest it held is removed (the
        fresh actor holds only its own group; the rebalancer may place them again)."""
        if dead.host is not None:
            return self.recreate(dead.host, f"{reason} (guest of group {dead.group})")
        dead.alive = False
        current = self.replicas[dead.group][dead.index]
        if current is not dead and current.alive:
            return current  # another coroutine already replaced it
        log.warning("expert actor %s is gone or hung (%s); re-creating it", dead.name, reason)
        kill_actor(dead.handle)  # a hung actor would otherwise keep its weights (and GPU share) forever
        for guest in [r for r in self.all_replicas() if r.host is dead]:
            guest.alive = False
            self.replicas[guest.group].remove(guest)
        fresh = self._make(dead.group, dead.index, dead.generation + 1)
        fresh.fresh = True
        self.replicas[dead.group][dead.index] = fresh
        self.version += 1
        return fresh

    def replace_unresponsive(self, replicas: list[Replica], timeout_s: float, stuck_after_s: float) -> list[Replica]:
        """Re-create every actor among ``replicas`` (a guest's: its host) that is hung: it does
        not answer within ``timeout_s`` how long its current computation has run
        (:meth:`actors.expert_actor.ExpertWorker.busy_s`), or that computation has run
        ``stuck_after_s`` or more. Returns the re-created ones (the dead generation).

        For a compiled-graph execution that timed out: its error does not say which member held it
        up, and a layer's actor calls would otherwise wait ``call_timeout_s`` again on a hung one
        before re-creating it. The question runs on the actor's second thread (``max_concurrency``
        2): a process that answers nothing is stopped, frozen or gone; one that answers but has
        been in one expert computation that long is stuck in it (a kernel or collective that
        never returns). A re-created actor not yet answered (``fresh``: its first computation
        may include loading its weights) is judged only by whether it answers."""
        actors = {id(r): r for r in (r.host or r for r in replicas) if r.alive}
        refs = {r.handle.busy_s.remote(): r for r in actors.values()}
        if not refs:
            return []
        done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        hung = [(refs[ref], f"it did not answer in {timeout_s:g} s") for ref in pending]
        for ref in done:
            busy_s = _answer(ref)
            if busy_s is not None and busy_s >= stuck_after_s and not refs[ref].fresh:
                hung.append((refs[ref], f"it has been in one expert computation for {busy_s:.1f} s"))
        for r, why in hung:
            self.recreate(r, f"a compiled-graph execution timed out and {why}")
        return [r for r, _ in hung]

    def actors(self) -> list[Replica]:
        """Every replica with its own actor (no guests), in group then replica order."""
        return [r for r in self.all_replicas() if r.host is None]

    def add_guest(self, group: int, host: Replica) -> tuple[Replica, ray.ObjectRef]:
        """A replica of ``group`` on ``host``'s actor, not ready until the returned ref (the host
        loading the group's experts) is done: then call :meth:`mark_ready`."""
        guest = Replica(group, len(self.replicas[group]), host.generation, f"{host.name}+g{group}", host.handle,
                        stats=host.stats, host=host, ready=False)
        self.replicas[group].append(guest)
        return guest, host.handle.host_experts.remote(self.groups[group])

    def mark_ready(self, guest: Replica) -> None:
        if guest.alive and not guest.ready:
            guest.ready = True
            self.version += 1

    def drain_guest(self, guest: Replica) -> None:
        """Stop sending rows to ``guest``; :meth:`remove_guest` once nothing of it is in flight."""
        if guest.ready:
            guest.ready = False
            self.version += 1

    def remove_guest(self, guest: Replica) -> None:
        """Forget a drained guest and let its host drop the experts (refcounted on the actor:
        another verifier sharing the actor may still use them)."""
        guest.alive = False
        if guest in self.replicas[guest.group]:
            self.replicas[guest.group].remove(guest)
        try:
            guest.handle.drop_experts.remote(self.groups[guest.group])
        except Exception:  # the host is gone: so are its experts
            log.debug("dropping guest experts of %s failed", guest.name, exc_info=True)

    def all_replicas(self) -> list[Replica]:
        return [r for reps in self.replicas.values() for r in reps]

    def shutdown(self) -> None:
        for r in self.actors():
            kill_actor(r.handle)


def _answer(ref: ray.ObjectRef) -> float | None:
    """A ready ``busy_s`` answer, or None where the actor failed it (a dead actor is the actor
    calls' to find and re-create, as before)."""
    try:
        return float(ray.get(ref, timeout=0))
    except (ray.exceptions.RayError, TypeError, ValueError):
        return None
