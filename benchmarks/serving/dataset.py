"""Benchmark prompts: JSONL loading and deterministic request sampling.

Rows look like ``{"id", "module", "prompt", "num_prompt_tokens", "max_tokens"}`` (the format of
``benchmarks/data/stdlib_heldout.jsonl``); only ``prompt`` is required, the others get defaults.
Rows of a prompt mix (``benchmarks/data/production_mix.jsonl``) may also set ``slo_class`` (the
request class the report groups by), ``endpoint`` (``completions`` or ``chat``), ``temperature`` and
``seed``; these override the command line's settings for that row.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATASET = Path(__file__).resolve().parents[1] / "data" / "stdlib_heldout.jsonl"
# Used when a row has no max_tokens and the command line gives none.
FALLBACK_MAX_TOKENS = 128


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    ``num_prompt_tokens`` is the dataset's own count (None when absent); the server's count comes
    back in the usage chunk and is what the report uses.
    """

    id: str
    prompt: str
    max_tokens: int
    num_prompt_tokens: int | None = None
    slo_class: str | None = None
    endpoint: str | None = None  # None: the run's endpoint
    temperature: float | None = None  # None: the run's temperature
    seed: int | None = None


def load_prompts(path: str | Path, max_tokens_override: int | None = None) -> list[Prompt]:
    """Read a JSONL prompt file in file order; ``max_tokens_override`` replaces every row's value.

    Raises ValueError naming the line for a row that is not a JSON object with a string ``prompt``,
    so a bad dataset fails before any request is sent.
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a string 'prompt'")
            if row.get("endpoint") not in (None, "completions", "chat"):
                raise ValueError(f"{path}:{line_no}: 'endpoint' must be 'completions' or 'chat'")
            max_tokens = max_tokens_override or int(row.get("max_tokens") or FALLBACK_MAX_TOKENS)
            prompts.append(
                Prompt(
                    id=str(row.get("id", line_no)),
                    prompt=row["prompt"],
                    max_tokens=max_tokens,
                    num_prompt_tokens=row.get("num_prompt_tokens"),
                    slo_class=_optional(row, "slo_class", str, path, line_no),
                    endpoint=_optional(row, "endpoint", str, path, line_no),
                    temperature=_optional(row, "temperature", float, path, line_no),
                    seed=_optional(row, "seed", int, path, line_no),
                )
            )
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _optional(row: dict, key: str, kind: type, path: str | Path, line_no: int):
    """``kind(row[key])`` or None when absent; ValueError naming the line for a wrong type."""
    value = row.get(key)
    if value is None:
        return None
    if kind is str and not isinstance(value, str) or kind is not str and not isinstance(value, int | float):
        raise ValueError(f"{path}:{line_no}: '{key}' must be a {kind.__name__}, got {value!r}")
    return kind(value)


def sample_prompts(prompts: list[Prompt], num: int, seed: int | None) -> list[Prompt]:
    """``num`` prompts in a deterministic order.

    ``seed=None`` keeps file order; otherwise the order is a ``random.Random(seed)`` shuffle. When
    more prompts are asked for than the file has, further passes follow (each pass reshuffled by
    the same generator), so every prompt is used once before any is repeated.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(seed) if seed is not None else None
    out: list[Prompt] = []
    while len(out) < num:
        order = list(prompts)
        if rng is not None:
            rng.shuffle(order)
        out.extend(order[: num - len(out)])
    return out
