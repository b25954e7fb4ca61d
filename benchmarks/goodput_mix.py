"""Production-mix goodput in-process: FCFS vs SLO-aware scheduling, speculation adaptive vs off.

    python benchmarks/goodput_mix.py --calibrate                      # unloaded TTFT/TPOT per class
    python benchmarks/goodput_mix.py --rates 1,2,3 --num-requests 120 --repeats 2 \
        --slo-file configs/slo_goodput.yaml --plot docs/img --save-result benchmarks/results/goodput_mix.json

The engine runs in this process (the engine and scheduler the Ray verifier wraps; no HTTP, so the
2-core machine's noise is the engine's alone). Requests of ``benchmarks/data/production_mix.jsonl``
arrive at the load generator's Gamma arrival times (``loadgen.class_arrival_offsets_s``: the
``completion`` class bursty, the others Poisson) and are added to the engine between steps, as
the verifier does; chat rows are rendered with the server's chat template. Every output is exactly
``max_tokens`` long (``ignore_eos``). A request's timestamps are taken when the step that emitted
its tokens returns; TTFT counts from its scheduled arrival. Goodput and per-class attainment are
``benchmarks.serving.goodput``'s (vLLM bench semantics) over every request *sent*: a refused
request (503, deadline refusal) is a miss.

Variants (one engine each, built once; at every rate the variants run one after another, in a
rotated order per repeat, so the machine's load affects them alike):
- ``fcfs``: today's scheduler before issue 15: FCFS, whole-prompt prefill, no budgets.
- ``slo-aware``: chunked prefill, ``scheduling_policy: slo`` with the SLO file's budgets as the
  engine's classes, deadline refusal on.
- ``... spec-off``: the same with no drafting (k = 0); the others use adaptive speculation, k <= 6.

``--capacity`` first measures each variant's saturated throughput on each repeat's prompts (all
requests at once, none refused): the offered rate at which the mix keeps the engine busy all the
time. Each run's line then shows its load, offered rate / that variant's median capacity.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DRAFT, ROOT, TARGET, machine, save_json  # noqa: E402
from benchmarks.serving.acceptance import SpecDecodeCounters, acceptance_metrics  # noqa: E402
from benchmarks.serving.client import RequestOptions, RequestResult  # noqa: E402
from benchmarks.serving.dataset import Prompt, load_prompts, sample_prompts  # noqa: E402
from benchmarks.serving.goodput import SloConfig, compute_goodput, load_slo_file  # noqa: E402
from benchmarks.serving.loadgen import LoadShape, class_arrival_offsets_s  # noqa: E402
from benchmarks.serving.metrics import compute_metrics  # noqa: E402
from benchmarks.serving.plots import plot_goodput, plot_slo_attainment  # noqa: E402
from benchmarks.serving.report import format_goodput_sweep, run_to_dict  # noqa: E402
from benchmarks.serving.runner import BenchmarkRun, gc_frozen  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine import engine as engine_module  # noqa: E402
from engine import slo as slo_module  # noqa: E402
from engine.chat_template import ChatTemplate  # noqa: E402
from engine.errors import QueueFull  # noqa: E402
from engine.slo import SLOClass  # noqa: E402

MIX = ROOT / "benchmarks/data/production_mix.jsonl"


class CpuClock:
    """``--clock cpu``: this thread's CPU time, plus the idle time skipped while no request is in
    the engine (``sleep``). The machine is shared (load averages of 10-50 on 2 cores), so wall
    time measures the neighbours; with one torch thread the engine computes on this thread, and
    its CPU time is the wall time it would take on a core of its own."""

    def __init__(self) -> None:
        self._skipped_s = 0.0

    def monotonic(self) -> float:
        return time.thread_time() + self._skipped_s

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self._skipped_s += max(0.0, seconds)


def use_clock(clock) -> None:
    """Make the engine read ``clock`` (``monotonic``/``perf_counter``): its request timestamps,
    step timings (the cost model) and deadlines all run on the benchmark's clock."""
    engine_module.time = slo_module.time = clock


