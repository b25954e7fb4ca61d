"""In-process engine throughput vs transformers ``generate`` on the held-out prompt mix.

    python benchmarks/engine.py --num-prompts 32 --max-tokens 64 --save-result benchmarks/results/engine.json

Measures output tokens/s (greedy, ignore EOS so every configuration emits the same number of tokens)
at batch 1 and 8 (median of ``--repeats`` runs for specmoe): specmoe with speculation off, with the draft model at k = 2, 4, 6, with the n-gram
drafter at k = 4 (``--compile``: also plain decoding with ``compile=True``, the layers' dense parts
under torch.compile); and the same checkpoints under transformers ``generate`` plain and with
``assistant_model`` (its assisted generation, batch 1 only, as transformers supports). One process,
one run, so every figure shares the machine's state.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from benchmarks.common import DRAFT, TARGET, Timer, load_prompts, machine, print_table, save_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

SPECMOE_CONFIGS = [("off", None, 0), ("draft", "draft", 2), ("draft", "draft", 4), ("draft", "draft", 6),
                   ("ngram", "ngram", 4)]


def bench_specmoe(prompts: list[list[int]], batch: int, method, k: int, max_tokens: int, repeats: int,
                  compile: bool = False) -> dict:
    llm = LLM(TARGET, draft_model=DRAFT if method == "draft" else None, speculative_method=method,
              num_speculative_tokens=k, max_num_seqs=batch, max_num_batched_tokens=16384, compile=compile,
              speculative_policy="fixed")  # the rows name k: every step drafts it (adaptive is speculation.py's)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], params)  # warm-up (compiles too: prefill and decode shapes)
    base = llm.get_metrics()
    times = []
    for _ in range(repeats):  # the median run: a 2-core machine has hiccups
        with Timer() as t:
            outs = llm.generate(prompts, params)
        times.append(t.elapsed_s)
    m = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = sorted(times)[len(times) // 2]
    drafted = m["num_draft_tokens"] - base["num_draft_tokens"]
    accepted = m["num_accepted_tokens"] - base["num_accepted_tokens"]
    drafts = m["num_drafts"] - base["num_drafts"]
    return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accept_len": 1 + accepted / drafts if drafts else None}


def bench_transformers(prompts: list[list[int]], batch: int, max_tokens: int, assisted: bool) -> dict | None:
    from transformers import AutoModelForCausalLM

    if assisted and batch != 1:
        return None  # transformers' assisted generation supports batch size 1 only
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval() if assisted else None
    kwargs = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    if assisted:
        kwargs["assistant_model"] = draft
    tokens = 0
    with torch.inference_mode(), Timer() as t:
        for i in range(0, len(prompts), batch):
            group = prompts[i: i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
            tokens += (out.shape[1] - width) * len(group)
    return {"tokens": tokens, "seconds": t.elapsed_s, "tok_per_s": tokens / t.elapsed_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per specmoe config (median)")
    parser.add_argument("--compile", action="store_true", help="add plain decoding with compile=True")
    parser.add_argument("--plain-only", action="store_true",
                        help="only plain decoding (speculation off) and plain transformers generate: the "
                             "step-overhead figures, without the speculative and assisted runs")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch intra-op threads for both systems (1 on a machine shared with other jobs: "
                             "two OpenMP threads stall whenever one is descheduled)")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm_tok = LLM(TARGET).tokenizer
    prompts = [llm_tok.encode(r["prompt"]).ids[-args.max_prompt_tokens:] for r in load_prompts(args.num_prompts)]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        specmoe = SPECMOE_CONFIGS[:1] if args.plain_only else SPECMOE_CONFIGS
        configs = [(*c, False) for c in specmoe] + ([("off", None, 0, True)] if args.compile else [])
        for name, method, k, compiled in configs:
            r = bench_specmoe(prompts, batch, method, k, args.max_tokens, args.repeats, compiled)
            rows.append({"system": "specmoe", "batch": batch, "speculation": name, "k": k, "compile": compiled, **r})
            print_table(rows[-1:], list(rows[-1]))
        if not args.skip_transformers:
            for assisted in (False,) if args.plain_only else (False, True):
                r = bench_transformers(prompts, batch, args.max_tokens, assisted)
                if r:
                    rows.append({"system": "transformers", "batch": batch,
                                 "speculation": "assistant_model" if assisted else "off", "k": None, **r})
    print()
    print_table(rows, ["system", "batch", "speculation", "k", "compile", "tokens", "seconds", "tok_per_s",
                       "acceptance_rate", "mean_accept_len"])
    for line in ratios(rows):
        print(line)
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


def ratios(rows: list[dict]) -> list[str]:
    """The issue's must-show figures: plain specmoe / plain transformers per batch, and the best
    draft-model configuration (the same model pair) / transformers' assisted generation."""

    def tps(batch: int, system: str, pred) -> float | None:
        return max((r["tok_per_s"] for r in rows if r["batch"] == batch and r["system"] == system and pred(r)),
                   default=None)

    lines = []
    for batch in sorted({r["batch"] for r in rows}):
        hf, hf_assisted = tps(batch, "transformers", lambda r: r["speculation"] == "off"), \
            tps(batch, "transformers", lambda r: r["speculation"] == "assistant_model")
        for compiled in (False, True):
            plain = tps(batch, "specmoe", lambda r, c=compiled: r["speculation"] == "off" and r["compile"] == c)
            if plain and hf:
                lines.append(f"batch {batch}: specmoe plain{' (compiled)' if compiled else ''} / transformers "
                             f"generate = {plain / hf:.2f}x")
        spec = tps(batch, "specmoe", lambda r: r["speculation"] == "draft")
        if spec and hf_assisted:
            lines.append(f"batch {batch}: best draft-model k specmoe / transformers assisted = {spec / hf_assisted:.2f}x")
    return lines


if __name__ == "__main__":
    main()
