"""The offload cache policy (engine/expert_cache.py): never evicts an entry in use, keeps pinned hot
entries and unused prefetches, LRFU order, and exact counters in a scripted sequence."""

from __future__ import annotations

import random

import pytest

from engine.expert_cache import CacheStats, ExpertCache, Lookup


def _use(cache: ExpertCache, key) -> Lookup:
    """One demand use: acquire, fill on a miss, release."""
    lookup = cache.acquire(key)
    if lookup is Lookup.MISS:
        cache.fill(key, None)
    cache.release(key)
    return lookup


def test_an_entry_in_use_is_never_evicted_under_random_traffic():
    rng = random.Random(7)
    evicted: list = []
    cache = ExpertCache(capacity=5, on_evict=evicted.append)
    held: list = []
    for _ in range(2000):
        if held and (len(held) >= 4 or rng.random() < 0.4):
            cache.release(held.pop(rng.randrange(len(held))))
            continue
        key = (rng.randrange(4), rng.randrange(8))
        before = len(evicted)
        lookup = cache.acquire(key)
        assert lookup is not Lookup.FULL  # at most 4 in use of 5 slots: always room
        if lookup is Lookup.MISS:
            cache.fill(key, None)
        held.append(key)
        assert not set(evicted[before:]) & set(held)  # nothing in use left
        assert all(k in cache for k in held) and len(cache) <= 5


def test_full_when_every_entry_is_in_use_and_nothing_is_counted():
    cache = ExpertCache(capacity=2)
    for key in [(0, 0), (0, 1)]:
        assert cache.acquire(key) is Lookup.MISS
        cache.fill(key, None)
    assert cache.acquire((0, 2)) is Lookup.FULL
    assert (0, 2) not in cache and cache.stats.misses == 2
    cache.release((0, 0))
    assert cache.acquire((0, 2)) is Lookup.MISS  # (0, 0) evicted, (0, 1) still in use
    assert (0, 0) not in cache and (0, 1) in cache


def test_lrfu_evicts_the_least_frequent_with_low_decay_and_the_least_recent_with_high_decay():
    for decay, survivor in [(0.0, (0, 0)), (5.0, (0, 1))]:
        cache = ExpertCache(capacity=2, decay=decay)
        for key in [(0, 0), (0, 0), (0, 0), (0, 1)]:  # (0, 0) frequent, (0, 1) most recent
            _use(cache, key)
        _use(cache, (0, 2))
        assert survivor in cache and len(cache) == 2


def test_pinned_hot_entries_stay_while_colder_ones_cycle():
    cache = ExpertCache(capacity=3, num_pinned=1, decay=5.0)  # near-LRU: the hot one would go first
    for _ in range(5):
        _use(cache, (0, 0))
    for e in range(1, 9):
        _use(cache, (1, e))
        assert (0, 0) in cache


def test_a_prefetch_never_evicts_an_unused_prefetch_and_a_demand_use_evicts_prefetches_last():
    cache = ExpertCache(capacity=3)
    _use(cache, (0, 0))
    assert cache.reserve_prefetch((1, 0)) and cache.reserve_prefetch((1, 1))
    assert not cache.reserve_prefetch((1, 1))  # already loading
    cache.fill((1, 0), None)
    cache.fill((1, 1), None)
    assert cache.reserve_prefetch((1, 2))  # evicts the used (0, 0), not a prefetch
    cache.fill((1, 2), None)
    assert (0, 0) not in cache
    assert not cache.reserve_prefetch((1, 3))  # only unused prefetches left: dropped
    assert cache.stats.prefetches == 3 and cache.stats.prefetches_wasted == 0
    assert _use(cache, (2, 0)) is Lookup.MISS  # a demand use may evict an unused prefetch: wasted
    assert cache.stats.prefetches_wasted == 1 and cache.stats.evictions == 2


def test_counters_are_exact_in_a_scripted_sequence():
    cache = ExpertCache(capacity=4)
    _use(cache, (0, 0))  # miss (load)
    _use(cache, (0, 0))  # hit
    assert cache.reserve_prefetch((1, 0)) and cache.reserve_prefetch((1, 1))
    cache.fill((1, 0), None)  # (1, 1) still loading
    assert cache.acquire((1, 0)) is Lookup.HIT  # prefetched in time: hit, prefetch used
    assert cache.acquire((1, 1)) is Lookup.PENDING  # prefetch in flight: a miss, prefetch used
    cache.fill((1, 1), None)
    cache.release((1, 0))
    cache.release((1, 1))
    assert cache.reserve_prefetch((2, 0))
    cache.fill((2, 0), None)
    _use(cache, (3, 0))  # miss, full: evicts the coldest used entry (1, 0), never the prefetch (2, 0)
    assert (1, 0) not in cache
    assert cache.reserve_prefetch((2, 1))  # evicts the next coldest used entry, (1, 1)
    cache.fill((2, 1), None)
    _use(cache, (3, 1))  # miss: evicts (3, 0) (used once, later than (0, 0)'s two uses but colder)
    assert cache.stats == CacheStats(hits=2, misses=4, loads=7, evictions=3, prefetches=4, prefetches_used=2,
                                     prefetches_wasted=0, stall_s=0.0)
    assert sorted(cache.resident()) == [(0, 0), (2, 0), (2, 1), (3, 1)]


