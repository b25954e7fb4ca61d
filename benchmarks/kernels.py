"""GPU benchmark: each Triton kernel against its torch reference on real MoE layer shapes.

Usage (from the repository root, on a CUDA machine)::

    .venv/bin/python benchmarks/kernels.py           # full table, < 5 minutes on one H200
    .venv/bin/python benchmarks/kernels.py --quick   # one decode and one prefill shape per op

Shapes: Mixtral-8x7B (hidden 4096, intermediate 14336, 8 experts, top-2) and Qwen3-30B-A3B (hidden
2048, moe_intermediate 768, 128 experts, top-8) with random bf16 weights of those shapes, at decode
(1-64 tokens) and prefill (2048-8192 tokens) sizes; rejection sampling at batch 64, k = 4, vocab
32000 (Mixtral) and 151936 (Qwen3).

Timing: CUDA events around each call, median over many calls after warm-up (which also compiles
the kernels). Rates are the Triton kernel's, against this device's measured peaks: a large
device-to-device copy (bytes read + written per second) and a large bf16 ``torch.matmul``. Bytes
are the minimum traffic (each input read once, each output written once), so GB/s is a lower
bound. Every case also checks the Triton result against the reference (``check`` column).

Without CUDA the script prints a message and exits with status 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# Run as a script, sys.path[0] is benchmarks/, where this very file would shadow the `kernels`
# package; put the repository root there instead.
_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _ROOT / "benchmarks":
    sys.path[0] = str(_ROOT)

import torch  # noqa: E402

DEVICE = "cuda"  # a module constant so the benchmark functions can be smoke-run elsewhere


class Layer(NamedTuple):
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    renormalize: bool
    vocab: int
    local_experts: tuple[int, ...]  # local expert counts to benchmark the FFN with


MIXTRAL = Layer("Mixtral-8x7B", 4096, 14336, 8, 2, True, 32000, (2, 8))
QWEN3 = Layer("Qwen3-30B-A3B", 2048, 768, 128, 8, True, 151936, (8, 16))
DECODE_TOKENS = (1, 16, 64)
PREFILL_TOKENS = (2048, 8192)


class Row(NamedTuple):
    op: str
    model: str
    shape: str
    ref_ms: float
    tri_ms: float
    gbytes: float  # minimum bytes moved, in GB
    tflop: float  # useful floating-point work, in TFLOP
    check: str


def time_ms(fn: Callable[[], object], budget_s: float, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream, from CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = int(min(200, max(5, budget_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def copy_bandwidth(budget_s: float, size: int = 1 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written (1 GiB buffers,
    far beyond L2)."""
    src = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * size / time_ms(lambda: dst.copy_(src), budget_s) / 1e6


