"""Expert offload: decode tok/s with half the experts resident, with and without prefetch, against
everything resident, in one run (variants interleaved batch by batch on one live serving unit).

    python benchmarks/offload.py [--batches 6] [--save-result runs/offload.json]

The serving unit of ``configs/embedded.yaml`` driven from this process (as
``benchmarks/serve_vs_engine.py``'s ``unit`` run): the target's experts on one expert actor (all 8
experts of every MoE layer) over the compiled-graph transport, speculation with the draft model
in-process (k from the config, fixed). The variants run on the same actor and graph: before each
batch the actor switches its store (:meth:`actors.expert_actor.ExpertWorker.set_offload`, each
variant's store and cache kept between its turns) and the model its predictor, so machine-load
drift hits every variant alike (each batch of ``concurrency`` prompts runs once per variant, in a
rotating order; ratios are per batch, then the median and quartiles over batches):

* ``resident``: all 32 (layer, expert) entries resident (the baseline), no hints;
* ``prefetch``: 16 of 32 resident (half), pre-gating prefetch;
* ``demand``: 16 of 32 resident, demand loads only, no hints;
* ``prefetch_sim`` / ``demand_sim`` (with ``--simulated-link-gbps``): the same over a labelled
  SIMULATED slower link (each load takes at least an expert's bf16 bytes at that bandwidth), a
  stand-in for a model whose expert loads cost as much as its layers (Mixtral over PCIe).

The real slow tier converts the expert from a memory-mapped spill file (bf16, already in the
slots' layout; written from the checkpoint when the store starts) to float32. Output tokens/s
(greedy, EOS ignored; outputs checked equal across variants) at concurrency 1 and 8, and the cache
hit rate (hits / (hits + misses); a prefetch still loading
when needed is a miss).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, load_prompts, machine, print_table, save_json  # noqa: E402

HALF = 16  # of 8 experts x 4 MoE layers on the one actor
STATS = ("hits", "misses", "loads", "prefetches", "prefetches_used", "prefetches_wasted", "stall_s")


def variants(sim_gbps: float | None) -> dict[str, tuple[dict | None, bool]]:
    """name -> (the actor's offload settings, whether the model sends prefetch hints)."""
    def half(prefetch: bool, gbps: float | None = None) -> dict:
        return {"max_resident": HALF, "max_resident_bytes": None, "num_pinned": 0, "prefetch": prefetch,
                "simulated_link_gbps": gbps}

    out = {"resident": (None, False), "prefetch": (half(True), True), "demand": (half(False), False)}
    if sim_gbps:
        out.update(prefetch_sim=(half(True, sim_gbps), True), demand_sim=(half(False, sim_gbps), False))
    return out


class Unit:
    """The engine over one expert actor (compiled graph) whose store the variants switch."""

    def __init__(self, config, max_seqs: int) -> None:
        import msgspec
        import ray
        import torch

        from actors.expert_pool import ExpertPool
        from actors.expert_router import ExpertRouter
        from engine.drafters.draft_model import DraftModelDrafter
        from engine.engine import LLMEngine
        from engine.loader import load_model
        from engine.scheduler import SchedulerConfig

        e = config.engine
        experts = msgspec.structs.replace(config.experts, max_resident_experts=HALF, prefetch=True)
        self.pool = ExpertPool(e.model, 8, experts, e.dtype, e.device, prefix=f"bench-offload-{os.getpid()}-{max_seqs}",
                               detached=False)
        self.pool.start()
        self.actor = self.pool.replicas[0][0].handle
        # Actors start slowly on a loaded machine: wait here, not in the first call's timeout.
        ray.get(self.actor.load.remote(), timeout=600)
        self.router = ExpertRouter(self.pool, torch.float32, graph=experts.transport == "compiled_graph")
        self.target = load_model(e.model, e.dtype, e.device, experts=self.router)
        self.predictor = self.target.model.predictor
        drafter = DraftModelDrafter(load_model(e.draft_model, e.dtype, e.device), max_seqs, 1024)
        sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16384, max_waiting=1 << 20)
        self.engine = LLMEngine(self.target, drafter, e.num_speculative_tokens, sched, 1024, speculative_policy="fixed")

    def use(self, offload: dict | None, hints: bool) -> None:
        import ray

        ray.get(self.actor.set_offload.remote(offload), timeout=60)
        self.target.model.predictor = self.predictor if hints else None

    def stats(self) -> dict:
        import ray

        s = ray.get(self.actor.cache_stats.remote(), timeout=60)
        return {k: s[k] for k in STATS} if s else dict.fromkeys(STATS, 0)

    def run(self, prompts: list[list[int]], params, tag: str) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        reqs = [self.engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [r.outputs[0].token_ids for r in reqs], time.perf_counter() - start

    def close(self) -> None:
        self.router.close()
        self.pool.shutdown()


def measure(unit: Unit, batches: list[list[list[int]]], names: dict, params) -> dict:
    """Every batch once per variant (rotating order); totals per variant."""
    total = {n: {"tokens": 0, "seconds": 0.0, "batch_ratios": [], **dict.fromkeys(STATS, 0)} for n in names}
    for n, (offload, hints) in names.items():  # warm-up: each variant's store, and the graph
        unit.use(offload, hints)
        for w in range(30):
            unit.run(batches[0], params, f"warm-{n}-{w}")
            if unit.router.graph is None or unit.router.graph.live:
                break
    order = list(names)
    for b, batch in enumerate(batches):
        outputs = {}
        for n in order[b % len(order):] + order[:b % len(order)]:
            unit.use(*names[n])
            before = unit.stats()
            outs, seconds = unit.run(batch, params, f"b{b}-{n}")
            after = unit.stats()
            outputs[n] = outs
            t = total[n]
            t["batch_ratios"].append(seconds)  # seconds for now; over resident's below
            t["tokens"] += sum(len(o) for o in outs)
            t["seconds"] += seconds
            for k in STATS:
                t[k] += after[k] - before[k]
        assert all(o == outputs["resident"] for o in outputs.values()), f"batch {b}: outputs differ"
        base_s = total["resident"]["batch_ratios"][-1]
        for n in names:  # this batch's tok/s over resident's = resident's seconds over this one's
            total[n]["batch_ratios"][-1] = base_s / total[n]["batch_ratios"][-1]
        graph = unit.router.graph.stats.as_dict() if unit.router.graph is not None else {}
        print(f"  batch {b}: " + ", ".join(f"{n} {total[n]['tokens'] / total[n]['seconds']:.1f}" for n in names)
              + f" (graph {graph})", flush=True)
    return total


def main() -> None:
    import ray
    import torch

    from actors.config import ServeConfig
    from engine import SamplingParams
    from engine.yaml_config import load_yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/embedded.yaml"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, default=6, help="batches of `concurrency` prompts per point")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--simulated-link-gbps", type=float, default=None,
                        help="also run the two offload variants over a SIMULATED link of this bandwidth")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    config = load_yaml(args.config, ServeConfig)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = variants(args.simulated_link_gbps)
    torch.set_num_threads(1)  # as in a verifier replica: more threads fight the actors' pollers
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rows, unit = [], None
    try:
        for conc in (int(c) for c in args.concurrency.split(",")):
            unit = Unit(config, conc)
            tok = unit.target.tokenizer
            prompts = [tok.encode(r["prompt"]).ids[-256:] for r in load_prompts(conc * args.batches)]
            print(f"concurrency {conc}", flush=True)
            total = measure(unit, [prompts[i:i + conc] for i in range(0, len(prompts), conc)], names, params)
            unit.close()
            unit = None
            row = {"concurrency": conc, "batches": args.batches}
            base = total["resident"]["tokens"] / total["resident"]["seconds"]
            for n, t in total.items():
                row[f"{n}_tok_per_s"] = t["tokens"] / t["seconds"]
                if n != "resident":
                    row[f"{n}_ratio"] = row[f"{n}_tok_per_s"] / base
                    q = statistics.quantiles(t["batch_ratios"], n=4) if len(t["batch_ratios"]) > 1 else [0, 0, 0]
                    row[f"{n}_batch_ratio_median"] = statistics.median(t["batch_ratios"])
                    row[f"{n}_batch_ratio_iqr"] = f"{q[0]:.2f}-{q[2]:.2f}"
                    row[f"{n}_batch_ratios"] = [round(r, 3) for r in t["batch_ratios"]]
                    row[f"{n}_hit_rate"] = t["hits"] / max(1, t["hits"] + t["misses"])
                    row[f"{n}_loads_per_token"] = t["loads"] / t["tokens"]
                    row[f"{n}_stall_ms_per_token"] = t["stall_s"] * 1e3 / t["tokens"]
                    row[f"{n}_prefetches_wasted_frac"] = t["prefetches_wasted"] / max(1, t["prefetches"])
            for a, b in (("prefetch", "demand"), ("prefetch_sim", "demand_sim")):
                if a in total:  # per batch, median
                    row[f"{a}_over_{b}"] = statistics.median(
                        x / y for x, y in zip(total[a]["batch_ratios"], total[b]["batch_ratios"]))
            rows.append(row)
    finally:
        if unit is not None:
            unit.close()
        ray.shutdown()
    info = machine()  # its load average is the run's
    load = info["load_avg"]
    offloaded = [n for n in names if n != "resident"]
    print_table(rows, ["concurrency"] + [f"{n}_tok_per_s" for n in names])
    print_table(rows, ["concurrency"] + [f"{n}_batch_ratio_{k}" for n in offloaded for k in ("median", "iqr")])
    print_table(rows, ["concurrency"] + [f"{n}_hit_rate" for n in offloaded]
                + [c for c in rows[0] if "_over_" in c])
    print(f"load average after the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    save_json(args.save_result, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
