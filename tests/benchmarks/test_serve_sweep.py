"""benchmarks/serve.py end to end: the CLI's single run and sweep (configuration files, servers
started and stopped by command, ratios against a baseline, JSON result, plots)."""

from __future__ import annotations

import json
import shlex
import socket
import sys
from pathlib import Path

import pytest

from benchmarks.serve import main
from benchmarks.serving.dataset import load_prompts, sample_prompts
from benchmarks.serving.runner import BenchmarkRun
from benchmarks.serving.sweep import ServerConfig, baseline_ratios, load_server_configs
from tests.benchmarks.helpers import write_prompts
from tests.benchmarks.stub_server import SCRIPTS

REPO = Path(__file__).resolve().parents[2]


def test_load_server_configs_yaml_json_and_errors(tmp_path):
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(
        "configs:\n"
        "  - {name: speculation_off, base_url: 'http://127.0.0.1:1'}\n"
        "  - name: draft_k4\n"
        "    start_cmd: serve --port {port} --k 4\n"
        "    ready_url: http://127.0.0.1:{port}/health\n"
        "    env: {A: '1'}\n"
    )
    configs = load_server_configs(yaml_path)
    assert [c.name for c in configs] == ["speculation_off", "draft_k4"]
    assert configs[1] == ServerConfig(
        "draft_k4",
        start_cmd="serve --port {port} --k 4",
        ready_url="http://127.0.0.1:{port}/health",
        env={"A": "1"},
    )
    assert [c.name for c in load_server_configs(yaml_path, ["draft_k4", "speculation_off"])] == [
        "draft_k4",
        "speculation_off",
    ]
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps([{"name": "a", "base_url": "http://127.0.0.1:2"}]))
    assert load_server_configs(json_path)[0].base_url == "http://127.0.0.1:2"
    with pytest.raises(ValueError, match="no configuration named"):
        load_server_configs(yaml_path, ["ngram"])
    json_path.write_text(json.dumps([{"name": "a", "base_ulr": "typo"}]))
    with pytest.raises(ValueError, match="unknown field"):
        load_server_configs(json_path)
    json_path.write_text(json.dumps([{"name": "a"}]))
    with pytest.raises(ValueError, match="base_url or a start_cmd"):
        load_server_configs(json_path)


def _fake_run(label: str, concurrency: int, tok_per_s: float, itl_p50_s: float) -> BenchmarkRun:
    """A BenchmarkRun carrying only what the ratios read."""
    from benchmarks.serving.loadgen import LoadShape
    from benchmarks.serving.metrics import LatencySummary

    class Metrics:  # duck-typed: baseline_ratios reads these attributes only
        output_throughput_tok_per_s = tok_per_s
        itl = LatencySummary(1, itl_p50_s, itl_p50_s, itl_p50_s, 2 * itl_p50_s)
        tpot = LatencySummary(0, None, None, None, None)

    return BenchmarkRun(label, "", LoadShape(concurrency=concurrency), None, [], Metrics(), None, None, 0, 0)


def test_baseline_ratios_exact():
    runs = [
        _fake_run("off", 1, 40.0, 0.5),
        _fake_run("off", 2, 64.0, 0.5),
        _fake_run("k4", 1, 100.0, 0.25),
        _fake_run("k4", 2, 96.0, 0.125),
        _fake_run("k4", 8, 1.0, 1.0),
    ]
    rows = {(r.name, r.concurrency): r for r in baseline_ratios(runs, "off")}
    assert set(rows) == {("off", 1), ("off", 2), ("k4", 1), ("k4", 2)}  # no baseline at c=8
    assert (rows["k4", 1].output_throughput, rows["k4", 1].itl_p50, rows["k4", 1].itl_p99) == (2.5, 0.5, 0.5)
    assert (rows["k4", 2].output_throughput, rows["k4", 2].itl_p50) == (1.5, 0.25)
    assert rows["off", 2].output_throughput == 1.0 and rows["k4", 1].tpot_p50 is None
    assert baseline_ratios(runs, "missing") == []


def test_cli_single_run_writes_json_and_plots(stub, tmp_path, capsys):
    data = write_prompts(tmp_path / "p.jsonl", ["alpha", "beta", "gamma", "delta", "fail"])
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    status = main(
        [
            "--base-url",
            stub.base_url,
            "--dataset",
            str(data),
            "--num-requests",
            "5",
            "--warmup-requests",
            "1",
            "--concurrency",
            "2",
            "--seed",
            "3",
            "--max-tokens",
            "24",
            "--save-result",
            str(out),
            "--plot",
            str(plots),
            "--no-progress",
        ]
    )
    assert status == 0
    result = json.loads(out.read_text())
    expected = sample_prompts(load_prompts(data, 24), 6, seed=3)
    assert [r["prompt_id"] for r in result["results"]] == [p.id for p in expected[1:]]
    metrics = result["metrics"]
    assert metrics["completed"] + metrics["failed"] == 5
    assert metrics["request_throughput_per_s"] == metrics["completed"] / metrics["duration_s"]
    assert {b["max_tokens"] for b in stub.config.requests} == {24}
    assert result["acceptance"]["mean_acceptance_length"] is not None
    assert (plots / "latency_cdf.png").stat().st_size > 0
    assert "Serving benchmark: default" in capsys.readouterr().out


