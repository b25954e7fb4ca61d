"""The adaptive draft length in the engine: lossless whatever k it picks, and k = 0 skips drafting."""

import pytest

from engine.drafters.draft_model import DraftModelDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from engine.spec_controller import Decision, SpeculationController
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids
from tests.engine.test_speculative_engine import GREEDY, MAX_TOKENS, make_engine, run_staggered


class ScriptedController(SpeculationController):
    """Draft lengths from a fixed per-step script (cycled; capped by each sequence's cap), so a
    test controls k changing mid-sequence and whole k = 0 phases."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(16, "adaptive")
        self.script, self.calls = script, 0

    def plan(self, caps, num_base_tokens, num_prefills=0, catchup=None, remaining=None,
             tpot=None, prefill_pairs=0.0) -> Decision:
        k = self.script[self.calls % len(self.script)]
        self.calls += 1
        return Decision({sid: min(c, k + i % 2) if k else 0 for i, (sid, c) in enumerate(caps.items())}, "adaptive")


class CountingDrafter(DraftModelDrafter):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.num_calls = 0

    def propose(self, requests):
        self.num_calls += 1
        return super().propose(requests)


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(40)


@pytest.fixture(scope="module")
def plain(prompts):
    return run_staggered(make_engine("none", 0, 8), prompts)


def test_adaptive_greedy_equals_plain_greedy(prompts, plain):
    engine = make_engine("draft", 8, 8, policy="adaptive")
    decisions = []
    plan = engine.controller.plan
    engine.controller.plan = lambda *a, **kw: decisions.append(plan(*a, **kw)) or decisions[-1]
    assert run_staggered(engine, prompts) == plain
    m = engine.get_metrics()
    assert m["num_draft_tokens"] > 0
    adaptive = [d for d in decisions if d.reason == "adaptive"]
    assert len(adaptive) > len(decisions) // 2  # past the warm-up the controller decides
    assert all(d.predicted_step_s > 0 and d.expected_tokens >= len(d.k) for d in adaptive)
    assert sum(m["draft_length_counts"]) == sum(len(d.k) for d in decisions)


def test_scripted_k_changes_and_k_zero_phases_stay_lossless(prompts, plain):
    engine = make_engine("draft", 8, 8, policy="adaptive")
    engine.controller = ScriptedController([0, 0, 3, 1, 6, 0, 2, 8, 0, 0, 0, 5])
    assert run_staggered(engine, prompts) == plain
    counts = engine.get_metrics()["draft_length_counts"]
    assert counts[0] > 0 and sum(1 for c in counts[1:] if c) >= 5  # k = 0 and at least 5 other lengths
    assert engine.get_metrics()["num_spec_off_steps"] > 0


def test_k_zero_skips_the_drafter_and_draft_probabilities(prompts):
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, max_waiting=100)
    drafter = CountingDrafter(loaded_draft(), 4, 1024)
    engine = LLMEngine(loaded_target(), drafter, 4, sched)
    engine.controller = ScriptedController([0])
    params = SamplingParams(temperature=0.8, max_tokens=8)  # sampled: q would be needed if drafted
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert drafter.num_calls == 0
    assert engine.get_metrics()["num_draft_tokens"] == 0
    assert engine.get_metrics()["num_spec_off_steps"] == engine.num_steps - 1  # all but the prefill
    # Speculation resumes later: the draft cache catches up lazily on the sequence's tokens.
    engine.controller = ScriptedController([4])
    engine.add_request("later", prompts[5], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert drafter.num_calls > 0 and engine.get_metrics()["num_draft_tokens"] > 0


def test_seeded_sampling_is_reproducible_whatever_the_batch_with_the_controller_on(prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=7)
    alone = run_staggered(make_engine("draft", 4, 1, policy="adaptive"), prompts[:4], params)
    engine = make_engine("draft", 4, 8, policy="adaptive")
    reqs = [engine.add_request(f"x{i}", p, params) for i, p in enumerate(prompts[:4])]
    for i, p in enumerate(prompts[10:16]):  # unseeded neighbours: adapted freely
        engine.add_request(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.outputs[0].token_ids for r in reqs] == alone


def test_seeded_sampling_is_the_same_with_any_draft_lengths_or_none(prompts):
    """A seeded sampled sequence's tokens are exponential races of its seed and position, so its
    output is the same with plain decoding, a fixed k, the adaptive controller and a scripted k
    schedule with k = 0 phases, alone or in a batch, with the draft model or n-grams."""
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=MAX_TOKENS, seed=11)
    plain = run_staggered(make_engine("none", 0, 8), prompts[:12], params)
    scripted = make_engine("draft", 8, 8, policy="adaptive")
    scripted.controller = ScriptedController([0, 3, 1, 6, 0, 2, 8, 5])
    runs = {"fixed k=3": make_engine("draft", 3, 8), "adaptive": make_engine("draft", 6, 8, policy="adaptive"),
            "scripted": scripted, "ngram k=4": make_engine("ngram", 4, 8), "alone, k=5": make_engine("draft", 5, 1)}
    for name, engine in runs.items():
        assert run_staggered(engine, prompts[:12], params) == plain, name
        if name != "ngram k=4":
            assert engine.get_metrics()["num_accepted_tokens"] > 0, name  # drafts were verified, and some held
    assert len({tuple(t) for t in plain}) == 12  # the prompts differ, and so do their samples


def test_a_different_seed_gives_a_different_sample(prompts):
    def sample(seed: int) -> list:
        return run_staggered(make_engine("draft", 4, 4), prompts[:4],
                             SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed))

    # Negative seeds too, as vLLM takes them; -1 and 2**63 - 1 were one stream (seeds taken modulo 2**63).
    out = {seed: sample(seed) for seed in (1, 2, -1, 2**63 - 1)}
    assert len({str(o) for o in out.values()}) == 4
    assert sample(-1) == out[-1]
