"""The embedded server as `make serve` runs it (``serve_app.py`` in its own process, its own local
Ray): nothing listens beyond loopback, a request past request_timeout_s gets 504 and frees its KV,
a dead verifier replica gives 503 + Retry-After (never 500) until it is back, and SIGTERM to the
launcher's whole process group (``make serve`` under make, a shell's ``kill %1``) exits within 10 s
with in-flight streams ended cleanly. The tests share one server, in file order; the last one
stops it."""

import ipaddress
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from actors.cluster import UNCONFINABLE_LISTENERS
from benchmarks.serving.server_process import (
    embedded_config,
    engine_gauge,
    free_port,
    process_tree,
    serve_process,
    wait_status,
)

MODEL = "stdlib-moe"
REQUEST_TIMEOUT_S = 6.0
LONG = {"model": MODEL, "prompt": "def parse(text):\n", "max_tokens": 900, "ignore_eos": True}
# A request that cannot finish within REQUEST_TIMEOUT_S: LONG alone took 5.4-6.1 s on the 2-core
# EPYC VM (2026-12-04), so it raced the timeout; four choices of 1000 tokens without drafting took
# 9.1-10.1 s.
PAST_TIMEOUT = {**LONG, "max_tokens": 1000, "n": 4, "num_speculative_tokens": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(process, base URL) of `serve_app.py` on a copy of the embedded config with a short
    request_timeout_s and small queues."""
    config = embedded_config(free_port())
    config["request_timeout_s"] = REQUEST_TIMEOUT_S
    config["engine"]["scheduler"].update(max_num_seqs=4, max_waiting=4)
    with serve_process(config, tmp_path_factory.mktemp("lifecycle") / "serve.yaml", launcher=True) as (proc, url, _):
        yield proc, url


def _replicas(proc, deployment: str) -> list[psutil.Process]:
    """The live Serve replica processes of one deployment in the server's process tree."""
    found = []
    for p in process_tree(proc.pid):
        try:
            if f"ServeReplica:specmoe:{deployment}" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # exited meanwhile
            continue
    return found


def _kv_usage(url: str) -> float:
    return engine_gauge(url, "kv_cache_usage_perc")


def _stream_in_background(url: str, out: list) -> threading.Thread:
    """A long streaming request; ``out`` gets (status, [events]) and its first event as it comes."""
    def run():
        events = []
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        out.append(("event", events[-1]))
            out.append(("done", r.status_code, events))
        except httpx.HTTPError as e:  # the connection was cut: what a clean end must avoid
            out.append(("done", type(e).__name__, events))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_first_event(out: list, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(o[0] == "event" for o in out):
        assert time.monotonic() < deadline, "the stream sent nothing"
        time.sleep(0.05)


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_embedded_default_listens_on_loopback_only(server):
    proc, url = server
    listeners = []
    for p in process_tree(proc.pid):
        try:
            name = p.cmdline()[0] if p.cmdline() else p.name()
            listeners += [(p.pid, name, c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    port = int(url.rsplit(":", 1)[1])
    assert any(lport == port and ip == "127.0.0.1" for _, _, ip, lport in listeners)  # the HTTP proxy
    names = {name for _, name, _, _ in listeners}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names)
    wide = [lst for lst in listeners if not _is_loopback(lst[2])]
    # The one exception Ray 2.60 cannot confine: each Serve replica's inter-deployment gRPC server
    # binds [::]:0 (actors/cluster.py). Everything else (GCS, raylet, object manager, workers,
    # agents, controller, proxy, expert and draft actors) is loopback.
    per_process: dict[int, list] = {}
    for pid, name, ip, lport in wide:
        assert any(name.startswith(prefix) for prefix in UNCONFINABLE_LISTENERS), (name, ip, lport)
        per_process.setdefault(pid, []).append((ip, lport))
    assert all(len(v) <= UNCONFINABLE_LISTENERS["ray::ServeReplica"] for v in per_process.values()), per_process
    assert all(ip in ("::", "0.0.0.0") for v in per_process.values() for ip, _ in v)


def test_request_past_request_timeout_gets_504_and_frees_its_kv(server):
    _, url = server
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=PAST_TIMEOUT, timeout=60)
    took_s = time.monotonic() - start
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout" and "request_timeout_s" in r.json()["error"]["message"]
    assert REQUEST_TIMEOUT_S <= took_s < REQUEST_TIMEOUT_S + 5
    for _ in range(50):  # the abort lands within a step; the gauge follows the next engine change
        if _kv_usage(url) == 0.0:
            break
        time.sleep(0.1)
    assert _kv_usage(url) == 0.0
    ok = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_a_dead_verifier_gives_503_with_retry_after_until_it_is_back(server):
    proc, url = server
    # The stream starts first; the plain request once the stream's first event is in; the kill as
    # soon as the plain one runs: both are then surely still running (the plain one used to start
    # first, and on a fast machine it once finished its 900 tokens while the stream's first event
    # was late), and the requests' request_timeout_s (6 s) covers the failover attempt (~2 s: a
    # resubmission waits that long for a replica), not a busy machine's queueing.
    out: list = []
    stream = _stream_in_background(url, out)
    _wait_first_event(out)
    plain: list = []
    request = threading.Thread(target=lambda: plain.append(
        httpx.post(url + "/v1/completions", json=LONG, timeout=60)), daemon=True)
    request.start()
    deadline = time.monotonic() + 30
    while engine_gauge(url, "num_requests_running") < 2:
        assert time.monotonic() < deadline and request.is_alive(), f"the plain request never ran: {plain}"
        time.sleep(0.05)
    verifier = _replicas(proc, "verifier")
    assert len(verifier) == 1
    verifier[0].send_signal(signal.SIGKILL)
    stream.join(30)
    request.join(30)
    assert plain[0].status_code == 503 and plain[0].headers["retry-after"] == "5", plain[0].text
    assert plain[0].json()["error"]["type"] == "server_overloaded"
    _, status, events = out[-1]
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503, events[-2]
    refused = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    back_after_s = wait_status(url, 200, timeout_s=180, proc=proc)
    ok = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    print(f"verifier back after {back_after_s:.1f} s")


def test_sigterm_to_the_process_group_exits_within_10_s_and_ends_streams_cleanly(server):
    """The group's SIGTERM reaches the server, not Ray's processes (they run in a group of their
    own), so the server still drains: before, they died with it and the streams were cut (41 s)."""
    proc, url = server
    out: list = []
    stream = _stream_in_background(url, out)
    _wait_first_event(out)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # proc: the launcher shell, leader of the server's group
    rc = proc.wait(30)
    exit_s = time.monotonic() - start
    stream.join(10)
    _, status, events = out[-1]
    assert rc == 0 and exit_s <= 10.0, (rc, exit_s)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and "shutting down" in events[-2]["error"]["message"]
    print(f"SIGTERM to exit: {exit_s:.1f} s")
