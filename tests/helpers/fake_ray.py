"""A deterministic stand-in for the few Ray calls the router and the remote drafter make.

``FakeRay`` replaces the ``ray`` module inside ``actors.expert_router`` / ``actors.draft_server``
(monkeypatched): ``wait`` reports every non-hung ref ready at once and times out immediately on
hung ones, ``get`` returns a ref's value or raises what the actor "did". ``FakeActor`` wraps a plain
object (e.g. an in-process ``ExpertWorker``) as an actor handle whose behaviour a test sets:
``"ok"`` (calls the object), ``"dead"`` or ``"killed"`` (RayActorError) or ``"hung"`` (never ready).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from actors import expert_actor, expert_pool, expert_router
from actors.config import ExpertPoolConfig
from actors.expert_pool import ExpertPool, Replica


class FakeRef:
    """An object ref: ``compute`` runs at ``get`` time; ``hung`` never becomes ready."""

    def __init__(self, compute: Callable[[], Any], hung: bool = False) -> None:
        self.compute, self.hung = compute, hung


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args) -> FakeRef:
        actor = self.actor
        actor.calls.append((self.name, args))
        if actor.behaviour == "hung":
            return FakeRef(lambda: None, hung=True)
        if actor.behaviour in ("dead", "killed"):
            def died():
                raise ray.exceptions.RayActorError()
            return FakeRef(died)
        return FakeRef(lambda: getattr(actor.target, self.name)(*args))


class FakeActor:
    """Actor handle over ``target``; ``calls`` lists ``(method, args)`` as sent."""

    def __init__(self, target: Any, behaviour: str = "ok") -> None:
        self.target, self.behaviour = target, behaviour
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)


class FakeRay:
    """The ``ray`` functions the router/drafter use, over :class:`FakeRef`; counts ``wait`` timeouts."""

    exceptions = ray.exceptions

    def __init__(self) -> None:
        self.timeouts = 0

    def wait(self, refs: list[FakeRef], num_returns: int = 1, timeout: float | None = None):
        ready = [r for r in refs if not r.hung][:num_returns]
        if not ready:
            self.timeouts += 1
        return ready, [r for r in refs if r not in ready]

    def get(self, ref: FakeRef, timeout: float | None = None):
        if ref.hung:
            self.timeouts += 1
            raise ray.exceptions.GetTimeoutError(f"timed out after {timeout} s")
        return ref.compute()


class FakePool(ExpertPool):
    """An ExpertPool whose replicas are in-process ExpertWorkers behind :class:`FakeActor` handles;
    ``behaviour(group, index, generation)`` decides how each new actor answers."""

    behaviour = staticmethod(lambda group, index, generation: "ok")

    @classmethod
    def started(cls, checkpoint: str, dtype: str = "float32", behaviour: Callable | None = None,
                **config) -> FakePool:
        """A started pool of 4 experts per actor, actor calls, 0.5 s timeout, plus ``config``."""
        from engine.config import load_model_config

        pool = cls(checkpoint, load_model_config(checkpoint).moe.num_experts,
                   ExpertPoolConfig(**{"experts_per_actor": 4, "call_timeout_s": 0.5, "transport": "actor_calls",
                                       **config}), dtype=dtype)
        if behaviour is not None:
            pool.behaviour = behaviour
        pool.start()
        return pool

    def _make(self, group: int, index: int, generation: int) -> Replica:
        worker = expert_actor.ExpertWorker(self.checkpoint, self.groups[group], self.dtype)
        handle = FakeActor(worker, self.behaviour(group, index, generation))
        return Replica(group, index, generation, f"g{group}-r{index}-v{generation}", handle)


def install_fake_ray(monkeypatch) -> FakeRay:
    """FakeRay inside the router; in-process workers skip Ray's runtime context (which would start
    Ray); re-creating a replica "kills" its fake handle instead of calling ``ray.kill``."""
    fake = FakeRay()
    monkeypatch.setattr(expert_router, "ray", fake)
    monkeypatch.setattr(expert_actor, "_actor_id", lambda: "in-process")
    monkeypatch.setattr(expert_pool, "kill_actor", lambda handle: setattr(handle, "behaviour", "killed"))
    return fake
