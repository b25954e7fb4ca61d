"""Train an EAGLE-3 head for the bundled target on the stdlib training split (CPU, seeded).

Per step: random windows of the training token stream (the same split and tokenizer as
``train_tiny.py``), the target run through specmoe's own engine model (:meth:`Transformer.
forward_with_features`, so the features are exactly what serving hands the head), and the head's
TTT loss against the target's distribution (:mod:`scripts.eagle3_training`). The draft vocabulary
is the ``--draft-vocab`` most frequent training tokens (``checkpoints/train_unigram_counts.json``),
EOS always included. The embedding is the target's and is not saved.

On-policy data (``--onpolicy-seqs``, self-distillation as in the EAGLE papers and as the bundled
draft model was trained): the target's greedy continuations of random training-split prompts
(``--seq-len`` − ``--onpolicy-new`` corpus tokens + ``--onpolicy-new`` greedy tokens per row). A
step takes a batch of those rows with probability ``--onpolicy-frac``. Speculation drafts only over
target-generated text, whose statistics (repetition loops; every token the target's argmax) differ
from the corpus, and the head's TTT input tokens are then the very tokens an accepted draft has.

Usage: python scripts/train_eagle3.py --seed 0 [--steps 300] [--out checkpoints/stdlib-eagle3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # allow `python scripts/train_eagle3.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.errors import ConfigError  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model import ForwardBatch  # noqa: E402
from engine.model.eagle3 import check_feature_layers  # noqa: E402
from scripts.eagle3_training import TrainableEagle3  # noqa: E402
from scripts.stdlib_corpus import list_source_files  # noqa: E402
from scripts.tiny_models import EOS_ID  # noqa: E402
from scripts.tiny_tokenizer import encode_documents  # noqa: E402
from scripts.tiny_training import greedy_continuations, make_optimizer, sample_windows, warmup_cosine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=Path, default=REPO / "checkpoints/stdlib-moe-target")
    ap.add_argument("--out", type=Path, default=REPO / "checkpoints/stdlib-eagle3")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per training step")
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layer-ids", default="1,2,4", help="target layers whose input the head reads (4: the last output)")
    ap.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of TTT step j: decay^(j-1)")
    ap.add_argument("--onpolicy-seqs", type=int, default=0, help="target greedy continuations to train on (0: none)")
    ap.add_argument("--onpolicy-new", type=int, default=96, help="greedy tokens per continuation")
    ap.add_argument("--onpolicy-frac", type=float, default=0.5, help="fraction of steps on continuations")
    ap.add_argument("--onpolicy-file", type=Path, default=None,
                    help="cache of the continuations: loaded if it exists (same shape), else written")
    ap.add_argument("--init", type=Path, default=None, help="start from this head checkpoint (same shapes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no spin-waiting on a loaded machine)")
    return ap.parse_args(argv)


def draft_vocabulary(size: int) -> torch.Tensor:
    """Ascending target ids of the ``size`` most frequent training tokens (EOS included)."""
    counts = torch.tensor(json.loads((REPO / "checkpoints/train_unigram_counts.json").read_text()), dtype=torch.float64)
    counts[EOS_ID] = float("inf")
    # Stable sort on (-count, id): ties go to the lower id, so the choice is deterministic.
    order = sorted(range(counts.numel()), key=lambda i: (-counts[i].item(), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def train_stream(tokenizer: Tokenizer) -> torch.Tensor:
    docs = encode_documents(tokenizer, (f.text for f in tqdm(list_source_files("train"), desc="encode", mininterval=5)))
    return torch.tensor([i for doc in docs for i in doc], dtype=torch.int64)


def onpolicy_rows(args: argparse.Namespace, stream: torch.Tensor) -> torch.Tensor | None:
    """``(onpolicy_seqs, seq_len)`` target-greedy continuations of training prompts, or None."""
    if args.onpolicy_seqs <= 0:
        return None
    shape = (args.onpolicy_seqs, args.seq_len)
    if args.onpolicy_file is not None and args.onpolicy_file.exists():
        rows = torch.load(args.onpolicy_file)
        if tuple(rows.shape) != shape:
            raise ValueError(f"{args.onpolicy_file}: shape {tuple(rows.shape)}, expected {shape}")
        return rows
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)  # fp32 upcast, as served
    prompt = args.seq_len - args.onpolicy_new
    rows = greedy_continuations(hf, stream, args.onpolicy_seqs, prompt, args.onpolicy_new, 64, args.seed + 2)
    if args.onpolicy_file is not None:
        torch.save(rows, args.onpolicy_file)
    return rows


def target_pass(target, kv, windows: torch.Tensor, layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits ``(B, T, V)`` and features ``(B, T, 3H)`` of ``windows`` ``(B, T)``."""
    B, T = windows.shape
    batch = ForwardBatch.build(list(range(B)), windows.tolist(), [0] * B, "all")
    logits, feats = target.model.forward_with_features(batch, kv, layer_ids)
    return logits.view(B, T, -1), feats.view(B, T, -1)


