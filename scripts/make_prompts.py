"""Build ``benchmarks/data/stdlib_heldout.jsonl``: code-completion prompts from HELD-OUT stdlib modules.

A prompt is a held-out source file cut right after a function's docstring (signature + docstring,
optionally preceded by the lines above it, ending at the closing quotes), so the natural
continuation is the function body.
Each prompt starts at a line boundary chosen to hit a target length drawn in
[``--min-tokens``, ``--max-prompt-tokens``] tokens (half of the draws log-uniform, half uniform):
lengths range from ~20 to ~700 tokens and prompt + ``max_tokens`` (32..128) always fits the
1024-token context.

Deterministic: files sorted, functions in source order, one seeded ``random.Random`` for the
shuffle, the target lengths and ``max_tokens``. Rows come out shuffled, so any prefix of the
file (e.g. the first 100 rows used for the acceptance figure) is a representative sample.

Usage: python scripts/make_prompts.py [--num 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # allow `python scripts/make_prompts.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from scripts.stdlib_corpus import SourceFile, list_source_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cut:
    """A function whose docstring ends a prompt. Line numbers are 1-based, inclusive."""

    file: SourceFile
    first_line: int  # first decorator or the ``def`` line: the earliest a prompt may NOT start after
    end_line: int  # last line of the docstring


def documented_functions(file: SourceFile) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """All (async) functions with a docstring in one file, in ``ast.walk`` order ([] if it does not parse)."""
    try:
        tree = ast.parse(file.text)
    except SyntaxError:
        return []
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node) is not None
    ]


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The first decorator's line, or the ``def`` line."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def find_cuts(file: SourceFile) -> list[Cut]:
    """All (async) functions with a docstring in one file, in source order."""
    cuts = [
        Cut(file, first_line(node), node.body[0].end_lineno or node.body[0].lineno)
        for node in documented_functions(file)
    ]
    return sorted(cuts, key=lambda c: (c.first_line, c.end_line))


def cut_prompt(cut: Cut, lines: list[str], line_tokens: list[int], want: int, tok: Tokenizer, limit: int):
    """Prompt text ending at the docstring and starting as early as ``want`` tokens allow.

    Args:
        lines: the file's lines with their newlines; line_tokens: approximate tokens per line.
    Returns:
        (text, exact token count), or None if even signature + docstring exceeds ``limit``.
    """
    start = cut.first_line
    budget = sum(line_tokens[start - 1 : cut.end_line])
    while start > 1 and budget + line_tokens[start - 2] <= want:
        start -= 1
        budget += line_tokens[start - 1]
    while start < cut.first_line and not lines[start - 1].strip():
        start += 1  # do not start a prompt on blank lines
    while True:  # per-line counts are approximate: fix up with the exact encoding
        # Stop right after the docstring's closing quotes, WITHOUT the newline: BPE merges a
        # newline with the next line's indentation ("\n        "), so a prompt ending in a bare
        # "\n" token would ask the model to continue from a token boundary it never saw in
        # training mid-function (it then starts a new top-level statement instead of the body).
        text = "".join(lines[start - 1 : cut.end_line]).rstrip("\r\n")
        n = len(tok.encode(text).ids)
        if n <= limit:
            return text, n
        if start >= cut.first_line:
            return None
        start += 1


def build_rows(tok: Tokenizer, num: int, seed: int, min_tokens: int, max_prompt_tokens: int) -> list[dict]:
    """Generate up to ``num`` prompt rows (see module doc) from the held-out modules."""
    rng = random.Random(seed)
    files = list_source_files("heldout")
    cuts = [c for f in files for c in find_cuts(f)]
    rng.shuffle(cuts)
    lines_of: dict[str, tuple[list[str], list[int]]] = {}
    rows: list[dict] = []
    seen: set[str] = set()
    bar = tqdm(total=num, desc="prompts", mininterval=5.0)
    for cut in cuts:
        if len(rows) >= num:
            break
        if cut.file.relpath not in lines_of:
            lines = cut.file.text.splitlines(keepends=True)
            lines_of[cut.file.relpath] = (lines, [len(ids) for ids in (e.ids for e in tok.encode_batch(lines))])
        lines, line_tokens = lines_of[cut.file.relpath]
        # Half log-uniform (many short prompts), half uniform (enough long ones >= 512 tokens).
        if rng.random() < 0.5:
            want = int(math.exp(rng.uniform(math.log(min_tokens), math.log(max_prompt_tokens))))
        else:
            want = rng.randint(min_tokens, max_prompt_tokens)
        max_tokens = rng.randint(32, 128)
        got = cut_prompt(cut, lines, line_tokens, want, tok, max_prompt_tokens)
        if got is None or got[0] in seen:
            continue
        seen.add(got[0])
        rows.append(
            {"id": len(rows), "module": cut.file.module, "path": cut.file.relpath, "prompt": got[0],
             "num_prompt_tokens": got[1], "max_tokens": max_tokens}
        )
        bar.update(1)
    bar.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "checkpoints/stdlib-moe-target/tokenizer.json")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/data/stdlib_heldout.jsonl")
    ap.add_argument("--num", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=700)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer))
    rows = build_rows(tok, args.num, args.seed, args.min_tokens, args.max_prompt_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    lens = sorted(r["num_prompt_tokens"] for r in rows)
    print(f"wrote {len(rows)} prompts to {args.out}: tokens min {lens[0]} median {lens[len(lens) // 2]} "
          f"max {lens[-1]}, >=512: {sum(n >= 512 for n in lens)}")


if __name__ == "__main__":
    main()
