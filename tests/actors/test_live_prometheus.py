"""The Grafana dashboard against a live Prometheus: Debian's ``prometheus`` (installed here when
missing; skipped with the reason where it cannot be) scrapes the running Serve app with
deploy/grafana/prometheus.yml (only the target address changed), and every PromQL expression of
deploy/grafana/specmoe-dashboard.json must parse and return finite data after two rounds of
requests, one scrape apart. Bounded: at most ~1 min once Prometheus is installed."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.actors.conftest import MODEL_NAME, free_port
from tests.helpers.prometheus import PrometheusServer, Unavailable, ensure_prometheus

DEPLOY = Path("deploy/grafana")


def dashboard_queries(dashboard: dict) -> tuple[list[str], list[str]]:
    """(panel target expressions, templating variable queries), panels inside rows included."""
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    variables = [v["query"] for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs, variables


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(value) * {"s": 1, "m": 60, "h": 3600}[unit]


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    try:
        binary = ensure_prometheus()
    except Unavailable as e:
        pytest.skip(f"no live Prometheus: {e}")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    target = urlparse(served[0]).netloc
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [target]
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = PrometheusServer(binary, workdir / "prometheus.yml", workdir, free_port())
    try:
        server.wait_ready()
        server.interval_s = _seconds(config["scrape_configs"][0]["scrape_interval"])
        yield server
    finally:
        server.stop()


def _wait_for_scrape_after(prom: PrometheusServer, t: float, timeout_s: float) -> None:
    """Until Prometheus holds a successful scrape of the app that started after ``t`` (unix s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # timestamp() of a plain selector: the sample's own time (an instant query's value time,
        # and timestamp() of a computed vector, are the query's time).
        stamp = prom.query('timestamp(up{job="specmoe"})')["result"]
        up = prom.query('up{job="specmoe"}')["result"]
        if stamp and up and float(stamp[0]["value"][1]) > t and up[0]["value"][1] == "1":
            return
        time.sleep(0.25)
    raise AssertionError(f"no scrape of the app after {t} within {timeout_s} s: {prom.log_tail()}")


def _requests(url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "def parse(line):\n", "max_tokens": 12, "temperature": 0}
    for extra in ({}, {"stream": True}, {"temperature": 0.8, "seed": 1}):
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200


def test_every_dashboard_query_returns_data_from_a_live_prometheus(served, prometheus):
    url = served[0]
    exprs, variables = dashboard_queries(json.loads((DEPLOY / "specmoe-dashboard.json").read_text()))
    assert len(exprs) >= 20 and variables
    budget_s = 4 * prometheus.interval_s  # one scrape interval plus slack per wait
    _wait_for_scrape_after(prometheus, 0, budget_s)
    for _ in range(2):  # counters must rise between two scrapes for rate() to see them
        _requests(url)
        _wait_for_scrape_after(prometheus, time.time(), budget_s)

    for query in variables:  # label_values(metric, label): Grafana's variable query
        metric, label = re.fullmatch(r"label_values\((\S+),\s*(\w+)\)", query).groups()
        assert MODEL_NAME in prometheus.label_values(label, metric), query
    # Grafana's $__rate_interval is at least four scrape intervals.
    rate_interval = f"{int(4 * prometheus.interval_s)}s"
    empty = []
    for expr in exprs:
        promql = expr.replace("$__rate_interval", rate_interval).replace("$model", MODEL_NAME)
        data = prometheus.query(promql)  # parses (else Prometheus' error is the failure)
        values = [float(s["value"][1]) for s in data["result"]] if data["resultType"] == "vector" else []
        if not any(math.isfinite(v) for v in values):
            empty.append((expr, data["result"][:2]))
    assert empty == [], f"dashboard queries without data: {empty}"
