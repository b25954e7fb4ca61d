"""Pipelined drafting (engine/drafters/pipelined.py): the window drafted ahead is exactly the
draft model's window for those tokens, greedy output stays identical to plain decoding, sampled
sequences are never pipelined, and a failure while drafting ahead only costs the head start."""

from __future__ import annotations

import threading

import pytest

from engine.drafters.base import DraftRequest
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.pipelined import PipelinedDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids
from tests.engine.test_speculative_engine import make_engine, run_staggered


def _draft(max_seqs: int = 8) -> DraftModelDrafter:
    return DraftModelDrafter(loaded_draft(), max_seqs, 1024)


def _engine(drafter, k: int = 4, policy: str = "fixed") -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8192, max_waiting=1000)
    return LLMEngine(loaded_target(), drafter, k, sched, speculative_policy=policy)


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(24)


@pytest.fixture(scope="module")
def plain(prompts):
    return run_staggered(make_engine("none", 0, 8), prompts)


def test_the_window_drafted_ahead_is_the_draft_models_window_for_those_tokens(prompts):
    pipelined, fresh = PipelinedDrafter(_draft()), _draft()
    tokens = prompts[0][:60]
    first = pipelined.propose([DraftRequest("s", tokens, 4)])[0]
    assert len(first.token_ids) == 4 and first.drafting_ahead and not first.pipelined
    guess = fresh.propose([DraftRequest("probe", tokens + first.token_ids, 1)])[0].token_ids  # the bonus guess
    accepted = tokens + first.token_ids + guess  # all 4 accepted, bonus token as guessed
    ahead = pipelined.propose([DraftRequest("s", accepted, 3)])[0]
    assert ahead.pipelined and ahead.token_ids == fresh.propose([DraftRequest("f", accepted, 3)])[0].token_ids
    # Any other continuation (a rejection, another bonus token) drafts as usual, and correctly.
    other = accepted[:-1] + [(accepted[-1] + 1) % 4096]
    redrafted = pipelined.propose([DraftRequest("s", other, 4)])[0]
    assert not redrafted.pipelined and redrafted.token_ids == fresh.propose([DraftRequest("g", other, 4)])[0].token_ids
    assert (pipelined.num_windows_prepared, pipelined.num_windows_used) == (3, 1)
    pipelined.close()


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_pipelined_greedy_equals_plain_greedy(prompts, plain, policy):
    engine = _engine(PipelinedDrafter(_draft()), k=4 if policy == "fixed" else 8, policy=policy)
    assert run_staggered(engine, prompts) == plain
    windows = engine.get_metrics()["pipelined_windows"]
    assert windows["used"] > 0 and windows["discarded"] > 0
    # Every window drafted ahead was either used or discarded by the end, and counted once.
    assert (engine.drafter.num_windows_used, engine.drafter.num_windows_prepared) == \
        (windows["used"], windows["used"] + windows["discarded"])
    engine.drafter.close()


def test_sampled_sequences_are_not_pipelined_and_keep_their_seeded_output(prompts):
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7)
    outs = []
    for drafter in (_draft(), PipelinedDrafter(_draft())):
        engine = _engine(drafter)
        outs.append(run_staggered(engine, prompts[:6], params))
    assert outs[0] == outs[1]
    assert engine.get_metrics()["pipelined_windows"] == {"used": 0, "discarded": 0}
    assert engine.drafter.num_windows_prepared == 0


class FailingAhead(DraftModelDrafter):
    """Raises whenever it is asked to draft ahead (on the pipeline's thread)."""

    def propose(self, requests):
        if threading.current_thread().name.startswith("draft-ahead"):
            raise RuntimeError("draft ahead failed")
        return super().propose(requests)


def test_a_failure_while_drafting_ahead_falls_back_to_drafting_without_loss(prompts, plain):
    engine = _engine(PipelinedDrafter(FailingAhead(loaded_draft(), 8, 1024)))
    assert run_staggered(engine, prompts) == plain
    m = engine.get_metrics()
    assert m["pipelined_windows"]["used"] == 0 and m["pipelined_windows"]["discarded"] > 0
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0  # still speculating


def test_no_window_is_drafted_ahead_past_the_drafters_context(prompts, caplog):
    """At the end of the context window drafting ahead could only fail (a KVCacheFull warning
    every step, a trial found); a window that fits is still drafted ahead."""
    pipelined = PipelinedDrafter(DraftModelDrafter(loaded_draft(), 2, 16))
    with caplog.at_level("WARNING", logger="engine.drafters.pipelined"):
        near_end = pipelined.propose([DraftRequest("s", prompts[0][:9], 4)])[0]  # 9 + 2 x 4 > 16
        assert len(near_end.token_ids) == 4 and not near_end.drafting_ahead
        fits = pipelined.propose([DraftRequest("t", prompts[1][:8], 4)])[0]  # 8 + 2 x 4 = 16
        assert fits.drafting_ahead
        pipelined.propose([DraftRequest("t", prompts[1][:8] + fits.token_ids, 1)])  # waits for it (12 + 2 fit)
    assert pipelined.num_windows_prepared == 2 and not caplog.records
    pipelined.close()
