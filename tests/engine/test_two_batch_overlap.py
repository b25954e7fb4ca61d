"""Two-batch overlap: a forward split into micro-batches whose MoE layers interleave (one's experts
out while the other's attention runs) computes what the single batch computes, and a failure in
one micro-batch drains the other's experts."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.batch import ForwardBatch

TARGET = "checkpoints/stdlib-moe-target"


class Deferred:
    """An executor whose experts run only when waited for, as remote ones finish later; records
    the order of submissions and waits, and asks for ``microbatches`` micro-batches."""

    def __init__(self, inner, microbatches: int = 2, fail_at: tuple[int, int] | None = None) -> None:
        self.inner, self.microbatches, self.fail_at = inner, microbatches, fail_at
        self.events: list[tuple[str, int, int]] = []

    def submit(self, layer, hidden, routing):
        tokens = hidden.shape[0]
        self.events.append(("submit", layer, tokens))

        def wait():
            self.events.append(("wait", layer, tokens))
            if self.fail_at == (layer, tokens):
                raise RuntimeError("expert group failed")
            return self.inner.execute(layer, hidden, routing)

        return wait


def _batch(model, kv, lens: list[int], start: int = 0) -> ForwardBatch:
    gen = torch.Generator().manual_seed(sum(lens))
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    for slot, n in enumerate(lens):
        kv.reserve(slot, start + n)
    return ForwardBatch.build(list(range(len(lens))), tokens, [start] * len(lens), [min(n, 2) for n in lens])


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET, dtype="float32", skip_tokenizer_init=True)


def test_split_keeps_every_row_in_order_with_balanced_tokens():
    batch = ForwardBatch.build([3, 4, 5, 6, 7], [[1] * 7, [2], [3] * 3, [4] * 2, [5] * 5], [10, 0, 4, 8, 2],
                               [2, 1, 3, 1, 1])
    parts = batch.split(2)
    assert [p.query_lens for p in parts] == [[7, 1], [3, 2, 5]]  # 8 and 10 of 18 tokens
    assert [p.slot_range for p in parts] == [(3, 5), (5, 8)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert torch.equal(torch.cat([p.positions for p in parts]), batch.positions)
    assert parts[1].token_seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert parts[1].logits_indices.tolist() == [0, 1, 2, 4, 9]  # the last 3, 1 and 1 rows of each
    offsets = [0, sum(parts[0].query_lens)]
    assert torch.equal(torch.cat([p.logits_indices + o for p, o in zip(parts, offsets)]), batch.logits_indices)
    assert [len(p.query_lens) for p in batch.split(9)] == [1] * 5  # at most one part per sequence
    assert batch.split(1)[0].query_lens == batch.query_lens


def test_interleaved_micro_batches_compute_what_the_single_batch_computes(llm):
    model = llm.engine.target.model
    kv = model.new_kv_cache(8, 256)
    lens = [5, 1, 7, 3, 2]
    single = model.forward(_batch(model, kv, lens, start=20), kv)
    inner = model.experts
    model.experts = deferred = Deferred(inner)
    try:
        split = model.forward(_batch(model, kv, lens, start=20), kv)
    finally:
        model.experts = inner
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-5)
    # Micro-batch A (5 + 1 = 6 tokens) and B (7 + 3 + 2 = 12): each layer's B submission comes
    # before A's wait, so B's attention ran while A's experts were out.
    events, moe_layers = deferred.events, list(model.config.moe.sparse_layers)
    first = moe_layers[0]
    assert events[:3] == [("submit", first, 6), ("submit", first, 12), ("wait", first, 6)]
    for layer in moe_layers:
        assert events.index(("submit", layer, 12)) < events.index(("wait", layer, 6))
    assert len(events) == 4 * len(moe_layers)  # each micro-batch: one submit and one wait a layer


def test_a_failing_micro_batch_drains_the_other_and_raises(llm):
    model = llm.engine.target.model
    kv = model.new_kv_cache(8, 256)
    inner = model.experts
    moe_layer = model.config.moe.sparse_layers[1]
    model.experts = deferred = Deferred(inner, fail_at=(moe_layer, 12))
    try:
        with pytest.raises(RuntimeError, match="expert group failed"):
            model.forward(_batch(model, kv, [5, 1, 7, 3, 2]), kv)
    finally:
        model.experts = inner
    submitted = [e[1:] for e in deferred.events if e[0] == "submit"]
    waited = [e[1:] for e in deferred.events if e[0] == "wait"]
    assert sorted(submitted) == sorted(waited)  # nothing left out: the other micro-batch was drained


def test_greedy_output_is_unchanged_with_two_batch_overlap(llm):
    prompts = [[5 + i, 17, 3 * i + 1, 40] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model = llm.engine.target.model  # a plain engine without SLO classes meters nothing: bare experts
    inner = model.experts
    model.experts = deferred = Deferred(inner)
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        model.experts = inner
    assert outs == reference
    assert any(e[0] == "submit" and e[2] < len(prompts) for e in deferred.events)  # the batches were split
