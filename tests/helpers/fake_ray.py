"""A deterministic stand-in for the few Ray calls the router and the remote drafter make.

``FakeRay`` replaces the ``ray`` module inside ``actors.expert_router`` / ``actors.actor_calls`` /
``actors.expert_pool`` / ``actors.draft_server`` (monkeypatched): ``wait`` reports every non-hung
ref ready at once and times out immediately on hung ones, ``get`` returns a ref's (or each ref of a list's) value or raises what
the actor "did" (a call to an actor without delay is computed when sent, a delayed one when got,
its timing moved to when its delay ended). ``FakeActor`` wraps a plain object (e.g. an in-process
``ExpertWorker``) as an actor handle whose behaviour a test sets:
``"ok"`` (calls the object), ``"dead"`` or ``"killed"`` (RayActorError) or ``"hung"`` (never ready). A
handle's ``set_delay_ms`` (the straggler knob) makes its later calls ready only that long after they
are sent, and ``wait`` sleeps (bounded by its timeout) until the next delayed ref is ready; ``cancel``
records the ref (a delayed one still becomes ready, like a running actor task that cannot stop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from actors import actor_calls, expert_actor, expert_pool, expert_router
from actors.expert_config import ExpertPoolConfig
from actors.expert_pool import ExpertPool, Replica


class FakeRef:
    """An object ref: ``compute`` runs at ``get`` time; ``hung`` never becomes ready."""

    def __init__(self, compute: Callable[[], Any], hung: bool = False, ready_at_s: float = 0.0) -> None:
        self.compute, self.hung, self.ready_at_s = compute, hung, ready_at_s  # ready_at_s: time.monotonic()

    def ready(self) -> bool:
        return not self.hung and self.ready_at_s <= time.monotonic()


class _Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args) -> FakeRef:
        actor = self.actor
        actor.calls.append((self.name, args))
        if self.name == "set_delay_ms":  # kept by the handle: the in-process worker never sleeps
            actor.delay_s = args[0] / 1e3
            return FakeRef(lambda: None)
        if actor.behaviour == "hung":
            return FakeRef(lambda: None, hung=True)
        if actor.behaviour in ("dead", "killed"):
            def died():
                raise ray.exceptions.RayActorError()
            return FakeRef(died)
        if self.name == "__ray_ready__":  # Ray adds it to every actor class: True once constructed
            return FakeRef(lambda: True, ready_at_s=time.monotonic() + actor.delay_s)  # a slow one starts late
        if not actor.delay_s:  # an idle actor computes at once (so its timings are its own)
            try:
                value = getattr(actor.target, self.name)(*args)
            except Exception as e:  # raised where Ray raises it: at get
                def failed(e=e):
                    raise e
                return FakeRef(failed)
            return FakeRef(lambda: value)
        ready_at_s = time.monotonic() + actor.delay_s

        def late():  # computed when got, timed as if it ran when its delay ended
            value = getattr(actor.target, self.name)(*args)
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict) and "start_s" in value[1]:
                value[1]["start_s"] -= max(0.0, time.monotonic() - ready_at_s)
            return value
        return FakeRef(late, ready_at_s=ready_at_s)


class FakeActor:
    """Actor handle over ``target``; ``calls`` lists ``(method, args)`` as sent."""

    def __init__(self, target: Any, behaviour: str = "ok") -> None:
        self.target, self.behaviour = target, behaviour
        self.delay_s = 0.0
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") and name != "__ray_ready__":
            raise AttributeError(name)
        return _Method(self, name)


def fake_actor(target: Any, behaviour: str | float) -> FakeActor:
    """A :class:`FakeActor`; a float ``behaviour`` is "ok", constructed and answering each call
    that many seconds late (a slow start, a straggler)."""
    if isinstance(behaviour, float):
        handle = FakeActor(target, "ok")
        handle.delay_s = behaviour
        return handle
    return FakeActor(target, behaviour)


class FakeRay:
    """The ``ray`` functions the router/drafter use, over :class:`FakeRef`; counts ``wait`` timeouts
    and keeps the cancelled refs."""

    exceptions = ray.exceptions

    def __init__(self) -> None:
        self.timeouts = 0
        self.cancelled: list[FakeRef] = []

    def wait(self, refs: list[FakeRef], num_returns: int = 1, timeout: float | None = None):
        ready = [r for r in refs if r.ready()][:num_returns]
        upcoming = sorted(r.ready_at_s for r in refs if not r.hung and not r.ready())
        if len(ready) < num_returns and upcoming and timeout != 0:
            now = time.monotonic()
            until = upcoming[min(num_returns - len(ready), len(upcoming)) - 1]
            time.sleep(max(0.0, min(until, now + timeout if timeout is not None else until) - now))
            ready = [r for r in refs if r.ready()][:num_returns]
        if not ready:
            self.timeouts += 1
        return ready, [r for r in refs if r not in ready]

    def cancel(self, ref: FakeRef) -> None:
        self.cancelled.append(ref)

    def get(self, ref: FakeRef | list[FakeRef], timeout: float | None = None):
        if isinstance(ref, list):
            return [self.get(r, timeout) for r in ref]
        wait_s = ref.ready_at_s - time.monotonic()
        if ref.hung or (timeout is not None and wait_s > timeout):
            time.sleep(0.0 if ref.hung else max(0.0, timeout))
            self.timeouts += 1
            raise ray.exceptions.GetTimeoutError(f"timed out after {timeout} s")
        time.sleep(max(0.0, wait_s))
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
        worker = expert_actor.ExpertWorker(self.checkpoint, self.groups[group], self.dtype,
                                           offload=self.config.offload_settings())
        handle = fake_actor(worker, self.behaviour(group, index, generation))
        return Replica(group, index, generation, f"g{group}-r{index}-v{generation}", handle)


def install_fake_ray(monkeypatch) -> FakeRay:
    """FakeRay inside the router; in-process workers skip Ray's runtime context (which would start
    Ray); re-creating a replica "kills" its fake handle instead of calling ``ray.kill``."""
    fake = FakeRay()
    monkeypatch.setattr(expert_router, "ray", fake)
    monkeypatch.setattr(actor_calls, "ray", fake)
    monkeypatch.setattr(expert_pool, "ray", fake)
    monkeypatch.setattr(expert_actor, "_actor_id", lambda: "in-process")
    monkeypatch.setattr(expert_pool, "kill_actor", lambda handle: setattr(handle, "behaviour", "killed"))
    return fake