def test_discarding_a_failed_load_frees_it_and_a_later_release_is_harmless():
    evicted: list = []
    cache = ExpertCache(capacity=2, on_evict=evicted.append)
    assert cache.acquire((0, 0)) is Lookup.MISS
    cache.discard((0, 0))
    cache.release((0, 0))
    assert (0, 0) not in cache and evicted == [(0, 0)]


@pytest.mark.parametrize("capacity, pinned", [(0, 0), (2, 2), (2, -1)])
def test_bad_sizes_are_refused(capacity, pinned):
    with pytest.raises(ValueError, match="capacity"):
        ExpertCache(capacity, pinned)


def test_with_a_layer_order_the_victim_is_from_the_layer_that_runs_again_last():
    cache = ExpertCache(capacity=4, layer_order=[0, 1, 2, 3], decay=0.0)
    for key in [(0, 0), (0, 0), (0, 0), (1, 0), (2, 0), (3, 0)]:  # (0, 0) by far the most frequent
        _use(cache, key)
    # Layer 3 is running: the next runs are 0, 1, 2, then 3; its own entry goes first.
    assert cache.acquire((3, 1)) is Lookup.MISS
    assert (3, 0) not in cache and {(0, 0), (1, 0), (2, 0)} <= set(cache.resident())
    cache.fill((3, 1), None)
    cache.release((3, 1))
    assert _use(cache, (0, 1)) is Lookup.MISS  # now at layer 0: layer 0 runs again last
    assert (0, 0) not in cache and {(1, 0), (2, 0), (3, 1)} <= set(cache.resident())


def test_a_layers_prefetches_never_evict_each_other_and_mispredictions_expire_as_wasted():
    cache = ExpertCache(capacity=2, layer_order=[0, 1])
    _use(cache, (1, 0))
    _use(cache, (0, 0))
    assert cache.reserve_prefetch((1, 1))  # evicts (0, 0), never its layer-mate (1, 0)
    assert (0, 0) not in cache
    cache.fill((1, 1), None)
    assert not cache.reserve_prefetch((1, 2))  # only (1, 0) (same layer) and a prefetch are left
    assert _use(cache, (1, 0)) is Lookup.HIT
    cache.expire_prefetches(1)  # layer 1 ran without (1, 1): a misprediction
    assert cache.stats.prefetches_wasted == 1 and cache.stats.prefetches_used == 0
    assert _use(cache, (0, 2)) is Lookup.MISS and _use(cache, (0, 3)) is Lookup.MISS  # (1, 1) evictable now
    assert (1, 1) not in cache and cache.stats.prefetches_wasted == 1  # counted once


def test_while_a_layers_run_has_micro_batches_to_come_its_entries_stay_and_its_prefetches_wait():
    cache = ExpertCache(capacity=3, layer_order=[0, 1, 2])
    for _ in range(2):  # layer 0 runs twice in a row: two micro-batches
        cache.begin_call(0)
        _use(cache, (0, 0))
    for key in [(1, 0), (1, 1)]:
        assert cache.reserve_prefetch(key)
        cache.fill(key, None)
    cache.begin_call(1)  # micro-batch A of layer 1 (the run is expected to be 2 calls long)
    assert cache.run_continues() and _use(cache, (1, 0)) is Lookup.HIT
    cache.expire_prefetches(1)  # B may still use (1, 1)
    assert cache.stats.prefetches_wasted == 0
    assert cache.reserve_prefetch((2, 0))  # evicts (0, 0): layer 1's (1, 0) is needed by B next
    cache.fill((2, 0), None)
    assert (0, 0) not in cache and (1, 0) in cache
    cache.begin_call(1)  # micro-batch B: the run's last call
    assert not cache.run_continues() and _use(cache, (1, 0)) is Lookup.HIT
    cache.expire_prefetches(1)  # (1, 1) unused by the whole run: wasted
    assert cache.stats.prefetches_wasted == 1
    assert cache.reserve_prefetch((2, 1))  # layer 1 is needed furthest now: (1, 1) (LRFU) goes
    assert (1, 1) not in cache and (1, 0) in cache
