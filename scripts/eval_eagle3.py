"""Acceptance per draft position of the EAGLE-3 head vs the bundled draft model, in specmoe's engine.

Greedy decoding of the same held-out prompts (``benchmarks/data/stdlib_heldout.jsonl``) with a fixed
draft length k, for each k in ``--k-list`` and each drafter, interleaved (k-major), one target
loaded once. Per run: ``mean acceptance length`` = tokens emitted per verification step, and the
acceptance rate of draft position i = verification steps whose draft token i was accepted / steps.
Every run's output is checked against plain greedy decoding (lossless).

Usage: python scripts/eval_eagle3.py [--num-prompts 40] [--k-list 2,4,6] [--out checkpoints/stdlib-eagle3/acceptance.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # allow `python scripts/eval_eagle3.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.args import EngineArgs  # noqa: E402
from engine.drafters.base import NoneDrafter  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run(target, drafter, k: int, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict, float]:
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8192, max_waiting=1000)
    engine = LLMEngine(target, drafter, k, sched, speculative_policy="fixed")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.outputs[0].token_ids for r in reqs], engine.get_metrics(), time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "checkpoints/stdlib-moe-target"))
    ap.add_argument("--draft", default=str(REPO / "checkpoints/stdlib-draft"))
    ap.add_argument("--head", default=str(REPO / "checkpoints/stdlib-eagle3"))
    ap.add_argument("--prompts", default=str(REPO / "benchmarks/data/stdlib_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k-list", default="2,4,6")
    ap.add_argument("--out", type=Path, default=REPO / "checkpoints/stdlib-eagle3/acceptance.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    target = load_model(args.target, "float32")
    rows = [json.loads(line) for line in open(args.prompts)][: args.num_prompts]
    window = target.config.max_position_embeddings
    if args.max_prompt_tokens + args.max_tokens > window:
        raise SystemExit(f"--max-prompt-tokens {args.max_prompt_tokens} + --max-tokens {args.max_tokens} exceed this "
                         f"target's context window ({window} tokens): lower them")
    prompts = [target.tokenizer.encode(r["prompt"]).ids[-args.max_prompt_tokens:] for r in rows]
    plain, _, plain_s = run(target, NoneDrafter(), 0, prompts, args.max_tokens)
    drafters = {"draft_model": EngineArgs(model=args.target, draft_model=args.draft),
                "eagle3": EngineArgs(model=args.target, draft_model=args.head, speculative_method="eagle3")}
    results = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "plain_seconds": plain_s, "runs": []}
    for k in (int(x) for x in args.k_list.split(",")):
        for name, eargs in drafters.items():
            out, m, seconds = run(target, eargs.build_drafter(target, 1024), k, prompts, args.max_tokens)
            per_pos = [a / m["num_drafts"] for a in m["accepted_per_position"]]
            row = {"drafter": name, "k": k, "lossless": out == plain, "mean_acceptance_length": m["mean_acceptance_length"],
                   "acceptance_rate": m["acceptance_rate"], "acceptance_per_position": per_pos, "seconds": seconds}
            results["runs"].append(row)
            print(f"k={k} {name:12s} lossless={row['lossless']} AL={row['mean_acceptance_length']:.3f} "
                  f"per-position={[round(p, 3) for p in per_pos]} {seconds:.1f}s", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
