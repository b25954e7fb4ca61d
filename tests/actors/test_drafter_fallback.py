"""RemoteDrafter's fallback without a Ray cluster: an in-process DraftServer behind a fake handle
(tests/helpers/fake_ray.py). A timed-out or dead draft actor costs one step's speculation and is
re-created; an error raised inside a healthy actor costs the step but keeps the actor."""

from __future__ import annotations

import time

import pytest
import torch

from actors import draft_server
from actors.draft_server import DraftActorSpec, DraftServer, RemoteDrafter
from engine.drafters.base import DraftRequest
from engine.drafters.draft_model import DraftModelDrafter
from engine.loader import load_model
from tests.helpers.fake_ray import FakeRay, fake_actor

DRAFT = "checkpoints/stdlib-draft"


class FakeDrafter(RemoteDrafter):
    """Each new actor is a FakeActor over an in-process DraftServer; ``behaviours`` lists how the
    actors of successive generations answer (the last one repeats)."""

    behaviours = ["ok"]

    def _make(self):
        behaviour = self.behaviours[min(self.generation, len(self.behaviours) - 1)]
        return fake_actor(DraftServer(DRAFT, max_seqs=4, pipelined=self.spec.pipelined), behaviour)


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(draft_server, "ray", fake)
    monkeypatch.setattr(draft_server, "kill_actor", lambda handle: setattr(handle, "behaviour", "killed"))
    return fake


def _requests():
    return [DraftRequest("a", list(range(5, 40)), 4),
            DraftRequest("c", [7, 8, 9], 2, temperature=0.9, generator=torch.Generator().manual_seed(5))]


def _drafter(behaviours: list[str]) -> FakeDrafter:
    spec = DraftActorSpec(DRAFT, "float32", "cpu", 4, None, None, "test-draft", "specmoe")
    FakeDrafter.behaviours = behaviours
    return FakeDrafter(spec, timeout_s=0.25)


@pytest.mark.parametrize("failure", ["hung", "dead"])
def test_a_timed_out_or_dead_draft_actor_costs_one_step_and_is_recreated(fake_ray, failure):
    expected = DraftModelDrafter(load_model(DRAFT, "float32", "cpu"), 4, None).propose(_requests())
    assert all(p.token_ids for p in expected)
    drafter = _drafter([failure, "ok"])
    failed = drafter.propose(_requests())
    assert [p.token_ids for p in failed] == [[], []] and all(p.probs is None for p in failed)
    assert (drafter.num_failures, drafter.generation) == (1, 1)
    assert fake_ray.timeouts == (1 if failure == "hung" else 0)
    recovered = drafter.propose(_requests())
    assert [p.token_ids for p in recovered] == [p.token_ids for p in expected]
    torch.testing.assert_close(recovered[1].probs, expected[1].probs, rtol=0, atol=0)


def test_a_recreated_draft_actor_is_not_waited_for_while_it_starts(fake_ray):
    # Before: the next step called the starting actor at once and waited for its start (a killed
    # draft stalled every request 3-4 s), and a start longer than the timeout was a timeout, a
    # kill and another re-creation.
    expected = DraftModelDrafter(load_model(DRAFT, "float32", "cpu"), 4, None).propose(_requests())
    drafter = _drafter(["dead", 0.4])  # the re-created actor takes 0.4 s to start, past the 0.25 s timeout
    assert [p.token_ids for p in drafter.propose(_requests())] == [[], []]
    started = time.monotonic()
    assert [p.token_ids for p in drafter.propose(_requests())] == [[], []]  # still starting: no speculation
    assert time.monotonic() - started < 0.2 and [c[0] for c in drafter.member.handle.calls] == ["__ray_ready__"]
    time.sleep(0.45)
    recovered = drafter.propose(_requests())  # its first call may take its warm-up: not a timeout
    assert [p.token_ids for p in recovered] == [p.token_ids for p in expected]
    assert (drafter.num_failures, drafter.generation) == (1, 1)


def test_an_error_inside_a_live_actor_keeps_the_actor(fake_ray):
    drafter = _drafter(["ok"])
    handle = drafter.member.handle
    bad = [DraftRequest("x", [10**9], 2)]  # out-of-vocabulary id: the draft model raises inside the actor
    assert [p.token_ids for p in drafter.propose(bad)] == [[]]
    assert (drafter.num_failures, drafter.generation) == (1, 0) and drafter.member.handle is handle
    assert [len(p.token_ids) for p in drafter.propose(_requests())] == [4, 2]


def test_a_pipelined_draft_actor_dying_mid_run_changes_no_greedy_output(fake_ray):
    """The draft actor drafts ahead (pipelined); it dies after a few steps: the step without a
    draft, the re-created actor (no window ready) and the rest are all lossless."""
    from engine.drafters.base import NoneDrafter
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.scheduler import SchedulerConfig
    from tests.engine.bundled import loaded_target, prompt_ids

    prompts, params = prompt_ids(6), SamplingParams(temperature=0.0, max_tokens=24)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, max_waiting=100)

    def run(drafter, kill_at_step: int | None = None) -> list[list[int]]:
        engine = LLMEngine(loaded_target(), drafter, 4, sched, speculative_policy="fixed")
        requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            if engine.num_steps == kill_at_step:
                drafter.member.handle.behaviour = "dead"
            engine.step()
        return [r.outputs[0].token_ids for r in requests], engine.get_metrics()

    expected, _ = run(NoneDrafter())
    spec = DraftActorSpec(DRAFT, "float32", "cpu", 4, None, None, "test-draft", "specmoe", pipelined=True)
    FakeDrafter.behaviours = ["ok"]
    drafter = FakeDrafter(spec, timeout_s=0.25)
    outputs, m = run(drafter, kill_at_step=6)
    assert outputs == expected
    assert (drafter.num_failures, drafter.generation) == (1, 1)
    assert m["pipelined_windows"]["used"] > 0  # windows drafted ahead were used before and after


def test_wait_loaded_returns_once_the_draft_actor_is_constructed(fake_ray):
    _drafter(["ok"]).wait_loaded(timeout_s=1.0)
    with pytest.raises(fake_ray.exceptions.GetTimeoutError):
        _drafter(["hung"]).wait_loaded(timeout_s=0.1)
