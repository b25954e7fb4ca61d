"""The bundled tiny model pair (checkpoints/) and its held-out benchmark prompts.

Cheap checks of what ``scripts/train_tiny.py`` produced: both checkpoints load with transformers,
the tokenizer round-trips source exactly, held-out perplexity orders target < draft < unigram,
every expert is used, and ``benchmarks/data/stdlib_heldout.jsonl`` is well-formed and held-out only.
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scripts.stdlib_corpus import EOT_TOKEN, HELDOUT_MODULES, list_source_files, stdlib_root

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "checkpoints/stdlib-moe-target"
DRAFT_DIR = REPO / "checkpoints/stdlib-draft"
COUNTS = REPO / "checkpoints/train_unigram_counts.json"
METRICS = REPO / "checkpoints/metrics.json"
PROMPTS = REPO / "benchmarks/data/stdlib_heldout.jsonl"

NUM_WINDOWS, WINDOW = 8, 128  # held-out sample: 8 windows x 128 tokens


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    target = transformers.AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    draft = transformers.AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    return target, draft


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def heldout_windows(tokenizer) -> torch.Tensor:
    """[8, 128] token ids: windows at evenly spaced offsets of the held-out token stream."""
    ids: list[int] = []
    for f in list_source_files("heldout"):
        ids += tokenizer.encode(f.text).ids + [0]
    stream = torch.tensor(ids)
    stride = (stream.numel() - WINDOW) // NUM_WINDOWS
    return torch.stack([stream[i * stride : i * stride + WINDOW] for i in range(NUM_WINDOWS)])


def _nll(model, windows: torch.Tensor) -> float:
    """Mean next-token NLL (nats) over positions 1..T-1 of every window."""
    with torch.no_grad():
        logits = model(input_ids=windows).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()


def test_checkpoints_load_with_expected_architecture(models):
    from scripts.tiny_models import count_params

    target, draft = models
    tc, dc = target.config, draft.config
    assert type(target).__name__ == "MixtralForCausalLM" and type(draft).__name__ == "LlamaForCausalLM"
    assert (tc.num_local_experts, tc.num_experts_per_tok, tc.num_hidden_layers) == (8, 2, 4)
    assert tc.vocab_size == dc.vocab_size == 4096
    assert tc.eos_token_id == dc.eos_token_id == 0
    assert tc.max_position_embeddings >= 1024 and dc.max_position_embeddings >= 1024
    tp, dp = count_params(target), count_params(draft)
    assert 3_000_000 <= tp["total"] <= 8_000_000
    assert dp["total"] * 5 <= tp["active"], (dp, tp)
    for d in (TARGET_DIR, DRAFT_DIR):
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 0


def test_autotokenizer_and_exact_roundtrip(tokenizer):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(TARGET_DIR)
    assert auto.eos_token == EOT_TOKEN and auto.eos_token_id == 0 == tokenizer.token_to_id(EOT_TOKEN)
    files = {f.relpath: f.text for f in list_source_files("heldout")}
    samples = [files[p] for p in ("json/decoder.py", "textwrap.py", "fractions.py", "email/utils.py")]
    samples.append("x\t= 'caf\u00e9 \U0001f642'\r\n  # <|endoftext|> trailing  \n\n")
    for text in samples:
        ids = tokenizer.encode(text).ids
        assert len(ids) < len(text.encode())  # BPE actually merges
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert auto.decode(auto(text)["input_ids"]) == text


def test_heldout_perplexity_target_below_draft_below_unigram(models, heldout_windows):
    target, draft = models
    counts = torch.tensor(json.loads(COUNTS.read_text()), dtype=torch.float64)
    assert counts.numel() == 4096 and counts.sum() > 1e6  # counts of the whole training stream
    logp = torch.log((counts + 1) / (counts.sum() + counts.numel()))  # add-one smoothed unigram
    unigram = -logp[heldout_windows[:, 1:]].mean().item()
    t_nll, d_nll = _nll(target, heldout_windows), _nll(draft, heldout_windows)
    assert math.exp(t_nll) < math.exp(d_nll) < math.exp(unigram), (t_nll, d_nll, unigram)


def test_every_expert_gets_at_least_3_percent(models, heldout_windows):
    target, _ = models
    with torch.no_grad():
        out = target(input_ids=heldout_windows, output_router_logits=True)
    assert len(out.router_logits) == 4
    for layer, logits in enumerate(out.router_logits):  # [8 * 128, 8]
        chosen = logits.topk(2, dim=-1).indices.flatten()
        shares = torch.bincount(chosen, minlength=8).double() / chosen.numel()
        assert shares.min().item() >= 0.03, (layer, shares.tolist())


def test_heldout_modules_are_excluded_from_training():
    train = {f.module for f in list_source_files("train")}
    assert not train & set(HELDOUT_MODULES)
    assert set(HELDOUT_MODULES) <= {f.module for f in list_source_files("heldout")}


def test_prompts_jsonl(tokenizer):
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    assert len(rows) >= 300
    assert [r["id"] for r in rows] == list(range(len(rows)))
    sources = {}
    same_python = platform.python_version() == json.loads(METRICS.read_text())["corpus"]["python_version"]
    for r in rows:
        assert r["module"] in HELDOUT_MODULES
        assert 32 <= r["max_tokens"] <= 128
        assert r["num_prompt_tokens"] == len(tokenizer.encode(r["prompt"]).ids)
        assert r["num_prompt_tokens"] + r["max_tokens"] <= 1024
        assert r["prompt"].rstrip()[-1] in "\"'"  # cut right after a docstring
        if same_python:  # prompts are verbatim slices of the held-out source files
            if r["path"] not in sources:
                sources[r["path"]] = (stdlib_root() / r["path"]).read_text(encoding="utf-8")
            assert r["prompt"] in sources[r["path"]]
    lengths = [r["num_prompt_tokens"] for r in rows]
    assert min(lengths) <= 32 and max(lengths) <= 700
    assert sum(n >= 512 for n in lengths) >= 10
    assert len({r["max_tokens"] for r in rows}) > 50
