"""Online replication of hot expert groups and row splitting, without a Ray cluster: in-process
ExpertWorkers behind fake handles (tests/helpers/fake_ray.py).

Covered: config errors naming the field path; the even contiguous split; on a routing-skewed copy
of the target (router gates zeroed: every token to experts 0 and 1) the rebalancer adds guest
replicas until max/mean rows per actor per dispatch is <= 1.5 (from 4.0), greedy output identical
to in-process experts; a replica added or removed mid-request loses nothing (a removed guest is
dropped from its host only once its last call has ended); cold guests are removed.
"""

from __future__ import annotations

import pytest
import torch

from actors.expert_config import ExpertPoolConfig, ReplicationConfig
from actors.expert_router import ExpertRouter
from actors.replica_choice import split_counts
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from scripts.skew_checkpoint import write_skewed_checkpoint
from tests.helpers.fake_ray import FakePool, install_fake_ray

TARGET = "checkpoints/stdlib-moe-target"
PROMPTS = [[5, 17, 99, 3], [42, 8, 8, 1000, 7], [7, 7, 1, 2], [300, 12, 5, 9, 11]]
REPLICATION = ReplicationConfig(enabled=True, check_every_dispatches=4, patience_checks=1, min_interval_s=0.0)


@pytest.fixture
def fake_ray(monkeypatch):
    return install_fake_ray(monkeypatch)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return str(write_skewed_checkpoint(TARGET, tmp_path_factory.mktemp("skewed")))


def _greedy(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _attach(llm: LLM, checkpoint: str, **config) -> ExpertRouter:
    """Route ``llm``'s experts through a fake pool of 4 actors (2 experts each). The fake runs calls
    one after another at ``get``, so later calls of a layer look slower: a high straggler floor
    keeps the straggler rule (tested in test_replica_choice.py) out of these tests."""
    pool = FakePool.started(checkpoint, **{"experts_per_actor": 2, "split_min_rows": 1, "straggler_floor_ms": 1e3,
                                           **config})
    router = ExpertRouter(pool, torch.float32)
    llm.engine.target.model.experts = router
    return router


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hot_factor", 1.0, "experts.replication.hot_factor must be > 1"),
    ("cold_factor", 1.3, "experts.replication.cold_factor must be >= 0 and < experts.replication.hot_factor"),
    ("patience_checks", 0, "experts.replication.patience_checks must be >= 1, got 0"),
    ("check_every_dispatches", -2, "experts.replication.check_every_dispatches must be >= 1, got -2"),
    ("load_alpha", 0.0, "experts.replication.load_alpha must be in"),
    ("min_interval_s", -1.0, "experts.replication.min_interval_s must be >= 0"),
    ("guest_slots_per_actor", -1, "experts.replication.guest_slots_per_actor must be >= 0, got -1"),
    ("max_replicas_per_group", -1, "experts.replication.max_replicas_per_group must be >= 0, got -1"),
])
def test_replication_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ReplicationConfig(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("split_min_rows", -1), ("probe_interval_s", 0.0)])
def test_choice_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"experts.{field}"):
        ExpertPoolConfig(**{field: value})


def test_rows_split_into_even_contiguous_parts_per_expert():
    parts = split_counts([3, 0, 4], 3)  # 7 rows: 3 + 2 + 2
    assert parts == [([3, 0, 0], 0, 3), ([0, 0, 2], 3, 5), ([0, 0, 2], 5, 7)]
    assert split_counts([5], 1) == [([5], 0, 5)]
    assert split_counts([1, 1], 4)[2:] == [([0, 0], 2, 2), ([0, 0], 2, 2)]  # more parts than rows: empty ones


