"""Output tokens/s through HTTP (Ray Serve + actors) vs the in-process engine, same prompts.

    python benchmarks/serve_vs_engine.py --num-prompts 24 --max-tokens 64

Starts the embedded app (configs/embedded.yaml, on a free port) and, in the same run, the
in-process engine on the same checkpoints with the same engine settings: speculation and, by
default, the server's scheduler (chunked prefill, SLO classes, token budget; ``max_num_seqs`` =
the concurrency); ``--in-process-scheduler default`` gives the in-process side the engine's
defaults instead, as runs before 2026-12-01 (late) did. Greedy, EOS ignored, so both emit the
same tokens.
Concurrency 1 and 8; speculation on (k from the config) and off (per-request k = 0). The ratio
HTTP / in-process is the cost of the distributed path; a third run drives the serving unit (expert
and draft actors over the configured transport) from this process without Serve or HTTP
(``unit_tok_per_s``), which splits that cost into hops and Serve/ingress. Before timing, warm-up requests run until
the server's compiled graphs are live (they build in the background, ~2 s, after an idle
teardown). At concurrency 1 the HTTP run streams, giving TPOT p50 (``(e2e - TTFT) / (n - 1)`` per
request) against the in-process engine's time per output token. ``--compare-two-batch-overlap``
adds the serving unit with ``experts.two_batch_overlap`` flipped (``unit_tbo_gain``: on / off).
Each timed run also records the CPU time of every process (``cpu_ms_per_token``: CPU ms per output
token by process, :mod:`benchmarks.serving.cpu_account`; this process is the client, the Ray
driver and the in-process engine), against the machine's capacity (wall x cores): where the
distributed path's extra CPU goes, pollers included, which traces do not show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import msgspec
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, Timer, load_prompts, machine, print_table, save_json  # noqa: E402
from benchmarks.serving.cpu_account import CpuAccount  # noqa: E402

PATHS = ("http", "unit", "engine")


async def http_run(url: str, model: str, prompts: list[str], concurrency: int, k: int, max_tokens: int,
                   handle=None, stream: bool = False) -> dict:
    """Output tokens/s over ``prompts`` at ``concurrency``; with ``stream``, also TPOT p50 in ms."""
    sem = asyncio.Semaphore(concurrency)
    tokens, tpots = 0, []

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        nonlocal tokens
        async with sem:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "num_speculative_tokens": k}
            if not stream:
                r = await client.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
                return
            body.update(stream=True, stream_options={"include_usage": True})
            first, n = None, 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["text"] and first is None:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            tokens += n
            if first is not None and n > 1:
                tpots.append((time.perf_counter() - first) / (n - 1) * 1e3)

    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(20):  # warm-up until the compiled graphs are live (or 20 rounds)
            await asyncio.gather(*[one(client, p) for p in prompts[:concurrency]])
            if handle is None or await _graphs_live(handle, k):
                break
        tokens, tpots = 0, []
        with CpuAccount() as cpu, Timer() as t:
            await asyncio.gather(*[one(client, p) for p in prompts])
    out = {"tokens": tokens, "seconds": t.elapsed_s, "tok_per_s": tokens / t.elapsed_s,
           "cpu": cpu.per_token_ms(tokens)}
    if tpots:
        out["tpot_p50_ms"] = statistics.median(tpots)
    return out


async def _graphs_live(handle, k: int) -> bool:
    """The server's expert graph is live, and its draft graph too when requests draft (k > 0: a
    plain-decoding run never builds it, so waiting for it would only burn warm-up rounds)."""
    stats = await handle.stats.remote()
    if stats["transport"]["kind"] != "compiled_graph":
        return True
    return stats["transport"]["graph_live"] and (not k or stats["draft_transport"].get("live", True))


def _scheduler(config, concurrency: int, which: str):
    """The in-process side's scheduler: the server's (``engine.scheduler``: chunked prefill, SLO
    classes, token budget) with ``concurrency`` sequences at most, so both sides batch alike and
    the ratio is the distributed path's cost; or ``default``, the engine's defaults (no SLO
    classes, a 16384-token budget), as earlier runs of this benchmark used."""
    from engine.scheduler import SchedulerConfig

    if which == "default":
        return SchedulerConfig(max_num_seqs=concurrency, max_num_batched_tokens=16384, max_waiting=1 << 20)
    return msgspec.structs.replace(config.engine.scheduler, max_num_seqs=concurrency, max_waiting=1 << 20)


def _drive(engine, ids: list[list[int]], max_tokens: int, tag: str) -> int:
    """Add every prompt (the scheduler admits ``max_num_seqs`` at a time), step to the end;
    returns the output tokens."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt_ids in enumerate(ids):
        engine.add_request(f"{tag}-{i}", prompt_ids, params)
    n = 0
    while engine.has_unfinished_requests():
        n += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return n


