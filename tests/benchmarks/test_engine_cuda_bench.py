"""benchmarks/engine_cuda.py's pieces on the CPU with a tiny width: the Mixtral-layout checkpoint it
writes loads in both specmoe and transformers, and in float32 both decode the same greedy tokens
(the agreement measures the benchmark reports on the GPU read 1.0 here)."""

from __future__ import annotations

import benchmarks.engine_cuda as bench

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=300)


def test_the_checkpoint_it_writes_decodes_the_same_in_specmoe_and_transformers(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    for key, value in TINY.items():
        monkeypatch.setitem(bench.MIXTRAL, key, value)
    bench.write_checkpoint(tmp_path, layers=2, device="cpu")
    rows, ours = bench.bench_specmoe(str(tmp_path), "ngram k=4", "float32", [1, 3], 16, 10)
    more, theirs, forced = bench.bench_transformers(str(tmp_path), "float32", [1, 3], 16, 10, ours)
    assert [len(s) for s in ours[3]] == [10, 10, 10]
    assert bench.agreement(ours, theirs) == {1: 1.0, 3: 1.0}
    assert forced == {1: (1.0, 1.0), 3: (1.0, 1.0)}
    assert [(r["system"], r["batch"]) for r in rows + more] == [
        ("specmoe ngram k=4", 1), ("specmoe ngram k=4", 3), ("transformers", 1), ("transformers", 3),
        ("transformers no-cudnn-sdpa", 1), ("transformers no-cudnn-sdpa", 3)]
