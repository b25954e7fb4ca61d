"""Attention in groups of sequences: a long prefill chunk no longer pads short queries to its
length, and every query attends exactly as in one padded call."""

import torch

from engine.kv_cache import KVCache
from engine.model.batch import ForwardBatch
from engine.model.layers import attention, grouped_attention, plan_attention, plan_grouped_attention


def _case(lens: list[int], starts: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(sum(lens))
    cache = KVCache(1, len(lens), 1024, kv_heads, dim, torch.float32, "cpu")
    for slot, (n, s) in enumerate(zip(lens, starts)):
        cache.reserve(slot, s + n)
        cache.k[0][slot, :, :s] = torch.randn(kv_heads, s, dim, generator=gen)
        cache.v[0][slot, :, :s] = torch.randn(kv_heads, s, dim, generator=gen)
    batch = ForwardBatch.build(list(range(len(lens))), [[1] * n for n in lens], starts, "all")
    total = sum(lens)
    qkv = [torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    return cache, batch, qkv


def test_a_long_chunk_beside_decodes_is_its_own_group_with_the_same_output():
    lens, starts = [300, 7, 7, 3, 1], [0, 40, 90, 17, 5]
    cache, batch, (q, k, v) = _case(lens, starts)
    plan = plan_grouped_attention(batch)
    assert [part.query_lens for _, part, _ in plan.groups] == [[300], [7, 7, 3, 1]]
    single = attention(q, k, v, cache.k[0].clone(), cache.v[0].clone(), batch, plan_attention(batch))
    grouped = grouped_attention(q, k, v, cache.k[0], cache.v[0], plan)
    torch.testing.assert_close(grouped, single, rtol=1e-5, atol=1e-5)
    assert plan.max_kv == 300


def test_small_padding_keeps_one_group():
    lens, starts = [7, 1, 5, 7, 2], [30, 12, 8, 3, 60]
    _, batch, _ = _case(lens, starts)
    assert len(plan_grouped_attention(batch).groups) == 1  # 35 padded rows for 22: not worth a call
    _, batch, _ = _case([640, 600], [0, 0])
    assert len(plan_grouped_attention(batch).groups) == 1  # similar lengths: no waste to cut