def engine_run(config, prompts: list[str], concurrency: int, k: int, max_tokens: int,
               scheduler: str = "server") -> dict:
    from engine.args import EngineArgs
    from engine.llm import build_engine

    e = config.engine
    engine = build_engine(EngineArgs(model=e.model, draft_model=e.draft_model if k else None,
                                     speculative_method=e.speculative_method if k else None,
                                     num_speculative_tokens=k, speculative_policy=e.speculative_policy,
                                     scheduler=_scheduler(config, concurrency, scheduler)))
    ids = [engine.target.tokenizer.encode(p).ids for p in prompts]
    _drive(engine, ids[:concurrency], max_tokens, "warm")
    with CpuAccount() as cpu, Timer() as t:
        tokens = _drive(engine, ids, max_tokens, "run")
    return {"tokens": tokens, "seconds": t.elapsed_s, "tok_per_s": tokens / t.elapsed_s,
            "cpu": cpu.per_token_ms(tokens)}


def unit_run(config, prompts: list[str], concurrency: int, k: int, max_tokens: int,
             scheduler: str = "server") -> dict:
    """The serving unit without Serve or HTTP: this process drives an engine whose experts and
    drafter are actors reached by the configured transport (what a verifier replica runs), so
    HTTP / unit is the cost of Serve and the ingress, and unit / in-process the cost of the hops."""
    import torch

    from actors.draft_server import DraftActorSpec, RemoteDrafter
    from actors.expert_pool import ExpertPool
    from actors.expert_router import ExpertRouter
    from engine.drafters.base import NoneDrafter
    from engine.engine import LLMEngine
    from engine.loader import load_model

    e, x = config.engine, config.experts
    graph = x.transport == "compiled_graph"
    pool = ExpertPool(e.model, 8, x, e.dtype, e.device, prefix=f"bench-unit-{concurrency}-{k}", detached=False)
    pool.start()
    router = ExpertRouter(pool, torch.float32, graph=graph)
    drafter = RemoteDrafter(DraftActorSpec(e.draft_model, e.dtype, e.device, concurrency, None, None,
                                           f"bench-unit-draft-{concurrency}-{k}", x.namespace),
                            graph_config=x if config.draft_transport == "compiled_graph" else None) if k else None
    target = load_model(e.model, e.dtype, e.device, experts=router)
    engine = LLMEngine(target, drafter or NoneDrafter(), k, _scheduler(config, concurrency, scheduler),
                       target.config.max_position_embeddings, speculative_policy=e.speculative_policy)
    ids = [target.tokenizer.encode(p).ids for p in prompts]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a verifier replica: more threads fight the actors' pollers
    try:
        for w in range(20):  # warm-up until the graphs are live
            _drive(engine, ids[:concurrency], max_tokens, f"warm{w}")
            if not graph or (router.graph.live and (drafter is None or drafter.graph is None or drafter.graph.live)):
                break
        with CpuAccount() as cpu, Timer() as t:
            tokens = _drive(engine, ids, max_tokens, "run")
    finally:
        torch.set_num_threads(threads)
        router.close()
        if drafter is not None:
            drafter.close()
            ray.kill(drafter.member.handle)
        pool.shutdown()
    return {"tokens": tokens, "seconds": t.elapsed_s, "tok_per_s": tokens / t.elapsed_s,
            "cpu": cpu.per_token_ms(tokens)}


