"""How long SIGTERM takes to stop the embedded server under load, and how the in-flight streams end.

    python benchmarks/shutdown_time.py --runs 2 --concurrency 8 --save-result benchmarks/results/shutdown.json

Each run starts ``serve_app.py`` on the embedded config (its own local Ray, like ``make serve``),
keeps ``--concurrency`` clients streaming long completions for ``--load-s`` seconds, then sends
SIGTERM and measures the time until the process has exited (issue 17's bound: 10 s), with the
server's own "stopped in" figure (``stop()`` alone) from its log. Every stream in flight at the
signal is classified: ``clean`` (an error chunk with code 503 and ``[DONE]``), ``completed``
(finished normally before the drain reached it), ``refused`` (a 503 before streaming), ``cut``
(the connection broke: what the drain must avoid); ``not_connected``: a request a client began
after the server had stopped listening.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # allow `python benchmarks/shutdown_time.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.serving.server_process import embedded_config, free_port, serve_process  # noqa: E402

MODEL = "stdlib-moe"
BODY = {"model": MODEL, "prompt": "def parse(text):\n", "max_tokens": 400, "ignore_eos": True, "stream": True}


def stream_once(url: str) -> str:
    """One long streamed completion; how it ended (see the module docstring)."""
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=60) as r:
            if r.status_code != 200:
                return "refused" if r.status_code == 503 else f"http_{r.status_code}"
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.ConnectError:  # sent after the server stopped listening: not a stream in flight
        return "not_connected"
    except (httpx.HTTPError, json.JSONDecodeError):
        return "cut"
    if not events or events[-1] != "[DONE]":
        return "cut"
    last = events[-2] if len(events) > 1 else {}
    return "clean" if isinstance(last, dict) and last.get("error", {}).get("code") == 503 else "completed"


def one_run(concurrency: int, load_s: float) -> dict:
    config = embedded_config(free_port())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ends_after_signal: list[str] = []
    signalled, stop = threading.Event(), threading.Event()
    with tempfile.TemporaryDirectory() as tmp, serve_process(config, Path(tmp) / "serve.yaml", env=env) as (
            proc, url, log_path):
        def client():
            while not stop.is_set():
                outcome = stream_once(url)
                if signalled.is_set():
                    ends_after_signal.append(outcome)
                    return

        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
        for th in threads:
            th.start()
        time.sleep(load_s)
        load_avg = os.getloadavg()[0]
        start = time.monotonic()
        signalled.set()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except Exception:
            rc = None
        exit_s = time.monotonic() - start
        stop.set()
        for th in threads:
            th.join(30)
        log = log_path.read_text()
    stopped = re.search(r"stopped in (\S+) s", log)
    return {"exit_s": round(exit_s, 2), "rc": rc, "stop_s": float(stopped[1]) if stopped else None,
            "streams_at_signal": dict(Counter(ends_after_signal)), "load_avg_1m": load_avg}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--load-s", type=float, default=20.0, help="seconds of load before SIGTERM")
    p.add_argument("--save-result", type=Path, default=Path("benchmarks/results/shutdown.json"))
    args = p.parse_args(argv)
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.concurrency, args.load_s))
        print(f"run {i}: {runs[-1]}", flush=True)
    args.save_result.parent.mkdir(parents=True, exist_ok=True)
    args.save_result.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs},
                                           indent=1))
    return 0 if all(r["rc"] == 0 and r["exit_s"] <= 10.0 and "cut" not in r["streams_at_signal"]
                    for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