@dataclass(frozen=True)
class Variant:
    name: str
    slo_aware: bool
    speculate: bool


VARIANTS = {v.name: v for v in (
    Variant("fcfs", False, True), Variant("slo-aware", True, True),
    Variant("fcfs spec-off", False, False), Variant("slo-aware spec-off", True, False))}


@dataclass
class Job:
    """One request of a run: its row, token ids, params and arrival offset (s)."""

    prompt: Prompt
    ids: list[int]
    params: SamplingParams
    offset_s: float


def build_llm(variant: Variant, args, slo_classes: dict[str, SLOClass]) -> LLM:
    """An engine for ``variant``; the SLO-aware one gets the SLO file's budgets as its classes."""
    llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=args.k if variant.speculate else 0,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=variant.slo_aware)
    if variant.slo_aware:
        sched = llm.engine.scheduler
        sched.config = msgspec.structs.replace(
            sched.config, scheduling_policy="slo", slo_classes=slo_classes,
            default_slo_class=next(iter(slo_classes)), refuse_unattainable_ttft=not args.no_refusal)
    return llm


def engine_slo_classes(slos: SloConfig) -> dict[str, SLOClass]:
    """The SLO file's per-class budgets as engine SLO classes (e2el is the client's alone)."""
    return {name: SLOClass(ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms) for name, s in slos.per_class.items()}


def make_jobs(llm: LLM, prompts: list[Prompt], offsets_s: list[float], send_class: bool) -> list[Job]:
    """Token ids as the server would make them (chat rows through the chat template); the row's
    class goes to the engine only when it has SLO classes (``send_class``)."""
    template, tok = ChatTemplate(None), llm.tokenizer
    jobs = []
    for p, off in zip(prompts, offsets_s):
        text = template.render([{"role": "user", "content": p.prompt}]) if p.endpoint == "chat" else p.prompt
        params = SamplingParams(temperature=p.temperature or 0.0, seed=p.seed, max_tokens=p.max_tokens,
                                ignore_eos=True, slo_class=p.slo_class if send_class else None)
        jobs.append(Job(p, tok.encode(text).ids, params, off))
    return sorted(jobs, key=lambda j: j.offset_s)


def drive(llm: LLM, jobs: list[Job], tag: str) -> tuple[list[RequestResult], float]:
    """Run ``jobs`` at their arrival offsets on the engine's clock; (one result per job, duration s)."""
    engine, clock = llm.engine, engine_module.time  # the clock use_clock installed (or time)
    results: dict[str, RequestResult] = {}
    live: dict[str, float] = {}  # request id -> arrival (monotonic s)
    start = clock.monotonic()
    pending = list(jobs)
    while pending or live:
        now = clock.monotonic()
        while pending and start + pending[0].offset_s <= now:
            job = pending.pop(0)
            rid = f"{tag}-{job.prompt.id}-{len(results)}"
            res = results[rid] = RequestResult(job.prompt.id, start_s=job.offset_s, slo_class=job.prompt.slo_class,
                                               prompt_tokens=len(job.ids))
            try:
                engine.add_request(rid, job.ids, job.params, arrival_time_s=start + job.offset_s)
                live[rid] = start + job.offset_s
            except QueueFull as e:  # deadline refusal: the server's 503
                res.error = f"HTTP 503: {e}"
        if not live:
            if pending:
                clock.sleep(max(0.0, start + pending[0].offset_s - clock.monotonic()))
            continue
        outputs = engine.step()
        now = clock.monotonic()
        for out in outputs:
            res, arrival = results[out.request_id], live[out.request_id]
            if out.outputs[0].new_token_ids:
                res.chunk_offsets_s.append(now - arrival)
            if out.finished:
                del live[out.request_id]
                res.e2e_s, res.output_tokens = now - arrival, len(out.outputs[0].token_ids)
                res.success = out.outputs[0].finish_reason in ("length", "stop")
    return list(results.values()), clock.monotonic() - start


