"""The offloading expert store (engine/expert_offload.py): the same rows as the resident store bit
for bit, whatever is resident or predicted; exact counters in a scripted case; budgets; and the
pre-gating predictor's hints (engine/expert_predictor.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.checkpoint import CheckpointReader
from engine.config import load_model_config
from engine.expert_offload import OffloadedExpertStore
from engine.expert_predictor import PreGatePredictor
from engine.model import ExpertStore
from kernels.routing import topk_routing
from tests.engine.bundled import TARGET

CONFIG = load_model_config(TARGET)
LAYERS = list(CONFIG.moe.sparse_layers)


def _store(expert_ids, **budget) -> OffloadedExpertStore:
    return OffloadedExpertStore(CheckpointReader(TARGET), CONFIG, expert_ids, **budget)


def _rows(counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    return torch.randn(n, CONFIG.hidden_size, generator=gen), torch.rand(n, generator=gen)


def test_outputs_equal_the_resident_store_bit_for_bit_with_half_resident_and_random_hints():
    experts = [1, 2, 4, 5, 7]  # an odd group
    full = ExpertStore(CheckpointReader(TARGET), CONFIG, experts)
    store = _store(experts, max_resident=len(experts) * len(LAYERS) // 2)
    gen = torch.Generator().manual_seed(3)
    try:
        for step in range(24):
            layer = LAYERS[step % len(LAYERS)]
            counts = torch.randint(0, 4, (len(experts),), generator=gen).tolist()
            if not sum(counts):
                counts[0] = 1
            rows, weights = _rows(counts, step)
            hint = (LAYERS[(step + 1) % len(LAYERS)], torch.randperm(8, generator=gen)[:4].tolist())
            out = store.forward(layer, rows, torch.tensor(counts), weights, prefetch=hint)
            assert torch.equal(out, full.forward(layer, rows, torch.tensor(counts), weights))
            assert len(store.cache) <= store.cache.capacity
    finally:
        store.close()
    stats = store.snapshot()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["prefetches"] > 0 and stats["evictions"] > 0


def test_counters_are_exact_in_a_scripted_case():
    store = _store([0, 1, 2, 3], max_resident=4)

    def run(layer: int, counts: list[int], hint=None) -> None:
        r, w = _rows(counts, layer)
        store.forward(layer, r, torch.tensor(counts), w, prefetch=hint)
        store.drain()

    try:
        run(0, [1, 1, 0, 0], hint=(1, [2, 3, 5]))  # 2 misses, loaded on demand; then prefetches
        # (1, 2) and (1, 3) into the free slots; 5 is not held
        run(1, [0, 0, 1, 0], hint=(2, [0, 1]))  # 1 hit (a prefetch used); (1, 3) unused by this run:
        # wasted. After the compute the prefetches evict layer 1's own entries, (1, 3) then (1, 2)
        # (the layer that just ran is needed furthest ahead), not layer 0's (it runs first)
        assert sorted(store.snapshot()["resident"]) == [(0, 0), (0, 1), (2, 0), (2, 1)]
        run(3, [1, 1, 1, 0])  # 3 misses: evict (0, 0), (0, 1) (LRFU: (0, 0) older), then an unused
        # prefetch (wasted; tie: lower key)
        first = store.take_stats()
        run(2, [0, 1, 0, 0])  # 1 hit: the other prefetch, used
        second = store.take_stats()
    finally:
        store.close()
    assert first.as_dict() | {"stall_s": 0} == {"hits": 1, "misses": 5, "loads": 9, "evictions": 5, "prefetches": 4,
                                               "prefetches_used": 1, "prefetches_wasted": 2, "stall_s": 0}
    assert first.stall_s > 0 and first.hit_rate == 1 / 6
    assert second.as_dict() == {"hits": 1, "misses": 0, "loads": 0, "evictions": 0, "prefetches": 0,
                                "prefetches_used": 1, "prefetches_wasted": 0, "stall_s": 0.0}
    assert sorted(store.snapshot()["resident"]) == [(2, 1), (3, 0), (3, 1), (3, 2)]


def test_a_call_uses_its_resident_experts_before_a_miss_can_evict_them():
    store = _store([0, 1], max_resident=2)

    def run(layer: int, counts: list[int]) -> torch.Tensor:
        r, w = _rows(counts, layer)
        out = store.forward(layer, r, torch.tensor(counts), w)
        assert torch.equal(out, ExpertStore(CheckpointReader(TARGET), CONFIG, [0, 1]).forward(
            layer, r, torch.tensor(counts), w))
        return out

    try:
        run(0, [0, 1])
        run(1, [1, 0])  # resident: (0, 1), (1, 0)
        run(0, [1, 1])  # (0, 1) is acquired first (a hit); the miss (0, 0) evicts (1, 0). Acquired in
        # row order, the miss would evict (0, 1), the layer's own entry, and then miss it too
    finally:
        store.close()
    stats = store.snapshot()
    assert (stats["hits"], stats["misses"], stats["loads"]) == (1, 3, 3)
    assert stats["resident"] == [(0, 0), (0, 1)]


def test_micro_batches_prefetch_once_per_layer_run_after_its_last_call():
    store = _store([0, 1], max_resident=4)

    def run(layer: int, counts: list[int], hint) -> None:
        r, w = _rows(counts, layer)
        store.forward(layer, r, torch.tensor(counts), w, prefetch=hint)
        store.drain()

    try:
        run(0, [1, 0], None)  # micro-batch A
        run(0, [0, 1], None)  # micro-batch B: layer 0 runs twice in a row
        run(1, [1, 0], (2, [0]))  # A of layer 1: its hint waits for B
        assert store.snapshot()["prefetches"] == 0
        run(1, [0, 1], (2, [1]))  # B: both hints, after the run's last call
        stats = store.snapshot()
    finally:
        store.close()
    # layer 1's run is over: its entries are needed furthest ahead, so the prefetches evicted them
    assert stats["prefetches"] == 2 and stats["resident"] == [(0, 0), (0, 1), (2, 0), (2, 1)]


def test_prefetch_off_loads_on_demand_only():
    store = _store([0, 1], max_resident=2, prefetch=False)
    try:
        assert store.prefetch(1, [0, 1]) == 0
        r, w = _rows([1, 1], 0)
        store.forward(0, r, torch.tensor([1, 1]), w, prefetch=(1, [0, 1]))
    finally:
        store.close()
    assert store.snapshot()["prefetches"] == 0 and store.snapshot()["misses"] == 2


def test_byte_budget_converts_to_entries_and_a_budget_below_one_layer_is_refused():
    store = _store([0, 1, 2], max_resident_bytes=5 * 3 * 256 * 128 * 4 + 7)  # 5 float32 experts
    assert store.cache.capacity == 5 and store.pool[0].shape == (5, 256, 128)
    store.close()
    with pytest.raises(ValueError, match="below one layer's 3 held experts plus 1 pinned"):
        _store([0, 1, 2], max_resident=3, num_pinned=1)
    with pytest.raises(ValueError, match="resident budget"):
        _store([0, 1, 2])


def test_pre_gating_hints_the_next_layer_and_wraps_to_the_first_with_its_routing():
    gen = torch.Generator().manual_seed(0)
    routers = {i: torch.randn(8, CONFIG.hidden_size, generator=gen) for i in (0, 2, 3)}  # layer 1 dense
    sent = []
    predictor = PreGatePredictor(routers, 2, lambda layer, ids: sent.append((layer, ids)))
    h = torch.randn(5, CONFIG.hidden_size, generator=gen)
    routing0 = topk_routing(h @ routers[0].T, 2, True)
    predictor.hint(0, h, routing0)
    predictor.hint(2, h, topk_routing(h @ routers[2].T, 2, True))
    predictor.hint(3, h, topk_routing(h @ routers[3].T, 2, True))
    expected_2 = sorted(set(torch.topk(h @ routers[2].T, 2).indices.flatten().tolist()))
    expected_3 = sorted(set(torch.topk(h @ routers[3].T, 2).indices.flatten().tolist()))
    first = sorted(set(routing0.topk_ids.flatten().tolist()))
    assert sent == [(2, expected_2), (3, expected_3), (0, first)]


def test_a_simulated_link_makes_every_load_last_at_least_its_bytes_over_the_bandwidth():
    store = _store([0, 1], max_resident=2, simulated_link_gbps=0.005)  # labelled simulation
    assert store.tier.seconds == pytest.approx(3 * 256 * 128 * 2 / 5e6)  # bf16 on disk: ~39 ms
    r, w = _rows([1, 1], 0)
    try:
        out = store.forward(0, r, torch.tensor([1, 1]), w)
    finally:
        store.close()
    assert torch.equal(out, ExpertStore(CheckpointReader(TARGET), CONFIG, [0, 1]).forward(0, r, torch.tensor([1, 1]), w))
    assert store.snapshot()["stall_s"] >= 2 * store.tier.seconds


def test_a_layer_finds_room_when_every_free_slot_is_held_by_prefetches_in_flight():
    store = _store([0, 1, 2, 3], max_resident=4)
    gate = threading.Event()
    inner = store.tier.load

    def slow_prefetch(layer, expert, dst):  # the loader thread's loads wait for the gate
        if threading.current_thread().name.startswith("expert-prefetch"):
            gate.wait(5)
        return inner(layer, expert, dst)

    store.tier.load = slow_prefetch
    try:
        assert store.prefetch(1, [0, 1, 2, 3]) == 4  # every slot reserved, none loaded
        r, w = _rows([1, 1], 0)
        threading.Timer(0.2, gate.set).start()
        out = store.forward(0, r, torch.tensor([1, 1, 0, 0]), w)  # FULL until a prefetch lands
    finally:
        gate.set()
        store.close()
    assert torch.equal(out, ExpertStore(CheckpointReader(TARGET), CONFIG, [0, 1, 2, 3]).forward(
        0, r, torch.tensor([1, 1, 0, 0]), w))
    stats = store.snapshot()
    assert stats["misses"] == 2 and stats["prefetches"] == 4


def test_a_mapped_view_equals_the_read_tensor_and_bad_names_or_shapes_are_named():
    from engine.errors import CheckpointError
    from engine.model.moe import expert_shapes
    from engine.model.names import expert_names

    reader = CheckpointReader(TARGET)
    name = expert_names(CONFIG, 2, 5)[2]
    shape = expert_shapes(CONFIG)[2]
    view = reader.view(name, shape)
    assert view.dtype == torch.bfloat16 and torch.equal(view, reader.get(name, shape))
    with pytest.raises(CheckpointError, match="expected"):
        reader.view(name, shape[::-1])
    with pytest.raises(CheckpointError, match="missing"):
        reader.view(name + ".nope", shape)


def test_the_cpu_tier_holds_the_checkpoint_in_the_slots_layout_and_leaves_no_file(tmp_path, monkeypatch):
    import tempfile

    from engine.expert_offload import SpillFileTier
    from engine.model.moe import expert_shapes
    from engine.model.names import expert_names
    from kernels.expert_ffn import linear_layout

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reader = CheckpointReader(TARGET)
    tier = SpillFileTier(reader, CONFIG, [2, 5])
    assert list(tmp_path.iterdir()) == []  # unlinked once mapped: nothing outlives the process
    shapes = expert_shapes(CONFIG)
    for layer in LAYERS:
        dst = [linear_layout(torch.empty(s)) for s in shapes]
        tier.load(layer, 5, dst)
        for d, held, name, s in zip(dst, tier._views[(layer, 5)], expert_names(CONFIG, layer, 5), shapes):
            assert torch.equal(d, reader.get(name, s, dtype=torch.float32))
            assert held.stride() == d.stride()  # the slot's layout: a load is no transposing copy
