"""The bundled production mix (benchmarks/data/production_mix.jsonl) and the script that builds it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.serving.dataset import load_prompts
from scripts.make_mix import CLASSES, CONTEXT_TOKENS, build_rows, chat_text, heldout_functions, write_rows
from scripts.stdlib_corpus import HELDOUT_MODULES

REPO = Path(__file__).resolve().parents[2]
MIX = REPO / "benchmarks/data/production_mix.jsonl"
TOKENIZER = REPO / "checkpoints/stdlib-moe-target/tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def test_mix_parses_and_has_every_class_within_the_window(tok):
    prompts = load_prompts(MIX)
    rows = [json.loads(line) for line in MIX.read_text().splitlines()]
    assert len(prompts) == len(rows) == 400
    by_class = {name: [r for r in rows if r["slo_class"] == name] for name in CLASSES}
    assert {p.slo_class for p in prompts} == set(CLASSES) == {"completion", "chat", "long_context"}
    assert all(len(rs) >= 30 for rs in by_class.values())
    assert {r["endpoint"] for r in by_class["completion"]} == {"completions"}
    assert {r["endpoint"] for r in by_class["chat"]} == {"chat"}
    assert {r["endpoint"] for r in by_class["long_context"]} == {"chat", "completions"}  # summary, docstring
    assert {r["module"] for r in rows} <= set(HELDOUT_MODULES)
    assert all(r["num_prompt_tokens"] + r["max_tokens"] <= CONTEXT_TOKENS for r in rows)
    # Greedy and sampled rows; every sampled row has a seed.
    assert {r["temperature"] for r in rows} == {0.0, 0.7}
    assert all(("seed" in r) == (r["temperature"] > 0) for r in rows)
    # Lengths: completion short outputs, chat long ones, long_context near the window.
    out_median = {n: statistics.median(r["max_tokens"] for r in rs) for n, rs in by_class.items()}
    assert 10 <= out_median["completion"] <= 16 and 110 <= out_median["chat"] <= 150
    assert min(r["num_prompt_tokens"] + r["max_tokens"] for r in by_class["long_context"]) >= 800
    # num_prompt_tokens is the server's count: raw text for completions, the chat template for chat.
    for r in rows[:40]:
        text = chat_text(r["prompt"]) if r["endpoint"] == "chat" else r["prompt"]
        assert len(tok.encode(text).ids) == r["num_prompt_tokens"], r["id"]


def test_script_is_deterministic_and_reproduces_the_bundled_file(tok, tmp_path):
    functions = heldout_functions()  # shared: the expensive part (parsing every held-out file)
    first = build_rows(tok, 12, seed=0, functions=functions)
    assert build_rows(tok, 12, seed=0, functions=functions) == first
    assert build_rows(tok, 12, seed=1, functions=functions) != first
    out = tmp_path / "mix.jsonl"
    write_rows(first, out)
    # Rows are drawn in order, so the bundled 400-row file starts with the 12-row build.
    assert out.read_bytes().splitlines() == MIX.read_bytes().splitlines()[:12]
