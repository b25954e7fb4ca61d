"""Where does the raylet's memory grow? Phases of load and object-store polling on one embedded server.

    python benchmarks/raylet_probe.py                                  # the default phases
    python benchmarks/raylet_probe.py --phase warm:120:8:0 --phase idle:120:0:0 --phase poll:120:0:1
    python benchmarks/raylet_probe.py --phase good:180:8:0:good=1 --phase cancel:180:8:0:cancel=1

Starts the embedded server like ``benchmarks/soak.py`` and runs ``--phase NAME:SECONDS:CONCURRENCY:POLL_S[:MIX]``
one after the other: ``CONCURRENCY`` clients of a request mix (``MIX``: ``KIND=WEIGHT/...``, default
the soak's ``good=0.6/cancel=0.2/bad=0.2``; 0 clients: idle) while the object
store is read every ``POLL_S`` seconds the way the soak's sampler reads it (0: not at all). Every
``--sample-interval-s`` the raylet's and the GCS's ``/proc/PID/status`` (RssAnon, RssFile, RssShmem,
KiB) are read (a file read: no Ray client, nothing sent to Ray). Per phase: the least-squares slope
of each series in MiB per minute. Responses are not checked (the soak does that): this only finds
what makes the raylet grow (the raylet's ``debug_state.txt`` is kept at the end of each phase:
its event counts), cheaply, by making one suspect at a time run much more often than in
the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # allow `python benchmarks/raylet_probe.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks.common import load_prompts  # noqa: E402
from benchmarks.serving.process_sampler import gcs_address, object_store_stats, process_label  # noqa: E402
from benchmarks.serving.server_process import embedded_config, free_port, process_tree, serve_process  # noqa: E402
from benchmarks.serving.soak_requests import KINDS, SoakTarget  # noqa: E402

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
DEFAULT_PHASES = ("warm:120:8:0", "idle:120:0:0", "idle_poll1s:120:0:1", "load:180:8:0", "load_poll1s:120:8:1")


def status_kib(pid: int) -> dict[str, int]:
    """``FIELDS`` of ``/proc/PID/status`` in KiB."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0])
    return out


def slope_mib_per_min(ts: list[float], vs: list[float]) -> float:
    """Least-squares slope of KiB values ``vs`` over times ``ts`` (s), in MiB per minute."""
    n = len(ts)
    if n < 2:
        return float("nan")
    mt, mv = sum(ts) / n, sum(vs) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den * 60 / 1024 if den else float("nan")


DEFAULT_MIX = "good=0.6/cancel=0.2/bad=0.2"


def parse_phase(text: str) -> tuple[str, float, int, float, dict[str, float]]:
    name, dur, conc, poll, *mix = text.split(":")
    weights = {k: float(w) for k, _, w in (part.partition("=") for part in (mix or [DEFAULT_MIX])[0].split("/"))}
    assert set(weights) <= set(KINDS), f"unknown request kind in {text!r}"
    return name, float(dur), int(conc), float(poll), weights


async def load(target: SoakTarget, concurrency: int, duration_s: float, mix: dict[str, float], seed: int) -> int:
    """``concurrency`` clients of request ``mix`` for ``duration_s``; number of requests sent."""
    end, count = time.monotonic() + duration_s, [0]
    kinds, weights = list(mix), list(mix.values())

    async def client_loop(client: httpx.AsyncClient, rng: random.Random) -> None:
        while time.monotonic() < end:
            try:
                await asyncio.wait_for(KINDS[rng.choices(kinds, weights)[0]](client, target, rng), 120)
            except (TimeoutError, httpx.HTTPError):
                pass
            count[0] += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        await asyncio.gather(*[client_loop(client, random.Random(seed + i)) for i in range(concurrency)])
    return count[0]


