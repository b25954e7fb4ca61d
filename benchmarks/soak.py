"""Soak run: the embedded server under steady mixed load, checked for leaks and lost responses.

    python benchmarks/soak.py                          # 20 minutes at concurrency 8
    python benchmarks/soak.py --duration-s 60 --save-result benchmarks/results/soak_short.json

Starts ``serve_app.py --config configs/embedded.yaml`` (what ``make serve`` runs, on its own local
Ray; ``RAY_ADDRESS`` is removed from its environment) and keeps ``--concurrency`` clients busy for
``--duration-s`` with a mix of greedy completions, streams the client abandons mid-way and bad
requests (``benchmarks/serving/soak_requests.py``). Meanwhile it samples the RSS of every process of
the app and the object store's use (``benchmarks/serving/process_sampler.py``; the object store as
the raylet reports it to the node's metrics endpoint, not by asking the raylet: a
``ray memory``-style query grows the raylet it measures, docs/BENCHMARKS.md "Soak").

Verdict (exit status 0 only if all hold):

* memory flat: after the warm-up (the first ``--warmup-fraction`` of the run), for every process
  alive through the whole post-warm-up window, max RSS / min RSS <= 1 + ``--flat-tolerance``
  (last/first is reported too). The object store holds the objects in flight at the moment of a
  sample (actor-call payloads come and go), so it is judged on its low-water level instead: the
  minimum over the window's last quarter / the minimum over its first quarter <= 1 +
  ``--flat-tolerance``, values under 1 MiB counted as 1 MiB; a leaked object raises that floor.
* nothing lost or corrupted: every good request ended in a 200 with text and finish reason equal
  to the in-process greedy reference for its prompt (``engine.LLM``, computed before the server
  starts); every bad request got a 4xx in OpenAI's error shape; every cancel closed mid-stream.
* cancels freed their resources: at the end, ``/metrics`` shows no running or waiting request and
  the KV cache usage it showed before the first request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # allow `python benchmarks/soak.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import TARGET, load_prompts, print_table, save_json  # noqa: E402
from benchmarks.serving.process_sampler import MemorySampler  # noqa: E402
from benchmarks.serving.server_process import embedded_config, engine_gauge, free_port, serve_process  # noqa: E402
from benchmarks.serving.soak_requests import KINDS, Outcome, SoakTarget  # noqa: E402

MIB = 1 << 20
STORE_FLOOR_BYTES = MIB
SETTLE_TIMEOUT_S = 60.0  # after the load: time for aborts to land and gauges to settle


def parse_mix(text: str) -> dict[str, float]:
    """'good:0.6,cancel:0.2,bad:0.2' -> weights per request kind."""
    mix = {}
    for part in filter(str.strip, text.split(",")):
        kind, _, weight = part.partition(":")
        if kind.strip() not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown request kind {kind!r}; known: {', '.join(KINDS)}")
        mix[kind.strip()] = float(weight)
    return mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1200.0, help="load duration (default 20 minutes)")
    p.add_argument("--concurrency", type=int, default=8, help="clients, each one request at a time")
    p.add_argument("--mix", type=parse_mix, default=parse_mix("good:0.6,cancel:0.2,bad:0.2"),
                   help="KIND:WEIGHT,... of good, cancel, bad")
    p.add_argument("--num-prompts", type=int, default=16, help="distinct prompts (held-out set)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the good requests")
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="first part of the run not judged")
    p.add_argument("--flat-tolerance", type=float, default=0.10, help="allowed max/min - 1 after warm-up")
    p.add_argument("--sample-interval-s", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="per request; past it: lost")
    p.add_argument("--transport", choices=["compiled_graph", "actor_calls"], default=None,
                   help="override experts.transport of the embedded config (compiled_graph there)")
    p.add_argument("--port", type=int, default=0, help="HTTP port of the server (default: a free one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", type=Path, default=Path("benchmarks/results/soak.json"))
    return p


def references(prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
    """(text, finish_reason) of each prompt's greedy completion, in-process, no speculation."""
    from engine import LLM, SamplingParams

    llm = LLM(TARGET, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


async def run_load(target: SoakTarget, args: argparse.Namespace) -> list[Outcome]:
    """``--concurrency`` clients sending requests drawn from ``--mix`` until ``--duration-s``."""
    kinds, weights = list(args.mix), list(args.mix.values())
    end = time.monotonic() + args.duration_s
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=args.concurrency + 2)

    async def client_loop(client: httpx.AsyncClient, rng: random.Random) -> None:
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome = await asyncio.wait_for(KINDS[kind](client, target, rng), args.request_timeout_s)
            except TimeoutError:
                outcome = Outcome(kind, "timeout", False, f"lost: no answer within {args.request_timeout_s:g} s")
            outcomes.append(outcome)

    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        await asyncio.gather(*[client_loop(client, random.Random(args.seed * 1000 + i))
                               for i in range(args.concurrency)])
    return outcomes


