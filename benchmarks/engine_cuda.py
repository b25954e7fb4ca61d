"""The engine on CUDA with Mixtral-8x7B-shaped random weights, against transformers ``generate``.

    python benchmarks/engine_cuda.py [--layers 2] [--batches 1,8,32] [--save-result runs/engine_cuda.json]

Writes a random bf16 checkpoint with Mixtral-8x7B's layer shapes (hidden 4096, 32 query and 8 KV
heads of 128, 8 experts of intermediate 14336, top-2, vocab 32000) but ``--layers`` layers (2:
~6.2 GB), then measures greedy decoding of ``--max-tokens`` tokens after ``--prompt-tokens`` random
prompt tokens: specmoe's ``--configs`` (plain decoding, the n-gram drafter at k = 4, plain under
``compile=True``; output tok/s, TPOT and TTFT in ms) and transformers ``generate`` on the same
checkpoint, same dtype, same device, in one run. Also the decode step's time per torch op
(``torch.profiler``, batch 8) and whether specmoe's greedy tokens are transformers' (bf16 on random
weights makes near-ties: the share within 0.05 of transformers' top logit is the check).

Without CUDA the script prints a message and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, print_table, save_json, sync  # noqa: E402

DEVICE = "cuda"  # a module constant so the functions can be smoke-run elsewhere
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)


def write_checkpoint(out: Path, layers: int, seed: int = 0, device: str = "cuda") -> None:
    """A random bf16 Mixtral-shaped checkpoint in the Hugging Face layout (w1 gate, w3 up, w2 down)."""
    from safetensors.torch import save_file

    h, inter, heads, kv, hd, experts, vocab = (MIXTRAL[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_local_experts", "vocab_size"))
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, h, std=1.0), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
                    p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
                    p + "block_sparse_moe.gate.weight": rand(experts, h, std=0.5)}
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(inter, h), q + "w3.weight": rand(inter, h), q + "w2.weight": rand(h, inter)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": layers,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu",
              "tie_word_embeddings": False, "dtype": "bfloat16", "eos_token_id": None, "bos_token_id": None,
              "sliding_window": None, **MIXTRAL}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, MIXTRAL["vocab_size"], (batch, length), generator=gen).tolist()


CONFIGS = {"plain": {}, "ngram k=4": dict(speculative_method="ngram", num_speculative_tokens=4,
                                          speculative_policy="fixed"), "plain compiled": dict(compile=True)}


def bench_specmoe(path: str, name: str, dtype: str, batches: list[int], prompt_tokens: int,
                  max_tokens: int) -> tuple[list[dict], dict]:
    from engine import LLM, SamplingParams

    rows, tokens = [], {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(path, dtype=dtype, device=DEVICE, skip_tokenizer_init=True, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * prompt_tokens, **CONFIGS[name])
    for batch in batches:
        prompts = _prompts(batch, prompt_tokens, seed=batch)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        sync(DEVICE)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(DEVICE)
        seconds = time.perf_counter() - start
        ttft_s = _ttft_s(llm, prompts)
        tokens[batch] = [o.outputs[0].token_ids for o in outs]
        rows.append({"system": f"specmoe {name}", "batch": batch, "tok_per_s": batch * max_tokens / seconds,
                     "tpot_ms": (seconds - ttft_s) / (max_tokens - 1) * 1e3, "ttft_ms": ttft_s * 1e3})
        print_table(rows[-1:], list(rows[-1]))
    if name == "plain":
        _profile_step(llm, _prompts(8, prompt_tokens, seed=8), params)
    return rows, tokens


def _ttft_s(llm, prompts: list[list[int]]) -> float:
    """Seconds of a one-token generate: the prefill (the step a request's first token comes from)."""
    from engine import SamplingParams

    sync(DEVICE)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    sync(DEVICE)
    return time.perf_counter() - start


def _profile_step(llm, prompts: list[list[int]], params) -> None:
    """Print the top torch ops of 8 decoded tokens at batch 8 by host (self CPU) and device time."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
        sync(DEVICE)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=15))
    print(table.table(sort_by="self_cuda_time_total", row_limit=12))


def bench_transformers(path: str, dtype: str, batches: list[int], prompt_tokens: int, max_tokens: int,
                       ours: dict) -> tuple[list[dict], dict, dict]:
    """transformers ``generate`` as it comes, and with the SDPA backends specmoe's forwards use
    (cuDNN's left out, :func:`engine.model.layers.attention_backends`), which is the fair baseline."""
    import transformers

    from engine.model.layers import attention_backends

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(DEVICE).eval()
    with attention_backends(DEVICE):
        forced = teacher_forced(model, prompt_tokens, ours, tol=0.05)
    rows, tokens = [], {}
    for name, backends in (("transformers", contextlib.nullcontext()),
                           ("transformers no-cudnn-sdpa", attention_backends(DEVICE))):
        with backends:
            more, tokens = _generate(model, name, batches, prompt_tokens, max_tokens)
        rows += more
    return rows, tokens, forced


def _generate(model, name: str, batches: list[int], prompt_tokens: int, max_tokens: int) -> tuple[list[dict], dict]:
    rows, tokens = [], {}
    for batch in batches:
        ids = torch.tensor(_prompts(batch, prompt_tokens, seed=batch), device=DEVICE)
        kwargs = dict(do_sample=False, min_new_tokens=max_tokens, max_new_tokens=max_tokens, pad_token_id=0)
        with torch.inference_mode():
            model.generate(input_ids=ids, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
            sync(DEVICE)
            start = time.perf_counter()
            out = model.generate(input_ids=ids, **kwargs)
            sync(DEVICE)
        seconds = time.perf_counter() - start
        tokens[batch] = out[:, prompt_tokens:].tolist()
        rows.append({"system": name, "batch": batch, "tok_per_s": batch * max_tokens / seconds})
        print_table(rows[-1:], list(rows[-1]))
    return rows, tokens


def agreement(ours: dict, theirs: dict) -> dict[int, float]:
    """Mean length of the common greedy prefix, as a share of the output, per batch."""
    out = {}
    for batch in ours.keys() & theirs.keys():
        shares = []
        for a, b in zip(ours[batch], theirs[batch]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shares.append(n / len(a))
        out[batch] = sum(shares) / len(shares)
    return out


def teacher_forced(model, prompt_tokens: int, ours: dict, tol: float) -> dict[int, tuple[float, float]]:
    """Per batch: the share of specmoe's greedy tokens that are transformers' argmax when it is fed
    specmoe's own sequence, and the share within ``tol`` of its top logit (a near-tie that bf16
    rounding may break either way). Unlike the common prefix, one tie does not end the comparison."""
    out = {}
    for batch, seqs in ours.items():
        ids = torch.tensor([_prompts(batch, prompt_tokens, seed=batch)[i] + s for i, s in enumerate(seqs)],
                           device=DEVICE)
        with torch.inference_mode():
            logits = model(input_ids=ids[:, :-1]).logits[:, prompt_tokens - 1:].float()
        chosen = logits.gather(-1, ids[:, prompt_tokens:, None]).squeeze(-1)
        top = logits.max(-1).values
        out[batch] = ((chosen == top).float().mean().item(), (chosen >= top - tol).float().mean().item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--configs", default="plain,ngram k=4", help=f"specmoe runs, from {list(CONFIGS)}")
    parser.add_argument("--dtype", default="bfloat16", help="both systems' weights and activations")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--checkpoint-dir", help="write the checkpoint here and keep it (default: a temporary one)")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.checkpoint_dir or scratch
        start = time.perf_counter()
        write_checkpoint(Path(tmp), args.layers)
        print(f"checkpoint written in {time.perf_counter() - start:.1f} s")
        rows, ours, theirs, forced = [], {}, {}, {}
        for name in args.configs.split(","):
            more, tokens = bench_specmoe(tmp, name, args.dtype, batches, args.prompt_tokens, args.max_tokens)
            rows += more
            if ours:  # lossless: speculation or compilation gives plain decoding's greedy tokens
                print(f"{name}: greedy tokens equal to {args.configs.split(',')[0]}'s per batch:",
                      {b: sum(x == y for x, y in zip(tokens[b], ours[b])) / b for b in batches})
            ours = ours or tokens
            torch.cuda.empty_cache()
        if not args.skip_transformers:
            more, theirs, forced = bench_transformers(tmp, args.dtype, batches, args.prompt_tokens, args.max_tokens, ours)
            rows += more
    print_table(rows, ["system", "batch", "tok_per_s", "tpot_ms", "ttft_ms"])
    tps = {(r["system"], r["batch"]): r["tok_per_s"] for r in rows}
    for (system, batch), value in tps.items():
        for baseline in ("transformers", "transformers no-cudnn-sdpa"):
            if system.startswith("specmoe") and (baseline, batch) in tps:
                print(f"batch {batch}: {system} / {baseline} generate = {value / tps[baseline, batch]:.2f}x")
    same = agreement(ours, theirs)
    print("greedy common prefix (share of output) per batch:", {b: round(s, 3) for b, s in sorted(same.items())})
    print("specmoe's greedy tokens, transformers fed specmoe's sequence: (share its argmax, share within 0.05 "
          "of its top logit) per batch:", {b: tuple(round(x, 3) for x in v) for b, v in sorted(forced.items())})
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows, "agreement": same,
                                 "teacher_forced": forced})


if __name__ == "__main__":
    main()
