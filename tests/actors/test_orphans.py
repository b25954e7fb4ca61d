"""Replaced actors are killed, not left holding their weights (and GPU share): a hung or dead
expert actor's replacement kills it, and so does a draft actor's (Ray-free: actor classes faked)."""

import logging
from types import SimpleNamespace

import actors.draft_server as draft_server
import actors.expert_pool as expert_pool
from actors.draft_server import DraftActorSpec, RemoteDrafter
from actors.expert_config import ExpertPoolConfig
from actors.expert_pool import ExpertPool


class _Handle(dict):
    """A created actor's options; ``__ray_ready__.remote()`` as a re-created draft actor is asked."""

    __ray_ready__ = SimpleNamespace(remote=lambda: "ready-ref")


class _FakeActorClass:
    """``Cls.options(**kw).remote(*args)`` returns a new handle that remembers its options."""

    def __init__(self) -> None:
        self.created: list[dict] = []

    def options(self, **options):
        return type("Bound", (), {"remote": lambda _, *args, **kwargs: self._new(options)})()

    def _new(self, options: dict) -> dict:
        handle = _Handle(name=options["name"], options=options)
        self.created.append(handle)
        return handle


def test_recreating_an_expert_actor_kills_the_old_one_once_and_says_why(monkeypatch, caplog):
    killed, actors = [], _FakeActorClass()
    monkeypatch.setattr(expert_pool, "kill_actor", killed.append)
    monkeypatch.setattr(expert_pool, "ExpertActor", actors)
    config = ExpertPoolConfig(experts_per_actor=2, resources={"expert_slot": 1}, scheduling_strategy="SPREAD")
    pool = ExpertPool("ckpt", 4, config, prefix="specmoe-experts-t", detached=False)
    pool.start()
    assert [h["name"] for h in actors.created] == ["specmoe-experts-t-g0-r0-v0", "specmoe-experts-t-g1-r0-v0"]
    assert actors.created[0]["options"]["resources"] == {"expert_slot": 1}
    assert actors.created[0]["options"]["scheduling_strategy"] == "SPREAD"
    old = pool.replicas[1][0]
    with caplog.at_level(logging.WARNING, logger=expert_pool.log.name):
        fresh = pool.recreate(old, "RayActorError in a call of layer 3")
    assert killed == [old.handle] and not old.alive
    assert [r.getMessage() for r in caplog.records] == [
        "expert actor specmoe-experts-t-g1-r0-v0 is gone or hung (RayActorError in a call of layer 3); re-creating it"]
    assert (fresh.name, fresh.generation) == ("specmoe-experts-t-g1-r0-v1", 1)
    assert pool.recreate(old, "test") is fresh and killed == [old.handle]  # a second caller kills nothing more
    pool.shutdown()
    assert killed == [old.handle, pool.replicas[0][0].handle, fresh.handle]


def test_recreating_the_draft_actor_kills_the_old_one(monkeypatch):
    killed, actors = [], _FakeActorClass()
    monkeypatch.setattr(draft_server, "kill_actor", killed.append)
    monkeypatch.setattr(draft_server, "DraftActor", actors)
    spec = DraftActorSpec("draft", "float32", "cpu", 4, None, None, "specmoe-draft-t", "specmoe")
    drafter = RemoteDrafter(spec, timeout_s=1.0)
    old = drafter.member.handle
    drafter._recreate()
    assert killed == [old] and drafter.member.handle["name"] == "specmoe-draft-t-v1"
