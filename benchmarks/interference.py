"""Long-prompt interference: inter-token latency of short requests while long prompts arrive.

    python benchmarks/interference.py --duration-s 20 --budgets 64,128,256 \
        --save-result benchmarks/results/interference.json

In-process engine, bundled pair, greedy. ``--concurrency`` short requests (held-out prompts cut
to ``--short-prompt-tokens``) run closed-loop: a finished one is replaced at once. In the
"interfered" runs a long prompt (``--long-prompt-tokens`` of held-out code, consecutive files
joined, near the 1024-token context window) arrives every ``--long-every-s`` seconds. ITL is the time between two consecutive token
emissions of one short request (a step that emits several tokens counts once: what a streaming
client sees). Reported per scheduler configuration: FCFS whole-prompt prefill (the baseline) and
chunked prefill at each token budget (and, with ``--tpot-ms`` / ``--itl-ms``, chunks sized by an SLO
class's TPOT budget, capped by its ITL budget), p50/p99 ITL without and with interference and
their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DRAFT, TARGET, load_prompts, machine, print_table, save_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.slo import SLOClass  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(llm: LLM, shorts: list[list[int]], longs: list[list[int]], args, interfere: bool) -> dict:
    """One timed run; returns the short requests' ITLs (ms) and the long prompts' TTFTs (ms)."""
    engine, ids = llm.engine, itertools.count()
    short_params = SamplingParams(temperature=0.0, max_tokens=args.short_max_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    last_emit: dict[str, float] = {}
    itl_ms: list[float] = []
    long_ttft_ms: list[float] = []
    long_arrival: dict[str, float] = {}
    pool = itertools.cycle(shorts)
    for _ in range(args.concurrency):
        engine.add_request(f"s{next(ids)}", next(pool), short_params)
    longs_iter = itertools.cycle(longs)
    start = time.perf_counter()
    next_long = start + args.long_every_s / 2
    while time.perf_counter() - start < args.duration_s:
        now = time.perf_counter()
        if interfere and now >= next_long:
            rid = f"L{next(ids)}"
            engine.add_request(rid, next(longs_iter), long_params)
            long_arrival[rid] = now
            next_long += args.long_every_s
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if rid.startswith("L"):
                if out.outputs[0].new_token_ids and rid in long_arrival:
                    long_ttft_ms.append((now - long_arrival.pop(rid)) * 1e3)
                continue
            if out.outputs[0].new_token_ids:
                if rid in last_emit:
                    itl_ms.append((now - last_emit[rid]) * 1e3)
                last_emit[rid] = now
            if out.finished:
                last_emit.pop(rid, None)
                engine.add_request(f"s{next(ids)}", next(pool), short_params)
    for rid in list(engine._requests):
        engine.abort_request(rid)
    return {"itl_ms": itl_ms, "long_ttft_ms": long_ttft_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--long-every-s", type=float, default=1.0)
    parser.add_argument("--short-prompt-tokens", type=int, default=128)
    parser.add_argument("--short-max-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=900)
    parser.add_argument("--budgets", default="64,128,256", help="chunked-prefill token budgets to compare")
    parser.add_argument("--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--tpot-ms", default="", help="also run chunked prefill sized by these TPOT budgets "
                        "(comma-separated ms; an SLO class every request is in) at the 4096-token budget")
    parser.add_argument("--itl-ms", default="", help="also run each --tpot-ms budget with these ITL caps "
                        "(comma-separated ms; SLOClass.itl_ms)")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok = LLM(TARGET).tokenizer
    rows = [tok.encode(r["prompt"]).ids for r in load_prompts(120)]
    shorts = [r[-args.short_prompt_tokens:] for r in rows[:32]]
    # Long prompts: consecutive held-out files joined (real code) and cut to the length wanted.
    joined = [t for r in rows[32:] for t in r]
    n = args.long_prompt_tokens
    longs = [joined[i * n:(i + 1) * n] for i in range(min(8, len(joined) // n))]
    configs = [("fcfs", 4096, False, None)] + [(f"chunked-{b}", int(b), True, None) for b in args.budgets.split(",")]
    tpots = [float(t) for t in args.tpot_ms.split(",") if t]
    itls = [None] + [float(i) for i in args.itl_ms.split(",") if i]
    configs += [(f"tpot-{t:g}ms" + (f"-itl-{i:g}ms" if i else ""), 4096, True, SLOClass(tpot_ms=t, itl_ms=i))
                for t in tpots for i in itls]
    results = []
    for name, budget, chunked, slo in configs:
        llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=args.num_speculative_tokens,
                  max_num_seqs=args.concurrency + 4, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        if slo is not None:  # every request in one class whose budgets size the chunks
            cfg = llm.engine.scheduler.config
            llm.engine.scheduler.config = msgspec.structs.replace(
                cfg, slo_classes={"interactive": slo}, default_slo_class="interactive")
        llm.generate(shorts[:4], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up
        alone = run(llm, shorts, longs, args, interfere=False)
        mixed = run(llm, shorts, longs, args, interfere=True)
        p99_alone, p99_mixed = percentile(alone["itl_ms"], 0.99), percentile(mixed["itl_ms"], 0.99)
        results.append({"config": name, "budget": budget,
                        "itl_p50_alone_ms": percentile(alone["itl_ms"], 0.5), "itl_p99_alone_ms": p99_alone,
                        "itl_p50_mixed_ms": percentile(mixed["itl_ms"], 0.5), "itl_p99_mixed_ms": p99_mixed,
                        "p99_ratio": p99_mixed / p99_alone, "long_ttft_p50_ms": percentile(mixed["long_ttft_ms"], 0.5),
                        "num_long": len(mixed["long_ttft_ms"])})
        print_table(results[-1:], list(results[-1]))
    print()
    print_table(results, list(results[0]))
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
