"""Train the bundled model pair on Python-stdlib source: BPE tokenizer, MoE target, distilled draft.

Phases (each with a tqdm bar): corpus -> tokenizer (+ exact round-trip check) -> target
pre-training -> draft distillation from the saved target -> held-out evaluation (perplexities,
unigram baseline, per-expert routing shares) -> benchmark prompts -> greedy speculative acceptance.

Writes ``<out-dir>/stdlib-moe-target/``, ``<out-dir>/stdlib-draft/`` (HF checkpoints, bf16),
``<out-dir>/train_unigram_counts.json`` ([V] training-token counts, for the unigram baseline) and
``<out-dir>/metrics.json`` (every figure of the model card), plus the prompts jsonl.
Deterministic for a given ``--seed`` on a given machine/thread count.

Usage (the bundled checkpoints): python scripts/train_tiny.py --seed 0
Smoke run: python scripts/train_tiny.py --out-dir /tmp/smoke --target-steps 20 --draft-steps 10 \\
    --eval-windows 8 --acceptance-prompts 5 --prompts-out /tmp/smoke/prompts.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # allow `python scripts/train_tiny.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from scripts import make_prompts, measure_acceptance, tiny_eval  # noqa: E402
from scripts.stdlib_corpus import HELDOUT_MODULES, heldout_share, list_source_files  # noqa: E402
from scripts.tiny_models import (  # noqa: E402
    DraftSize,
    TargetSize,
    build_draft,
    build_target,
    count_params,
    save_checkpoint,
)
from scripts.tiny_tokenizer import assert_roundtrip, encode_documents, train_bpe  # noqa: E402
from scripts.tiny_training import (  # noqa: E402
    Phase,
    distill_step_fn,
    greedy_continuations,
    parse_phases,
    run_phases,
    target_step_fn,
)

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Temporarily run torch ops on ``n`` threads.

    Token-by-token decoding issues thousands of tiny ops; on a 2-core machine shared with other
    processes, 2 OpenMP threads that must both be scheduled for every op made decoding ~100x
    slower than 1 thread (measured), so the decoding phases use 1 thread.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--prompts-out", type=Path, default=REPO / "benchmarks/data/stdlib_heldout.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    # target size / training
    ap.add_argument("--target-hidden", type=int, default=128)
    ap.add_argument("--target-intermediate", type=int, default=256, help="per expert")
    ap.add_argument("--target-layers", type=int, default=4)
    ap.add_argument("--aux-loss-coef", type=float, default=0.02, help="Mixtral (Switch) aux loss weight")
    ap.add_argument("--balance-coef", type=float, default=1.0, help="soft top-k load loss weight")
    ap.add_argument("--balance-tau", type=float, default=0.3, help="soft top-k membership temperature")
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--target-tokens-per-step", type=int, default=4096)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--phases", default="512:0.7,1024:0.3", help="seq_len:fraction of steps, in order")
    # draft size / distillation
    ap.add_argument("--draft-hidden", type=int, default=64)
    ap.add_argument("--draft-intermediate", type=int, default=192)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-steps", type=int, default=1400)
    ap.add_argument("--draft-tokens-per-step", type=int, default=4096)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--draft-phases", default="512:0.7,1024:0.3")
    ap.add_argument("--distill-alpha", type=float, default=0.1, help="weight of data CE vs teacher KL")
    ap.add_argument("--distill-temperature", type=float, default=1.0)
    ap.add_argument("--onpolicy-seqs", type=int, default=384, help="target greedy continuations to distill on")
    ap.add_argument("--onpolicy-prompt", type=int, default=384, help="prompt tokens per continuation")
    ap.add_argument("--onpolicy-new", type=int, default=256, help="greedy tokens per continuation")
    ap.add_argument("--onpolicy-frac", type=float, default=0.3, help="fraction of draft steps on them")
    # evaluation
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=None, help="default: all held-out windows")
    ap.add_argument("--acceptance-prompts", type=int, default=100)
    ap.add_argument("--k", type=int, default=4)
    return ap.parse_args(argv)


def build_corpus(vocab_size: int) -> tuple[dict, object, torch.Tensor, torch.Tensor]:
    """Corpus + tokenizer. Returns (stats, tokenizer, train stream [N] int64, held-out stream [M] int64)."""
    train_files = list_source_files("train")
    heldout_files = list_source_files("heldout")
    share = heldout_share(train_files, heldout_files)
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files "
          f"({share:.2%} of source bytes held out: {', '.join(HELDOUT_MODULES)})", flush=True)
    t0 = time.time()
    tok = train_bpe((f.text for f in tqdm(train_files, desc="bpe corpus", mininterval=5.0)), vocab_size)
    texts = [f.text for f in train_files + heldout_files]
    checked = assert_roundtrip(tok, tqdm(texts, desc="round-trip check", mininterval=5.0))
    train_ids = [i for doc in encode_documents(tok, tqdm([f.text for f in train_files], desc="encode train",
                                                              mininterval=5.0)) for i in doc]
    heldout_ids = [i for doc in encode_documents(tok, [f.text for f in heldout_files]) for i in doc]
    stats = {
        "python_version": platform.python_version(),
        "stdlib_path": sysconfig.get_paths()["stdlib"],
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_bytes": sum(len(f.text.encode()) for f in train_files),
        "heldout_bytes": sum(len(f.text.encode()) for f in heldout_files),
        "heldout_share_bytes": share,
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "roundtrip_checked_files": checked,
        "tokenizer_seconds": time.time() - t0,
    }
    print(json.dumps(stats, indent=2), flush=True)
    return stats, tok, torch.tensor(train_ids, dtype=torch.long), torch.tensor(heldout_ids, dtype=torch.long)


def evaluate(out: Path, target_dir: Path, draft_dir: Path, heldout: torch.Tensor, counts: torch.Tensor,
             seq_len: int, max_windows: int | None) -> dict:
    """Held-out NLL/perplexity of both SAVED checkpoints (bf16 weights, fp32 math) + unigram + routing."""
    windows = tiny_eval.cut_windows(heldout, seq_len, max_windows)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    res = {
        "eval_windows": windows.shape[0],
        "eval_seq_len": seq_len,
        "scored_tokens": windows.shape[0] * (seq_len - 1),
        "target_nll": tiny_eval.model_nll(target, windows, desc="target ppl"),
        "draft_nll": tiny_eval.model_nll(draft, windows, desc="draft ppl"),
        "unigram_nll": tiny_eval.unigram_nll(counts, windows),
    }
    for name in ("target", "draft", "unigram"):
        res[f"{name}_ppl"] = tiny_eval.ppl(res[f"{name}_nll"])
    shares = tiny_eval.routing_shares(target, windows)
    res["routing_shares"] = shares.tolist()
    res["routing_share_min"] = shares.min().item()
    res["routing_share_max"] = shares.max().item()
    return res


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = out / "stdlib-moe-target", out / "stdlib-draft"
    metrics: dict = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    corpus, tok, train_stream, heldout_stream = build_corpus(args.vocab_size)
    metrics["corpus"] = corpus
    counts = torch.bincount(train_stream, minlength=args.vocab_size)
    (out / "train_unigram_counts.json").write_text(json.dumps(counts.tolist()) + "\n")

    # --- target -----------------------------------------------------------------------------
    tsize = TargetSize(hidden=args.target_hidden, intermediate=args.target_intermediate,
                       layers=args.target_layers, aux_loss_coef=args.aux_loss_coef)
    torch.manual_seed(args.seed)
    target = build_target(tsize, args.vocab_size)
    phases: list[Phase] = parse_phases(args.phases, args.target_steps)
    warmup = max(1, min(100, args.target_steps // 10))
    step_fn = target_step_fn(target, args.balance_coef, args.balance_tau)
    metrics["target_train"] = run_phases(target, step_fn, train_stream, phases, args.target_tokens_per_step,
                                         args.target_lr, warmup, args.seed, "target")
    save_checkpoint(target, tok, target_dir)
    print("target:", metrics["target_train"], flush=True)

    # --- draft: distilled from the SAVED target (the bf16 weights acceptance is measured against) --
    teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    dsize = DraftSize(hidden=args.draft_hidden, intermediate=args.draft_intermediate, layers=args.draft_layers)
    torch.manual_seed(args.seed + 1)
    draft = build_draft(dsize, args.vocab_size)
    dphases = parse_phases(args.draft_phases, args.draft_steps)
    dwarmup = max(1, min(50, args.draft_steps // 10))
    t0 = time.time()
    onpolicy = None
    if args.onpolicy_seqs > 0:
        with torch_threads(1):
            onpolicy = greedy_continuations(teacher, train_stream, args.onpolicy_seqs, args.onpolicy_prompt,
                                            args.onpolicy_new, 32, args.seed + 2)
    metrics["onpolicy_seconds"] = time.time() - t0
    step_fn = distill_step_fn(draft, teacher, args.distill_alpha, args.distill_temperature)
    metrics["draft_train"] = run_phases(draft, step_fn, train_stream, dphases, args.draft_tokens_per_step,
                                        args.draft_lr, dwarmup, args.seed + 1, "draft", onpolicy,
                                        args.onpolicy_frac)
    save_checkpoint(draft, tok, draft_dir)
    print("draft:", metrics["draft_train"], flush=True)

    tp, dp = count_params(target), count_params(draft)
    metrics["params"] = {"target": tp, "draft": dp, "draft_over_target_active": dp["active"] / tp["active"]}
    print("params:", metrics["params"], flush=True)
    metrics["train_seconds"] = time.time() - t_start

    # --- evaluation ---------------------------------------------------------------------------
    metrics["heldout"] = evaluate(out, target_dir, draft_dir, heldout_stream, counts, args.eval_seq_len,
                                  args.eval_windows)
    h = metrics["heldout"]
    print(f"held-out ppl: target {h['target_ppl']:.3f} draft {h['draft_ppl']:.3f} unigram "
          f"{h['unigram_ppl']:.1f}; routing share min {h['routing_share_min']:.4f}", flush=True)

    rows = make_prompts.build_rows(tok, 400, args.seed, 16, 700)
    args.prompts_out.parent.mkdir(parents=True, exist_ok=True)
    args.prompts_out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tgt, drf = measure_acceptance.load_pair(target_dir, draft_dir)
    with torch_threads(1):
        metrics["acceptance"] = measure_acceptance.measure(
            tgt, drf, target_dir / "tokenizer.json", rows[: args.acceptance_prompts], args.k, check_lossless=5)
    print("acceptance:", metrics["acceptance"], flush=True)

    metrics["total_seconds"] = time.time() - t_start
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"done in {metrics['total_seconds'] / 60:.1f} min; metrics in {out / 'metrics.json'}", flush=True)


if __name__ == "__main__":
    main()
