"""Greedy speculative-decoding acceptance of the bundled draft against the bundled target.

A plain draft-then-verify loop (no tree, no sampling), written against transformers' KV caches:

1. the draft proposes ``k`` tokens greedily, one forward per token;
2. the target scores ``[uncached committed tokens, d_1 .. d_k]`` in ONE forward;
3. the longest prefix of drafts equal to the target's greedy choices is accepted (``n`` tokens),
   plus the target's own next token (a correction, or a bonus token when all ``k`` match);
4. both KV caches are truncated back to the committed prefix.

Figures (per prompt set): ``acceptance_rate = accepted / drafted`` (drafted = rounds * k) and
``mean_accepted_length = 1 + accepted / rounds`` = tokens committed per target forward.
The output equals plain greedy decoding of the target (lossless); ``--check-lossless N``
verifies that against ``model.generate`` on the first N prompts.

Usage: python scripts/measure_acceptance.py [--num-prompts 100] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # allow `python scripts/measure_acceptance.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel  # noqa: E402

from scripts.tiny_models import EOS_ID  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SpecStats:
    """Counters of one or many speculative generations."""

    rounds: int = 0  # target verification forwards (= drafting rounds)
    accepted: int = 0  # draft tokens accepted
    drafted: int = 0  # draft tokens proposed (= rounds * k)
    generated: int = 0  # tokens emitted (after truncation to max_tokens)

    def add(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.drafted += other.drafted
        self.generated += other.generated

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / max(1, self.rounds)


def _truncate(cache: DynamicCache, length: int) -> None:
    """Drop cached positions beyond ``length`` (transformers 5 ``crop`` takes -tokens_to_remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def _feed(model: PreTrainedModel, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
    """Append ``ids`` to ``cache`` and return logits [len(ids), V] for those positions."""
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, cache=cache, use_cache=True).logits[0]


@torch.no_grad()
def speculative_greedy(
    target: PreTrainedModel, draft: PreTrainedModel, prompt: list[int], max_tokens: int, k: int
) -> tuple[list[int], SpecStats]:
    """Greedy speculative generation; returns (generated ids, counters). Stops at eos or max_tokens."""
    seq = list(prompt)
    t_cache, d_cache = DynamicCache(), DynamicCache()
    stats = SpecStats()
    # Invariant: caches hold a prefix of seq; the uncached tail is fed on the next forward.
    t_logits = _feed(target, t_cache, seq)
    if len(seq) > 1:
        _feed(draft, d_cache, seq[:-1])  # the draft gets the last prompt token on its first step
    seq.append(int(t_logits[-1].argmax()))  # first token always comes from the target (prefill)
    while len(seq) - len(prompt) < max_tokens and seq[-1] != EOS_ID:
        base = len(seq)
        drafts: list[int] = []
        for _ in range(k):
            tail = (seq + drafts)[d_cache.get_seq_length() :]
            drafts.append(int(_feed(draft, d_cache, tail)[-1].argmax()))
        t_tail = seq[t_cache.get_seq_length() :] + drafts
        verify = _feed(target, t_cache, t_tail)[-(k + 1) :].argmax(-1).tolist()  # k+1 greedy choices
        n = 0
        while n < k and drafts[n] == verify[n]:
            n += 1
        seq += drafts[:n] + [verify[n]]
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        _truncate(t_cache, base + n)  # positions up to d_n are valid; verify[n] is uncached
        _truncate(d_cache, min(d_cache.get_seq_length(), base + n))
        if EOS_ID in drafts[:n]:
            seq = seq[: base + drafts.index(EOS_ID) + 1]
    out = seq[len(prompt) :][:max_tokens]
    if EOS_ID in out:
        out = out[: out.index(EOS_ID) + 1]
    stats.generated = len(out)
    return out, stats


def load_pair(target_dir: Path, draft_dir: Path) -> tuple[PreTrainedModel, PreTrainedModel]:
    """Load both checkpoints upcast to fp32 (the bf16 weights as shipped, fp32 arithmetic)."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target, draft


def read_prompts(path: Path, num: int) -> list[dict]:
    """First ``num`` rows of a prompts jsonl (rows are already shuffled deterministically)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:num]


def measure(
    target: PreTrainedModel, draft: PreTrainedModel, tokenizer_path: Path, rows: list[dict], k: int,
    check_lossless: int = 0,
) -> dict:
    """Run speculative greedy on every prompt row; return aggregate figures (see module doc)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    total = SpecStats()
    lossless_ok = 0
    t0 = time.time()
    for i, row in enumerate(tqdm(rows, desc=f"acceptance k={k}", mininterval=5.0)):
        ids = tok.encode(row["prompt"]).ids
        out, stats = speculative_greedy(target, draft, ids, row["max_tokens"], k)
        total.add(stats)
        if i < check_lossless:
            ref = target.generate(
                torch.tensor([ids]), max_new_tokens=row["max_tokens"], do_sample=False, eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
            )[0, len(ids) :].tolist()
            lossless_ok += int(ref == out)
    return {
        "k": k,
        "num_prompts": len(rows),
        "rounds": total.rounds,
        "drafted": total.drafted,
        "accepted": total.accepted,
        "generated_tokens": total.generated,
        "acceptance_rate": total.acceptance_rate,
        "mean_accepted_length": total.mean_accepted_length,
        "lossless_checked": min(check_lossless, len(rows)),
        "lossless_matches": lossless_ok,
        "seconds": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=REPO / "checkpoints/stdlib-moe-target")
    ap.add_argument("--draft", type=Path, default=REPO / "checkpoints/stdlib-draft")
    ap.add_argument("--prompts", type=Path, default=REPO / "benchmarks/data/stdlib_heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--check-lossless", type=int, default=5, help="compare with target.generate on N prompts")
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest for token-by-token decoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = load_pair(args.target, args.draft)
    rows = read_prompts(args.prompts, args.num_prompts)
    res = measure(target, draft, args.target / "tokenizer.json", rows, args.k, args.check_lossless)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
