"""The scheduler's token budget (and its "alone" exception) and the KV cache's slot accounting,
on hand-made sequences: exact admissions per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheFull
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SeqStatus


def _seq(name: str, prompt_len: int):
    return SimpleNamespace(name=name, seq_id=name, prompt_token_ids=[1] * prompt_len, status=None,
                           num_prompt_tokens_left=prompt_len)


def _schedule(sched: Scheduler, num_free_slots: int, decode_cost):
    """One step: schedule, then prefill each scheduled chunk as the engine would."""
    out = sched.schedule(num_free_slots, decode_cost)
    for seq in out.prefills:
        seq.num_prompt_tokens_left -= out.chunks[seq.seq_id]
    return out


def _names(seqs) -> list[str]:
    return [s.name for s in seqs]


def _scheduler(budget: int, max_num_seqs: int = 8, **kw) -> Scheduler:
    """Whole-prompt prefills (chunked prefill is tested in tests/engine/test_chunked_prefill.py)."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     enable_chunked_prefill=False, **kw))


def test_prefills_fill_the_budget_left_by_decodes_first_come_first_served():
    sched = _scheduler(budget=20)
    for name, n in (("a", 8), ("b", 8), ("c", 5), ("d", 1)):
        sched.add(_seq(name, n))
    out = _schedule(sched, num_free_slots=8, decode_cost=lambda s, spec: 1 + 4 * spec)
    # a + b = 16 of 20; c (5) does not fit, and d (1) would but may not jump the queue
    assert _names(out.prefills) == ["a", "b"] and out.decodes == [] and _names(sched.waiting) == ["c", "d"]
    out = _schedule(sched, num_free_slots=6, decode_cost=lambda s, spec: 1 + 4 * spec)
    # two decodes at 1 + 4 tokens = 10 of 20; c (5) and d (1) fit: 16
    assert _names(out.decodes) == ["a", "b"] and _names(out.prefills) == ["c", "d"]
    assert all(s.status is SeqStatus.RUNNING for s in sched.running) and not sched.waiting


def test_a_prompt_over_the_whole_budget_runs_alone_and_only_alone():
    sched = _scheduler(budget=16)
    for name, n in (("short", 4), ("long", 40)):
        sched.add(_seq(name, n))
    out = _schedule(sched, num_free_slots=8, decode_cost=lambda s, spec: 1)
    assert _names(out.prefills) == ["short"]  # long (40 > 12 left) waits: short is in this step
    out = _schedule(sched, num_free_slots=8, decode_cost=lambda s, spec: 1)
    assert out.prefills == [] and _names(sched.waiting) == ["long"]  # not alone: short is running
    sched.remove(sched.running[0])
    out = _schedule(sched, num_free_slots=8, decode_cost=lambda s, spec: 1)
    assert _names(out.prefills) == ["long"]  # alone: admitted although 40 > 16
    big = _scheduler(budget=16)
    for name, n in (("long1", 30), ("long2", 30)):
        big.add(_seq(name, n))
    assert _names(_schedule(big, 8, lambda s, spec: 1).prefills) == ["long1"]  # only the first goes alone


def test_decode_cost_counts_speculation_and_spec_disable_batch_size():
    sched = _scheduler(budget=12, spec_disable_batch_size=2)
    sched.add(_seq("a", 2))
    _schedule(sched, 8, lambda s, spec: 1 + 5 * spec)
    sched.add(_seq("b", 6))
    out = _schedule(sched, 8, lambda s, spec: 1 + 5 * spec)
    assert out.speculate and _names(out.prefills) == ["b"]  # 6 decode + 6 prefill = 12
    sched.add(_seq("c", 10))
    out = _schedule(sched, 8, lambda s, spec: 1 + 5 * spec)
    assert not out.speculate and _names(out.prefills) == ["c"]  # 2 running: no speculation, 2 + 10 = 12


def test_slots_and_max_num_seqs_bound_admission():
    sched = _scheduler(budget=100, max_num_seqs=2)
    for name in "abc":
        sched.add(_seq(name, 1))
    assert _names(_schedule(sched, num_free_slots=1, decode_cost=lambda s, spec: 1).prefills) == ["a"]
    assert _names(_schedule(sched, num_free_slots=5, decode_cost=lambda s, spec: 1).prefills) == ["b"]
    assert _schedule(sched, num_free_slots=5, decode_cost=lambda s, spec: 1).prefills == []


def _cache(max_seqs: int = 2, max_len: int = 8) -> KVCache:
    return KVCache(num_layers=1, max_seqs=max_seqs, max_len=max_len, num_kv_heads=1, head_dim=2)


def test_kv_cache_full_and_double_free():
    kv = _cache()
    assert [kv.allocate(), kv.allocate()] == [0, 1] and kv.num_free == 0
    with pytest.raises(KVCacheFull, match="all 2 KV cache slots are in use"):
        kv.allocate()
    kv.reserve(1, 5)
    kv.free(1)
    assert kv.num_free == 1 and kv.lengths == [0, 0]
    with pytest.raises(ValueError, match="KV slot 1 is not allocated"):
        kv.free(1)  # a double free would hand slot 1 out twice
    with pytest.raises(ValueError, match="KV slot 7 is not allocated"):
        kv.free(7)
    assert kv.num_free == 1 and kv.allocate() == 1 and kv.num_free == 0


def test_kv_cache_length_bounds_and_usage():
    kv = _cache(max_len=8)
    slot = kv.allocate()
    kv.reserve(slot, 8)
    assert kv.usage() == 8 / 16
    with pytest.raises(KVCacheFull, match="needs 9 cached tokens, max_len is 8"):
        kv.reserve(slot, 9)
    kv.truncate(slot, 3)
    assert kv.lengths[slot] == 3
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate(slot, 4)
    assert kv.k.shape == (1, 2, 1, 8, 2) and kv.k.dtype == torch.float32
