"""skip_tokenizer_init (vLLM's option): a checkpoint without tokenizer.json loads, token-id prompts
go in and token ids come out, equal to the same engine with its tokenizer; text prompts and stop
strings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import CheckpointError
from engine.request_ranges import RequestError

TARGET, DRAFT = Path("checkpoints/stdlib-moe-target"), Path("checkpoints/stdlib-draft")
PROMPTS = [[100, 5, 17, 42, 9], [7, 8, 9, 10, 11, 12, 13]]


def without_tokenizer(src: Path, dst: Path) -> Path:
    """``src``'s weights and configs, no tokenizer files (symlinks, nothing copied)."""
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            (dst / f.name).symlink_to(f.resolve())
    return dst


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("bare")
    return str(without_tokenizer(TARGET, root / "target")), str(without_tokenizer(DRAFT, root / "draft"))


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(str(TARGET), draft_model=str(DRAFT), num_speculative_tokens=3)


def test_a_checkpoint_without_tokenizer_needs_the_option(bare):
    with pytest.raises(CheckpointError, match="no tokenizer.json.*skip_tokenizer_init"):
        LLM(bare[0])


def test_token_ids_in_token_ids_out_equal_the_tokenized_engine(bare, reference):
    llm = LLM(bare[0], draft_model=bare[1], num_speculative_tokens=3, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=12, logprobs=1, ignore_eos=True)
    for params in (greedy, sampled):
        got, want = llm.generate(PROMPTS, params), reference.generate(PROMPTS, params)
        for g, w in zip(got, want):
            assert g.prompt is None and g.prompt_token_ids == w.prompt_token_ids
            assert g.outputs[0].token_ids == w.outputs[0].token_ids and len(g.outputs[0].token_ids) == 12
            assert g.outputs[0].text == "" and w.outputs[0].text != ""
    assert [t.token_id for t in got[0].outputs[0].logprobs] == got[0].outputs[0].token_ids
    # stop_token_ids still work: stop at the third token of the greedy run
    first = llm.generate(PROMPTS[0], greedy)[0].outputs[0].token_ids
    stop = first[2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == first[:first.index(stop) + 1] and out.finish_reason == "stop"


def test_text_prompts_and_stop_strings_are_refused_by_name(bare):
    llm = LLM(bare[0], skip_tokenizer_init=True)
    with pytest.raises(RequestError, match="skip_tokenizer_init.*token ids") as err:
        llm.generate("def f():")
    assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="'stop' strings need a tokenizer") as err:
        llm.generate(PROMPTS[0], SamplingParams(stop=["\n"]))
    assert err.value.param == "stop"
    with pytest.raises(RequestError, match="'stop' strings"):  # the engine API refuses them too
        llm.engine.add_request("direct", PROMPTS[0], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished_requests()


def test_chat_is_refused_by_name_without_a_tokenizer(bare):
    llm = LLM(bare[0], skip_tokenizer_init=True)
    with pytest.raises(RequestError, match="chat needs a tokenizer") as err:
        llm.chat([{"role": "user", "content": "hi"}])
    assert err.value.param == "messages" and llm.get_tokenizer() is None
