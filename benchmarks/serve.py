"""Serving benchmark: streaming load against an OpenAI-compatible server, with a report.

Single run (fixed concurrency, or Poisson arrivals with --request-rate):

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 4 --num-requests 200
    python benchmarks/serve.py --request-rate 2 --concurrency 16 --seed 1 --save-result out.json

Sweep over concurrencies and server configurations, with ratios against a baseline:

    python benchmarks/serve.py --sweep --concurrency-list 1,2,4,8,16 --config-file configs/sweep.yaml \
        --configs speculation_off,draft_k4 --baseline speculation_off --plot plots/

Production prompt mix, bursty arrivals, goodput against SLOs (per class), and goodput vs offered
load for several configurations:

    python benchmarks/serve.py --dataset benchmarks/data/production_mix.jsonl --request-rate 4 \
        --class-burstiness completion:0.1 --goodput ttft:500 tpot:50 --slo-file slo.yaml
    python benchmarks/serve.py --sweep --request-rate-list 1,2,4,8 --dataset ... --goodput ttft:500 \
        --config-file configs/sweep.yaml --configs speculation_off,draft_k4 --plot plots/

See docs/BENCHMARKS.md for the metric definitions and the configuration file format.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # allow `python benchmarks/serve.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving.client import RequestOptions  # noqa: E402
from benchmarks.serving.dataset import DEFAULT_DATASET, load_prompts, sample_prompts  # noqa: E402
from benchmarks.serving.goodput import SloConfig, load_slo_file, parse_goodput_args  # noqa: E402
from benchmarks.serving.host import host_facts  # noqa: E402
from benchmarks.serving.loadgen import LoadShape  # noqa: E402
from benchmarks.serving.report import (  # noqa: E402
    format_goodput_sweep,
    format_ratios,
    format_run,
    format_sweep,
    run_to_dict,
    sweep_to_dict,
)
from benchmarks.serving.runner import BenchmarkRun, run_benchmark  # noqa: E402
from benchmarks.serving.sweep import (  # noqa: E402
    ServerConfig,
    acceptance_by_config,
    baseline_ratios,
    load_server_configs,
    run_sweep,
    sweep_shapes,
)


def parse_int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]."""
    return [int(part) for part in text.split(",") if part.strip()]