def engine_counters(llm: LLM) -> SpecDecodeCounters:
    s = llm.engine.stats
    return SpecDecodeCounters(drafts=None, draft_tokens=float(s.num_draft_tokens),
                              accepted_tokens=float(s.num_accepted_tokens))


def measure(llm: LLM, variant: Variant, jobs: list[Job], rate: float, slos: SloConfig) -> BenchmarkRun:
    before = engine_counters(llm)
    with gc_frozen():
        results, duration_s = drive(llm, jobs, f"{variant.name}@{rate}")
    after = engine_counters(llm)
    deltas = SpecDecodeCounters(draft_tokens=after.draft_tokens - before.draft_tokens,
                                accepted_tokens=after.accepted_tokens - before.accepted_tokens)
    return BenchmarkRun(label=variant.name, base_url="in-process", shape=LoadShape(None, rate),
                        options=RequestOptions(ignore_eos=True), results=results,
                        metrics=compute_metrics(results, duration_s), counter_deltas=deltas,
                        acceptance=acceptance_metrics(deltas), not_sent=0, warmup_failed=0,
                        goodput=compute_goodput(results, duration_s, slos))


def calibrate(llm: LLM, prompts: list[Prompt]) -> None:
    """Unloaded latencies: one request at a time, p50/p90 TTFT and TPOT per class."""
    jobs = make_jobs(llm, prompts, [0.0] * len(prompts), bool(llm.engine.scheduler.config.slo_classes))
    by_class: dict[str, list[RequestResult]] = {}
    for job in jobs:
        res, _ = drive(llm, [job], "cal")
        by_class.setdefault(job.prompt.slo_class or "default", []).extend(res)
    for name, rs in by_class.items():
        g = compute_goodput(rs, 1.0, SloConfig()).classes[0]
        print(f"{name:<13} n={len(rs):>3}  TTFT p50 {g.ttft.median_s * 1e3:7.1f} p90 {g.ttft.p90_s * 1e3:7.1f} ms  "
              f"TPOT p50 {g.tpot.median_s * 1e3:6.1f} p90 {g.tpot.p90_s * 1e3:6.1f} ms")


def capacity(llm: LLM, variant: Variant, prompts: list[Prompt]) -> dict[str, float]:
    """The engine's saturated throughput on ``prompts``: every request arrives at once and none is
    refused, so the engine runs full batches until the last finishes. Requests, output tokens and
    prompt tokens per second of the clock: the load (req/s) at which this mix keeps the engine
    busy all the time, i.e. the rate where the utilisation is 1."""
    sched = llm.engine.scheduler
    config = sched.config
    sched.config = msgspec.structs.replace(config, refuse_unattainable_ttft=False)
    try:
        jobs = make_jobs(llm, prompts, [0.0] * len(prompts), variant.slo_aware)
        results, duration_s = drive(llm, jobs, f"{variant.name}@capacity")
    finally:
        sched.config = config
    if not all(r.success for r in results):
        raise RuntimeError(f"{variant.name}: a saturated request failed")
    return {"req_per_s": len(results) / duration_s,
            "output_tok_per_s": sum(r.output_tokens for r in results) / duration_s,
            "prompt_tok_per_s": sum(len(j.ids) for j in jobs) / duration_s}


def report(runs: list[BenchmarkRun], plot_dir: Path | None) -> None:
    """The goodput table (interleaved runs sorted by rate, then variant) and the figures."""
    runs = sorted(runs, key=lambda r: (r.shape.request_rate_per_s, list(VARIANTS).index(r.label)))
    print(format_goodput_sweep(runs))
    if plot_dir:
        written = [p for p in (plot_goodput(runs, plot_dir), plot_slo_attainment(runs, plot_dir)) if p is not None]
        if written:
            print("wrote", *written)
        else:  # both figures are curves over offered load
            print("no figures: they need runs at two or more rates")


def ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,3", help="offered loads (req/s), comma-separated")
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=1, help="runs per (rate, variant), each with its own seed")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--slo-file", type=Path, default=ROOT / "configs/slo_goodput.yaml")
    ap.add_argument("--class-burstiness", default="completion:0.1")
    ap.add_argument("--k", type=int, default=6, help="draft length cap of the speculating variants")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--no-refusal", action="store_true", help="SLO-aware variants do not refuse")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the engine thread's CPU time (needs --threads 1); wall: wall-clock time")
    ap.add_argument("--calibrate", action="store_true", help="only measure unloaded latencies per class")
    ap.add_argument("--capacity", action="store_true",
                    help="first measure each variant's saturated throughput on each repeat's prompts (every "
                         "request at once): the rate where utilisation is 1, to set the offered rates against")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--runs-out", type=Path, help="pickle the runs here (to plot runs of several processes together)")
    ap.add_argument("--plot-runs", type=Path, nargs="+", help="only plot and tabulate these pickled runs")
    ap.add_argument("--save-result")
    args = ap.parse_args()
    if args.plot_runs:
        report([run for path in args.plot_runs for run in pickle.loads(path.read_bytes())], args.plot)
        return
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu needs --threads 1 (other threads' CPU time is not this thread's)")
        use_clock(CpuClock())
    rows = load_prompts(MIX)
    warm, measured = rows[:6], rows[12:]
    slos = SloConfig(per_class=load_slo_file(args.slo_file))
    variants = [VARIANTS[n] for n in args.variants.split(",")]
    llms = {v.name: build_llm(v, args, engine_slo_classes(slos)) for v in variants}
    for v in variants:  # warm-up: kernels, and the cost model the controller learns online
        llm = llms[v.name]
        drive(llm, make_jobs(llm, warm, [0.1 * i for i in range(len(warm))], v.slo_aware), "warm")
    if args.calibrate:
        calibrate(llms[variants[0].name], measured[:30])
        return
    burst = dict((c, float(s)) for c, s in (x.split(":") for x in args.class_burstiness.split(",") if x))
    capacities: dict[str, list[float]] = {}
    for rep in range(args.repeats if args.capacity else 0):
        prompts = sample_prompts(measured, args.num_requests, args.seed + rep)
        for v in variants:
            cap = capacity(llms[v.name], v, prompts)
            capacities.setdefault(v.name, []).append(cap["req_per_s"])
            print(f"capacity rep {rep} {v.name:<20} {cap['req_per_s']:.2f} req/s  "
                  f"{cap['output_tok_per_s']:.0f} output tok/s  {cap['prompt_tok_per_s']:.0f} prompt tok/s", flush=True)
    runs: list[BenchmarkRun] = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for rep in range(args.repeats):
            seed = args.seed + rep
            prompts = sample_prompts(measured, args.num_requests, seed)
            offsets = class_arrival_offsets_s([p.slo_class for p in prompts], rate, seed, 1.0, burst)
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                run = measure(llms[v.name], v, make_jobs(llms[v.name], prompts, offsets, v.slo_aware), rate, slos)
                runs.append(run)
                if args.runs_out:  # after every run: a sweep cut short keeps what it measured
                    args.runs_out.write_bytes(pickle.dumps(runs))
                g = run.goodput
                cap = capacities.get(v.name)  # offered load over this variant's capacity (utilisation)
                load = f"load {rate / statistics.median(cap):.2f}  " if cap else ""
                print(f"rate {rate:g} rep {rep} {v.name:<20} {load}attainment {g.slo_attainment:.3f} "
                      f"goodput {g.goodput_req_per_s:.2f} req/s  failed {run.metrics.failed}  "
                      + "  ".join(f"{c.name} {c.slo_attainment:.2f} (TTFT p50 {ms(c.ttft.median_s)} p99 "
                                  f"{ms(c.ttft.p99_s)}, TPOT p50 {ms(c.tpot.median_s)} p99 {ms(c.tpot.p99_s)})"
                                  for c in g.classes), flush=True)
    report(runs, args.plot)
    save_json(args.save_result, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                 "capacity_req_per_s": capacities,
                                 "slos": json.loads(args.slo_file.read_text()) if args.slo_file.suffix == ".json"
                                 else str(args.slo_file), "runs": [run_to_dict(r, False) for r in runs]})


if __name__ == "__main__":
    main()
