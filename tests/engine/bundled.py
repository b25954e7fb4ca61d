"""Shared access to the bundled checkpoints and held-out prompts for engine tests."""

import functools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(ROOT / "checkpoints/stdlib-moe-target")
DRAFT = str(ROOT / "checkpoints/stdlib-draft")
PROMPTS = ROOT / "benchmarks/data/stdlib_heldout.jsonl"


@functools.cache
def heldout_rows() -> tuple[dict, ...]:
    return tuple(json.loads(line) for line in PROMPTS.read_text().splitlines())


@functools.cache
def loaded_target():
    from engine.loader import load_model

    return load_model(TARGET, "float32")


@functools.cache
def loaded_draft():
    from engine.loader import load_model

    return load_model(DRAFT, "float32")


def prompt_ids(n: int, max_len: int = 400) -> list[list[int]]:
    """Token ids of the first ``n`` held-out prompts, truncated to their last ``max_len`` tokens
    (keeps the suite fast; the long-prompt path is covered by the HTTP tests)."""
    tok = loaded_target().tokenizer
    return [tok.encode(row["prompt"]).ids[-max_len:] for row in heldout_rows()[:n]]