def parse_float_list(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]."""
    return [float(part) for part in text.split(",") if part.strip()]


def parse_class_floats(text: str) -> dict[str, float]:
    """'completion:0.1,chat:1' -> {'completion': 0.1, 'chat': 1.0}."""
    out = {}
    for part in filter(str.strip, text.split(",")):
        name, sep, value = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected CLASS:VALUE, got {part!r}")
        out[name.strip()] = float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--model", default=None, help="request 'model' field (default: first of /v1/models)")
    data = p.add_argument_group("requests")
    data.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="JSONL prompts")
    data.add_argument("--num-requests", type=int, default=100, help="measured requests per run")
    data.add_argument("--warmup-requests", type=int, default=2, help="uncounted requests before each run")
    data.add_argument("--max-tokens", type=int, default=None, help="override every prompt's max_tokens")
    data.add_argument("--seed", type=int, default=0, help="prompt order and Poisson arrivals")
    data.add_argument("--temperature", type=float, default=0.0)
    data.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true")
    data.add_argument(
        "--no-slo-class", action="store_true", help="do not send the rows' slo_class field in the body"
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight (default 1; with --request-rate: a cap, default none)",
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="open loop: Gamma (Poisson) arrivals, requests/s"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape of the gaps: 1 Poisson, < 1 burstier"
    )
    load.add_argument(
        "--class-burstiness",
        type=parse_class_floats,
        default={},
        help="CLASS:SHAPE,...: an arrival process per class (others use --burstiness)",
    )
    load.add_argument("--time-limit-s", type=float, default=600.0, help="no new requests after this")
    load.add_argument("--request-timeout-s", type=float, default=300.0, help="per request, whole stream")
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--sweep", action="store_true", help="run every config x --concurrency-list")
    sweep.add_argument("--concurrency-list", type=parse_int_list, default=[1, 2, 4, 8, 16])
    sweep.add_argument(
        "--request-rate-list",
        type=parse_float_list,
        default=None,
        help="sweep offered load (req/s) instead of concurrency; --concurrency stays a cap",
    )
    sweep.add_argument("--config-file", type=Path, default=None, help="YAML/JSON server configurations")
    sweep.add_argument(
        "--configs", default=None, help="comma-separated names from --config-file (default all)"
    )
    sweep.add_argument("--baseline", default="speculation_off", help="configuration the ratios divide by")
    sweep.add_argument(
        "--server-log-dir",
        type=Path,
        default=None,
        help="stdout/stderr of start_cmd servers, <name>.log (default: a new temporary directory)",
    )
    slo = p.add_argument_group("goodput")
    slo.add_argument(
        "--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    slo.add_argument("--slo-file", type=Path, default=None, help="per-class SLOs {class: {ttft_ms, tpot_ms}}")
    out = p.add_argument_group("output")
    out.add_argument("--save-result", type=Path, default=None, help="write the JSON result here")
    out.add_argument("--plot", type=Path, default=None, help="write PNG figures into this directory")
    out.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _shape(args: argparse.Namespace) -> LoadShape:
    """The load shape of a single run (and the template of a sweep's load points)."""
    open_loop = args.request_rate or args.request_rate_list
    return LoadShape(
        concurrency=args.concurrency if args.concurrency or open_loop else 1,
        request_rate_per_s=args.request_rate or (args.request_rate_list or [None])[0],
        seed=args.seed,
        time_limit_s=args.time_limit_s,
        burstiness=args.burstiness,
        class_burstiness=args.class_burstiness,
    )


async def _single(args: argparse.Namespace, options: RequestOptions, prompts, warmup) -> list[BenchmarkRun]:
    run = await run_benchmark(
        args.base_url,
        prompts,
        options,
        _shape(args),
        warmup,
        show_progress=not args.no_progress,
        slos=args.slos,
    )
    print(format_run(run))
    return [run]


def _sweep_configs(args: argparse.Namespace) -> list[ServerConfig]:
    if args.config_file is None:
        if args.configs:  # names without a file to find them in would silently mean --base-url
            raise ValueError("--configs names configurations of a --config-file; none was given")
        return [ServerConfig(name="default", base_url=args.base_url)]
    names = [n.strip() for n in args.configs.split(",")] if args.configs else None
    return load_server_configs(args.config_file, names)


async def _sweep(
    args: argparse.Namespace, configs: list[ServerConfig], options: RequestOptions, prompts, warmup
):
    async def run_one(base_url: str, config: ServerConfig, shape: LoadShape) -> BenchmarkRun:
        run_options = dataclasses.replace(options, model=config.model or options.model)
        run = await run_benchmark(
            base_url,
            prompts,
            run_options,
            shape,
            warmup,
            label=config.name,
            show_progress=not args.no_progress,
            slos=args.slos,
        )
        print(format_run(run), flush=True)
        return run

    shapes = sweep_shapes(_shape(args), args.concurrency_list, args.request_rate_list)
    return await run_sweep(configs, shapes, run_one, args.server_log_dir)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when nothing completed or a sweep configuration failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Bad inputs fail here, before any request is sent or server started.
    try:
        rows = load_prompts(args.dataset, args.max_tokens)
        configs = _sweep_configs(args) if args.sweep else []
        if min(args.num_requests, args.warmup_requests) < 0 or min(args.concurrency_list or [0]) < 1:
            raise ValueError("request counts must be >= 0 and concurrencies >= 1")
        if min(args.request_rate_list or [1.0]) <= 0:
            raise ValueError("request rates must be > 0")
        per_class = load_slo_file(args.slo_file) if args.slo_file else {}
        args.slos = SloConfig(parse_goodput_args(args.goodput), per_class)
        _shape(args)  # burstiness checks
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a config entry of the wrong shape
        parser.error(str(exc))
    sampled = sample_prompts(rows, args.warmup_requests + args.num_requests, args.seed)
    warmup, prompts = sampled[: args.warmup_requests], sampled[args.warmup_requests :]
    options = RequestOptions(
        endpoint=args.endpoint,
        model=args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout_s,
        send_slo_class=not args.no_slo_class,
    )
    if args.sweep:
        runs, failures = asyncio.run(_sweep(args, configs, options, prompts, warmup))
        ratios = baseline_ratios(runs, args.baseline)
        acceptance = acceptance_by_config(runs)
        print(format_sweep(runs, failures))
        print(format_ratios(ratios, args.baseline))
        if goodput_table := format_goodput_sweep(runs):
            print(goodput_table)
        result = sweep_to_dict(runs, failures, ratios, acceptance, args.baseline)
    else:
        runs, failures = asyncio.run(_single(args, options, prompts, warmup)), []
        result = run_to_dict(runs[0])
    if args.save_result:
        result["machine"] = host_facts()  # the load average over the run's last minutes too
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=2))
    if args.plot:
        _write_plots(args.plot, runs, args.sweep)
    return 1 if failures or not any(r.metrics.completed for r in runs) else 0


def _write_plots(out_dir: Path, runs: list[BenchmarkRun], sweep: bool) -> None:
    from benchmarks.serving import plots  # matplotlib only when asked for

    written = [plots.plot_latency_cdfs(runs, out_dir)]
    if sweep:
        written += [
            plots.plot_throughput(runs, out_dir),
            plots.plot_p99_latency(runs, out_dir),
            plots.plot_acceptance(acceptance_by_config(runs), out_dir),
            plots.plot_goodput(runs, out_dir),
        ]
    print("plots:", ", ".join(str(p) for p in written if p is not None))


if __name__ == "__main__":
    sys.exit(main())
