"""Build ``benchmarks/data/production_mix.jsonl``: a production-like prompt mix from HELD-OUT stdlib code.

Three request classes, each row tagged with its ``slo_class`` (the load generator reports per class):

- ``completion`` (``/v1/completions``): a held-out file cut right after a function's docstring, as in
  ``make_prompts.py``; short outputs. Modelled on the Azure LLM inference 2023 *code* trace (median
  1,469 prompt / 13 output tokens).
- ``chat`` (``/v1/chat/completions``): a short question about one function followed by its source
  (and the lines above it). Modelled on the Azure 2023 *conversation* trace (median 1,020 / 129).
- ``long_context``: prompts near the 1024-token window of the bundled target: the lines before a
  function plus its signature ending at the opening quotes of its (removed) docstring
  (completions: the model writes the docstring), or a file excerpt with a request to summarise it
  (chat). Not in the Azure traces: the interference stream of issue 15.

Lengths (tokens of the bundled tokenizer; chat counts include the chat template): Azure prompts run
to several thousand tokens, the bundled target's window is 1024, so prompt medians are scaled by
1/4 (code 1469 -> 367, conversation 1020 -> 255) and drawn log-normal around them (sigma 0.6,
our choice, not fitted); output medians (13, 129) are already small and kept, log-normal with sigma
0.5. Every row satisfies prompt + ``max_tokens`` <= 1024. Sampled rows (temperature 0.7) carry a
``seed`` so reruns produce the same text; the rest are greedy.

Deterministic: held-out files sorted, functions in source order, one seeded ``random.Random`` for
the class of each row, the function it uses, the lengths and the sampling, in row order (so the
first N rows of ``--num 400`` equal ``--num N``). No network.

Usage: python scripts/make_mix.py [--num 400] [--seed 0] [--out benchmarks/data/production_mix.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # allow `python scripts/make_mix.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer  # noqa: E402

from engine.chat_template import ChatTemplate  # noqa: E402
from scripts.make_prompts import Cut, cut_prompt, documented_functions, first_line  # noqa: E402
from scripts.stdlib_corpus import SourceFile, list_source_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTEXT_TOKENS = 1024  # max_position_embeddings of checkpoints/stdlib-moe-target
SAMPLED_TEMPERATURE = 0.7
OPENING_QUOTES = re.compile(r"^[rRuU]?(\"\"\"|''')")


@dataclass(frozen=True)
class ClassSpec:
    """Length and sampling model of one request class (token counts; shares sum to 1)."""

    share: float
    prompt_median_tokens: float
    prompt_sigma: float
    output_median_tokens: float
    output_sigma: float
    output_min_tokens: int
    output_max_tokens: int
    sampled_fraction: float


CLASSES: dict[str, ClassSpec] = {
    "completion": ClassSpec(0.45, 1469 / 4, 0.6, 13, 0.5, 4, 48, 0.2),
    "chat": ClassSpec(0.45, 1020 / 4, 0.6, 129, 0.5, 16, 320, 0.5),
    # Prompt lengths for long_context are drawn near the window instead (see draw_prompt_tokens).
    "long_context": ClassSpec(0.10, 0.0, 0.0, 64, 0.4, 32, 128, 0.0),
}
CHAT_QUESTIONS = (
    "What does `{name}` do?",
    "Can you explain what the function `{name}` returns?",
    "Is there a bug in `{name}`?",
    "How would I call `{name}`, and what arguments does it take?",
    "Why does `{name}` work the way it does?",
)
SUMMARY_REQUEST = "Summarize what the code above does, and what `{name}` is for."


@dataclass(frozen=True)
class Function:
    """A held-out function with a docstring. Line numbers are 1-based, inclusive."""

    file: SourceFile
    name: str
    first_line: int  # first decorator or the ``def`` line
    doc_line: int  # first line of the docstring
    doc_end_line: int  # last line of the docstring
    end_line: int  # last line of the function


def find_functions(file: SourceFile) -> list[Function]:
    """All (async) functions with a docstring in one file, in source order."""
    found = []
    for node in documented_functions(file):
        doc = node.body[0]
        doc_end = doc.end_lineno or doc.lineno
        found.append(Function(file, node.name, first_line(node), doc.lineno, doc_end, node.end_lineno or doc_end))
    return sorted(found, key=lambda f: (f.first_line, f.end_line))


def heldout_functions() -> list[Function]:
    """Every function with a docstring in the held-out split (files sorted, source order)."""
    return [f for src in list_source_files("heldout") for f in find_functions(src)]


def chat_text(content: str) -> str:
    """The prompt the server renders for one user message (specmoe's plain chat template)."""
    return ChatTemplate(None).render([{"role": "user", "content": content}])


def lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal draw around ``median``, rounded and clipped to [low, high]."""
    return min(high, max(low, round(median * math.exp(rng.gauss(0.0, sigma)))))


class MixBuilder:
    """Builds rows one at a time from a seeded generator (see the module docstring)."""

    def __init__(self, tok: Tokenizer, seed: int, functions: list[Function] | None = None) -> None:
        self.tok, self.rng = tok, random.Random(seed)
        self.functions = heldout_functions() if functions is None else functions
        self._lines: dict[str, tuple[list[str], list[int]]] = {}
        self.seen: set[str] = set()

    def lines(self, file: SourceFile) -> tuple[list[str], list[int]]:
        """The file's lines (with newlines) and approximate tokens per line, cached."""
        if file.relpath not in self._lines:
            lines = file.text.splitlines(keepends=True)
            self._lines[file.relpath] = (lines, [len(e.ids) for e in self.tok.encode_batch(lines)])
        return self._lines[file.relpath]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def window(self, fn: Function, end_line: int, want: int, limit: int, last: str | None = None):
        """(text, tokens) of the lines ending at ``end_line`` (its text replaced by ``last``)."""
        lines, line_tokens = self.lines(fn.file)
        if last is not None:
            lines = lines[: end_line - 1] + [last]
        return cut_prompt(Cut(fn.file, fn.first_line, end_line), lines, line_tokens, want, self.tok, limit)

    def completion(self, fn: Function, prompt_tokens: int, max_tokens: int):
        """Cut right after the docstring (the model writes the body)."""
        got = self.window(fn, fn.doc_end_line, prompt_tokens, CONTEXT_TOKENS - max_tokens)
        return ("completions", *got) if got else None

    def docstring(self, fn: Function, prompt_tokens: int, max_tokens: int):
        """The function up to the opening quotes of its docstring (the model writes the docstring)."""
        lines, _ = self.lines(fn.file)
        doc = lines[fn.doc_line - 1]
        indent = doc[: len(doc) - len(doc.lstrip())]
        quotes = OPENING_QUOTES.match(doc.lstrip())
        if quotes is None:
            return None
        got = self.window(fn, fn.doc_line, prompt_tokens, CONTEXT_TOKENS - max_tokens, indent + quotes.group(0))
        return ("completions", *got) if got else None

    def chat(self, fn: Function, prompt_tokens: int, max_tokens: int, question: str, before: bool):
        """A question and a fenced code excerpt ending with the function (question first or last)."""
        wrap = ("{q}\n\n```python\n{code}\n```" if before else "```python\n{code}\n```\n\n{q}")
        overhead = self.count(chat_text(wrap.format(q=question, code="")))
        got = self.window(fn, fn.end_line, prompt_tokens - overhead, CONTEXT_TOKENS - max_tokens - overhead)
        if got is None:
            return None
        content = wrap.format(q=question, code=got[0])
        total = self.count(chat_text(content))
        return ("chat", content, total) if total + max_tokens <= CONTEXT_TOKENS else None

    def draw_prompt_tokens(self, name: str, max_tokens: int) -> int:
        """Target prompt length: log-normal per class; long_context fills 88-100 % of the window."""
        spec = CLASSES[name]
        room = CONTEXT_TOKENS - max_tokens
        if name == "long_context":
            return int(room * self.rng.uniform(0.88, 1.0))
        return lognormal_int(self.rng, spec.prompt_median_tokens, spec.prompt_sigma, 16, room)

    def row(self, row_id: int) -> dict:
        """The next row: class, function and lengths drawn until a candidate fits (and is new)."""
        rng = self.rng
        name = rng.choices(list(CLASSES), weights=[c.share for c in CLASSES.values()])[0]
        spec = CLASSES[name]
        sampled = rng.random() < spec.sampled_fraction
        docstring = rng.random() < 0.5  # long_context only: docstring (completions) or summary (chat)
        while True:
            fn = rng.choice(self.functions)
            max_tokens = lognormal_int(
                rng, spec.output_median_tokens, spec.output_sigma, spec.output_min_tokens, spec.output_max_tokens
            )
            want = self.draw_prompt_tokens(name, max_tokens)
            if name == "completion":
                got = self.completion(fn, want, max_tokens)
            elif name == "chat":
                question = rng.choice(CHAT_QUESTIONS).format(name=fn.name)
                got = self.chat(fn, want, max_tokens, question, before=rng.random() < 0.5)
            elif docstring:
                got = self.docstring(fn, want, max_tokens)
            else:
                got = self.chat(fn, want, max_tokens, SUMMARY_REQUEST.format(name=fn.name), before=False)
            # long_context rows must really be long: a function near the top of a file cannot be.
            if got is None or got[1] in self.seen or (name == "long_context" and got[2] < 0.9 * want):
                continue
            self.seen.add(got[1])
            endpoint, prompt, tokens = got
            row = {"id": row_id, "slo_class": name, "endpoint": endpoint, "module": fn.file.module,
                   "path": fn.file.relpath, "prompt": prompt, "num_prompt_tokens": tokens,
                   "max_tokens": max_tokens, "temperature": SAMPLED_TEMPERATURE if sampled else 0.0}
            if sampled:
                row["seed"] = row_id
            return row


def build_rows(tok: Tokenizer, num: int, seed: int, functions: list[Function] | None = None) -> list[dict]:
    """``num`` mix rows (see the module docstring); ``functions`` defaults to ``heldout_functions()``."""
    builder = MixBuilder(tok, seed, functions)
    return [builder.row(i) for i in range(num)]


def write_rows(rows: list[dict], out: Path) -> None:
    """One JSON object per line, UTF-8."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "checkpoints/stdlib-moe-target/tokenizer.json")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/data/production_mix.jsonl")
    ap.add_argument("--num", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = build_rows(Tokenizer.from_file(str(args.tokenizer)), args.num, args.seed)
    write_rows(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")
    for name in CLASSES:
        of = sorted((r["num_prompt_tokens"], r["max_tokens"]) for r in rows if r["slo_class"] == name)
        if of:
            ins, outs = sorted(p for p, _ in of), sorted(o for _, o in of)
            print(f"  {name:<13} {len(of):>4} rows, prompt tokens median {ins[len(ins) // 2]} "
                  f"(min {ins[0]}, max {ins[-1]}), max_tokens median {outs[len(outs) // 2]}")


if __name__ == "__main__":
    main()
