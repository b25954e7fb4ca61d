"""The pool of named, shared expert actors: groups of experts, replicas per group, re-creation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from actors.compiled_graph import kill_actor
from actors.config import ExpertPoolConfig
from actors.expert_actor import ExpertActor

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One actor serving an expert group, with the router's view of its load and speed."""

    group: int
    index: int
    generation: int
    name: str
    handle: ray.actor.ActorHandle
    outstanding_rows: int = 0
    ewma_latency_ms: float = 0.0
    alive: bool = True

    def observe_latency(self, latency_ms: float, alpha: float = 0.2) -> None:
        self.ewma_latency_ms = latency_ms if self.ewma_latency_ms == 0 else (
            alpha * latency_ms + (1 - alpha) * self.ewma_latency_ms)


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
        return [r for r in self.replicas[group] if r.alive]

    def recreate(self, dead: Replica) -> Replica:
        """Replace a dead replica with the next generation (shared by name across verifiers)."""
        dead.alive = False
        current = self.replicas[dead.group][dead.index]
        if current is not dead and current.alive:
            return current  # another coroutine already replaced it
        log.warning("expert actor %s is gone or hung; re-creating it", dead.name)
        kill_actor(dead.handle)  # a hung actor would otherwise keep its weights (and GPU share) forever
        fresh = self._make(dead.group, dead.index, dead.generation + 1)
        self.replicas[dead.group][dead.index] = fresh
        return fresh

    def all_replicas(self) -> list[Replica]:
        return [r for reps in self.replicas.values() for r in reps]

    def shutdown(self) -> None:
        for r in self.all_replicas():
            kill_actor(r.handle)
