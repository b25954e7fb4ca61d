"""Serve autoscaling of serving units under a load ramp, from a Serve config file as `serve run`
runs it: one verifier replica, two while eight streams run (target_ongoing_requests 2), one again
after the load stops; every request completes, and /metrics follows the units."""

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving.server_process import free_port, wait_status
from tests.test_lifecycle import _replicas


def _count_until(proc, want: int, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        assert proc.poll() is None, "serve run exited"
        if len(_replicas(proc, "verifier")) == want:
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"verifier replicas did not reach {want} within {timeout_s} s "
                         f"(now {len(_replicas(proc, 'verifier'))})")


def _verifier_pages(url: str) -> set[str]:
    """The verifier replicas whose engine metrics one scrape of ``/metrics`` carries."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("replica", "").startswith("verifier-")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    doc = yaml.safe_load(open("configs/serve.yaml"))
    port = free_port()
    doc["http_options"]["port"] = port
    app = doc["applications"][0]
    verifier = next(d for d in app["deployments"] if d["name"] == "verifier")
    verifier["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                      "metrics_interval_s": 0.5, "look_back_period_s": 2,
                                      "upscale_delay_s": 1, "downscale_delay_s": 5}
    verifier["ray_actor_options"] = {"num_cpus": 0}  # two units on a 2-core machine
    path = tmp_path_factory.mktemp("autoscale") / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    log = open(path.with_suffix(".log"), "w")
    # --address local: a new Ray of its own, never the cluster another test recorded in
    # /tmp/ray/ray_current_cluster (serve run's default would join that one).
    proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", "--address", "local", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_status(url, 200, timeout_s=300, proc=proc, log_path=path.with_suffix(".log"))
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C does
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


@pytest.mark.timeout(600)
def test_units_scale_up_under_load_and_back_down_without_failed_requests(served):
    proc, url = served
    assert len(_replicas(proc, "verifier")) == 1
    stop = threading.Event()
    results: list = []

    def client() -> None:
        body = {"model": "stdlib-moe", "prompt": "def parse(text):\n", "max_tokens": 64, "ignore_eos": True}
        while not stop.is_set():
            r = httpx.post(url + "/v1/completions", json=body, timeout=300)
            results.append((r.status_code, r.json().get("usage", {}).get("completion_tokens")))

    clients = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for c in clients:
        c.start()
    up_s = _count_until(proc, 2, timeout_s=180)
    time.sleep(5)  # both units serve for a while
    for _ in range(5):  # a unit's first page may miss a scrape's 2 s wait on 2 loaded cores
        if len(both := _verifier_pages(url)) == 2:
            break
    stop.set()
    for c in clients:
        c.join(300)
    down_s = _count_until(proc, 1, timeout_s=180)
    # The unit Serve stopped left the pages as it shut down (actors/metrics_hub.py): not served
    # from its last page until forgotten 30 s later.
    assert len(both) == 2 and len(_verifier_pages(url)) == 1, both
    assert results and all(r == (200, 64) for r in results), [r for r in results if r != (200, 64)][:5]
    print(f"scaled 1 -> 2 after {up_s:.1f} s of load, 2 -> 1 {down_s:.1f} s after it; {len(results)} requests")
