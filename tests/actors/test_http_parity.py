"""HTTP through the Ray actors reproduces the in-process engine token for token."""

import asyncio

import openai
import pytest

from engine import SamplingParams
from tests.actors.conftest import MODEL_NAME

NUM_PROMPTS = 20
MAX_TOKENS = 24


def _prompts(heldout_prompts):
    # Short and long prompts alike: every 15th held-out prompt.
    return [row["prompt"] for row in heldout_prompts[::15][:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def expected(reference_llm, heldout_prompts):
    outs = reference_llm.generate(_prompts(heldout_prompts), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("k", [4, 0], ids=["speculation-on", "speculation-off"])
def test_greedy_http_equals_in_process_engine(served, heldout_prompts, expected, k):
    async def run():
        client = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
        calls = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"num_speculative_tokens": k})
                 for p in _prompts(heldout_prompts)]
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    got = [(r.choices[0].text, r.choices[0].finish_reason) for r in results]
    assert got == expected


def test_streaming_completion_concatenates_to_the_same_text(client, heldout_prompts, expected):
    prompt = _prompts(heldout_prompts)[3]
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[3][0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected[3][1]


def test_chat_completion_stream_and_not(client, reference_llm):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(s):"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    # The bundled checkpoint has no chat template: the documented plain template is used.
    prompt = "<|system|>\nYou write Python.\n<|user|>\ndef parse(s):\n<|assistant|>\n"
    ref = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0]
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.outputs[0].text


def test_models_and_health(served, client):
    import httpx

    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(served[0] + "/health").status_code == 200


@pytest.fixture(scope="module")
def speculative_llm():
    """In-process engine with the served draft model and k (sampled output depends on k)."""
    from engine import LLM
    from tests.actors.conftest import DRAFT, TARGET

    return LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=4, dtype="float32")


def test_sampled_requests_with_logprobs_over_http_equal_the_in_process_engine(client, speculative_llm):
    prompt = "def read_config(path):\n"
    params = dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=16)
    ref = speculative_llm.generate(prompt, SamplingParams(n=2, logprobs=2, ignore_eos=True, **params))[0]
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, n=2, logprobs=2,
                                    extra_body={"ignore_eos": True}, **params)
    assert len({o.text for o in ref.outputs}) == 2  # two different samples (seed + index)
    for choice, out in zip(sorted(got.choices, key=lambda c: c.index), ref.outputs):
        assert choice.text == out.text
        assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in out.logprobs], abs=1e-4)
        for top, tok, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.tokens, choice.logprobs.token_logprobs):
            assert len(top) in (2, 3) and top[tok] == pytest.approx(lp)  # the sampled token is always there
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    chat_params = dict(temperature=0.7, seed=5, max_tokens=12)
    messages = [{"role": "user", "content": "def parse(s):"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, logprobs=True, top_logprobs=1,
                                          **chat_params)
    chat_ref = speculative_llm.generate("<|user|>\ndef parse(s):\n<|assistant|>\n",
                                        SamplingParams(logprobs=1, **chat_params))[0].outputs[0]
    assert chat.choices[0].message.content == chat_ref.text
    assert [c.logprob for c in chat.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in chat_ref.logprobs], abs=1e-4)
