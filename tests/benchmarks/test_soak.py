"""A 25-second soak (benchmarks/soak.py) on the embedded server, so the script does not rot: every
request kind is sent and judged, every process of the app and the object store are sampled, and
the cancelled streams leave the KV cache as it was. Memory flatness needs the full run's warm-up
and length (minutes), so it is reported here but not asserted."""

import json

import pytest

from benchmarks import soak
from benchmarks.serving.server_process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP_PROCESSES = ("ray::ServeReplica:specmoe:ingress", "ray::ServeReplica:specmoe:verifier", "ray::ExpertWorker",
                 "ray::DraftServer", "ray::ServeController", "ray::ProxyActor", "raylet", "gcs_server", "serve_app.py")


def test_short_soak_judges_every_request_kind_and_samples_every_process(tmp_path):
    out = tmp_path / "soak.json"
    soak.main(["--duration-s", "25", "--concurrency", "4", "--num-prompts", "3", "--max-tokens", "8",
               "--sample-interval-s", "2", "--port", str(free_port()), "--save-result", str(out)])
    result = json.loads(out.read_text())
    requests = result["requests"]
    assert set(requests["by_kind"]) == {"good", "cancel", "bad"}, requests
    assert requests["failed"] == 0, requests["problems"]
    assert result["checks"]["nothing_lost_or_corrupted"] and result["checks"]["cancelled_freed"]
    assert result["gauges_after"] == result["gauges_before"] == {
        "kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    memory = result["memory"]
    labels = {key.rsplit("[", 1)[0] for key in memory["processes"]}
    assert set(APP_PROCESSES) <= labels, labels
    assert all(v["min"] > 0 for v in memory["processes"].values())
    store = memory["object_store_bytes"]
    assert store is not None and store["max"] >= store["min"] >= 0
