"""p99 end-to-end latency with a straggling expert replica, hedged expert calls on and off.

    python benchmarks/hedging.py [--transport compiled_graph] [--num-prompts 16] [--concurrency 4]
        [--max-tokens 32] [--delay-ms 100]

One run of the embedded app (configs/embedded.yaml) over the HTTP path with
``experts.transport: --transport`` (``actor_calls`` or the default ``compiled_graph``),
``experts.replicas: 2`` (two replicas of every expert group, ``--experts-per-actor`` experts each). Four phases on the same server, each after the router's
latency views are reset (``VerifierServer.set_expert_hedging``, so every phase starts alike):

* ``baseline``: no straggler, hedging off;
* ``straggler_no_hedge``: replica ``--slow-replica`` of group ``--slow-group`` sleeps ``--delay-ms``
  per call (``ExpertWorker.set_delay_ms``), hedging off;
* ``straggler_hedge``: the same straggler, hedging on;
* ``baseline_hedge``: no straggler, hedging on (what hedging costs when nothing is slow).

A persistent straggler is avoided by the router's latency-aware replica choice (expected
completion = (calls in flight + 1) x latency EWMA; the straggler rule; probes let it back once it
recovers: actors/replica_choice.py) after its first slow call, hedging or not. On the compiled-graph
transport a straggling graph member makes the router probe its group's other replica at once and
rebuild the graph without it (actor calls, latency-aware and hedged, in the meantime); with hedging on, an
execution past its groups' hedge deadline is given up at once (actors/expert_router.py). A deadline
needs a few known latencies: ``--warm-requests N`` lets each phase serve N requests before the
straggler is slowed (a replica turning slow while serving), and again until the standby graph is
live where the server keeps one (``experts.graph_standby``; the previous phase may have used it;
``--no-standby`` turns it off, for a comparison in the same conditions). ``--flip-s S`` makes the straggler intermittent instead: every S
seconds the delay moves to the group's other replica, so the replica the router prefers turns slow
and is chosen until its latency view catches up (what hedging is for).

Each phase sends the same ``--num-prompts`` greedy completions (EOS ignored) at ``--concurrency``
and reports p50/p99 e2e seconds (p99: nearest rank, i.e. the slowest request of 16), hedges sent,
and whether every completion's text equals the baseline's. Ratios are p99 over the baseline p99.
With ``--repeats N`` the phases run N times interleaved and each row is the phase's median repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, load_prompts, machine, print_table, save_json  # noqa: E402

PHASES = (("baseline", False, False), ("straggler_no_hedge", True, False), ("straggler_hedge", True, True),
          ("baseline_hedge", False, True))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``0 < q <= 1``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def run_requests(url: str, model: str, prompts: list[str], concurrency: int,
                       max_tokens: int) -> tuple[list[float], list[str]]:
    """E2e seconds of each request and each completion's text, in prompt order."""
    sem = asyncio.Semaphore(concurrency)
    e2e_s: list[float] = [0.0] * len(prompts)
    texts: list[str] = [""] * len(prompts)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        async with sem:
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            e2e_s[i] = time.perf_counter() - start
            texts[i] = r.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[one(client, i) for i in range(len(prompts))])
    return e2e_s, texts


def server_config(args: argparse.Namespace):
    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    raw = msgspec.to_builtins(load_yaml(str(ROOT / "configs/embedded.yaml"), ServeConfig))
    raw["experts"].update(transport=args.transport, replicas=2, experts_per_actor=args.experts_per_actor,
                          hedge=True, hedge_factor=args.hedge_factor, hedge_floor_ms=args.hedge_floor_ms,
                          straggler_floor_ms=args.straggler_floor_ms, graph_standby=not args.no_standby)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        raw["http"]["port"] = s.getsockname()[1]
    return msgspec.convert(raw, ServeConfig)


def load_every_expert_actor(handle, namespace: str) -> None:
    """Load every actor's weights now, so no phase pays a replica's lazy first load."""
    import ray

    names = handle.expert_actor_names.remote().result()
    ray.get([ray.get_actor(n, namespace=namespace).load.remote() for n in names], timeout=120)


def slow_replica(handle, args: argparse.Namespace) -> int:
    """``--slow-replica``, or with -1 the replica of ``--slow-group`` inside the live compiled graph
    (replica 0 when no graph is live)."""
    if args.slow_replica >= 0:
        return args.slow_replica
    tag = f"-g{args.slow_group}-r"
    for name in handle.stats.remote().result()["transport"].get("graph_members", []):
        if tag in name and "+" not in name:  # "+": a guest replica on another group's actor
            return int(name.split(tag)[1].split("-")[0])
    return 0


def warm_until_standby(handle, warm, limit_s: float = 15.0) -> None:
    """Run ``warm`` (the warm-up requests) once, and again until the standby graph is live where
    the server keeps one (``experts.graph_standby``, two replicas a group) or ``limit_s`` passed:
    a phase right after a straggler phase would otherwise start while the standby the last one
    used is being replaced (it is rebuilt once probes have measured the replicas left)."""
    deadline = time.monotonic() + limit_s
    warm()
    while time.monotonic() < deadline:
        transport = handle.stats.remote().result()["transport"]
        if not transport.get("standby_enabled") or transport["standby_live"]:
            return
        warm()


