"""Serving benchmark metrics: pure functions exactly, and a full run against the scripted stub.

Pure metric tests use binary-exact inputs and compare with ``==`` (no tolerance). The stub test
compares what the client measured with what the stub logged it did within ``TOL_S`` (sleeps are
real, and a loaded machine makes them late: the script is only a lower bound), and
checks that every aggregate equals an independent recomputation from the recorded timestamps exactly.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from benchmarks.serving.acceptance import (
    SpecDecodeCounters,
    acceptance_metrics,
    add_counters,
    counter_deltas,
    parse_spec_decode_counters,
)
from benchmarks.serving.client import RequestResult
from benchmarks.serving.loadgen import LoadShape
from benchmarks.serving.metrics import (
    LatencySummary,
    compute_metrics,
    inter_chunk_latencies_s,
    summarize,
    tpot_s,
    ttft_s,
)
from benchmarks.serving.report import format_run
from tests.benchmarks.helpers import (
    MEASURED,
    TOL_S,
    assert_client_saw,
    assert_summary_close,
    assert_summary_exact,
    closed_loop_starts,
    run,
    scripted,
    served,
)
from tests.benchmarks.stub_server import SCRIPTS, StubConfig, StubServer

# ---------------------------------------------------------------------------------------------
# Pure metric functions (exact)
# ---------------------------------------------------------------------------------------------


def test_ttft_and_inter_chunk_latencies_exact():
    offsets = [0.125, 0.25, 0.375, 0.875]
    assert ttft_s(offsets) == 0.125
    assert inter_chunk_latencies_s(offsets) == [0.125, 0.125, 0.5]
    assert ttft_s([]) is None
    assert inter_chunk_latencies_s([0.5]) == []


def test_tpot_exact_and_undefined_for_one_token():
    assert tpot_s(e2e_s=0.875, first_token_s=0.125, output_tokens=4) == 0.25
    assert tpot_s(e2e_s=0.5, first_token_s=0.125, output_tokens=2) == 0.375
    assert tpot_s(e2e_s=0.5, first_token_s=0.125, output_tokens=1) is None
    assert tpot_s(e2e_s=0.5, first_token_s=0.125, output_tokens=0) is None


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([2.0, 1.0], LatencySummary(2, 1.5, 1.5, 1.9, 1.99)),
        ([0.5, 0.25, 1.0, 0.75, 0.0], LatencySummary(5, 0.5, 0.5, 0.9, 0.99)),
        ([i / 4 for i in range(100, -1, -1)], LatencySummary(101, 12.5, 12.5, 22.5, 24.75)),
        ([0.25, 0.0625, 0.125], LatencySummary(3, 0.4375 / 3, 0.125, 0.225, 0.2475)),
        ([0.375], LatencySummary(1, 0.375, 0.375, 0.375, 0.375)),
        ([], LatencySummary(0, None, None, None, None)),
    ],
)
def test_summarize_linear_percentiles_exact(values, expected):
    # p90 of [1, 2]: index 0.9 between 1 and 2 -> 1.9; p99 of 0..25 step 0.25: index 99 -> 24.75.
    assert summarize(values) == expected


def _ok(offsets, e2e, tokens, prompt_tokens=10) -> RequestResult:
    return RequestResult("x", True, 0.0, e2e, list(offsets), tokens, prompt_tokens)


def test_compute_metrics_exact_on_synthetic_requests():
    results = [
        _ok([0.125, 0.25, 0.5], e2e=0.5, tokens=5),  # ITLs 0.125, 0.25; TPOT 0.375/4 = 0.09375
        _ok([0.25, 0.375], e2e=0.5, tokens=3),  # ITL 0.125; TPOT 0.25/2 = 0.125
        _ok([0.0625], e2e=0.0625, tokens=1),  # no ITL, no TPOT
        RequestResult("f1", error="HTTP 400: bad"),
        RequestResult("f2", error="timeout after 1 s"),
        RequestResult("f3", error="HTTP 400: bad"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 3)
    assert m.failure_reasons == {"HTTP 400: bad": 2, "timeout after 1 s": 1}
    assert (m.total_output_tokens, m.total_prompt_tokens) == (9, 30)
    assert m.request_throughput_per_s == 1.5
    assert m.output_throughput_tok_per_s == 4.5
    assert m.ttft == LatencySummary(3, 0.4375 / 3, 0.125, 0.225, 0.2475)
    assert m.itl == LatencySummary(3, 0.5 / 3, 0.125, 0.225, 0.2475)
    assert m.tpot == LatencySummary(2, 0.109375, 0.109375, 0.121875, 0.1246875)
    assert m.e2e == LatencySummary(3, 1.0625 / 3, 0.5, 0.5, 0.5)
    assert compute_metrics([], duration_s=0.0).request_throughput_per_s is None


METRICS_BEFORE = """\
# TYPE specmoe:spec_decode_num_drafts_total counter
specmoe:spec_decode_num_drafts_total{engine="0"} 10.0
specmoe:spec_decode_num_drafts_total{engine="1"} 6.0
# TYPE specmoe:spec_decode_num_draft_tokens_total counter
specmoe:spec_decode_num_draft_tokens_total{engine="0"} 40.0
specmoe:spec_decode_num_draft_tokens_total{engine="1"} 24.0
# TYPE specmoe:spec_decode_num_accepted_tokens_total counter
specmoe:spec_decode_num_accepted_tokens_total{engine="0"} 20.0
# TYPE specmoe:spec_decode_num_accepted_tokens_per_pos_total counter
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 7.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 4.0
# TYPE specmoe:spec_decode_num_drafts_created gauge
specmoe:spec_decode_num_drafts_created{engine="0"} 1.7e9
"""
# After: +16 drafts, +64 draft tokens, +24 accepted (engine 1 appears for the first time),
# per position +14, +7, +3 (engine 1 position 3 absent before, +0).
METRICS_AFTER = """\
specmoe:spec_decode_num_drafts_total{engine="0"} 20.0
specmoe:spec_decode_num_drafts_total{engine="1"} 12.0
specmoe:spec_decode_num_draft_tokens_total{engine="0"} 80.0
specmoe:spec_decode_num_draft_tokens_total{engine="1"} 48.0
specmoe:spec_decode_num_accepted_tokens_total{engine="0"} 36.0
specmoe:spec_decode_num_accepted_tokens_total{engine="1"} 8.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 17.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 6.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 12.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="1"} 2.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 7.0
specmoe:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="3"} 0.0
specmoe:other_total 99.0
"""


def test_parse_counters_sums_label_sets_except_position():
    parsed = parse_spec_decode_counters(METRICS_AFTER)
    assert parsed == SpecDecodeCounters(32.0, 128.0, 44.0, {0: 23.0, 1: 14.0, 2: 7.0, 3: 0.0})


def test_acceptance_from_counter_deltas_exact():
    delta = counter_deltas(
        parse_spec_decode_counters(METRICS_BEFORE), parse_spec_decode_counters(METRICS_AFTER)
    )
    assert delta == SpecDecodeCounters(16.0, 64.0, 24.0, {0: 14.0, 1: 7.0, 2: 3.0, 3: 0.0})
    acc = acceptance_metrics(delta)
    assert acc.acceptance_rate == 0.375  # 24 / 64
    assert acc.mean_acceptance_length == 2.5  # 1 + 24 / 16
    assert acc.per_position == {0: 0.875, 1: 0.4375, 2: 0.1875, 3: 0.0}


def test_acceptance_missing_metrics_is_none_not_a_crash():
    empty = acceptance_metrics(
        counter_deltas(parse_spec_decode_counters("# nothing\n"), parse_spec_decode_counters("up 1\n"))
    )
    assert (empty.acceptance_rate, empty.mean_acceptance_length, empty.per_position) == (None, None, {})
    assert parse_spec_decode_counters(None) is None
    assert parse_spec_decode_counters("this is {not prometheus") is None
    assert counter_deltas(None, parse_spec_decode_counters(METRICS_AFTER)) == SpecDecodeCounters()
    # A counter that went down (server restarted) gives n/a rather than a negative delta.
    assert (
        counter_deltas(
            parse_spec_decode_counters(METRICS_AFTER), parse_spec_decode_counters(METRICS_BEFORE)
        ).drafts
        is None
    )
    # Zero drafts: no division by zero.
    zero = SpecDecodeCounters(0.0, 0.0, 0.0, {0: 0.0})
    assert acceptance_metrics(zero).mean_acceptance_length is None


def test_add_counters_exact():
    a = SpecDecodeCounters(2.0, 8.0, 3.0, {0: 2.0, 1: 1.0})
    b = SpecDecodeCounters(4.0, 16.0, 5.0, {0: 3.0, 2: 2.0})
    assert add_counters(a, b) == SpecDecodeCounters(6.0, 24.0, 8.0, {0: 5.0, 1: 1.0, 2: 2.0})
    assert add_counters(a, SpecDecodeCounters()).drafts is None


# ---------------------------------------------------------------------------------------------
# Against the scripted stub server
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 2])
def test_metrics_against_scripted_server(stub, concurrency):
    result = run(stub, MEASURED, LoadShape(concurrency=concurrency), warmup=["alpha"])
    by_key = {r.prompt_id: r for r in result.results}
    assert list(by_key) == MEASURED  # results come back in dispatch order
    ok = [k for k in MEASURED if k != "fail"]

    # Per request, against what the stub did (its log of sends, on the client's clock). Send times
    # and the duration get twice the tolerance: each request's client/connection overhead (~1-3 ms)
    # adds up along a worker's sequence.
    durations_s = [by_key[k].e2e_s if k != "fail" else 0.0 for k in MEASURED]
    starts, makespan_s = closed_loop_starts(durations_s, concurrency)
    for key, start_s in zip(MEASURED, starts, strict=True):
        r = by_key[key]
        assert r.start_s == pytest.approx(start_s, abs=2 * TOL_S), key
        if key == "fail":
            assert not r.success and r.error == "HTTP 400: scripted failure: prompt is too long"
            continue
        exp = served(stub, key)
        assert r.success and r.error is None
        assert (r.output_tokens, r.prompt_tokens) == (SCRIPTS[key].output_tokens, SCRIPTS[key].prompt_tokens)
        assert len(r.chunk_offsets_s) == len(SCRIPTS[key].chunk_tokens), key
        assert_client_saw(r, exp)
        # The stub kept to its script: nothing early (a loaded machine may only make it late).
        assert np.all(np.array(exp["offsets"]) >= np.array(scripted(key)["offsets"]) - 1e-3), key

    m = result.metrics
    assert (m.completed, m.failed) == (4, 1)
    assert m.failure_reasons == {"HTTP 400: scripted failure: prompt is too long": 1}
    assert (m.total_output_tokens, m.total_prompt_tokens) == (6 + 3 + 1 + 8, 11 + 7 + 5 + 13)
    assert m.duration_s == pytest.approx(makespan_s, abs=2 * TOL_S)
    assert m.request_throughput_per_s == 4 / m.duration_s
    assert m.output_throughput_tok_per_s == 18 / m.duration_s

    # Aggregates: exactly the definitions applied to the recorded timestamps ...
    recorded = [by_key[k] for k in ok]
    ttfts = [r.chunk_offsets_s[0] for r in recorded]
    itls = [b - a for r in recorded for a, b in pairwise(r.chunk_offsets_s)]
    tpots = [
        (r.e2e_s - r.chunk_offsets_s[0]) / (r.output_tokens - 1) for r in recorded if r.output_tokens > 1
    ]
    assert_summary_exact(m.ttft, ttfts)
    assert_summary_exact(m.itl, itls)
    assert_summary_exact(m.tpot, tpots)
    assert_summary_exact(m.e2e, [r.e2e_s for r in recorded])
    # ... and close to what the stub did (scripted TPOTs: 20 ms, 40 ms, 100/7 ms; gamma has one token).
    # TTFT and e2e include each request's trip to the stub (up to 2 TOL_S, see assert_client_saw).
    assert_summary_close(m.ttft, [served(stub, k)["offsets"][0] for k in ok], tol_s=2 * TOL_S)
    assert_summary_close(m.itl, [g for k in ok for g in served(stub, k)["itls"]])
    assert [scripted(k)["tpot"] for k in ok] == pytest.approx([0.020, 0.040, None, 0.100 / 7])
    assert_summary_close(m.tpot, [t for k in ok if (t := served(stub, k)["tpot"]) is not None])
    assert_summary_close(m.e2e, [served(stub, k)["e2e"] for k in ok], tol_s=2 * TOL_S)
    assert m.itl.count == 4 + 2 + 0 + 5

    # Acceptance: deltas of the measured requests only (the warm-up's increments came before).
    a = result.acceptance
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (12.0, 36.0, 12.0)
    assert a.acceptance_rate == 12 / 36
    assert a.mean_acceptance_length == 2.0
    assert a.per_position == {0: 8 / 12, 1: 3 / 12, 2: 1 / 12}
    assert (result.not_sent, result.warmup_failed) == (0, 0)

    # What was sent: warm-up first, model from /v1/models, no ignore_eos, usage requested.
    sent = stub.config.requests
    assert [b["prompt"] for b in sent][0] == "alpha" and len(sent) == 6
    for body in sent:
        assert body["model"] == "stub-model" and body["temperature"] == 0.0 and body["max_tokens"] == 16
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "ignore_eos" not in body

    table = format_run(result)
    assert "1 x HTTP 400: scripted failure: prompt is too long" in table
    assert "Mean acceptance length:" in table and "2.0000" in table


@pytest.mark.parametrize("config", [StubConfig(spec_metrics=False), StubConfig(metrics_status=404)])
def test_missing_spec_metrics_reported_as_na(config):
    server = StubServer(config).start()
    try:
        result = run(server, ["gamma"], LoadShape(concurrency=1))
    finally:
        server.stop()
    a = result.acceptance
    assert (a.num_drafts, a.acceptance_rate, a.mean_acceptance_length, a.per_position) == (
        None,
        None,
        None,
        {},
    )
    assert result.metrics.completed == 1
    table = format_run(result)
    assert "Acceptance rate:" in table and "n/a" in table