def _gauges(url: str) -> dict[str, float]:
    return {name: engine_gauge(url, name)
            for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}


def settle(url: str, initial_kv: float) -> dict[str, float]:
    """The engine gauges once nothing runs or waits and the KV usage is back (or at the timeout)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        g = _gauges(url)
        done = g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0
        if done and g["kv_cache_usage_perc"] == initial_kv or time.monotonic() > deadline:
            return g
        time.sleep(0.5)


def _sample_until(sampler: MemorySampler, stop: threading.Event, interval_s: float) -> None:
    while True:
        sampler.sample()
        if stop.wait(interval_s):
            return


def flatness(values: list[float], tolerance: float, floor: float = 0.0, rule: str = "max_over_min") -> dict:
    """first/last/min/max of a series (values below ``floor`` count as ``floor``), max/min,
    last/first and the low-water ratio (min of the last quarter over min of the first quarter),
    and whether the ``rule`` ratio is <= 1 + ``tolerance``."""
    v = [max(x, floor) for x in values]
    quarter = max(1, len(v) // 4)
    ratios = {"max_over_min": max(v) / min(v) if min(v) > 0 else float("inf"),
              "last_over_first": v[-1] / v[0] if v[0] > 0 else float("inf"),
              "low_water": min(v[-quarter:]) / min(v[:quarter]) if min(v[:quarter]) > 0 else float("inf")}
    return {"first": values[0], "last": values[-1], "min": min(values), "max": max(values), **ratios,
            "rule": rule, "flat": ratios[rule] <= 1 + tolerance}


def memory_report(sampler: MemorySampler, warmup_s: float, tolerance: float) -> dict:
    """Per-process RSS and object-store flatness over the samples taken after ``warmup_s``."""
    post = [s for s in sampler.samples if s.t_s >= warmup_s]
    keys = sorted({k for s in sampler.samples for k in s.rss_bytes})
    persistent = [k for k in keys if all(k in s.rss_bytes for s in post)]
    processes = {k: flatness([s.rss_bytes[k] for s in post], tolerance) for k in persistent}
    transient = {k: sum(k in s.rss_bytes for s in sampler.samples) for k in keys if k not in persistent}
    store = [s.object_store for s in post if s.object_store is not None]
    return {
        "num_samples": len(sampler.samples), "num_post_warmup_samples": len(post), "warmup_s": warmup_s,
        "processes": processes,
        "transient_processes": transient,  # not alive through the whole window: samples seen in
        "object_store_bytes": flatness([s["bytes_used"] for s in store], tolerance, STORE_FLOOR_BYTES, "low_water")
        if store else None,
        "object_store_objects": [s["num_objects"] for s in store],
        "object_store_bytes_spilled_last": store[-1]["bytes_spilled"] if store else None,
        "load_avg_1m_mean": sum(s.load_avg_1m for s in sampler.samples) / max(1, len(sampler.samples)),
        "series": [{"t_s": round(s.t_s, 1), "rss_bytes": s.rss_bytes, "object_store": s.object_store,
                    "load_avg_1m": s.load_avg_1m} for s in sampler.samples],
    }


def request_report(outcomes: list[Outcome]) -> dict:
    problems = [o.problem for o in outcomes if not o.ok]
    return {
        "total": len(outcomes),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "by_detail": dict(Counter(f"{o.kind}:{o.detail.split()[0]}" for o in outcomes)),
        "bad_statuses": dict(Counter(f"{o.detail}:{o.status}" for o in outcomes if o.kind == "bad")),
        "lost": sum(p.startswith("lost") for p in problems if p),
        "corrupted": sum(p.startswith("corrupted") for p in problems if p),
        "failed": len(problems),
        "problems": problems[:50],
    }


def print_report(result: dict) -> None:
    mem = result["memory"]
    rows = [{"process": k, "first_MiB": v["first"] / MIB, "last_MiB": v["last"] / MIB, "min_MiB": v["min"] / MIB,
             "max_MiB": v["max"] / MIB, "max/min": v["max_over_min"], "last/first": v["last_over_first"],
             "low-water": v["low_water"], "flat": v["flat"]} for k, v in mem["processes"].items()]
    store = mem["object_store_bytes"]
    if store:
        rows.append({"process": "object store (bytes used)", "first_MiB": store["first"] / MIB,
                     "last_MiB": store["last"] / MIB, "min_MiB": store["min"] / MIB, "max_MiB": store["max"] / MIB,
                     "max/min": store["max_over_min"], "last/first": store["last_over_first"],
                     "low-water": store["low_water"], "flat": store["flat"]})
    print(f"memory after warm-up ({mem['num_post_warmup_samples']} of {mem['num_samples']} samples, "
          f"from t = {mem['warmup_s']:.0f} s):")
    print_table(rows, ["process", "first_MiB", "last_MiB", "min_MiB", "max_MiB", "max/min", "last/first", "low-water",
                       "flat"])
    if mem["transient_processes"]:
        print("processes not alive through the window (samples seen):", mem["transient_processes"])
    req = result["requests"]
    print(f"requests: {req['total']} {req['by_detail']}; lost {req['lost']}, corrupted {req['corrupted']}, "
          f"failed {req['failed']}")
    print(f"bad requests (sub-kind:status): {req['bad_statuses']}")
    print(f"engine gauges before {result['gauges_before']}, after {result['gauges_after']}")
    print(f"load average (1 min) mean {mem['load_avg_1m_mean']:.2f}; checks {result['checks']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = [row["prompt"] for row in load_prompts(args.num_prompts)]
    refs = references(prompts, args.max_tokens)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the embedded server's own Ray
    config = embedded_config(args.port or free_port())
    config["experts"]["transport"] = args.transport or config["experts"]["transport"]
    with tempfile.TemporaryDirectory() as tmp, serve_process(config, Path(tmp) / "serve.yaml", env=env,
                                                             stop_with_sigterm=True) as (proc, url, _):
        max_model_len = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        target = SoakTarget(url, config["model_name"], max_model_len, prompts, refs, args.max_tokens)
        before = _gauges(url)
        sampler, stop = MemorySampler(proc.pid), threading.Event()
        thread = threading.Thread(target=_sample_until, args=(sampler, stop, args.sample_interval_s), daemon=True)
        thread.start()
        outcomes = asyncio.run(run_load(target, args))
        after = settle(url, before["kv_cache_usage_perc"])
        stop.set()
        thread.join()
    memory = memory_report(sampler, args.warmup_fraction * args.duration_s, args.flat_tolerance)
    requests = request_report(outcomes)
    store = memory["object_store_bytes"]
    checks = {
        "rss_flat": bool(memory["processes"]) and all(v["flat"] for v in memory["processes"].values()),
        "object_store_flat": bool(store and store["flat"]),
        "nothing_lost_or_corrupted": requests["failed"] == 0,
        "cancelled_freed": after["num_requests_running"] == after["num_requests_waiting"] == 0
        and after["kv_cache_usage_perc"] == before["kv_cache_usage_perc"],
    }
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "checks": checks, "passed": all(checks.values()), "requests": requests, "memory": memory,
              "gauges_before": before, "gauges_after": after, "load_avg_end": os.getloadavg()}
    print_report(result)
    save_json(str(args.save_result), result)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
