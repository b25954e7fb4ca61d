"""Speculative decoding is lossless on the bundled pair, under continuous batching."""

import pytest

from engine.drafters.base import NoneDrafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids

NUM_PROMPTS = 100
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def make_engine(drafter_name: str, k: int, max_num_seqs: int, policy: str = "fixed") -> LLMEngine:
    """Fixed k by default: these tests prove losslessness for each k (tests/engine/
    test_adaptive_speculation.py covers the adaptive controller)."""
    drafter = {"none": NoneDrafter, "ngram": NgramDrafter,
               "draft": lambda: DraftModelDrafter(loaded_draft(), max_num_seqs, 1024)}[drafter_name]()
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_waiting=1000)
    return LLMEngine(loaded_target(), drafter, k, sched, speculative_policy=policy)


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params=GREEDY, per_step: int = 3) -> list:
    """Add ``per_step`` requests before every step, so requests join a running batch mid-flight."""
    requests, pending = [], list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(min(per_step, len(pending))):
            i, p = pending.pop(0)
            requests.append(engine.add_request(f"r{i}", p, params))
        engine.step()
    assert engine.kv.num_used == 0
    return [r.outputs[0].token_ids for r in requests]


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(NUM_PROMPTS)


@pytest.fixture(scope="module")
def plain_greedy(prompts):
    return run_staggered(make_engine("none", 0, 16), prompts)


@pytest.mark.parametrize("batch", [16, 1])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_greedy_speculative_equals_plain_greedy(prompts, plain_greedy, drafter, k, batch):
    engine = make_engine(drafter, k, batch)
    assert run_staggered(engine, prompts) == plain_greedy
    stats = engine.get_metrics()
    assert stats["num_draft_tokens"] > 0
    if drafter == "draft":  # a trained draft: more than half a token accepted per verification
        assert stats["mean_acceptance_length"] > 1.5


def test_same_seed_same_output_whatever_the_batch(prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=MAX_TOKENS, seed=1234)
    alone = run_staggered(make_engine("draft", 4, 1), prompts[:6], params)
    engine = make_engine("draft", 4, 16)
    # The same six requests, now reversed and mixed with twelve others that have their own seeds.
    others = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=s) for s in range(12)]
    reqs = [engine.add_request(f"x{i}", p, params) for i, p in reversed(list(enumerate(prompts[:6])))]
    for i, (p, sp) in enumerate(zip(prompts[10:22], others)):
        engine.add_request(f"o{i}", p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.outputs[0].token_ids for r in reversed(reqs)] == alone
    assert alone != run_staggered(make_engine("draft", 4, 1), prompts[:6],
                                  SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=MAX_TOKENS, seed=99))


def test_counters_are_consistent(prompts):
    engine = make_engine("draft", 4, 16)
    requests = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:16])]
    while engine.has_unfinished_requests():
        engine.step()
    totals = engine.get_metrics()
    per_request = [r.spec_stats for r in requests]
    assert totals["num_accepted_tokens"] == sum(s.num_accepted_tokens for s in per_request)
    assert totals["num_emitted_tokens"] == sum(len(r.outputs[0].token_ids) for r in requests)
    assert sum(totals["accepted_per_position"]) == totals["num_accepted_tokens"]
    # Positions are nested: a token at position i is accepted only if 0..i-1 were.
    assert totals["accepted_per_position"] == sorted(totals["accepted_per_position"], reverse=True)
    s = per_request[0]
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)


def test_kv_slots_return_to_zero_after_finish_cancel_and_error(prompts):
    engine = make_engine("draft", 4, 4)
    for i, p in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.kv.num_used == 4
    assert engine.abort_request("r0") and engine.abort_request("r5")  # running and waiting
    real_forward = engine.target.model.forward
    calls = {"n": 0}

    def flaky(batch, kv):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_forward(batch, kv)

    engine.target.model.forward = flaky
    try:
        engine.step()  # fails every running sequence of this step
        assert engine.kv.num_used == 0 and engine.drafter.kv.num_used == 0
        engine.add_request("after", prompts[7], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.target.model.forward = real_forward
    reasons = engine.get_metrics()["finished_by_reason"]
    # r1-r3 were running and r4 was admitted into the failing step: all four fail, nothing else.
    assert reasons["abort"] == 2 and reasons["error"] == 4 and reasons["length"] == 1
    assert engine.kv.num_used == 0


def test_a_sequence_that_samples_no_token_fails_alone(prompts, monkeypatch):
    """A row with no token to emit (the sampler's placeholder, e.g. from NaN logits) fails its own
    sequence; the others in the step carry on and finish with the output they would have had."""
    import engine.engine as engine_module
    from kernels.rejection import PLACEHOLDER_TOKEN_ID

    expected = run_staggered(make_engine("draft", 4, 4), prompts[:3], per_step=3)
    engine = make_engine("draft", 4, 4)
    real_verify, calls = engine_module.verify, {"n": 0}

    def one_bad_row(batch):
        out_ids, num_acc = real_verify(batch)
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step: the second sequence's run becomes the placeholder
            out_ids[1], num_acc[1] = [PLACEHOLDER_TOKEN_ID], 0
        return out_ids, num_acc

    monkeypatch.setattr(engine_module, "verify", one_bad_row)
    reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:3])]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.outputs[0].finish_reason for r in reqs] == ["length", "error", "length"]
    assert [reqs[0].outputs[0].token_ids, reqs[2].outputs[0].token_ids] == [expected[0], expected[2]]
    assert engine.kv.num_used == 0 and engine.drafter.kv.num_used == 0


def test_speculation_turns_off_at_the_configured_batch_size(prompts):
    engine = make_engine("draft", 4, 16)
    engine.scheduler.config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8192, max_waiting=100,
                                              spec_disable_batch_size=4)
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()  # prefill of 8
    before = engine.get_metrics()["num_draft_tokens"]
    engine.step()  # 8 running >= 4: no drafting
    assert engine.get_metrics()["num_draft_tokens"] == before


@pytest.mark.parametrize("temperature", [1e-40, 3e-38, 1e-6])
def test_a_temperature_below_the_greedy_threshold_decodes_greedily(prompts, plain_greedy, temperature):
    # 3e-38 and 1e-40 made logits / t overflow float32: softmax gave NaN, no token was sampled and
    # the request failed (HTTP 500). Below 1e-5 a temperature is greedy, as in vLLM's sampler.
    from engine.sampling_params import GREEDY_BELOW_TEMPERATURE

    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=7)
    assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy  # the threshold samples
    engine = make_engine("draft", 4, 8)
    assert run_staggered(engine, prompts[:8], params) == plain_greedy[:8]
