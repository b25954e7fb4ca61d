"""The bundled pair: specmoe's greedy output equals transformers' token for token."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.bundled import DRAFT, TARGET, prompt_ids

NEW_TOKENS = 32


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_greedy_matches_transformers_on_heldout_prompts(path):
    from transformers import AutoModelForCausalLM

    prompts = [prompt_ids(40, max_len=200)[i] for i in (0, 17, 39)]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    llm = LLM(path, dtype="float32", max_num_seqs=3)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in got] == expected
