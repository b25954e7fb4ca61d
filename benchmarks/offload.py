"""Expert offload: decode tok/s with half the experts resident, with and without prefetch, against
everything resident, in one run (variants interleaved, repeats, medians of same-repeat ratios).

    python benchmarks/offload.py [--repeats 3] [--save-result runs/offload.json]

The serving unit of ``configs/embedded.yaml`` driven from this process (as
``benchmarks/serve_vs_engine.py``'s ``unit`` run): the target's experts on one expert actor (all 8
experts of every MoE layer) over the compiled-graph transport, speculation with the draft model
in-process (k from the config, fixed). Variants differ only in ``experts.max_resident_experts`` /
``experts.prefetch``:

* ``resident``: all 32 (layer, expert) entries resident (the baseline);
* ``offload_prefetch``: 16 of 32 resident (half), pre-gating prefetch on;
* ``offload_demand``: 16 of 32 resident, demand loads only.

The slow tier is real: a load copies the expert out of the memory-mapped safetensors checkpoint and
converts bf16 to float32 (no artificial delay). Output tokens/s (greedy, EOS ignored, so every
variant emits the same tokens, which is checked) at concurrency 1 and 8, and the actor's cache hit
rate (hits / (hits + misses); a prefetch still in flight when needed is a miss) over the timed runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, Timer, load_prompts, machine, print_table, save_json  # noqa: E402

VARIANTS = {"resident": {}, "offload_prefetch": {"max_resident_experts": 16, "prefetch": True},
            "offload_demand": {"max_resident_experts": 16, "prefetch": False}}


class Unit:
    """One variant's engine: an expert pool (its own actor) behind a compiled-graph router."""

    def __init__(self, name: str, config, overrides: dict, max_seqs: int) -> None:
        import msgspec
        import torch

        from actors.expert_pool import ExpertPool
        from actors.expert_router import ExpertRouter
        from engine.drafters.draft_model import DraftModelDrafter
        from engine.engine import LLMEngine
        from engine.loader import load_model
        from engine.scheduler import SchedulerConfig

        e = config.engine
        experts = msgspec.structs.replace(config.experts, **overrides)
        self.name = name
        self.pool = ExpertPool(e.model, 8, experts, e.dtype, e.device, prefix=f"bench-offload-{name}-{os.getpid()}",
                               detached=False)
        self.pool.start()
        import ray  # actors start slowly on a loaded machine: wait here, not in the first call's timeout

        ray.get([r.handle.load.remote() for r in self.pool.all_replicas()], timeout=600)
        self.router = ExpertRouter(self.pool, torch.float32, graph=experts.transport == "compiled_graph")
        target = load_model(e.model, e.dtype, e.device, experts=self.router)
        drafter = DraftModelDrafter(load_model(e.draft_model, e.dtype, e.device), max_seqs, 1024)
        sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16384, max_waiting=1 << 20)
        self.engine = LLMEngine(target, drafter, e.num_speculative_tokens, sched, 1024, speculative_policy="fixed")
        self.tokenizer = target.tokenizer
        self.actor = self.pool.replicas[0][0].handle

    def run(self, prompts: list[list[int]], params, tag: str) -> list[list[int]]:
        reqs = [self.engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [r.outputs[0].token_ids for r in reqs]

    def warm(self, prompts: list[list[int]], params) -> None:
        """Runs until the compiled graph is live (it builds in the background after traffic)."""
        for w in range(30):
            self.run(prompts, params, f"warm{w}")
            if self.router.graph is None or self.router.graph.live:
                return

    def cache_stats(self) -> dict | None:
        import ray

        return ray.get(self.actor.cache_stats.remote(), timeout=60)

    def close(self) -> None:
        self.router.close()
        self.pool.shutdown()


def measure(unit: Unit, prompts: list[list[int]], conc: int, params, teardown_s: float) -> dict:
    time.sleep(teardown_s)  # the other units' graphs reach their idle teardown (pollers off the cores)
    unit.warm(prompts[:conc], params)
    before = unit.cache_stats()
    with Timer() as t:
        outs = unit.run(prompts, params, "run")
    after = unit.cache_stats()
    tokens = sum(len(o) for o in outs)
    row = {"tok_per_s": tokens / t.elapsed_s, "outputs": outs}
    if before is not None:
        d = {k: after[k] - before[k] for k in ("hits", "misses", "prefetches", "prefetches_used",
                                               "prefetches_wasted", "loads", "stall_s")}
        row.update(hit_rate=d["hits"] / max(1, d["hits"] + d["misses"]), loads_per_token=d["loads"] / tokens,
                   stall_ms_per_token=d["stall_s"] * 1e3 / tokens,
                   prefetch_used_frac=d["prefetches_used"] / max(1, d["prefetches"]))
    return row


def main() -> None:
    import ray
    import torch

    from actors.config import ServeConfig
    from engine import SamplingParams
    from engine.yaml_config import load_yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/embedded.yaml"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts-per-seq", type=int, default=2, help="prompts per concurrent sequence")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-result")
    args = parser.parse_args()
    config = load_yaml(args.config, ServeConfig)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(1)  # as in a verifier replica: more threads fight the actors' pollers
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    units: dict = {}
    rows = []
    try:
        for conc in concs:
            units = {name: Unit(name, config, o, conc) for name, o in VARIANTS.items()}
            tok = next(iter(units.values())).tokenizer
            prompts = [tok.encode(r["prompt"]).ids[-256:] for r in load_prompts(conc * args.prompts_per_seq)]
            reps = []
            for rep in range(args.repeats):
                order = list(VARIANTS)[rep % 3:] + list(VARIANTS)[:rep % 3]  # rotate who goes first
                res = {n: measure(units[n], prompts, conc, params, config.experts.graph_idle_teardown_s + 1.0)
                       for n in order}
                assert all(r["outputs"] == res["resident"]["outputs"] for r in res.values()), "outputs differ"
                reps.append(res)
                print(f"conc {conc} rep {rep}: " + ", ".join(f"{n} {r['tok_per_s']:.1f}" for n, r in res.items()),
                      flush=True)
            row = {"concurrency": conc, "repeats": args.repeats}
            for n in VARIANTS:
                row[f"{n}_tok_per_s"] = statistics.median(r[n]["tok_per_s"] for r in reps)
            for n in ("offload_prefetch", "offload_demand"):
                row[f"{n}_ratio"] = statistics.median(r[n]["tok_per_s"] / r["resident"]["tok_per_s"] for r in reps)
                for k in ("hit_rate", "loads_per_token", "stall_ms_per_token", "prefetch_used_frac"):
                    row[f"{n}_{k}"] = statistics.median(r[n][k] for r in reps)
            row["prefetch_over_demand"] = statistics.median(
                r["offload_prefetch"]["tok_per_s"] / r["offload_demand"]["tok_per_s"] for r in reps)
            rows.append(row)
            for u in units.values():
                u.close()
            units = {}
    finally:
        for u in units.values():
            u.close()
        ray.shutdown()
    load = os.getloadavg()
    print_table(rows, ["concurrency", "resident_tok_per_s", "offload_prefetch_tok_per_s", "offload_demand_tok_per_s",
                       "offload_prefetch_ratio", "offload_demand_ratio", "prefetch_over_demand",
                       "offload_prefetch_hit_rate", "offload_demand_hit_rate"])
    print(f"load average after the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    save_json(args.save_result, {"machine": machine(), "load_average": load, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
