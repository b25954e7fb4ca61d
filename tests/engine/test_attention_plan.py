"""The attention plan's shortcuts (no mask, SDPA's causal mask, queries as a view, cache rows as a
view also when the slots are a range out of order or a span with gaps) change nothing: each batch shape gives what the
general path (padded queries, explicit position mask, gathered cache rows) gives."""

import dataclasses

import pytest
import torch

from engine.model import ForwardBatch
from engine.model.layers import _mask, attention, plan_attention

HEADS, KV_HEADS, DIM, MAX_LEN = 4, 2, 8, 32

CASES = {  # name: (slots, new-token counts, start positions, sliding window, expected plan shortcut)
    "prefill_one_from_zero": ([0], [6], [0], None, "causal"),
    "prefill_ragged_from_zero": ([1, 0, 2], [6, 3, 4], [0, 0, 0], None, "causal"),  # padded queries
    "prefill_ragged_from_zero_in_window": ([0, 1], [6, 3], [0, 0], 4, "mask"),
    "prefill_one_from_zero_one_continuing": ([0, 1], [4, 4], [0, 3], None, "mask"),
    "decode_equal_lengths": ([0, 1, 2], [1, 1, 1], [9, 9, 9], None, "no_mask"),
    "decode_ragged_lengths": ([2, 0], [1, 1], [4, 11], None, "mask"),
    "verify_equal_drafts": ([1, 2], [3, 3], [5, 8], None, "mask"),
    "ragged_prefill_and_verify": ([0, 2], [5, 2], [0, 7], None, "mask"),
    "decode_inside_window": ([0, 1], [1, 1], [9, 9], 4, "mask"),
    "decode_window_covers_all": ([0, 1], [1, 1], [9, 9], 16, "no_mask"),
    "decode_ragged_slots_out_of_order": ([2, 0, 1], [1, 1, 1], [4, 11, 7], None, "mask"),
    "verify_ragged_slots_out_of_order": ([1, 2, 0], [3, 2, 1], [5, 8, 2], None, "mask"),
    # Slots with gaps (sequences that finished left their rows): a span of rows, or a gather.
    "decode_equal_lengths_slots_with_a_gap": ([3, 1, 4], [1, 1, 1], [9, 9, 9], None, "no_mask"),
    "decode_ragged_slots_with_gaps": ([5, 0, 2], [1, 1, 1], [4, 11, 7], None, "mask"),
    "verify_ragged_slots_with_gaps": ([4, 1], [3, 2], [5, 8], None, "mask"),
    "prefill_and_verify_slots_with_gaps": ([0, 3, 5], [5, 2, 3], [0, 7, 4], None, "mask"),
    "prefill_from_zero_slots_with_gaps": ([2, 0], [6, 3], [0, 0], None, "causal"),
    "decode_slots_mostly_gaps": ([5, 0], [1, 1], [4, 11], None, "mask"),  # span 6 > 2 x 2: gathered
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_shortcuts_equal_the_general_masked_path(name):
    slots, counts, starts, window, shortcut = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    batch = ForwardBatch.build(slots, [[1] * n for n in counts], starts, logits="all")
    n = sum(counts)
    q, k, v = (torch.randn(n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = torch.randn(2, 6, KV_HEADS, MAX_LEN, DIM, generator=g)

    plan = plan_attention(batch, window)
    kind = "causal" if plan.causal else "no_mask" if plan.mask is None else "mask"
    assert kind == shortcut
    assert plan.uniform == (min(counts) == max(counts))
    # Cache rows a view whenever the slots span at most twice as many rows as sequences.
    assert isinstance(plan.slot_rows, slice) == (max(slots) - min(slots) + 1 <= 2 * len(slots))
    assert (plan.slot_order is not None) == (isinstance(plan.slot_rows, slice) and batch.slot_range is None)
    general = dataclasses.replace(plan, uniform=False, causal=False, slot_rows=batch.slots, slot_order=None,
                                  mask=_mask(batch, plan.max_q, plan.max_kv, False, window))
    fast_cache, general_cache = cache.clone(), cache.clone()
    fast = attention(q, k, v, fast_cache[0], fast_cache[1], batch, plan)
    want = attention(q, k, v, general_cache[0], general_cache[1], batch, general)
    assert fast.shape == (n, HEADS, DIM)
    torch.testing.assert_close(fast, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(fast_cache, general_cache)  # the same keys and values written


def test_forwards_on_cuda_leave_cudnn_attention_out_until_the_last_one_ends():
    # cuDNN's SDPA builds a plan per new shape, and every decode step brings a new key length
    # (engine/model/layers.py). The switch is a process flag, so this runs without a GPU. Two
    # forwards overlap as the target's and a pipelined draft's on two threads do.
    from engine.model.layers import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    target, draft = attention_backends("cuda:0"), attention_backends("cuda")
    target.__enter__()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    draft.__enter__()
    target.__exit__(None, None, None)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # the draft's forward is still running
    draft.__exit__(None, None, None)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("other_start", [9, 4], ids=["equal_lengths_no_mask", "ragged_lengths_mask"])
def test_a_decode_query_gets_bit_for_bit_what_it_gets_as_the_last_of_a_verification(other_start):
    # Lossless speculation compares plain decoding (one query a sequence) with verification (k + 1
    # queries): the packed grouped-query decode path must compute exactly what the longer query does.
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 2, KV_HEADS, MAX_LEN, DIM, generator=g)
    q, k, v = (torch.randn(2, 2, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))  # (seq, token, ...)
    # Sequence 0 verifies tokens at positions 8 and 9; the decode step sees position 8 in its cache.
    verify = ForwardBatch.build([0, 1], [[1, 1], [1, 1]], [8, other_start - 1], logits="all")
    decode = ForwardBatch.build([0, 1], [[1], [1]], [9, other_start], logits="all")
    verify_cache, decode_cache = cache.clone(), cache.clone()
    decode_cache[0][0, :, 8], decode_cache[1][0, :, 8] = k[0, 0], v[0, 0]
    decode_cache[0][1, :, other_start - 1], decode_cache[1][1, :, other_start - 1] = k[1, 0], v[1, 0]
    long = attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), verify_cache[0], verify_cache[1], verify,
                     plan_attention(verify))
    plan = plan_attention(decode)
    assert (plan.mask is None) == (other_start == 9)
    short = attention(q[:, 1], k[:, 1], v[:, 1], decode_cache[0], decode_cache[1], decode, plan)
    assert torch.equal(short, long.view(2, 2, HEADS, DIM)[:, 1])