def _refuses_connections(base_url: str) -> bool:
    host, port = base_url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_cli_sweep_starts_stops_servers_and_compares(stub, tmp_path, capsys):
    data = write_prompts(tmp_path / "p.jsonl", ["alpha", "beta", "delta"])
    # "& wait" keeps the shell alive as the child's parent: stopping must kill the whole group.
    start_cmd = f"{shlex.quote(sys.executable)} -m tests.benchmarks.stub_server --port {{port}} --itl-scale 0.5 & wait"
    config_file = tmp_path / "sweep.json"
    config_file.write_text(
        json.dumps(
            {
                "configs": [
                    {"name": "speculation_off", "base_url": stub.base_url},
                    {"name": "faster", "start_cmd": start_cmd, "cwd": str(REPO), "startup_timeout_s": 30},
                    {"name": "broken", "start_cmd": "exit 3", "startup_timeout_s": 10},
                    {"name": "unused", "base_url": "http://127.0.0.1:9"},
                ]
            }
        )
    )
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    status = main(
        [
            "--sweep",
            "--concurrency-list",
            "1,2",
            "--config-file",
            str(config_file),
            "--configs",
            "speculation_off,faster,broken",
            "--dataset",
            str(data),
            "--num-requests",
            "3",
            "--warmup-requests",
            "1",
            "--save-result",
            str(out),
            "--plot",
            str(plots),
            "--no-progress",
            "--server-log-dir",
            str(tmp_path / "logs"),
        ]
    )
    assert status == 1  # one configuration failed to start
    result = json.loads(out.read_text())
    runs = {(r["label"], r["shape"]["concurrency"]): r for r in result["runs"]}
    assert list(runs) == [("speculation_off", 1), ("speculation_off", 2), ("faster", 1), ("faster", 2)]
    assert all(r["metrics"]["completed"] == 3 for r in runs.values())
    (failure,) = result["failures"]
    assert failure["name"] == "broken" and "exited with code 3" in failure["reason"]
    assert (tmp_path / "logs" / "faster.log").exists()
    assert _refuses_connections(runs["faster", 1]["base_url"])  # process group gone

    ratios = {(r["name"], r["concurrency"]): r for r in result["ratios_vs_baseline"]}
    for c in (1, 2):
        base, fast, row = (
            runs["speculation_off", c]["metrics"],
            runs["faster", c]["metrics"],
            ratios["faster", c],
        )
        assert row["itl_p50"] == fast["itl"]["median_s"] / base["itl"]["median_s"]
        assert row["tpot_p99"] == fast["tpot"]["p99_s"] / base["tpot"]["p99_s"]
        assert row["output_throughput"] == (
            fast["output_throughput_tok_per_s"] / base["output_throughput_tok_per_s"]
        )
        assert row["itl_p50"] == pytest.approx(0.5, abs=0.2)  # the faster server's gaps are halved
        assert row["output_throughput"] > 1.0
        assert ratios["speculation_off", c]["itl_p50"] == 1.0

    # Acceptance per configuration sums both runs' deltas: 2 x the scripted counters of the
    # measured prompts (the default seed 0 sample after one warm-up prompt).
    measured = [SCRIPTS[p.prompt] for p in sample_prompts(load_prompts(data), 4, seed=0)[1:]]
    drafts = 2 * sum(s.drafts for s in measured)
    per_pos = [2 * sum(s.accepted_per_pos[i] for s in measured) for i in range(3)]
    acc = result["acceptance_by_config"]["speculation_off"]
    assert (acc["num_drafts"], acc["num_draft_tokens"], acc["num_accepted_tokens"]) == (
        drafts,
        2 * sum(s.draft_tokens for s in measured),
        sum(per_pos),
    )
    assert acc["per_position"] == {str(i): n / drafts for i, n in enumerate(per_pos)}
    assert acc["mean_acceptance_length"] == 1 + sum(per_pos) / drafts
    for name in (
        "latency_cdf",
        "throughput_vs_concurrency",
        "p99_latency_vs_concurrency",
        "acceptance_per_position",
    ):
        assert (plots / f"{name}.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Ratios vs baseline 'speculation_off'" in printed and "FAILED configuration broken" in printed


def test_cli_sweep_names_without_a_config_file_are_an_error(capsys):
    """``--configs`` alone used to run one 'default' configuration against --base-url, silently."""
    with pytest.raises(SystemExit) as exc:
        main(["--sweep", "--configs", "speculation_off,adaptive_k8", "--base-url", "http://127.0.0.1:9"])
    assert exc.value.code == 2
    assert "--configs names configurations of a --config-file" in capsys.readouterr().err
