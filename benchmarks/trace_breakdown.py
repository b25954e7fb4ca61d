"""Where a step's time goes, read from the traces: mean span durations per step phase.

    python benchmarks/trace_breakdown.py --num-requests 16 --concurrency 4

Starts the embedded app exporting to an in-process OTLP receiver, sends greedy requests, and
aggregates the received spans: per engine step, the draft proposal, the target forward (and
within it the MoE layer dispatches and expert calls), and verification, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, load_prompts, machine, print_table, save_json  # noqa: E402
from benchmarks.tracing_overhead import _load, _warm_until_live  # noqa: E402

NAMES = ["specmoe.engine.step", "specmoe.draft.propose", "specmoe.draft.forward", "specmoe.target.forward",
         "specmoe.moe.dispatch", "specmoe.expert.call", "specmoe.expert.compute", "specmoe.verify"]


def main() -> None:
    import serve_app
    from actors.config import HttpConfig, ServeConfig
    from engine.yaml_config import load_yaml
    from observability import TracingConfig
    from observability.otlp_receiver import OtlpReceiver

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/embedded.yaml"))
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--save-result")
    args = parser.parse_args()
    receiver = OtlpReceiver().start()
    config = load_yaml(args.config, ServeConfig)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config.http = HttpConfig(port=s.getsockname()[1])
    config.tracing = TracingConfig(endpoint=receiver.endpoint, schedule_delay_ms=100)
    url = serve_app.start(config, base=ROOT)
    try:
        prompts = [r["prompt"] for r in load_prompts(args.num_requests)]
        # Steady state only: steps over actor calls while the graphs build are not what this
        # breakdown is about, so the warm-up's spans are dropped once they have arrived.
        _warm_until_live(url, config.model_name, prompts, args)
        time.sleep(1.0)
        receiver.spans.clear()
        asyncio.run(_load(url, config.model_name, prompts, args.concurrency, args.max_tokens))
        time.sleep(3)  # let the batch processors export
    finally:
        serve_app.stop()
        receiver.stop()
    durations = defaultdict(list)
    for span in receiver.spans:
        durations[span.name].append((span.end_time_ns - span.start_time_ns) / 1e6)
    steps = max(1, len(durations["specmoe.engine.step"]))
    rows = [{"span": n, "count": len(durations[n]), "per_step": len(durations[n]) / steps,
             "mean_ms": statistics.fmean(durations[n]), "median_ms": statistics.median(durations[n]),
             "ms_per_step": sum(durations[n]) / steps} for n in NAMES if durations[n]]
    print_table(rows, list(rows[0]))
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
