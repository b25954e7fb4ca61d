"""Expert offload at Mixtral-8x7B expert size: the slow tier's transfer rate, and MoE layer passes
with half the experts resident, with and without prefetch, against everything resident.

    python benchmarks/offload_cuda.py --checkpoint /tmp/mixtral-shaped [--steps 48] [--tokens 8]

The checkpoint: ``benchmarks/engine_cuda.py --checkpoint-dir`` writes a Mixtral-shaped random bf16
one (one (layer, expert) entry is w1, w3, w2: 3 x 14336 x 4096 bf16 = 352 MB). On CUDA the slow
tier is pinned host memory copied on a side stream (:class:`engine.expert_tiers.PinnedHostTier`);
elsewhere the spill file (the same code runs, for a smoke run).

1. Transfer: one entry loaded into a resident slot, timed around the load and a sync: GB/s of
   checkpoint bytes, median of ``--loads`` loads.
2. Passes: ``--steps`` decode steps of ``--tokens`` tokens, each through every MoE layer. Routing is
   each layer's own router on random hidden states (no temporal locality: the hard case for a
   cache). Variants, in one run, outputs checked equal: ``resident`` (every entry), ``prefetch``
   (half resident; each layer hints the next layer's experts exactly: an oracle pre-gating
   predictor, the most prediction can hide) and ``demand`` (half resident, no hints). ms per step,
   ratio to resident, cache hit rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, print_table, save_json, sync  # noqa: E402
from engine.checkpoint import CheckpointReader  # noqa: E402
from engine.config import load_model_config  # noqa: E402
from engine.expert_offload import OffloadedExpertStore  # noqa: E402
from engine.model import ExpertStore  # noqa: E402
from engine.model.moe import dispatch, expert_entry_bytes  # noqa: E402
from engine.model.names import expert_names, router_name  # noqa: E402
from kernels.routing import topk_routing  # noqa: E402


def routed_steps(checkpoint: str, steps: int, tokens: int, dtype: torch.dtype, device: str) -> list[list[tuple]]:
    """Per step, per MoE layer: ``(layer, rows, host counts, weights)`` of a real top-k routing of
    random hidden states by that layer's router."""
    config, reader = load_model_config(checkpoint), CheckpointReader(checkpoint)
    gen = torch.Generator().manual_seed(0)
    routers = {layer: reader.get(router_name(config, layer)).to(device, dtype) for layer in config.moe.sparse_layers}
    out = []
    for _ in range(steps):
        step = []
        for layer, router in routers.items():
            hidden = torch.randn(tokens, config.hidden_size, generator=gen).to(device, dtype)
            plan = dispatch(hidden, topk_routing(hidden @ router.T, config.moe.top_k, True))
            step.append((layer, plan.hidden, plan.expert_counts.cpu(), plan.weights))
        out.append(step)
    return out


def run_passes(store, steps: list[list[tuple]], device: str, hints: bool) -> tuple[float, list[torch.Tensor]]:
    """Milliseconds per step (median) and every layer call's output."""
    times, outputs = [], []
    for step in steps:
        sync(device)
        start = time.perf_counter()
        for i, (layer, rows, counts, weights) in enumerate(step):
            nxt = steps[0][0] if i + 1 == len(step) else step[i + 1]  # the next pass starts at the first layer
            hint = (nxt[0], [e for e, c in enumerate(nxt[2].tolist()) if c]) if hints else None
            kwargs = {"prefetch": hint} if isinstance(store, OffloadedExpertStore) else {}
            outputs.append(store.forward(layer, rows, counts, weights, **kwargs))
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), outputs


def transfer_gb_per_s(store: OffloadedExpertStore, entry_bytes: int, loads: int, device: str) -> float:
    """GB per second of ``entry_bytes`` (one entry in the checkpoint's dtype) over the tier's own
    load of an entry into slot 0 (whatever was resident there is overwritten: measure last)."""
    layer = store.config.moe.sparse_layers[0]
    seconds = []
    for i in range(loads):
        dst = [p[0] for p in store.pool]
        sync(device)
        start = time.perf_counter()
        event = store.tier.load(layer, store.expert_ids[i % len(store.expert_ids)], dst)
        if event is not None:
            event.synchronize()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return entry_bytes / statistics.median(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per decode step (top-k rows each)")
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--save-result")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config, reader = load_model_config(args.checkpoint), CheckpointReader(args.checkpoint)
    experts = range(config.moe.num_experts)
    half = config.moe.num_experts * len(config.moe.sparse_layers) // 2
    first = reader.get(expert_names(config, config.moe.sparse_layers[0], 0)[0])
    entry_bytes = expert_entry_bytes(config, first.dtype)  # in the checkpoint's dtype
    steps = routed_steps(args.checkpoint, args.steps, args.tokens, dtype, args.device)
    resident = ExpertStore(reader, config, dtype=dtype, device=args.device)
    rows, want = [], None
    for name in ("resident", "prefetch", "demand"):
        store = resident if name == "resident" else OffloadedExpertStore(
            reader, config, experts, dtype, args.device, max_resident=half, prefetch=name == "prefetch")
        run_passes(store, steps[:2], args.device, hints=name == "prefetch")  # warm-up (kernels compile)
        ms, outs = run_passes(store, steps, args.device, hints=name == "prefetch")
        want = want or outs
        same = all(torch.equal(a, b) for a, b in zip(outs, want))
        row = {"variant": name, "ms_per_step": ms, "x_resident": rows[0]["ms_per_step"] / ms if rows else 1.0,
               "outputs_equal": same}
        if isinstance(store, OffloadedExpertStore):
            stats = store.snapshot()
            row["hit_rate"] = stats["hits"] / max(1, stats["hits"] + stats["misses"])
            row["transfer_gb_per_s"] = transfer_gb_per_s(store, entry_bytes, args.loads, args.device)
            store.close()
        rows.append(row)
        print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, ["variant", "ms_per_step", "x_resident", "hit_rate", "transfer_gb_per_s", "outputs_equal"])
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
