"""Request latency and throughput with tracing off, on (live collector) and on (collector down).

    python benchmarks/tracing_overhead.py --num-requests 48 --concurrency 4

One invocation runs the three phases back to back on the embedded app (restarted between phases,
since tracing is configured per process at start-up): the same prompts, greedy, EOS ignored.
Prints median and p99 end-to-end latency, output tokens/s, and the ratios to "off" (goal: <= 1.10).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, load_prompts, machine, print_table, save_json  # noqa: E402
from benchmarks.serving.server_process import free_port  # noqa: E402


async def _load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem, latencies, tokens = asyncio.Semaphore(concurrency), [], 0

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[one(client, p) for p in prompts[:concurrency]])  # warm-up
        latencies.clear()
        tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*[one(client, p) for p in prompts])
        elapsed = time.perf_counter() - t0
    return {"median_s": float(np.median(latencies)), "p99_s": float(np.percentile(latencies, 99)),
            "tok_per_s": tokens / elapsed}


def _warm_until_live(url: str, model: str, prompts: list[str], args) -> None:
    """Steady state in every phase: warm-up batches until the server's compiled graphs are live."""
    from ray import serve

    import serve_app
    from benchmarks.serve_vs_engine import _graphs_live

    handle = serve.get_deployment_handle("verifier", app_name=serve_app.APP_NAME)
    for _ in range(20):
        asyncio.run(_load(url, model, prompts[: args.concurrency], args.concurrency, args.max_tokens))
        if asyncio.run(_graphs_live(handle, k=1)):  # its requests draft (the server default k)
            return


def run_phase(name: str, endpoint: str | None, args, prompts: list[str]) -> dict:
    import serve_app
    from actors.config import HttpConfig
    from engine.yaml_config import load_yaml
    from observability import TracingConfig

    config = load_yaml(args.config, serve_app.ServeConfig)
    config.http = HttpConfig(port=free_port())
    config.tracing = TracingConfig(endpoint=endpoint) if endpoint else None
    url = serve_app.start(config, base=ROOT)
    try:
        _warm_until_live(url, config.model_name, prompts, args)
        result = asyncio.run(_load(url, config.model_name, prompts, args.concurrency, args.max_tokens))
    finally:
        serve_app.stop()
    return {"tracing": name, **result}


def main() -> None:
    from observability.otlp_receiver import OtlpReceiver

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/embedded.yaml"))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--save-result")
    args = parser.parse_args()
    prompts = [r["prompt"] for r in load_prompts(args.num_requests)]
    receiver = OtlpReceiver().start()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rows = [run_phase("off", None, args, prompts),
            run_phase("on (live receiver)", receiver.endpoint, args, prompts),
            run_phase("on (collector down)", dead, args, prompts)]
    receiver.stop()
    base = rows[0]
    for r in rows:
        r["median_ratio"] = r["median_s"] / base["median_s"]
        r["p99_ratio"] = r["p99_s"] / base["p99_s"]
        r["tok_per_s_ratio"] = r["tok_per_s"] / base["tok_per_s"]
    print_table(rows, list(rows[0]))
    print(f"spans received by the live receiver: {len(receiver.spans)}")
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows,
                                 "spans_received": len(receiver.spans)})


if __name__ == "__main__":
    main()