def matmul_rate(budget_s: float, n: int = 8192) -> float:
    """bf16 ``torch.matmul`` rate in TFLOP/s on (n x n) @ (n x n)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    return 2 * n**3 / time_ms(lambda: torch.matmul(a, b), budget_s) / 1e9


def bench_routing(layer: Layer, tokens: int, budget_s: float) -> Row:
    from kernels.routing import topk_routing_reference
    from kernels.routing_triton import topk_routing_triton

    logits = torch.randn(tokens, layer.experts, dtype=torch.bfloat16, device=DEVICE)
    args = (logits, layer.top_k, layer.renormalize)
    got, want = topk_routing_triton(*args), topk_routing_reference(*args)
    same = torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.sorted_slots, want.sorted_slots)
    close = torch.allclose(got.topk_weights, want.topk_weights, atol=1e-5, rtol=1e-5)
    assignments = tokens * layer.top_k
    moved = logits.numel() * 2 + assignments * (4 + 8 + 8) + layer.experts * 8
    return Row(
        "routing", layer.name, f"T={tokens} E={layer.experts} k={layer.top_k}",
        time_ms(lambda: topk_routing_reference(*args), budget_s),
        time_ms(lambda: topk_routing_triton(*args), budget_s),
        moved / 1e9, 0.0, "ok" if same and close else f"MISMATCH ids={same} weights={close}",
    )  # fmt: skip


def bench_ffn(layer: Layer, tokens: int, local: int, budget_s: float) -> Row:
    from kernels.expert_ffn import expert_ffn_reference
    from kernels.expert_ffn_triton import expert_ffn_triton

    gen = torch.Generator(device=DEVICE).manual_seed(tokens + local)
    h, inter = layer.hidden, layer.intermediate
    # Rows this process sees: its share of the token x top-k assignments, spread at random.
    rows = max(1, round(tokens * layer.top_k * local / layer.experts))
    owner = torch.randint(0, local, (rows,), device=DEVICE, generator=gen)
    counts = torch.bincount(owner, minlength=local).to(torch.int64)

    def weights(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, generator=gen) * shape[-1] ** -0.5

    x = torch.randn(rows, h, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    w_gate, w_up, w_down = weights(local, inter, h), weights(local, inter, h), weights(local, h, inter)
    rw = torch.rand(rows, device=DEVICE, generator=gen)
    args = (x, counts, w_gate, w_up, w_down, rw)
    got, want = expert_ffn_triton(*args), expert_ffn_reference(*args)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
    active = int((counts > 0).sum())
    moved = 3 * active * inter * h * 2 + rows * (2 * h * 2 + 2 * inter * 2 + 4)
    return Row(
        "expert_ffn", layer.name, f"T={tokens} rows={rows} local={local}",
        time_ms(lambda: expert_ffn_reference(*args), budget_s),
        time_ms(lambda: expert_ffn_triton(*args), budget_s),
        moved / 1e9, 6 * rows * h * inter / 1e12, "ok" if err < 2e-2 else f"MISMATCH rel={err:.1e}",
    )  # fmt: skip


def bench_rejection(layer: Layer, budget_s: float, batch: int = 64, k: int = 4) -> Row:
    from kernels.rejection import rejection_sample_reference
    from kernels.rejection_triton import rejection_sample_triton

    gen = torch.Generator(device=DEVICE).manual_seed(layer.vocab)
    v = layer.vocab
    target = torch.softmax(torch.randn(batch, k + 1, v, device=DEVICE, generator=gen) * 3, dim=-1)
    draft = torch.softmax(torch.randn(batch, k, v, device=DEVICE, generator=gen) * 3, dim=-1)
    # Drafts mostly agree with the target argmax, so both accepted runs and rejections occur.
    ids = torch.where(torch.rand(batch, k, device=DEVICE, generator=gen) < 0.7, target[:, :k].argmax(-1),
                      torch.randint(0, v, (batch, k), device=DEVICE, generator=gen))  # fmt: skip
    n = torch.full((batch,), k, dtype=torch.int64, device=DEVICE)
    greedy = torch.arange(batch, device=DEVICE) % 2 == 0  # half greedy, half sampling
    args = (ids, n, draft, target,
            torch.rand(batch, k, device=DEVICE, generator=gen),
            torch.rand(batch, k + 1, device=DEVICE, generator=gen), greedy)  # fmt: skip
    got, want = rejection_sample_triton(*args), rejection_sample_reference(*args)
    same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    moved = (target.numel() + draft.numel()) * 4
    return Row(
        "rejection", layer.name, f"B={batch} k={k} V={v}",
        time_ms(lambda: rejection_sample_reference(*args), budget_s),
        time_ms(lambda: rejection_sample_triton(*args), budget_s),
        moved / 1e9, 0.0, "ok" if same else "MISMATCH",
    )  # fmt: skip


def print_table(rows: list[Row], copy_gbs: float, mm_tflops: float) -> None:
    head = ("op", "model", "shape", "ref ms", "triton ms", "speedup", "GB/s (% copy)", "TFLOP/s (% mm)", "check")
    lines = []
    for r in rows:
        gbs = r.gbytes / (r.tri_ms / 1e3)
        tfs = r.tflop / (r.tri_ms / 1e3)
        lines.append((
            r.op, r.model, r.shape, f"{r.ref_ms:.3f}", f"{r.tri_ms:.3f}", f"{r.ref_ms / r.tri_ms:.2f}x",
            f"{gbs:.0f} ({100 * gbs / copy_gbs:.0f}%)",
            f"{tfs:.1f} ({100 * tfs / mm_tflops:.0f}%)" if r.tflop else "-", r.check,
        ))  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    for line in (head, *lines):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one decode and one prefill shape per op")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed calls per case")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device (torch.cuda.is_available() is False); nothing to do.")
        return 0
    budget = opts.budget if opts.budget is not None else (0.1 if opts.quick else 0.25)
    decode = (16,) if opts.quick else DECODE_TOKENS
    prefill = (2048,) if opts.quick else PREFILL_TOKENS
    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbs, mm_tflops = copy_bandwidth(budget), matmul_rate(budget)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write), "
          f"bf16 matmul {mm_tflops:.0f} TFLOP/s")  # fmt: skip
    rows: list[Row] = []
    for layer in (MIXTRAL, QWEN3):
        for tokens in decode + prefill:
            rows.append(bench_routing(layer, tokens, budget))
        for local in layer.local_experts[-1:] if opts.quick else layer.local_experts:
            for tokens in decode + prefill:
                rows.append(bench_ffn(layer, tokens, local, budget))
                torch.cuda.empty_cache()
        rows.append(bench_rejection(layer, budget))
    print_table(rows, copy_gbs, mm_tflops)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
