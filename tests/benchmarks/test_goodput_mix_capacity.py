"""`benchmarks/goodput_mix.py --capacity`: a saturated run serves every request, refuses none even
in an SLO-aware engine that refuses at run time, and reports throughput from what it served."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import goodput_mix
from benchmarks.serving.dataset import load_prompts
from engine.slo import SLOClass


def test_capacity_serves_every_request_of_a_saturated_run_with_refusal_switched_off_for_it():
    args = argparse.Namespace(k=0, max_num_seqs=4, max_num_batched_tokens=512, no_refusal=False)
    # A TTFT budget nothing can meet: refusal would turn away nearly every request of a burst.
    classes = {name: SLOClass(ttft_ms=0.001, tpot_ms=25) for name in ("completion", "chat", "long_context")}
    variant = goodput_mix.VARIANTS["slo-aware spec-off"]
    llm = goodput_mix.build_llm(variant, args, classes)
    rows = [p for p in load_prompts(goodput_mix.MIX) if p.max_tokens <= 16]
    prompts, warm = rows[:6], rows[6:9]
    # Steps the cost model learns from, so that refusal has a wait to judge by.
    goodput_mix.drive(llm, goodput_mix.make_jobs(llm, warm, [0.0] * len(warm), True), "warm")
    before = llm.engine.scheduler.config
    assert before.refuse_unattainable_ttft

    cap = goodput_mix.capacity(llm, variant, prompts)

    assert llm.engine.scheduler.config is before  # refusal is back for the rate runs
    jobs = goodput_mix.make_jobs(llm, prompts, [0.0] * len(prompts), True)
    duration_s = len(prompts) / cap["req_per_s"]
    assert cap["output_tok_per_s"] * duration_s == pytest.approx(sum(p.max_tokens for p in prompts))
    assert cap["prompt_tok_per_s"] * duration_s == pytest.approx(sum(len(j.ids) for j in jobs))
