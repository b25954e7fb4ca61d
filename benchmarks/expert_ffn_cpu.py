"""CPU expert FFN: the grouped GEMMs against the per-expert loop, and what the bound between them
buys a prefill.

    .venv/bin/python benchmarks/expert_ffn_cpu.py                 # ~1 minute on 2 cores
    .venv/bin/python benchmarks/expert_ffn_cpu.py --threads 1     # as in an expert actor

1. One layer's experts (the bundled target's shapes: 8 experts, hidden 128, intermediate 256,
   float32, rows spread evenly over the experts) through :func:`kernels.expert_ffn.grouped_swiglu`,
   :func:`kernels.expert_ffn.looped_swiglu` and the production dispatch
   (:func:`kernels.expert_ffn.expert_ffn_reference`): median microseconds a call, and which path
   the dispatch took.
2. The in-process engine prefilling one prompt (``max_tokens=1``) with the production rule against
   the rule before 2026-12-06, grouped GEMMs at every size (the bound lifted), interleaved:
   ``before / now`` > 1 is faster now.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)  # benchmarks/ would shadow the `kernels` package

import torch  # noqa: E402

import kernels.expert_ffn as ffn  # noqa: E402
from benchmarks.common import TARGET, Timer, call_times_ms, load_prompts  # noqa: E402


def layer_table(rows_list: list[int], experts: int = 8, hidden: int = 128, inter: int = 256) -> None:
    g = torch.Generator().manual_seed(0)
    wg, wu = (ffn.linear_layout(torch.randn(experts, inter, hidden, generator=g)) for _ in range(2))
    wd = ffn.linear_layout(torch.randn(experts, hidden, inter, generator=g))
    print(f"{'rows':>6} {'grouped us':>11} {'looped us':>10} {'dispatch us':>12}  path     loop/grouped")
    for rows in rows_list:
        counts = [rows // experts + (e < rows % experts) for e in range(experts)]
        x = torch.randn(rows, hidden, generator=g)
        calls = max(30, 20000 // rows)
        runs = ((ffn.grouped_swiglu, counts), (ffn.looped_swiglu, counts), (ffn.expert_ffn_reference, torch.tensor(counts)))
        grouped, looped, dispatch = (call_times_ms(calls, fn, x, c, wg, wu, wd)[0] * 1e3 for fn, c in runs)
        path = "grouped" if ffn._grouped(x, counts, wg, wu, wd) else "looped"
        print(f"{rows:>6} {grouped:>11.1f} {looped:>10.1f} {dispatch:>12.1f}  {path:8s} {grouped / looped:.2f}")


def prefill_table(lengths: list[int], repeats: int) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(TARGET)
    ids = llm.tokenizer.encode("\n".join(r["prompt"] for r in load_prompts(8))).ids
    params = SamplingParams(temperature=0.0, max_tokens=1)
    bound = ffn._GROUPED_MAX_ACTIVATION_BYTES
    print(f"\n{'prompt tokens':>13} {'before ms':>10} {'now ms':>8} {'before / now':>13}  (medians of {repeats})")
    for n in lengths:
        times: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(repeats):
            for name, limit in (("before", float("inf")), ("now", bound)):
                ffn._GROUPED_MAX_ACTIVATION_BYTES = limit
                try:
                    with Timer() as t:
                        llm.generate([ids[:n]], [params])
                    times[name].append(t.elapsed_s)
                finally:
                    ffn._GROUPED_MAX_ACTIVATION_BYTES = bound
        before, now = (statistics.median(times[k]) * 1e3 for k in ("before", "now"))
        print(f"{n:>13} {before:>10.1f} {now:>8.1f} {before / now:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--rows", default="16,64,128,256,384,512,640,1024,1800", help="rows per layer call")
    parser.add_argument("--prompt-tokens", default="128,256,512,900", help="prefill lengths ('' skips)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved prefills per length")
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    layer_table([int(r) for r in args.rows.split(",")])
    if args.prompt_tokens:
        prefill_table([int(n) for n in args.prompt_tokens.split(",")], args.repeats)


if __name__ == "__main__":
    main()