def _measure(config, url: str, handle, prompts: list[str], conc: int, k: int, args) -> dict:
    """HTTP, serving unit and in-process, interleaved ``--repeats`` times; medians (tok/s, ratios of
    the same repeat), so a noisy machine's drift hits both sides of a ratio alike."""
    reps, cpus = [], []
    for _ in range(args.repeats):
        h = asyncio.run(http_run(url, config.model_name, prompts, conc, k, args.max_tokens, handle, stream=conc == 1))
        # Let the server's compiled graphs reach their idle teardown: their polling readers
        # would otherwise take cores from the runs below.
        time.sleep(config.experts.graph_idle_park_s + 1.0)
        u = unit_run(config, prompts, conc, k, args.max_tokens, args.in_process_scheduler)
        time.sleep(config.experts.graph_idle_park_s + 1.0)
        e = engine_run(config, prompts, conc, k, args.max_tokens, args.in_process_scheduler)
        rep = {"http_tok_per_s": h["tok_per_s"], "unit_tok_per_s": u["tok_per_s"], "engine_tok_per_s": e["tok_per_s"],
               "ratio": h["tok_per_s"] / e["tok_per_s"], "unit_ratio": u["tok_per_s"] / e["tok_per_s"]}
        cpus.append({"http": h["cpu"], "unit": u["cpu"], "engine": e["cpu"]})
        if args.compare_two_batch_overlap:  # the unit once more with the other setting: its gain
            time.sleep(config.experts.graph_idle_park_s + 1.0)
            x = config.experts
            other = msgspec.structs.replace(config, experts=msgspec.structs.replace(
                x, two_batch_overlap=not x.two_batch_overlap))
            o = unit_run(other, prompts, conc, k, args.max_tokens, args.in_process_scheduler)["tok_per_s"]
            rep["unit_tbo_gain"] = (u["tok_per_s"] / o) if x.two_batch_overlap else (o / u["tok_per_s"])
        if "tpot_p50_ms" in h:  # against the in-process time per output token at this concurrency
            rep.update(http_tpot_p50_ms=h["tpot_p50_ms"], engine_ms_per_token=1e3 / e["tok_per_s"],
                       tpot_over_engine=h["tpot_p50_ms"] * e["tok_per_s"] / 1e3)
        reps.append(rep)
    row = {"concurrency": conc, "k": k, "repeats": args.repeats}
    row.update({key: statistics.median(r[key] for r in reps) for key in reps[0]})
    if args.repeats > 1:
        row["ratio_min_max"] = f"{min(r['ratio'] for r in reps):.3f}-{max(r['ratio'] for r in reps):.3f}"
    row["cpu_ms_per_token"] = {path: _median_by_label([c[path] for c in cpus]) for path in PATHS}
    return row


def _median_by_label(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per label, the median over repeats of CPU ms per output token (0 where a repeat lacks it)."""
    labels = dict.fromkeys(label for run in runs for label in run)
    medians = {label: statistics.median(run.get(label, 0.0) for run in runs) for label in labels}
    tail = ("other", "total", "wall x cores")
    processes = sorted((kv for kv in medians.items() if kv[0] not in tail), key=lambda kv: -kv[1])
    return dict(processes + [(label, medians[label]) for label in tail if label in medians])


def print_cpu(rows: list[dict]) -> None:
    """Per measured point and path, CPU milliseconds per output token of each process label (top
    ones), the total, and the machine's capacity over the run (wall x cores) per token."""
    out = []
    for row in rows:
        for path in PATHS:
            cpu = row["cpu_ms_per_token"][path]
            parts = ", ".join(f"{label} {ms:.2f}" for label, ms in cpu.items() if label not in ("total", "wall x cores"))
            out.append({"concurrency": row["concurrency"], "k": row["k"], "path": path, "total": cpu["total"],
                        "wall x cores": cpu["wall x cores"], "by process (CPU ms / token)": parts})
    print_table(out, list(out[0]))


def main() -> None:
    import serve_app
    from actors.config import HttpConfig, ServeConfig
    from engine.yaml_config import load_yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/embedded.yaml"))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats per point (medians)")
    parser.add_argument("--compare-two-batch-overlap", action="store_true",
                        help="also run the serving unit with experts.two_batch_overlap flipped: unit_tbo_gain = "
                             "unit tok/s with it on / off")
    parser.add_argument("--in-process-scheduler", choices=("server", "default"), default="server",
                        help="the in-process engine's and the serving unit's scheduler: the server's config "
                             "(chunked prefill, SLO classes, token budget; same as HTTP) or the engine defaults")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    config = load_yaml(args.config, ServeConfig)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config.http = HttpConfig(port=s.getsockname()[1])
    prompts = [r["prompt"] for r in load_prompts(args.num_prompts)]
    url = serve_app.start(config, base=ROOT)
    from ray import serve

    handle = serve.get_deployment_handle("verifier", app_name=serve_app.APP_NAME)
    rows = []
    try:
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for k in (config.engine.num_speculative_tokens, 0):
                rows.append(_measure(config, url, handle, prompts, conc, k, args))
                print_table(rows[-1:], [c for c in rows[-1] if c != "cpu_ms_per_token"])
    finally:
        serve_app.stop()
    print()
    print_table(rows, [c for c in dict.fromkeys(c for r in rows for c in r) if c != "cpu_ms_per_token"])
    print()
    print_cpu(rows)
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
