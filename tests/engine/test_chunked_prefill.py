"""Chunked prefill: prompts split across steps under the token budget, output unchanged."""

import pytest

from engine.drafters.base import NoneDrafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import MIN_PREFILL_CHUNK, SchedulerConfig
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids
from tests.engine.test_speculative_engine import run_staggered

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def engine_with(budget: int, chunked: bool = True, drafter: str = "draft", k: int = 4, seqs: int = 4) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_waiting=100,
                            enable_chunked_prefill=chunked)
    d = DraftModelDrafter(loaded_draft(), seqs, 1024) if drafter == "draft" else NoneDrafter()
    return LLMEngine(loaded_target(), d, k if drafter == "draft" else 0, sched)


@pytest.fixture(scope="module")
def prompts():
    return [p for p in prompt_ids(30) if len(p) > 150][:8]


def test_chunked_output_equals_unchunked_with_speculation(prompts):
    """Budget 64: every prompt (150-400 tokens) crosses 3-7 chunk boundaries, chunks share
    steps with speculative decodes."""
    plain = run_staggered(engine_with(8192, chunked=False, drafter="none"), prompts, GREEDY, per_step=2)
    engine = engine_with(64)
    steps_with_partial = []
    real = engine.scheduler.schedule

    def spy(*a):
        out = real(*a)
        partial = [s for s in out.prefills if out.chunks[s.seq_id] < s.num_prompt_tokens_left]
        steps_with_partial.append((len(partial), len(out.decodes), sum(out.chunks.values())))
        return out

    engine.scheduler.schedule = spy
    assert run_staggered(engine, prompts, GREEDY, per_step=2) == plain
    assert sum(1 for p, d, _ in steps_with_partial if p and d) >= 5  # chunks ran beside decodes
    assert engine.get_metrics()["num_draft_tokens"] > 0
    assert all(tokens <= 64 for _, _, tokens in steps_with_partial)


def test_decodes_first_then_continuing_chunks_then_new_prompts(prompts):
    engine = engine_with(100, drafter="none", seqs=4)
    engine.add_request("a", prompts[0], GREEDY)  # > 150 tokens
    engine.step()  # a: first 100-token chunk
    a = engine._requests["a"][0]
    assert a.num_cached == 100 and not a.state.token_ids
    engine.add_request("b", prompts[1], GREEDY)
    out = engine.scheduler.schedule(engine.kv.num_free, engine._decode_cost)
    assert [s.seq_id for s in out.prefills] == ["a-0"]  # a continues; no room left for b
    assert out.chunks == {"a-0": 100}


def test_budget_used_by_draft_caps_still_lets_the_oldest_prefill_progress(prompts):
    engine = engine_with(8, k=4, seqs=3)  # two decodes with k = 4 reserve 10 > 8 tokens
    for i in range(2):
        engine.add_request(f"d{i}", prompts[i][:5], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    engine.add_request("long", prompts[2], GREEDY)
    engine.scheduler.config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100, max_waiting=10)
    engine.step()  # admitted with a chunk of the 100 - 10 tokens left
    engine.scheduler.config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_waiting=10)
    long = engine._requests["long"][0]
    before = long.num_cached
    engine.step()
    assert long.num_cached - before == MIN_PREFILL_CHUNK


def test_without_chunking_a_long_prompt_waits_unless_alone(prompts):
    engine = engine_with(100, chunked=False, drafter="none", seqs=4)
    engine.add_request("short", prompts[0][:20], SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    engine.add_request("long", prompts[1], GREEDY)  # > 100 tokens: not admitted beside a decode
    out = engine.scheduler.schedule(engine.kv.num_free, engine._decode_cost)
    assert out.prefills == [] and [s.seq_id for s in out.decodes] == ["short-0"]
    alone = engine_with(100, chunked=False, drafter="none", seqs=4)
    alone.add_request("long", prompts[1], GREEDY)
    out = alone.scheduler.schedule(alone.kv.num_free, alone._decode_cost)
    assert out.chunks == {"long-0": len(prompts[1])}  # the only work: admitted whole
