"""Latency of a request that arrives after the server went idle, against one that arrives warm.

    python benchmarks/after_idle.py [--idle-s 6] [--repeats 3] [--build-after 0,1]

An idle server parks its compiled graphs (their readers would poll; ``actors/graph_park.py``) and
the next request wakes them (before parking, it tore them down and the next burst rebuilt them, at
once with ``experts.graph_build_after_s: 0`` or after that long of steady traffic: 1.2 s and
0.43 s against 0.28 s warm). For each ``--build-after`` setting (which now only matters for the
first build and after a failure), one run of the embedded app: warm requests back to back, then
requests each after ``--idle-s`` of silence; e2e seconds of a greedy 48-token completion (draft k
from the config).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, machine, print_table, save_json  # noqa: E402

BODY = {"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def _once(url: str, model: str) -> float:
    start = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json={"model": model, **BODY}, timeout=120).raise_for_status()
    return time.perf_counter() - start


def run(build_after_s: float, idle_s: float, repeats: int) -> dict:
    import serve_app
    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    raw = msgspec.to_builtins(load_yaml(str(ROOT / "configs/embedded.yaml"), ServeConfig))
    raw["experts"]["graph_build_after_s"] = build_after_s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        raw["http"]["port"] = s.getsockname()[1]
    config = msgspec.convert(raw, ServeConfig)
    url = serve_app.start(config, base=ROOT)
    try:
        for _ in range(30):  # steady traffic until the graphs are live
            _once(url, config.model_name)
        warm = [_once(url, config.model_name) for _ in range(repeats)]
        after = []
        for _ in range(repeats):
            time.sleep(idle_s)
            after.append(_once(url, config.model_name))
    finally:
        serve_app.stop()
    return {"graph_build_after_s": build_after_s, "warm_e2e_s": statistics.median(warm),
            "after_idle_e2e_s": statistics.median(after), "after_idle_max_s": max(after),
            "after_over_warm": statistics.median(after) / statistics.median(warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-s", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-after", default="0,1")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    rows = [run(float(b), args.idle_s, args.repeats) for b in args.build_after.split(",")]
    print_table(rows, list(rows[0]))
    save_json(args.save_result, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
