"""Where a speculative step's time goes, per fixed draft length, in-process.

    python benchmarks/step_costs.py --batch 1 --ks 0,1,2,4 --num-prompts 12 --max-tokens 64

For each ``k`` (0: plain decoding, no drafter loaded) the engine runs the held-out prompts at
``--batch`` sequences with every sequence drafting ``k`` tokens a step (``speculative_policy:
fixed``), and the script times, around the engine's own calls: each step, the drafter's
``propose`` (its draft-model passes included), each draft-model pass and each target forward.
Columns (milliseconds are wall-clock means per call; ``per_token_ms`` = run seconds / output
tokens):

- ``tokens_per_step``: output tokens a step emits (prefill steps included).
- ``step_ms``, ``target_ms``, ``propose_ms``, ``pass_ms`` (one draft-model pass), ``other_ms``
  (a step less its target forward and proposal: scheduling, verification, emission).
- ``vs_plain``: output tokens/s over k = 0's, same run.

Speculation pays at a batch size only where ``per_token_ms`` is below k = 0's: the target's
forward over ``k + 1`` tokens a sequence plus ``k`` draft passes must cost less than the tokens
it emits would cost one by one. This shows which side breaks even on a given machine and model
pair (docs/BENCHMARKS.md, "Why drafting does not pay in-process at batch 1").
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import TARGET, load_prompts, machine, print_table, save_json  # noqa: E402
from benchmarks.speculation import build  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


class CallTimer:
    """Wraps methods of live objects to sum their wall-clock seconds and count their calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, obj: object, method: str, key: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        setattr(obj, method, timed)

    def mean_ms(self, key: str) -> float | None:
        return 1e3 * self.seconds[key] / self.calls[key] if self.calls[key] else None


def measure(k: int, batch: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """One row: the engine at ``batch`` sequences drafting ``k`` tokens each (0: no drafter)."""
    llm = build("fixed" if k else "none", k, batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[: max(batch, 2)], params)  # warm-up
    engine, timer = llm.engine, CallTimer()
    timer.wrap(engine, "step", "step")
    timer.wrap(engine.target.model, "forward", "target")
    if k:
        timer.wrap(engine.drafter, "propose", "propose")
        timer.wrap(engine.drafter.draft.model, "forward", "pass")
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = timer.calls["step"]
    other_s = timer.seconds["step"] - timer.seconds["target"] - timer.seconds["propose"]
    return {"k": k, "batch": batch, "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "tokens_per_step": tokens / steps, "step_ms": timer.mean_ms("step"), "target_ms": timer.mean_ms("target"),
            "propose_ms": timer.mean_ms("propose"), "pass_ms": timer.mean_ms("pass"),
            "passes_per_step": timer.calls["pass"] / steps, "other_ms": 1e3 * other_s / steps,
            "per_token_ms": 1e3 * seconds / tokens}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ks", default="0,1,2,4", help="draft lengths; 0 is plain decoding (the baseline)")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--save-result")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    if 0 not in ks:
        parser.error("--ks must include 0 (the plain-decoding baseline)")
    tokenizer = LLM(TARGET).tokenizer
    prompts = [tokenizer.encode(r["prompt"]).ids[-args.max_prompt_tokens:] for r in load_prompts(args.num_prompts)]
    rows = [measure(k, args.batch, prompts, args.max_tokens) for k in ks]
    plain = next(r["tok_per_s"] for r in rows if r["k"] == 0)
    for r in rows:
        r["vs_plain"] = r["tok_per_s"] / plain
    print_table(rows, ["k", "tokens_per_step", "step_ms", "target_ms", "propose_ms", "passes_per_step", "pass_ms",
                       "other_ms", "per_token_ms", "tok_per_s", "vs_plain"])
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