def run_phase(name, duration_s, concurrency, poll_s, mix, pids, target, address, interval_s, t0, seed):
    """One phase; returns its samples and request/poll counts."""
    samples, stop, polls = [], threading.Event(), [0]

    def sample_loop():
        while True:
            samples.append({"t_s": time.monotonic() - t0,
                            **{f"{who}.{k}": v for who, pid in pids.items() for k, v in status_kib(pid).items()}})
            if stop.wait(interval_s):
                return

    def poll_loop():
        while not stop.wait(poll_s):
            try:
                object_store_stats(address)
                polls[0] += 1
            except Exception:
                pass

    threads = [threading.Thread(target=sample_loop, daemon=True)]
    if poll_s > 0:
        threads.append(threading.Thread(target=poll_loop, daemon=True))
    for th in threads:
        th.start()
    requests = asyncio.run(load(target, concurrency, duration_s, mix, seed)) if concurrency else time.sleep(duration_s)
    stop.set()
    for th in threads:
        th.join()
    return {"name": name, "duration_s": duration_s, "concurrency": concurrency, "poll_s": poll_s, "mix": mix,
            "requests": requests or 0, "polls": polls[0], "load_avg_1m": os.getloadavg()[0], "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", action="append", type=parse_phase, help="NAME:SECONDS:CONCURRENCY:POLL_S")
    p.add_argument("--sample-interval-s", type=float, default=5.0)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server's environment")
    p.add_argument("--save-result", type=Path, default=Path("benchmarks/results/raylet_probe.json"))
    args = p.parse_args(argv)
    phases = args.phase or [parse_phase(t) for t in DEFAULT_PHASES]
    prompts = [row["prompt"] for row in load_prompts(args.num_prompts)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(kv.split("=", 1) for kv in args.server_env)
    config = embedded_config(free_port())
    results = []
    with tempfile.TemporaryDirectory() as tmp, serve_process(config, Path(tmp) / "serve.yaml", env=env,
                                                             stop_with_sigterm=True) as (proc, url, _):
        tree = {process_label(q.cmdline()): q.pid for q in process_tree(proc.pid)}
        pids = {"raylet": tree["raylet"], "gcs": tree["gcs_server"]}
        address = gcs_address(proc.pid)
        raylet_args = psutil.Process(pids["raylet"]).cmdline()
        socket = next(a.split("=", 1)[1] for a in raylet_args if a.startswith("--raylet_socket_name="))
        debug_state = Path(socket).parents[1] / "logs" / "debug_state.txt"  # the raylet rewrites it every 10 s
        max_model_len = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        target = SoakTarget(url, config["model_name"], max_model_len, prompts, [("", "")] * len(prompts),
                            args.max_tokens)
        t0 = time.monotonic()
        for i, (name, dur, conc, poll, mix) in enumerate(phases):
            r = run_phase(name, dur, conc, poll, mix, pids, target, address, args.sample_interval_s, t0, i * 100)
            ts = [s["t_s"] for s in r["samples"]]
            r["slopes_mib_per_min"] = {key: round(slope_mib_per_min(ts, [s[key] for s in r["samples"]]), 3)
                                       for key in r["samples"][0] if key != "t_s"}
            first, last = r["samples"][0], r["samples"][-1]
            print(f"{name:>14} {dur:>5.0f}s c{conc} poll {poll:g}s: {r['requests']} req, {r['polls']} polls, "
                  f"load {r['load_avg_1m']:.1f}; raylet RSS {first['raylet.VmRSS'] / 1024:.1f} -> "
                  f"{last['raylet.VmRSS'] / 1024:.1f} MiB; slopes MiB/min "
                  + ", ".join(f"{k} {v:+.3f}" for k, v in r["slopes_mib_per_min"].items()), flush=True)
            r["debug_state_at_end"] = debug_state.read_text() if debug_state.exists() else None
            results.append(r)
    args.save_result.parent.mkdir(parents=True, exist_ok=True)
    args.save_result.write_text(json.dumps({"server_env": args.server_env, "phases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
