"""Cost of one hop on each transport, against the work it carries, in one run.

    python benchmarks/transport.py [--iters 300] [--save-result runs/transport.json]

On local Ray with the bundled target: one MoE layer's dispatch through :class:`ExpertRouter`
(compiled graph vs actor calls) and the same experts run in-process; one draft proposal through
:class:`RemoteDrafter` (compiled graph vs actor call) and the draft model in-process. Row counts
are the decode shapes of the embedded config: batch 1 and 8 at k = 6 (7 tokens per sequence,
top-2 routing), over ``--experts-per-actor`` experts per actor. Also the CPU time the actors burn in 10 idle seconds with a graph live and after
its idle teardown. Milliseconds; overhead = hop - in-process work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DRAFT, ROOT, call_times_ms, machine, print_table, save_json, sync  # noqa: E402

TARGET = str(ROOT / "checkpoints/stdlib-moe-target")


def _wait_live(graph, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not graph.live and time.monotonic() < deadline:
        graph.request_build()
        time.sleep(0.1)
    if not graph.live:
        raise RuntimeError(f"the {graph.name} graph did not build")


def _proc_cpu_s(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def expert_rows(tokens: int, config, dtype, device: str, seed: int = 0):
    """Rows, weights and per-expert counts of a real routing of ``tokens`` random hidden states of
    ``config``'s width, on ``device``."""
    import torch

    from engine.model.moe import dispatch
    from kernels.routing import topk_routing

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, config.moe.num_experts, generator=gen).to(device)
    plan = dispatch(hidden, topk_routing(logits, config.moe.top_k, True))
    return plan.hidden, plan.weights, plan.expert_counts.tolist()


def _synced(fn, device: str):
    """``fn`` followed by a device sync, so CUDA work is inside the timed call."""
    def call(*args):
        out = fn(*args)
        sync(device)
        return out

    return call


def bench_experts(iters: int, experts_per_actor: int, checkpoint: str = TARGET, dtype: str = "float32",
                  device: str = "cpu") -> list[dict]:
    import torch

    from actors.expert_config import ExpertPoolConfig
    from actors.expert_pool import ExpertPool
    from actors.expert_router import ExpertRouter
    from engine.checkpoint import CheckpointReader
    from engine.config import load_model_config
    from engine.loader import resolve_dtype
    from engine.model import ExpertStore

    config, torch_dtype = load_model_config(checkpoint), resolve_dtype(dtype)
    local = ExpertStore(CheckpointReader(checkpoint), config, dtype=torch_dtype, device=device)
    num_gpus = 0.25 if device != "cpu" else 0.0
    rows_out = []
    for transport in ("compiled_graph", "actor_calls"):
        pool_config = ExpertPoolConfig(experts_per_actor=experts_per_actor, transport=transport, num_gpus=num_gpus)
        pool = ExpertPool(checkpoint, config.moe.num_experts, pool_config, dtype=dtype, device=device,
                          prefix=f"bench-{transport}", detached=False)
        pool.start()
        router = ExpertRouter(pool, torch_dtype, graph=transport == "compiled_graph")
        if router.graph is not None:
            _wait_live(router.graph)
        for batch in (1, 8):
            rows, weights, counts = expert_rows(batch * 7, config, torch_dtype, device)
            layer = config.moe.sparse_layers[0]
            hop = call_times_ms(iters, _synced(router.run_layer, device), layer, rows, weights, counts)
            work = call_times_ms(iters, _synced(local.forward, device), layer, rows, torch.tensor(counts), weights)
            rows_out.append({"hop": f"expert layer ({transport})", "batch": batch, "rows": rows.shape[0],
                             "median_ms": hop[0], "p99_ms": hop[1], "in_process_ms": work[0],
                             "overhead_ms": hop[0] - work[0]})
        if router.graph is not None:
            pids = [r.handle.info.remote() for r in pool.all_replicas()]
            import ray

            pids = [i["pid"] for i in ray.get(pids)]
            rows_out.append({"hop": "idle cpu, graph live", **_idle_cpu(pids)})
            router.graph.close()
            rows_out.append({"hop": "idle cpu, graph torn down", **_idle_cpu(pids)})
        pool.shutdown()
    return rows_out


def _idle_cpu(pids: list[int], seconds: float = 10.0) -> dict:
    before = [_proc_cpu_s(p) for p in pids]
    time.sleep(seconds)
    used = sum(_proc_cpu_s(p) - b for p, b in zip(pids, before))
    return {"idle_cpu_s_per_10s": used, "actors": len(pids)}


def bench_draft(iters: int) -> list[dict]:
    from actors.draft_server import DraftActorSpec, RemoteDrafter
    from actors.expert_config import ExpertPoolConfig
    from engine.drafters.base import DraftRequest
    from engine.drafters.draft_model import DraftModelDrafter
    from engine.loader import load_model

    prompt = list(range(5, 200))
    rows_out = []
    local = DraftModelDrafter(load_model(DRAFT, "float32", "cpu"), 16, None)
    for batch in (1, 8):
        reqs = [DraftRequest(f"s{i}", prompt, 6) for i in range(batch)]
        local.propose(reqs)  # prefill once; then each call re-drafts from the cached prefix
        work = call_times_ms(iters // 3, local.propose, reqs)
        for transport in ("compiled_graph", "actor_calls"):
            spec = DraftActorSpec(DRAFT, "float32", "cpu", 16, None, None, f"bench-draft-{transport}-{batch}",
                                  "specmoe")
            drafter = RemoteDrafter(spec, graph_config=ExpertPoolConfig() if transport == "compiled_graph" else None)
            if drafter.graph is not None:
                _wait_live(drafter.graph)
            drafter.propose(reqs)
            hop = call_times_ms(iters // 3, drafter.propose, reqs)
            rows_out.append({"hop": f"draft proposal ({transport})", "batch": batch, "rows": batch,
                             "median_ms": hop[0], "p99_ms": hop[1], "in_process_ms": work[0],
                             "overhead_ms": hop[0] - work[0]})
            drafter.close()
    return rows_out


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--experts-per-actor", type=int, default=8, help="8: one actor (the embedded default)")
    parser.add_argument("--checkpoint", default=TARGET, help="the target whose experts the actors hold")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="cuda: the actors and the rows on the GPU (a host "
                        "copy each way at the wire), the draft hop skipped")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    import os

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, namespace="specmoe",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    import torch

    torch.set_num_threads(1)
    try:
        rows = bench_experts(args.iters, args.experts_per_actor, args.checkpoint, args.dtype, args.device)
        rows += bench_draft(args.iters) if args.device == "cpu" else []
    finally:
        ray.shutdown()
    print_table([r for r in rows if "median_ms" in r], ["hop", "batch", "rows", "median_ms", "p99_ms",
                                                        "in_process_ms", "overhead_ms"])
    print_table([r for r in rows if "idle_cpu_s_per_10s" in r], ["hop", "idle_cpu_s_per_10s", "actors"])
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
