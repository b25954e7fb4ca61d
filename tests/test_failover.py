"""Two verifier replicas (serving units): one dying mid-request is invisible to its clients. The
ingress re-submits prompt + emitted tokens to the survivor; every stream continues without a
duplicate or a gap and the greedy text equals the undisturbed in-process engine's. Over both of
Serve's transports (``serve_transport``): a replica dying surfaces as a different error in each."""

import json
import signal
import threading
import time
from collections import defaultdict

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving.server_process import embedded_config, free_port, process_tree, serve_process
from engine import LLM, SamplingParams
from tests.test_lifecycle import _replicas

PROMPTS = ["def read_config(path):\n", "class LRUCache:\n"]
MAX_TOKENS = 64


@pytest.fixture(scope="module", params=["grpc", "actor_calls"])
def server(tmp_path_factory, request):
    config = embedded_config(free_port())
    config["verifier"] = {"num_replicas": 2}
    config["serve_transport"] = request.param
    with serve_process(config, tmp_path_factory.mktemp("failover") / "serve.yaml", start_timeout_s=300,
                       stop_with_sigterm=True) as server:
        yield server


@pytest.fixture(scope="module")
def expected():
    llm = LLM("checkpoints/stdlib-moe-target", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _stream(url: str, prompt: str, out: dict, key: int) -> None:
    body = {"model": "stdlib-moe", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = out.setdefault(key, [])
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                elif line.strip():
                    events.append({"error": f"HTTP {r.status_code}: {line}"})  # not a stream item
    except httpx.HTTPError as e:  # kept for the assertion's message (a thread's exception is lost)
        events.append({"error": f"{type(e).__name__}: {e}"})


def _tail(log, num_lines: int = 40) -> str:
    return "\n".join(log.read_text().splitlines()[-num_lines:])


def _proxies(proc) -> list[psutil.Process]:
    """Serve's HTTP proxies (``ray::ProxyActor``; not the compiled graphs' ``DAGDriverProxyActor``,
    which a unit has once traffic built its graphs)."""
    return [p for p in process_tree(proc.pid) if " ".join(p.cmdline()).startswith("ray::ProxyActor")]


def _busiest_verifier(proc) -> psutil.Process:
    """The verifier replica doing the most work (the one serving the streams, or one of them)."""
    verifiers = _replicas(proc, "verifier")
    assert len(verifiers) == 2
    before = [sum(p.cpu_times()[:2]) for p in verifiers]
    time.sleep(0.3)
    busy = [sum(p.cpu_times()[:2]) - b for p, b in zip(verifiers, before)]
    return verifiers[busy.index(max(busy))]


def _per_replica(url: str, name: str) -> dict[str, float]:
    """``name``'s samples on one scrape of ``/metrics``, summed per ``replica`` label."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("replica", "")] += s.value
    return out


@pytest.mark.timeout(300)
def test_each_scrape_carries_every_replicas_series(server):
    """Both verifier replicas' engine counters (and the ingress's request counters) in every scrape,
    labelled by replica, so their sums count every request whichever replica served it."""
    _, url, _ = server
    engine, ingress = "specmoe:slo_requests_total", "specmoe:request_success_total"
    before = _per_replica(url, engine), _per_replica(url, ingress)
    num_requests = 6
    for i in range(num_requests):
        r = httpx.post(url + "/v1/completions", json={"model": "stdlib-moe", "prompt": PROMPTS[i % 2],
                                                      "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    after = _per_replica(url, engine), _per_replica(url, ingress)
    assert len([r for r in after[0] if r.startswith("verifier-")]) == 2, dict(after[0])
    assert [r.split("-")[0] for r in after[1]] == ["ingress"], dict(after[1])
    for b, a in zip(before, after):
        assert sum(a.values()) - sum(b.values()) == num_requests


@pytest.mark.timeout(600)
def test_a_verifier_replica_dying_mid_stream_is_invisible_to_its_clients(server, expected, request):
    proc, url, log = server
    grpc = "1" if request.node.callspec.params["server"] == "grpc" else "0"
    assert [p.environ().get("RAY_SERVE_PROXY_USE_GRPC") for p in _proxies(proc)] == [grpc]
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, p, out, i), daemon=True) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(out.get(i, [])) >= 2 for i in range(len(PROMPTS))):
        ended = [i for i, t in enumerate(threads) if not t.is_alive() and len(out.get(i, [])) < 2]
        assert not ended and time.monotonic() < deadline, \
            f"the streams did not start (ended: {ended}; events: {out}); server log tail:\n{_tail(log)}"
        time.sleep(0.05)
    victim = _busiest_verifier(proc)
    victim.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(180)
    for i, events in out.items():
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == expected[i]
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    after = httpx.post(url + "/v1/completions", json={"model": "stdlib-moe", "prompt": PROMPTS[0],
                                                      "max_tokens": 8, "temperature": 0}, timeout=120)
    assert after.status_code == 200, after.text
    for _ in range(20):  # the ingress's log lines reach the driver's output within a second or so
        if "re-submitting with" in log.read_text():
            break
        time.sleep(0.5)
    assert "re-submitting with" in log.read_text()  # a stream did fail over (the victim served one)
