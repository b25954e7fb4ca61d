"""EOS, stop strings, stop tokens and max_tokens cut a run exactly where they fall inside it.

The target drafts for itself (greedy acceptance is then 100%), so with k = 4 the second step emits
one accepted run of 5 tokens and every position inside it can be hit.
"""

import dataclasses

import msgspec
import pytest

from engine.drafters.draft_model import DraftModelDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from tests.engine.bundled import loaded_target, prompt_ids

K = 4


def run(params: SamplingParams, prompt: list[int], eos: tuple[int, ...] | None = None):
    target = loaded_target()
    if eos is not None:
        target = dataclasses.replace(target, config=msgspec.structs.replace(target.config, eos_token_ids=eos))
    engine = LLMEngine(target, DraftModelDrafter(loaded_target(), 2, 1024), K, SchedulerConfig(max_num_seqs=2))
    req = engine.add_request("r", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(list(req.outputs[0].new_token_ids))
    assert engine.kv.num_used == 0
    return req.outputs[0], steps


@pytest.fixture(scope="module")
def case():
    prompt = prompt_ids(3)[2]
    out, steps = run(SamplingParams(temperature=0, max_tokens=11, ignore_eos=True), prompt)
    assert [len(s) for s in steps[:2]] == [1, K + 1]  # prefill token, then a fully accepted run
    return prompt, out


@pytest.mark.parametrize("pos", range(1, K + 2))
def test_max_tokens_inside_a_run(case, pos):
    prompt, full = case
    out, _ = run(SamplingParams(temperature=0, max_tokens=1 + pos, ignore_eos=True), prompt)
    assert out.token_ids == full.token_ids[: 1 + pos] and out.finish_reason == "length"


def _first_index(tokens: list[int], pos: int) -> bool:
    return tokens.index(tokens[pos]) == pos


@pytest.mark.parametrize("pos", range(1, K + 2))
def test_stop_token_and_eos_inside_a_run(case, pos):
    prompt, full = case
    if not _first_index(full.token_ids, pos):
        pytest.fail("test prompt must have a token that first appears at each run position")
    tok = full.token_ids[pos]
    out, _ = run(SamplingParams(temperature=0, max_tokens=11, stop_token_ids=[tok]), prompt)
    assert out.token_ids == full.token_ids[: pos + 1] and (out.finish_reason, out.stop_reason) == ("stop", tok)
    # The second of a checkpoint's EOS ids ends it as well (only the first did: Llama 3's <|eot_id|>).
    out, _ = run(SamplingParams(temperature=0, max_tokens=11), prompt, eos=(0, tok))
    assert out.token_ids == full.token_ids[: pos + 1] and (out.finish_reason, out.stop_reason) == ("stop", None)
    tokenizer = loaded_target().tokenizer
    assert out.text == tokenizer.decode(full.token_ids[:pos])  # EOS adds no text


@pytest.mark.parametrize("pos", range(1, K + 2))
def test_stop_string_inside_a_run(case, pos):
    prompt, full = case
    tokenizer = loaded_target().tokenizer
    before = tokenizer.decode(full.token_ids[:pos])
    upto = tokenizer.decode(full.token_ids[: pos + 1])
    stop = upto[len(before) - 1:]  # spans the previous token's last character and this token
    if full.text.find(stop) != len(before) - 1:
        pytest.fail("stop string must first occur at the chosen position")
    out, _ = run(SamplingParams(temperature=0, max_tokens=11, stop=[stop]), prompt)
    assert out.text == before[:-1] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[: pos + 1]
