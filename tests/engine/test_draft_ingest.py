"""Prompt chunks reach a drafter that takes them (``Drafter.ingest``: the draft actor) in the step
the target prefills them: its cache then holds a prompt when the sequence first drafts, output
stays lossless, and a k = 0 request only fills the draft model's cache."""

import pytest

from engine.drafters.base import DraftRequest
from engine.drafters.draft_model import DraftModelDrafter, _common_prefix
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids
from tests.engine.test_adaptive_speculation import ScriptedController
from tests.engine.test_chunked_prefill import engine_with
from tests.engine.test_speculative_engine import run_staggered

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


class IngestingDrafter(DraftModelDrafter):
    """A draft model with ``ingest`` (here synchronous, as the draft actor's would have finished by
    the next call); records per call each request's (seq_id, k, tokens, tokens the cache lacked)."""

    ingests_prompts = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[list[tuple[str, int, int, int]]] = []

    def propose(self, requests):
        self.calls.append([(r.seq_id, r.k, len(r.token_ids),
                            len(r.token_ids) - _common_prefix(self._cached.get(r.seq_id, []), r.token_ids))
                           for r in requests])
        return super().propose(requests)

    def ingest(self, requests):
        assert all(r.k == 0 for r in requests)
        self.propose(requests)


@pytest.fixture(scope="module")
def prompts():
    return [p for p in prompt_ids(30) if len(p) > 150][:6]


def test_chunks_reach_the_drafter_as_they_are_prefilled_and_output_is_unchanged(prompts):
    plain = run_staggered(engine_with(8192, chunked=False, drafter="none"), prompts, GREEDY, per_step=1)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_waiting=100)
    drafter = IngestingDrafter(loaded_draft(), 4, 1024)
    engine = LLMEngine(loaded_target(), drafter, 4, sched, speculative_policy="fixed")
    assert run_staggered(engine, prompts, GREEDY, per_step=1) == plain
    ingested: dict[str, list[int]] = {}
    first_draft_fed: dict[str, int] = {}
    for call in drafter.calls:
        for sid, k, n, fed in call:
            if k == 0:
                assert sid not in first_draft_fed  # chunks only before the sequence drafts
                ingested.setdefault(sid, []).append(n)
            else:
                first_draft_fed.setdefault(sid, fed)
    lengths = {f"r{i}-0": len(p) for i, p in enumerate(prompts)}
    assert len(ingested) >= 4  # prompts prefilled beside drafting decodes
    for sid, ends in ingested.items():
        assert ends == sorted(ends) and ends[-1] == lengths[sid]  # chunk by chunk, up to the whole prompt
        # Its first draft feeds only its first output token and the one before it (the newest
        # token is always re-fed for its logits), not the prompt.
        assert first_draft_fed[sid] <= 2
    assert "r0-0" not in ingested and first_draft_fed["r0-0"] > 150  # before any decode drafted


def test_no_chunks_go_while_the_controller_keeps_speculation_off(prompts):
    drafter = IngestingDrafter(loaded_draft(), 4, 1024)
    engine = LLMEngine(loaded_target(), drafter, 4,
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_waiting=100))
    engine.controller = ScriptedController([0])
    run_staggered(engine, prompts[:3], GREEDY, per_step=1)
    assert drafter.calls == []


def test_a_k_zero_request_only_fills_the_cache(prompts):
    p, q = prompts[0], prompts[1]
    alone = DraftModelDrafter(loaded_draft(), 4, 1024)
    want_q = alone.propose([DraftRequest("q", q, 3)])[0].token_ids
    want_p = alone.propose([DraftRequest("p", p, 4)])[0].token_ids
    drafter = DraftModelDrafter(loaded_draft(), 4, 1024)
    out = drafter.propose([DraftRequest("p", p[:100], 0), DraftRequest("q", q, 3)])
    assert out[0].token_ids == [] and out[0].probs is None and out[1].token_ids == want_q
    assert drafter._cached["p"] == p[:100] and drafter.kv.lengths[drafter._slots["p"]] == 100
    assert drafter.propose([DraftRequest("p", p, 0)])[0].token_ids == []  # the rest, alone
    assert drafter.propose([DraftRequest("p", p, 4)])[0].token_ids == want_p  # as if caught up at once
