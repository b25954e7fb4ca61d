"""Goodput and per-class SLO attainment (exact, on scripted request results), SLO parsing, Gamma
arrivals (seeded statistics), per-row request fields, and a goodput sweep over request rates
against the scripted stub."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from benchmarks.serve import main
from benchmarks.serving.client import RequestOptions, RequestResult, build_payload
from benchmarks.serving.dataset import Prompt
from benchmarks.serving.goodput import (
    Slo,
    SloConfig,
    compute_goodput,
    is_good,
    load_slo_file,
    parse_goodput_args,
)
from benchmarks.serving.loadgen import (
    class_arrival_offsets_s,
    gamma_arrival_offsets_s,
    poisson_arrival_offsets_s,
)
from benchmarks.serving.metrics import LatencySummary

# ---------------------------------------------------------------------------------------------
# Goodput on scripted results (binary-exact times, compared with ==)
# ---------------------------------------------------------------------------------------------


def _ok(cls: str, offsets: list[float], e2e_s: float, tokens: int) -> RequestResult:
    return RequestResult("x", True, 0.0, e2e_s, offsets, tokens, 10, slo_class=cls)


RESULTS = [
    _ok("chat", [0.125, 0.375], 0.625, 5),  # TTFT 125 ms, TPOT (625-125)/4 = 125 ms, E2E 625 ms
    _ok("chat", [0.25, 0.375], 0.5, 3),  # TTFT 250, TPOT 125, E2E 500
    _ok("completion", [0.0625], 0.0625, 1),  # TTFT 62.5, one token: TPOT 0 (vLLM), E2E 62.5
    _ok("completion", [0.5, 1.0], 1.0, 2),  # TTFT 500, TPOT 500, E2E 1000
    RequestResult("f", error="HTTP 503: overloaded", slo_class="completion"),  # never good
]


def test_goodput_vllm_semantics_exact():
    slos = SloConfig(parse_goodput_args(["ttft:250", "tpot:125"]))
    g = compute_goodput(RESULTS, duration_s=2.0, slos=slos)
    # Budgets are inclusive: request 1 has TPOT == 125 and request 2 TTFT == 250, both good.
    assert [is_good(r, slos.default) for r in RESULTS] == [True, True, True, False, False]
    assert (g.good, g.goodput_req_per_s, g.slo_attainment) == (3, 1.5, 0.6)
    chat, completion = g.classes
    assert (chat.name, chat.requests, chat.completed, chat.good, chat.slo_attainment) == (
        "chat",
        2,
        2,
        2,
        1.0,
    )
    assert (completion.requests, completion.completed, completion.good) == (3, 2, 1)
    assert completion.slo_attainment == 1 / 3  # the 503 counts as a miss
    assert chat.ttft == LatencySummary(2, 0.1875, 0.1875, 0.2375, 0.24875)
    assert chat.tpot == LatencySummary(2, 0.125, 0.125, 0.125, 0.125)
    assert completion.tpot == LatencySummary(1, 0.5, 0.5, 0.5, 0.5)  # one-token request: no TPOT sample
    assert completion.e2e == LatencySummary(2, 0.53125, 0.53125, 0.90625, 0.990625)
    # An E2E budget alone: 625 > 600 fails the first request.
    e2e_only = compute_goodput(RESULTS, 2.0, SloConfig(parse_goodput_args(["e2el:600"])))
    assert (e2e_only.good, e2e_only.goodput_req_per_s) == (2, 1.0)


def test_per_class_slos_override_the_default_metric_by_metric():
    per_class = {"completion": Slo(ttft_ms=500, tpot_ms=500), "chat": Slo(tpot_ms=100)}
    slos = SloConfig(Slo(ttft_ms=250, tpot_ms=125), per_class)
    assert slos.for_class("chat") == Slo(ttft_ms=250, tpot_ms=100)
    assert slos.for_class("other") == Slo(ttft_ms=250, tpot_ms=125)
    g = compute_goodput(RESULTS, 4.0, slos)
    assert [(c.name, c.good, c.slo_attainment) for c in g.classes] == [
        ("chat", 0, 0.0),
        ("completion", 2, 2 / 3),
    ]
    assert (g.good, g.goodput_req_per_s, g.slo_attainment) == (2, 0.5, 0.4)
    # Per-class SLOs alone (no --goodput) still define goodput; a class without budgets has nothing
    # to miss, so its completed requests are good (the 503 is not).
    only_chat = compute_goodput(RESULTS, 4.0, SloConfig(per_class={"chat": Slo(ttft_ms=200)}))
    assert [(c.name, c.good) for c in only_chat.classes] == [("chat", 1), ("completion", 2)]
    assert (only_chat.good, only_chat.slo_attainment) == (3, 0.6)


def test_no_slo_reports_classes_but_no_goodput():
    g = compute_goodput(RESULTS, 2.0, SloConfig())
    assert (g.good, g.goodput_req_per_s, g.slo_attainment) == (None, None, None)
    assert [(c.name, c.requests, c.good, c.slo_attainment) for c in g.classes] == [
        ("chat", 2, None, None),
        ("completion", 3, None, None),
    ]


def test_slo_parsing_and_file(tmp_path):
    assert parse_goodput_args(["ttft:500", "tpot:50.5", "e2el:2000"]) == Slo(500.0, 50.5, 2000.0)
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput_args(bad)
    yaml_path = tmp_path / "slo.yaml"
    yaml_path.write_text("chat: {ttft_ms: 800, tpot_ms: 60}\ncompletion:\n  ttft_ms: 300\n")
    assert load_slo_file(yaml_path) == {"chat": Slo(800.0, 60.0), "completion": Slo(ttft_ms=300.0)}
    json_path = tmp_path / "slo.json"
    json_path.write_text(json.dumps({"chat": {"ttft": 800}}))
    with pytest.raises(ValueError, match="unknown field"):
        load_slo_file(json_path)


# ---------------------------------------------------------------------------------------------
# Gamma arrivals (seeded; tolerances ~5 standard errors at n = 20000)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_mean_and_coefficient_of_variation(burstiness):
    offsets = gamma_arrival_offsets_s(20000, rate_per_s=4.0, burstiness=burstiness, seed=1)
    assert offsets[0] == 0.0 and offsets == gamma_arrival_offsets_s(20000, 4.0, burstiness, seed=1)
    gaps = np.diff(offsets)
    cv = 1 / np.sqrt(burstiness)  # Gamma(k): CV = 1 / sqrt(k)
    assert gaps.mean() == pytest.approx(0.25, rel=5 * cv / np.sqrt(len(gaps)))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_burstiness_orders_the_coefficient_of_variation_and_keeps_poisson():
    cvs = []
    for shape in (0.1, 0.5, 1.0, 2.0):
        gaps = np.diff(gamma_arrival_offsets_s(5000, 2.0, shape, seed=3))
        cvs.append(gaps.std() / gaps.mean())
    assert cvs == sorted(cvs, reverse=True)  # burstier (smaller shape) -> larger CV
    assert poisson_arrival_offsets_s(100, 2.0, seed=3) == gamma_arrival_offsets_s(100, 2.0, 1.0, seed=3)


def test_per_class_arrival_processes():
    classes = ["code"] * 8000 + ["chat"] * 12000
    offsets = class_arrival_offsets_s(classes, rate_per_s=10.0, seed=5, class_burstiness={"code": 0.25})
    assert offsets == class_arrival_offsets_s(classes, 10.0, seed=5, class_burstiness={"code": 0.25})
    code, chat = np.diff(offsets[:8000]), np.diff(offsets[8000:])
    # Rates 10 * 0.4 = 4 and 10 * 0.6 = 6 req/s: both classes span about the same time.
    assert code.mean() == pytest.approx(0.25, rel=0.05) and chat.mean() == pytest.approx(1 / 6, rel=0.05)
    assert code.std() / code.mean() == pytest.approx(2.0, rel=0.1)  # shape 0.25
    assert chat.std() / chat.mean() == pytest.approx(1.0, rel=0.06)  # --burstiness default: Poisson
    # Without per-class shapes: one process over all requests in order (vllm bench).
    assert class_arrival_offsets_s(classes[:50], 10.0, seed=5) == gamma_arrival_offsets_s(50, 10.0, 1.0, 5)


# ---------------------------------------------------------------------------------------------
# Request bodies and an end-to-end goodput sweep against the stub
# ---------------------------------------------------------------------------------------------


def test_row_fields_in_the_request_body():
    prompt = Prompt("p", "hi", 8, slo_class="chat", endpoint="chat", temperature=0.7, seed=3)
    path, body = build_payload(prompt, RequestOptions(endpoint="completions", temperature=0.0))
    assert path == "/v1/chat/completions"
    assert (body["temperature"], body["seed"], body["slo_class"]) == (0.7, 3, "chat")
    _, body = build_payload(prompt, RequestOptions(send_slo_class=False))
    assert "slo_class" not in body


def test_cli_goodput_sweep_over_request_rates(stub, tmp_path, capsys):
    data = tmp_path / "mix.jsonl"
    rows = [("alpha", "chat"), ("beta", "completion"), ("gamma", "completion"), ("delta", "chat")]
    # Chat rows name their own endpoint, as the bundled production mix's do.
    data.write_text("".join(json.dumps({"id": k, "prompt": k, "slo_class": c, **({"endpoint": "chat"} if c == "chat" else {})})
                            + "\n" for k, c in rows))
    slo_file = tmp_path / "slo.yaml"
    # The stub never sends a first token before 100 ms (TTFT_MS), so no chat request can meet 50 ms
    # however the machine's load shifts its chunks. (A TPOT budget cannot be relied on to fail: a
    # loaded loop that wakes late sends the overdue chunks back to back.)
    slo_file.write_text("chat: {ttft_ms: 50}\n")
    config_file = tmp_path / "sweep.yaml"
    config_file.write_text(f"- {{name: stub, base_url: '{stub.base_url}'}}\n")
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    argv = [
        "--sweep",
        "--config-file",
        str(config_file),
        "--baseline",
        "stub",
        "--request-rate-list",
        "20,40",
    ]
    argv += ["--dataset", str(data), "--num-requests", "4", "--warmup-requests", "0", "--no-progress"]
    argv += ["--goodput", "ttft:5000", "--slo-file", str(slo_file), "--class-burstiness", "completion:0.5"]
    assert main(argv + ["--save-result", str(out), "--plot", str(plots)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert result["machine"]["num_cpus"] == os.cpu_count() and len(result["machine"]["load_avg"]) == 3
    assert [(r["shape"]["request_rate_per_s"], r["shape"]["class_burstiness"]) for r in runs] == [
        (20.0, {"completion": 0.5}),
        (40.0, {"completion": 0.5}),
    ]
    for run in runs:
        g = run["goodput"]
        # Completions (TTFT ~100 ms) meet the default 5 s budget, chats fail their 50 ms one.
        assert {c["name"]: (c["requests"], c["good"]) for c in g["classes"]} == {
            "chat": (2, 0),
            "completion": (2, 2),
        }
        assert g["goodput_req_per_s"] == 2 / run["metrics"]["duration_s"]
    assert sorted(b["slo_class"] for b in stub.config.requests) == ["chat"] * 4 + ["completion"] * 4
    assert (plots / "goodput_vs_load.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert (
        "Goodput (req/s) and SLO attainment per class" in printed
        and "class chat (TTFT<=50 ms)" in printed
    )
    assert re.search(r"Endpoint / load:\s+chat \+ completions, Poisson \[completion: 0.5\] 20 req/s", printed)
    # Each load point's rows carry its offered rate (two lines per configuration looked the same).
    for table in ("Sweep results", "Ratios vs baseline"):
        header, *rows = printed.split(table, 1)[1].splitlines()[1:4]
        assert header.split()[:4] == ["config", "conc", "req/s", "in"], table
        assert [row.split()[2] for row in rows if row.startswith("stub")] == ["20", "40"], table