def test_skewed_routing_is_rebalanced_with_identical_output(fake_ray, skewed):
    llm = LLM(model=skewed, skip_tokenizer_init=True, max_num_seqs=4)
    reference = _greedy(llm)
    router = _attach(llm, skewed, replication=REPLICATION)
    assert _greedy(llm) == reference
    imbalance = list(router.actor_imbalance)
    assert imbalance[0] == pytest.approx(4.0)  # every row on the actor of experts 0 and 1
    assert max(imbalance[-8:]) <= 1.5
    guests = [r for r in router.pool.replicas[0] if r.host is not None]
    assert len(guests) >= 2 and all(r.ready for r in guests)
    assert {r.host.group for r in guests} <= {1, 2, 3}  # hosted by the other groups' actors
    assert all(len(router.pool.replicas[g]) == 1 for g in (1, 2, 3))  # cold groups: not replicated
    assert all(r.stats.outstanding_calls == 0 and r.inflight == 0 for r in router.pool.all_replicas())
    assert router.actor_calls.num_retries == 0


def test_a_replica_added_or_removed_mid_request_loses_nothing(fake_ray, skewed):
    llm = LLM(model=skewed, skip_tokenizer_init=True, max_num_seqs=4)
    reference = _greedy(llm, max_tokens=12)
    router = _attach(llm, skewed, replication=REPLICATION)
    submit, dispatches, removed = router.submit, [], []

    def submit_and_remove(*args):
        dispatches.append(1)
        guests = [r for r in router.pool.replicas[0] if r.host is not None and r.ready]
        if len(dispatches) % 12 == 0 and guests:  # every 3rd step: remove a guest mid-forward
            victim = guests[0]
            victim.handle.set_delay_ms.remote(50.0)  # a probe or call of it may be in flight
            router.rebalancer.remove(victim)
            removed.append(victim)
        return submit(*args)

    router.submit = submit_and_remove
    assert _greedy(llm, max_tokens=12) == reference
    assert removed and router.rebalancer.num_added > len(removed)  # re-added after each removal
    assert router.rebalancer.num_removed == len([v for v in removed if not v.alive])
    drops = [args for v in removed for name, args in v.handle.calls if name == "drop_experts"]
    assert drops and all(args == ([0, 1],) for args in drops)
    assert router.actor_calls.num_retries == 0


def test_a_draining_guest_is_dropped_only_after_its_last_call(fake_ray, skewed):
    router = _attach(LLM(model=skewed, skip_tokenizer_init=True, max_num_seqs=4), skewed,
                     replication=REPLICATION)
    guest, ref = router.pool.add_guest(0, router.pool.replicas[2][0])
    router.rebalancer._loading[ref] = guest
    router.rebalancer.step()
    assert guest.ready and router.pool.version == 1
    guest.begin(3, 0.0)  # e.g. a probe of it still runs on its host
    router.rebalancer.remove(guest)
    assert not guest.ready and guest in router.pool.replicas[0] and router.pool.version == 2
    assert all(name != "drop_experts" for name, _ in guest.handle.calls)
    guest.end(3)
    router.rebalancer.step()
    assert guest not in router.pool.replicas[0] and not guest.alive
    assert [args for name, args in guest.handle.calls if name == "drop_experts"] == [([0, 1],)]


def test_cold_guests_are_removed_when_the_load_evens_out(fake_ray, skewed):
    llm = LLM(model=skewed, skip_tokenizer_init=True, max_num_seqs=4)
    router = _attach(llm, skewed, replication=REPLICATION)
    _greedy(llm)
    added = router.rebalancer.num_added
    assert added >= 2
    even = [1] * 8  # one row per expert: every group equally loaded
    rows, weights = torch.randn(8, llm.engine.target.config.hidden_size), torch.rand(8)
    for _ in range(50 * REPLICATION.check_every_dispatches):  # the EWMA forgets the skew, then one removal a check
        router.run_layer(llm.engine.target.config.moe.sparse_layers[0], rows, weights, even)
    assert all(len(router.pool.replicas[g]) == 1 for g in range(4))  # only the static replicas left
    assert router.rebalancer.num_removed == router.rebalancer.num_added >= added
