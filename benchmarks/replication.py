"""Online replication of hot expert groups under skewed routing: max/mean rows per expert actor.

    python benchmarks/replication.py [--num-prompts 8] [--max-tokens 32] [--repeats 3]

The target checkpoint's routing-skewed copy (scripts/skew_checkpoint.py: router gates zeroed, so
every token goes to experts 0 and 1) runs in-process (``engine.LLM``, greedy, EOS ignored) with its
experts on Ray actors: 4 actors of 2 experts (``experts_per_actor: 2``), the default
``compiled_graph`` transport, over two private pools in the same Ray: replication off and on
(``experts.replication.enabled``, defaults otherwise). Every token's rows land on the actor of
group 0, so max/mean rows per actor per dispatch is 4.0 without replication.

First a warm-up on the replicated pool until its replicas stop changing (the rebalancer's
hysteresis: ``patience_checks`` checks of ``check_every_dispatches`` dispatches, at most one change
per ``min_interval_s``; each change rebuilds the compiled graph). Then the two variants,
interleaved ``--repeats`` times, each the same batch of ``--num-prompts`` requests: mean and max of
the per-dispatch max/mean rows per actor, decode throughput, whether every completion equals the
in-process experts' (token ids), and the share of layers that went by the compiled graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import TARGET, load_prompts, machine, print_table, save_json  # noqa: E402


def make_router(checkpoint: str, replication: bool, tag: str, straggler_floor_ms: float):
    import torch

    from actors.expert_config import ExpertPoolConfig, ReplicationConfig
    from actors.expert_pool import ExpertPool
    from actors.expert_router import ExpertRouter

    config = ExpertPoolConfig(experts_per_actor=2, straggler_floor_ms=straggler_floor_ms,
                              replication=ReplicationConfig(enabled=replication))
    pool = ExpertPool(checkpoint, 8, config, prefix=f"bench-repl-{tag}-{os.getpid()}", detached=False)
    pool.start()
    import ray

    ray.get([r.handle.load.remote() for r in pool.all_replicas()], timeout=300)
    return ExpertRouter(pool, torch.float32, graph=True)


def run_batch(llm, router, prompts: list[list[int]], max_tokens: int) -> dict:
    from engine.sampling_params import SamplingParams

    llm.engine.target.model.experts = router
    router.actor_imbalance.clear()  # a bounded deque: once full, its length no longer counts dispatches
    graph0, calls0 = router.num_graph_layers, router.num_call_layers
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    elapsed_s = time.perf_counter() - start
    ratios = list(router.actor_imbalance)
    layers = router.num_graph_layers - graph0 + router.num_call_layers - calls0
    return {"tokens": [o.outputs[0].token_ids for o in outs], "tok_s": len(prompts) * max_tokens / elapsed_s,
            "imbalance_first": ratios[0], "imbalance_mean": statistics.fmean(ratios), "imbalance_max": max(ratios),
            "graph_share": (router.num_graph_layers - graph0) / max(1, layers)}


def replicas(router) -> list[int]:
    return [len(router.pool.alive(g)) for g in range(len(router.pool.groups))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-timeout-s", type=float, default=240.0)
    parser.add_argument("--straggler-floor-ms", type=float, default=5.0,
                        help="experts.straggler_floor_ms: latencies below it never count as a straggler's")
    parser.add_argument("--save-result")
    args = parser.parse_args()

    import ray
    import torch

    from engine.llm import LLM
    from scripts.skew_checkpoint import write_skewed_checkpoint

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="skewed-")
    skewed = str(write_skewed_checkpoint(TARGET, tmp.name))
    llm = LLM(model=skewed, max_num_seqs=args.num_prompts)
    prompts = [llm.tokenizer.encode(p["prompt"]).ids for p in load_prompts(args.num_prompts)]
    from engine.sampling_params import SamplingParams

    reference = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))]
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, namespace="specmoe",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    routers = {}
    try:
        routers = {name: make_router(skewed, on, name, args.straggler_floor_ms)
                   for name, on in (("replication_off", False), ("replication_on", True))}
        on = routers["replication_on"]
        warm, start, stable_since, last = [], time.monotonic(), time.monotonic(), None
        while time.monotonic() - start < args.warmup_timeout_s:  # until the replicas stop changing
            r = run_batch(llm, on, prompts, args.max_tokens)
            if not warm:
                first = r["imbalance_first"]  # the first dispatch, before any replica was added
            warm.append({"t_s": round(time.monotonic() - start, 1), "replicas": replicas(on),
                         "imbalance_mean": r["imbalance_mean"], "graph_share": r["graph_share"],
                         "graph_rebuilds": on.graph.stats.rebuilds, "graph_hedges": on.num_graph_hedges})
            print("warm-up", warm[-1], flush=True)
            if replicas(on) != last:
                last, stable_since = replicas(on), time.monotonic()
            elif time.monotonic() - stable_since > 2.5 * on.pool.config.replication.min_interval_s:
                break
        runs: dict[str, list[dict]] = {name: [] for name in routers}
        for _ in range(args.repeats):
            for name, router in routers.items():
                runs[name].append(run_batch(llm, router, prompts, args.max_tokens))
        rows = []
        for name, reps in runs.items():
            rows.append({"variant": name, "imbalance_mean": statistics.median(r["imbalance_mean"] for r in reps),
                         "imbalance_max": max(r["imbalance_max"] for r in reps),
                         "tok_s": statistics.median(r["tok_s"] for r in reps),
                         "graph_share": statistics.median(r["graph_share"] for r in reps),
                         "same_output": all(r["tokens"] == reference for r in reps),
                         "replicas_per_group": replicas(routers[name]),
                         "graph_rebuilds": routers[name].graph.stats.rebuilds,
                         "graph_hedges": routers[name].num_graph_hedges})
        summary = {"first_dispatch_imbalance": first,
                   "on_imbalance_mean": rows[1]["imbalance_mean"], "goal_imbalance": 1.5,
                   "warmup_s": warm[-1]["t_s"], "on_over_off_tok_s": rows[1]["tok_s"] / rows[0]["tok_s"],
                   "guests_added": on.rebalancer.num_added, "guests_removed": on.rebalancer.num_removed}
        # Reported before Ray shuts down: a graph teardown thread still running then ends the process.
        print_table(warm, list(warm[0]))
        print_table(rows, list(rows[0]))
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
        save_json(args.save_result, {"machine": machine(), "args": vars(args),
                                     "warmup": warm, "rows": rows, "summary": summary})
    finally:
        for router in routers.values():
            router.close()
            router.pool.shutdown()
        ray.shutdown()
        tmp.cleanup()


if __name__ == "__main__":
    main()