class Straggler:
    """The slowed replica of one group: fixed, or moving to the other replica every ``flip_s``."""

    def __init__(self, handle, group: int, replica: int, delay_ms: float, flip_s: float) -> None:
        self.handle, self.group, self.replica, self.delay_ms, self.flip_s = handle, group, replica, delay_ms, flip_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _set(self, slow: int) -> None:
        for r in (0, 1):
            self.handle.set_expert_delay_ms.remote(self.group, self.delay_ms if r == slow else 0.0, r).result()

    def start(self) -> None:
        self._set(self.replica)
        if self.flip_s > 0:
            self._thread = threading.Thread(target=self._flip, daemon=True)
            self._thread.start()

    def _flip(self) -> None:
        slow = self.replica
        while not self._stop.wait(self.flip_s):
            slow = 1 - slow
            self._set(slow)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.handle.set_expert_delay_ms.remote(self.group, 0.0).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["compiled_graph", "actor_calls"], default="compiled_graph")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--experts-per-actor", type=int, default=4)
    parser.add_argument("--slow-group", type=int, default=0)
    parser.add_argument("--slow-replica", type=int, default=0,
                        help="0: the replica the router prefers on a tie; -1: the group's member of the live "
                             "compiled graph at each straggler phase's start (compiled_graph only)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the median is reported")
    parser.add_argument("--flip-s", type=float, default=0.0, help="move the delay to the other replica this often")
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="untimed requests at each phase's start, after the latency views are reset and "
                             "before the straggler is slowed: a replica that turns slow while serving (with "
                             "0 it is slow from the phase's first call, before any latency is known)")
    parser.add_argument("--hedge-factor", type=float, default=2.0)
    parser.add_argument("--hedge-floor-ms", type=float, default=10.0)
    parser.add_argument("--straggler-floor-ms", type=float, default=5.0,
                        help="experts.straggler_floor_ms: the straggler rule ignores latencies below it")
    parser.add_argument("--no-standby", action="store_true",
                        help="experts.graph_standby false: a dropped graph is rebuilt, actor calls meanwhile")
    parser.add_argument("--save-result")
    args = parser.parse_args()

    from ray import serve

    import serve_app

    config = server_config(args)
    prompts = [p["prompt"] for p in load_prompts(args.num_prompts)]
    url = serve_app.start(config, base=ROOT)
    rows, reference = [], None
    try:
        handle = serve.get_deployment_handle("verifier", app_name=serve_app.APP_NAME)
        load_every_expert_actor(handle, config.experts.namespace)
        asyncio.run(run_requests(url, config.model_name, prompts[:args.concurrency], args.concurrency,
                                 args.max_tokens))  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in PHASES}
        for _ in range(args.repeats):  # interleaved: every phase once per repeat
            for name, slowed, hedge in PHASES:
                handle.set_expert_hedging.remote(hedge).result()
                if args.warm_requests:
                    warm_until_standby(handle, lambda: asyncio.run(run_requests(
                        url, config.model_name, prompts[:args.warm_requests], args.concurrency, args.max_tokens)))
                straggler = Straggler(handle, args.slow_group, slow_replica(handle, args), args.delay_ms, args.flip_s)
                if slowed:
                    straggler.start()
                before = handle.stats.remote().result()
                try:
                    e2e_s, texts = asyncio.run(run_requests(url, config.model_name, prompts, args.concurrency,
                                                            args.max_tokens))
                finally:
                    straggler.stop()
                after = handle.stats.remote().result()
                hedges = after["expert_hedges"] - before["expert_hedges"]
                reference = texts if reference is None else reference
                layers = {k: after["transport"][k] - before["transport"][k] for k in ("graph_layers", "call_layers")}
                runs[name].append({"p50_e2e_s": statistics.median(e2e_s), "p99_e2e_s": percentile(e2e_s, 0.99),
                                   "hedges": hedges, "same_output": texts == reference,
                                   "graph_rebuilds": after["transport"].get("rebuilds", 0)
                                   - before["transport"].get("rebuilds", 0),
                                   "graph_builds": after["transport"].get("builds", 0)
                                   - before["transport"].get("builds", 0),
                                   "graph_late": after["transport"].get("late", 0) - before["transport"].get("late", 0),
                                   "graph_takeovers": after["transport"].get("graph_takeovers", 0)
                                   - before["transport"].get("graph_takeovers", 0),
                                   "e2e_s": [round(x, 3) for x in e2e_s],
                                   "graph_share": layers["graph_layers"] / max(1, sum(layers.values()))})
        for name, reps in runs.items():  # the median repeat of each phase (by p99)
            mid = sorted(reps, key=lambda r: r["p99_e2e_s"])[len(reps) // 2]
            rows.append({"phase": name, **mid, "same_output": all(r["same_output"] for r in reps),
                         "p99_each_repeat": [round(r["p99_e2e_s"], 3) for r in reps]})
    finally:
        serve_app.stop()
    base = rows[0]["p99_e2e_s"]
    for r in rows:
        r["p99_over_baseline"] = r["p99_e2e_s"] / base
    by = {r["phase"]: r for r in rows}
    summary = {"hedge_over_no_hedge_p99": by["straggler_hedge"]["p99_e2e_s"] / by["straggler_no_hedge"]["p99_e2e_s"],
               "hedge_over_baseline_p99": by["straggler_hedge"]["p99_over_baseline"],
               "goal_hedge_over_baseline_p99": 1.3}
    print_table(rows, list(rows[0]))
    print(" ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows,
                                 "summary": summary})


if __name__ == "__main__":
    main()