def head_config(args: argparse.Namespace, target_cfg, layer_ids: tuple[int, ...]) -> dict:
    """``config.json`` in the published EAGLE-3 layout (vLLM ``LlamaForCausalLMEagle3``)."""
    c = target_cfg
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": args.intermediate, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": args.draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    layer_ids = tuple(int(i) for i in args.layer_ids.split(","))
    target = load_model(args.target, "float32")
    c = target.config
    try:  # the head's loader would refuse them later; a bad id failed the first target pass
        check_feature_layers(layer_ids, c.num_layers, "--layer-ids")
    except ConfigError as e:
        raise SystemExit(str(e)) from e
    stream = train_stream(target.tokenizer)
    draft_ids = draft_vocabulary(args.draft_vocab)
    head = TrainableEagle3(c.hidden_size, args.intermediate, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                           c.rope_theta, target.model.embed, draft_ids)
    with torch.no_grad():  # warm start: the target's own output head and final norm
        head.lm_head.weight.copy_(target.model.lm_head[draft_ids])
        head.norm.copy_(target.model.norm)
    if args.init is not None:
        head.load_checkpoint_tensors(load_file(str(args.init / "model.safetensors")))
    t_gen = time.time()
    extra = onpolicy_rows(args, stream)
    gen_seconds = time.time() - t_gen
    opt = make_optimizer(head, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, args.steps, args.warmup))
    kv = target.model.new_kv_cache(args.batch, args.seq_len)
    gen = torch.Generator().manual_seed(args.seed)
    t0, tail = time.time(), []
    bar = tqdm(range(args.steps), desc="eagle3", mininterval=5.0, unit="step")
    for step in bar:
        if extra is not None and torch.rand((), generator=gen).item() < args.onpolicy_frac:
            windows = extra[torch.randint(0, extra.shape[0], (args.batch,), generator=gen)]
        else:
            windows = sample_windows(stream, args.batch, args.seq_len - 1, gen)  # (B, seq_len)
        logits, feats = target_pass(target, kv, windows, layer_ids)
        loss, acc = head.ttt_loss(windows, feats.clone(), logits.clone(), args.ttt_steps, args.ttt_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step >= int(args.steps * 0.9):
            tail.append([float(loss.detach())] + acc)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", **{f"acc{j + 1}": f"{a:.2f}" for j, a in enumerate(acc)}, refresh=False)
    seconds = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(head.checkpoint_tensors(), str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(head_config(args, c, layer_ids), indent=2) + "\n")
    means = [sum(col) / len(col) for col in zip(*tail)]
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "train_tokens_in_split": stream.numel(),
              "tokens_seen": args.steps * args.batch * args.seq_len, "onpolicy_seconds": gen_seconds,
              "train_seconds": seconds,
              "params": sum(p.numel() for p in head.parameters()), "tail_loss": means[0],
              "tail_top1_agreement_per_step": means[1:]}
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
