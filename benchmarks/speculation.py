"""In-process speculation sweep: adaptive draft length vs fixed k vs plain decoding, per batch size.

    python benchmarks/speculation.py --batches 1,2,4,8,16 --num-prompts 32 --max-tokens 64 \
        --save-result benchmarks/results/speculation.json

Output tokens/s (greedy, or ``--temperature``) of the engine on the held-out prompts with
``--speculative-method none`` (the baseline), fixed k in ``--fixed-ks`` and the adaptive
controller (``speculative_policy: adaptive``, k at most ``--max-k``), and with ``--pipelined`` each
of those drafting ahead as well (``pipelined_drafting``, "+pipe"). Every configuration runs
``--repeats`` times, interleaved (A B C A B C ...) so machine drift hits all alike; the median
run counts. Ratios are against ``none`` at the same batch size, in the same run; ``vs_none_min_max``
is the range of each round's ratio (a configuration's run against plain decoding's of the same round).

Every request produces exactly ``--max-tokens`` tokens (EOS ignored) unless ``--dataset-lengths``:
then each produces its dataset row's ``max_tokens`` (the held-out continuation's length, 9-128
tokens), as requests of a real workload differ. With equal lengths plain decoding keeps a batch's
sequences finishing together, so the next prompts are prefilled together, while drafting (each
sequence advancing by its own accepted count) admits them one by one into mixed steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DRAFT, EAGLE3, TARGET, Timer, load_prompts, machine, print_table, save_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

DRAFTERS = {"draft": DRAFT, "eagle3": EAGLE3}


def build(name: str, k: int, batch: int, pipelined: bool = False, drafter: str = "draft") -> LLM:
    method, policy = (None, "fixed") if name == "none" else (drafter, "adaptive" if name == "adaptive" else "fixed")
    return LLM(TARGET, draft_model=DRAFTERS[drafter] if method else None, speculative_method=method,
               num_speculative_tokens=k if method else 0, speculative_policy=policy, pipelined_drafting=pipelined,
               max_num_seqs=batch, max_num_batched_tokens=16384)


def label(config: tuple[str, int, bool]) -> str:
    name, k, pipelined = config
    return (name if name in ("none", "adaptive") else f"k={k}") + ("+pipe" if pipelined else "")


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float, dict]:
    before = llm.get_metrics()
    with Timer() as t:
        outs = llm.generate(prompts, params)
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    counts = [a - b for a, b in zip(after["draft_length_counts"], before["draft_length_counts"])]
    return tokens, t.elapsed_s, {"k_counts": counts,
                                 "drafted": after["num_draft_tokens"] - before["num_draft_tokens"],
                                 "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"]}


def sweep_batch(prompts, batch: int, configs: list[tuple[str, int]], params: list[SamplingParams], repeats: int,
                drafter: str = "draft"):
    engines = {c: build(c[0], c[1], batch, c[2], drafter) for c in configs}
    for llm in engines.values():
        llm.generate(prompts[: max(batch, 2)], params[: max(batch, 2)])  # warm-up (and the controller's warm-up)
    times: dict = {c: [] for c in configs}
    extra: dict = {}
    for _ in range(repeats):
        for c, llm in engines.items():
            tokens, seconds, info = run_once(llm, prompts, params)
            times[c].append(seconds)
            extra[c] = (tokens, info)
    rows = []
    for c in configs:
        tokens, info = extra[c]
        seconds = statistics.median(times[c])
        mean_k = sum(k * n for k, n in enumerate(info["k_counts"])) / max(1, sum(info["k_counts"]))
        rows.append({"batch": batch, "config": label(c),
                     "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                     "mean_k": mean_k, "acceptance": info["accepted"] / info["drafted"] if info["drafted"] else None})
    base = next(r["tok_per_s"] for r in rows if r["config"] == "none")
    none = next(c for c in configs if c[0] == "none")
    for r, c in zip(rows, configs):
        r["vs_none"] = r["tok_per_s"] / base
        # Each repeat's ratio against plain decoding's run of the same round: the spread is the noise.
        ratios = [plain_s / own_s for plain_s, own_s in zip(times[none], times[c])]
        r["vs_none_min_max"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dataset-lengths", action="store_true",
                        help="each request's output length from its dataset row (not --max-tokens)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--fixed-ks", default="2,4,6")
    parser.add_argument("--max-k", type=int, default=8, help="the adaptive controller's maximum k")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pipelined", action="store_true", help="also each speculative config drafting ahead")
    parser.add_argument("--speculative-method", choices=sorted(DRAFTERS), default="draft",
                        help="the drafter: the bundled draft model or the bundled EAGLE-3 head")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    for name in ("num_prompts", "repeats", "max_k", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pipelined and args.speculative_method != "draft":
        parser.error("--pipelined drafts ahead with the draft model: it needs --speculative-method draft")
    torch.set_num_threads(2)
    tok = LLM(TARGET).tokenizer
    rows = load_prompts(args.num_prompts)
    prompts = [tok.encode(r["prompt"]).ids[-args.max_prompt_tokens:] for r in rows]
    lengths = [r["max_tokens"] if args.dataset_lengths else args.max_tokens for r in rows]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in lengths]
    spec = [("fixed", int(k)) for k in args.fixed_ks.split(",") if k] + [("adaptive", args.max_k)]
    configs = [("none", 0, False)] + [(n, k, False) for n, k in spec] + \
        ([(n, k, True) for n, k in spec] if args.pipelined else [])
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows += sweep_batch(prompts, batch, configs, params, args.repeats, args.speculative_method)
        print_table(rows[-len(configs):], ["batch", "config", "tok_per_s", "vs_none", "vs_none_min_max", "mean_k",
                                           "acceptance"])
    print()
    print_table(rows, ["batch", "config", "tokens", "seconds", "tok_per_s", "vs_none", "vs_none_min_max", "mean_k",
                       "acceptance"])
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
