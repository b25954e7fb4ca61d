"""The model core computes what transformers computes, for every supported architecture."""

import pytest
import torch

from engine.loader import load_model
from engine.model import ForwardBatch
from tests.helpers.tiny_checkpoints import ARCHITECTURES, VOCAB

PROMPT_LENS = (7, 1, 13, 4)


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_and_decode_logits_match_transformers(tiny_checkpoints, arch):
    path, ref = tiny_checkpoints[arch]
    loaded = load_model(path, "float32")
    kv = loaded.model.new_kv_cache(4, 64)
    prompts = _prompts()
    slots = [kv.allocate() for _ in prompts]
    # Ragged prefill of all prompts in one forward, logits at every position.
    logits = loaded.model.forward(ForwardBatch.build(slots, prompts, [0] * 4, logits="all"), kv)
    worst = 0.0
    for p, rows in zip(prompts, torch.split(logits, [len(p) for p in prompts])):
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0]
        worst = max(worst, (expected - rows).abs().max().item())
    # Then one batched decode step of 3 tokens per sequence (a verification-shaped forward).
    extra = [[(7 * i + j) % VOCAB for j in range(3)] for i in range(4)]
    logits = loaded.model.forward(ForwardBatch.build(slots, extra, [len(p) for p in prompts], logits="all"), kv)
    for p, e, rows in zip(prompts, extra, torch.split(logits, 3)):
        with torch.no_grad():
            expected = ref(torch.tensor([p + e])).logits[0, -3:]
        worst = max(worst, (expected - rows).abs().max().item())
    assert worst <= 1e-4, f"{arch}: max |dlogit| = {worst:.2e}"


@pytest.mark.parametrize("reverse_slots", [False, True], ids=["consecutive_slots", "gathered_slots"])
def test_ragged_batched_decode_equals_one_at_a_time(tiny_checkpoints, reverse_slots):
    path, _ = tiny_checkpoints["mixtral"]
    model = load_model(path).model
    prompts = _prompts(2)

    def greedy(batch_prompts: list[list[int]], steps: int) -> list[list[int]]:
        kv = model.new_kv_cache(len(batch_prompts) + 1, 64)
        kv.allocate()  # slot 0 stays unused: a batch's slots need not start at 0
        slots = [kv.allocate() for _ in batch_prompts]
        if reverse_slots:  # descending slots: the cache rows are gathered, not a view
            slots = slots[::-1]
        logits = model.forward(ForwardBatch.build(slots, batch_prompts, [0] * len(slots)), kv)
        seqs = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(steps - 1):
            starts = [len(p) + len(s) - 1 for p, s in zip(batch_prompts, seqs)]
            logits = model.forward(ForwardBatch.build(slots, [[s[-1]] for s in seqs], starts), kv)
            for s, t in zip(seqs, logits.argmax(-1)):
                s.append(int(t))
        return seqs

    batched = greedy(prompts, 12)
    single = [greedy([p], 12)[0] for p in prompts]
    assert batched == single


def test_rollback_then_redecode_equals_fresh_decode(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_moe"]
    model = load_model(path).model
    prompt, junk, real = list(range(5, 14)), [3, 99, 42, 17], [8, 9, 10]
    kv = model.new_kv_cache(1, 64)
    slot = kv.allocate()
    model.forward(ForwardBatch.build([slot], [prompt], [0]), kv)
    kv.reserve(slot, len(prompt) + len(junk))
    model.forward(ForwardBatch.build([slot], [junk], [len(prompt)]), kv)  # rejected drafts
    kv.truncate(slot, len(prompt))
    rolled = model.forward(ForwardBatch.build([slot], [real], [len(prompt)], logits="all"), kv)
    fresh_kv = model.new_kv_cache(1, 64)
    fresh_slot = fresh_kv.allocate()
    fresh = model.forward(ForwardBatch.build([fresh_slot], [prompt + real], [0], logits="all"), fresh_kv)[-3:]
    assert torch.allclose(rolled, fresh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_32_tokens_match_transformers_generate(tiny_checkpoints, arch):
    from engine import LLM, SamplingParams

    path, ref = tiny_checkpoints[arch]
    prompts = _prompts(3)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=32, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    llm = LLM(str(path), max_num_seqs=4)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in got] == expected
    assert all(len(t) == 32 for t in expected)


def test_sharded_checkpoint_loads_with_its_index(tiny_checkpoints, tmp_path):
    from tests.helpers.tiny_checkpoints import byte_tokenizer

    _, ref = tiny_checkpoints["qwen2_moe"]
    ref.save_pretrained(tmp_path, max_shard_size="20KB")  # forces several shards + an index
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path)
    kv = loaded.model.new_kv_cache(1, 32)
    prompt = _prompts(4)[0]
    logits = loaded.model.forward(ForwardBatch.build([kv.allocate()], [prompt], [0], logits="all"), kv)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (expected - logits).abs().max().item() <= 1e-4
