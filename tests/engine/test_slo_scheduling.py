"""Latency budgets in the scheduler: priorities, earliest-deadline order, refusal, attainment.

Chunk sizing at the policy level (no engine) is in tests/engine/test_slo_chunk_sizing.py."""

import time

import msgspec
import pytest

from engine.drafters.base import NoneDrafter
from engine.engine import LLMEngine
from engine.errors import QueueFull
from engine.outputs import RequestMetrics
from engine.request_ranges import RequestError
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from engine.slo import DeadlineUnattainable, SLOClass, request_slo_met
from engine.slo_budget import prefill_token_limit, wait_estimate_s
from engine.spec_cost import prefill_attention_pairs
from tests.engine.bundled import loaded_target, prompt_ids

CLASSES = {"interactive": SLOClass(ttft_ms=100.0, tpot_ms=50.0), "batch": SLOClass(ttft_ms=60_000.0),
           "impossible": SLOClass(tpot_ms=1e-6)}


def engine_with(policy="fcfs", seqs=1, **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=4096, max_waiting=100,
                            scheduling_policy=policy, slo_classes=CLASSES, **kw)
    return LLMEngine(loaded_target(), NoneDrafter(), 0, sched)


def admission_order(engine, requests) -> list[str]:
    """Add ``requests`` [(id, params)] while one blocker holds the only slot; return the order
    in which they are first scheduled."""
    p = prompt_ids(8, 40)
    engine.add_request("blocker", p[0], SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()
    for i, (rid, params) in enumerate(requests):
        engine.add_request(rid, p[i + 1], params, arrival_time_s=100.0 + i)
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in order and out.request_id != "blocker":
                order.append(out.request_id)
    return order


def test_priority_policy_runs_lower_priority_values_first_then_arrival():
    mk = lambda prio: SamplingParams(temperature=0.0, max_tokens=1, priority=prio)  # noqa: E731
    reqs = [("p5", mk(5)), ("p0", mk(0)), ("p3", mk(3)), ("p0b", mk(0))]
    assert admission_order(engine_with("priority"), reqs) == ["p0", "p0b", "p3", "p5"]


def test_a_priority_under_fcfs_is_refused_as_vllm_does():
    """It used to be accepted and ignored; vLLM answers 400 (priority scheduling not enabled)."""
    engine = engine_with("fcfs")
    with pytest.raises(RequestError, match=r"'priority' 5 needs priority scheduling.*scheduling_policy: fcfs") as err:
        engine.add_request("p5", prompt_ids(1, 40)[0], SamplingParams(temperature=0.0, max_tokens=1, priority=5))
    assert err.value.param == "priority" and not engine.has_unfinished_requests()
    engine.add_request("p0", prompt_ids(1, 40)[0], SamplingParams(temperature=0.0, max_tokens=1, priority=0))
    assert engine.has_unfinished_requests()


def test_slo_policy_runs_the_earliest_ttft_deadline_first():
    mk = lambda c: SamplingParams(temperature=0.0, max_tokens=1, slo_class=c)  # noqa: E731
    # Arrivals 100, 101, 102 s: deadlines 160.0, 101.1, 102 + inf (no budget).
    reqs = [("batch", mk("batch")), ("interactive", mk("interactive")), ("none", mk(None))]
    assert admission_order(engine_with("slo"), reqs) == ["interactive", "batch", "none"]


def test_unknown_classes_are_refused_with_the_field_named():
    with pytest.raises(RequestError, match="slo_class") as refused:
        engine_with().add_request("x", [1, 2, 3], SamplingParams(slo_class="gold"))
    assert refused.value.param == "slo_class" and "'gold'" in str(refused.value)
    with pytest.raises(ValueError, match="default_slo_class"):
        SchedulerConfig(default_slo_class="gold")


def test_unattainable_ttft_is_refused_as_queue_full_and_admitted_requests_finish():
    engine = engine_with(seqs=4, refuse_unattainable_ttft=True)
    p = prompt_ids(12, 200)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i in range(3):  # the cost model learns real step times
        engine.add_request(f"warm{i}", p[i], params)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(8):  # 8 x 200 prompt tokens queued
        engine.add_request(f"q{i}", p[i], params)
    tight = SamplingParams(temperature=0.0, max_tokens=4, slo_class="interactive")
    five_steps_ms = 5 * engine.controller.predict_step_s(64) * 1e3
    assert five_steps_ms > 0  # the cost model has learned
    engine.scheduler.config = SchedulerConfig(  # 1600 + 200 tokens at 64 a step: 29 steps > 5
        max_num_seqs=4, max_num_batched_tokens=64, max_waiting=100, refuse_unattainable_ttft=True,
        slo_classes={"interactive": SLOClass(ttft_ms=five_steps_ms)})
    with pytest.raises(DeadlineUnattainable) as err:
        engine.add_request("late", p[9], tight)
    assert isinstance(err.value, QueueFull) and "TTFT budget" in str(err.value)
    engine.add_request("patient", p[10], SamplingParams(temperature=0.0, max_tokens=4))  # no budget: admitted
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert sorted(outs) == sorted([f"q{i}" for i in range(8)] + ["patient"])
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs.values())


def test_attainment_counts_match_a_scripted_run():
    engine = engine_with(seqs=4, default_slo_class="batch")
    p = prompt_ids(6, 40)
    plan = {"a": None, "b": "batch", "c": "impossible", "d": "impossible", "e": "interactive"}
    reqs = {rid: engine.add_request(rid, p[i], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                                slo_class=c))
            for i, (rid, c) in enumerate(plan.items())}
    while engine.has_unfinished_requests():
        engine.step()
    totals = engine.get_metrics()["slo_attainment"]
    expected = {}
    for rid, c in plan.items():
        name = c or "batch"
        met = request_slo_met(CLASSES[name], reqs[rid].metrics, 5)
        expected.setdefault(name, [0, 0])
        expected[name][0] += int(met)
        expected[name][1] += 1
    assert totals == expected
    assert totals["batch"] == [2, 2] and totals["impossible"] == [0, 2]


def test_request_slo_met_follows_vllm_bench_definitions():
    m = RequestMetrics(arrival_time_s=10.0, first_token_time_s=10.2, finished_time_s=11.2)
    assert request_slo_met(SLOClass(ttft_ms=200.0, tpot_ms=100.0), m, 11)  # TPOT = 1 s / 10 = 100 ms
    assert not request_slo_met(SLOClass(ttft_ms=199.0), m, 11)
    assert not request_slo_met(SLOClass(tpot_ms=99.0), m, 11)


def engine_with_a_learned_tpot_class():
    """An engine whose cost model has seen steps of 10, 100 and 300 tokens (so it can tell token
    counts apart), with an ``interactive`` class whose TPOT budget (``tpot_ms``, returned) fits
    a step prefilling a 300-token prompt (its attention work included); and the prompts
    ``prompt_ids(30, 400)``."""
    engine = engine_with(seqs=4, enable_chunked_prefill=True)
    p = prompt_ids(30, 400)
    for n in (10, 100, 300):
        engine.add_request(f"w{n}", p[n % 7][:n], SamplingParams(temperature=0.0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    tpot_ms = _fresh_chunk_step_s(engine.controller, 0)(300) * 1e3
    engine.scheduler.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                              slo_classes={"interactive": SLOClass(tpot_ms=tpot_ms)})
    return engine, p, tpot_ms


def _fresh_chunk_step_s(controller, decode_tokens: int):
    """Predicted step seconds for a step's target tokens whose chunk starts a prompt (position 0)."""
    return lambda tokens: controller.predict_step_s(
        tokens, prefill_pairs=prefill_attention_pairs(0, tokens - decode_tokens))


def test_tpot_budgets_cap_the_prefill_chunk():
    linear = lambda tokens: 0.005 + 0.0001 * tokens  # noqa: E731  (5 ms + 0.1 ms a token)
    assert prefill_token_limit([50.0, 20.0], 10, 4096, linear) == 140  # 5 + 0.1 * (10 + 140) = 20 ms
    assert prefill_token_limit([], 10, 4096, linear) is None
    assert prefill_token_limit([5.0], 10, 4096, linear) == 0
    assert prefill_token_limit([1000.0], 10, 256, linear) == 246  # the token budget binds first
    assert prefill_token_limit([20.0], 10, 4096, lambda t: 0.0) is None  # nothing learned yet
    engine, p, tpot_ms = engine_with_a_learned_tpot_class()
    engine.add_request("short", p[0][:20], SamplingParams(temperature=0.0, max_tokens=40, slo_class="interactive"))
    engine.step()
    engine.add_request("long", [t for q in p[1:6] for t in q][:900], SamplingParams(temperature=0.0, max_tokens=2))
    short = engine._requests["short"][0]  # its TPOT budget already spent: no slack, the flat cap
    short.request.metrics.first_token_time_s = time.monotonic() - 39 * tpot_ms / 1e3
    limit = engine.slo.prefill_limit([short], 1)
    assert limit == prefill_token_limit([tpot_ms], 1, 4096, _fresh_chunk_step_s(engine.controller, 1))
    assert limit is not None and 100 < limit < 900
    out = engine.scheduler.schedule(engine.kv.num_free, engine._decode_cost, limit)
    assert out.chunks["long-0"] == limit and [s.seq_id for s in out.decodes] == ["short-0"]


def test_slo_policy_puts_a_due_prompt_before_a_started_long_prefill():
    """Chunked prefill at 64 tokens a step: a 300-token batch prompt is mid-prefill when a short
    interactive one (deadline 100 ms) arrives; under "slo" the short one takes the next chunk
    first, under "fcfs" the started prefill keeps the whole budget."""
    long, short = [t for q in prompt_ids(4, 120) for t in q][:300], prompt_ids(5, 40)[4]
    chunks = {}
    for policy in ("slo", "fcfs"):
        engine = LLMEngine(loaded_target(), NoneDrafter(), 0, SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy=policy, slo_classes=CLASSES))
        engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=2, slo_class="batch"))
        engine.step()
        engine.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=2, slo_class="interactive"))
        chunks[policy] = engine.scheduler.schedule(engine.kv.num_free, engine._decode_cost).chunks
    assert chunks["slo"] == {"short-0": len(short), "long-0": 64 - len(short)}
    assert chunks["fcfs"] == {"long-0": 64}


def test_refusal_counts_only_the_prefill_work_scheduled_ahead():
    """Eight queued batch prompts (60 s deadlines) delay an interactive request under "fcfs" but
    not under "slo", where its earlier deadline puts it first: refused there, admitted here."""
    p = prompt_ids(12, 200)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outcome = {}
    for policy in ("fcfs", "slo"):
        engine = engine_with(policy, seqs=4, refuse_unattainable_ttft=True)
        for i in range(3):  # the cost model learns real step times
            engine.add_request(f"warm{i}", p[i], params)
        while engine.has_unfinished_requests():
            engine.step()
        budget_ms = 5 * engine.controller.predict_step_s(64) * 1e3
        engine.scheduler.config = msgspec.structs.replace(
            engine.scheduler.config, max_num_batched_tokens=64,
            slo_classes={**CLASSES, "interactive": SLOClass(ttft_ms=budget_ms)})
        for i in range(8):  # 1600 tokens at 64 a step: 25 steps ahead under fcfs
            engine.add_request(f"q{i}", p[i], SamplingParams(temperature=0.0, max_tokens=4, slo_class="batch"))
        try:
            engine.add_request("urgent", p[9][:100], SamplingParams(temperature=0.0, max_tokens=4,
                                                                    slo_class="interactive"))
            outcome[policy] = "admitted"
        except DeadlineUnattainable:
            outcome[policy] = "refused"
    assert outcome == {"fcfs": "refused", "slo": "admitted"}


def test_refusal_counts_each_queued_prompts_attention_over_itself():
    """The wait before a request's first token includes the causal attention of every prompt
    ahead and its own (quadratic in a prompt's length), not only their tokens: a budget the tokens
    alone would meet is refused once their attention is counted."""
    predict = lambda tokens, pairs=0.0: 0.002 + 1e-5 * tokens + 1e-3 * pairs  # noqa: E731
    p = [ids for ids in prompt_ids(12, 200) if len(ids) == 200]
    tokens_only_s = wait_estimate_s(500, [(float("inf"), 0, 64)], predict)  # 2 x 200 queued + 100, 64 a step
    attention_s = 1e-3 * (2 * prefill_attention_pairs(0, 200) + prefill_attention_pairs(0, 100))
    assert tokens_only_s == pytest.approx(0.021) and attention_s == pytest.approx(0.04525)
    outcome = {}
    for budget_ms in (40.0, 80.0):  # between the two estimates, and above both
        engine = engine_with(seqs=4, refuse_unattainable_ttft=True)
        engine.slo.step_predictor = lambda batch_scale=1.0: predict
        engine.scheduler.config = msgspec.structs.replace(
            engine.scheduler.config, max_num_batched_tokens=64,
            slo_classes={**CLASSES, "interactive": SLOClass(ttft_ms=budget_ms)})
        for i in range(2):
            engine.add_request(f"q{i}", p[i], SamplingParams(temperature=0.0, max_tokens=4, slo_class="batch"))
        try:
            engine.add_request("new", p[2][:100], SamplingParams(temperature=0.0, max_tokens=4,
                                                                 slo_class="interactive"))
            outcome[budget_ms] = "admitted"
        except DeadlineUnattainable as e:
            outcome[budget_ms] = f"refused at {str(e).split('about ')[1].split(' ms')[0]} ms"
    assert outcome == {40.0: f"refused at {1e3 * (tokens_only_s + attention_s):.0f} ms", 80.0: "admitted"}


def test_wait_estimate_is_full_steps_then_the_remainder():
    linear = lambda tokens: 0.005 + 0.0001 * tokens  # noqa: E731
    inf = float("inf")
    assert wait_estimate_s(130, [(inf, 10, 64)], linear) == pytest.approx(2 * linear(74) + linear(12))
    assert wait_estimate_s(128, [(inf, 10, 64)], linear) == pytest.approx(2 * linear(74))
    assert wait_estimate_s(10, [(inf, 10, 0)], linear) == inf
    # 1 step of 64 beside 10 decode tokens, 2 steps that prefill nothing (20 decode tokens), then 100 a step
    phases = [(1, 10, 64), (2, 20, 0), (inf, 0, 100)]
    assert wait_estimate_s(300, phases, linear) == pytest.approx(linear(74) + 2 * linear(20) + 2 * linear(100) + linear(36))
    assert wait_estimate_s(50, phases, linear) == pytest.approx(linear(60))


def test_a_speculating_decode_budgets_the_step_for_every_token_it_is_expected_to_emit():
    """TPOT is per output token: a decode verifying k drafts emits 1 + E[accepted] tokens in the
    step, so the step may take that many TPOT budgets (one budget starved the prefills of a
    speculating batch: 2-3 of 8 requests running at HTTP concurrency 8, the rest waiting)."""
    from types import SimpleNamespace

    from engine.scheduler import Scheduler
    from engine.slo import SLOPolicy
    from engine.spec_controller import Decision, SpeculationController

    controller = SpeculationController(max_k=4)
    for _ in range(50):  # "spec" accepts about 3 of 4 drafts
        controller.observe_acceptances([("spec", 4, 3)])
    controller.last = Decision(k={"spec": 4, "plain": 0})
    expected = controller.expected_tokens("spec", 4)
    acc = controller.acceptance("spec")
    assert expected == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2] + acc.prod())
    assert 3.0 < expected < 4.0 and controller.expected_tokens("spec", 0) == 1.0
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, slo_classes={"i": SLOClass(tpot_ms=20.0)},
                                      default_slo_class="i"))
    policy = SLOPolicy(sched, controller)
    linear = lambda tokens, passes=0, drafted=0, prefill_pairs=0.0: 0.005 + 0.0001 * tokens  # noqa: E731
    controller.predict_step_s = linear
    fresh = SimpleNamespace(metrics=RequestMetrics(arrival_time_s=0.0))  # no first token yet: no slack
    spec = SimpleNamespace(seq_id="spec", params=SamplingParams(max_tokens=8), request=fresh, num_output_tokens=0)
    plain = SimpleNamespace(seq_id="plain", params=SamplingParams(max_tokens=8), request=fresh, num_output_tokens=0)
    # alone, the speculating decode allows 20 ms x E tokens; beside a plain decode, 20 ms binds
    assert policy.prefill_limit([spec], 5) == prefill_token_limit([20.0 * expected], 5, 4096, linear)
    assert policy.prefill_limit([spec], 5) > 4 * prefill_token_limit([20.0], 5, 4096, linear)  # 744 vs 145
    assert policy.prefill_limit([spec, plain], 6) == prefill_token_limit([20.0], 6, 4096, linear) == 144


def test_slack_sized_chunks_in_the_engine():
    """The engine's own chunk: a running decode that has just emitted its first token, with 37
    more to go, has most of its TPOT budget ahead of it and lets the whole ~865-token prompt
    through in one step; the same decode with its budget spent caps the chunk at what one TPOT
    budget allows."""
    engine, p, tpot_ms = engine_with_a_learned_tpot_class()
    engine.add_request("short", p[0][:20], SamplingParams(temperature=0.0, max_tokens=40, slo_class="interactive"))
    for _ in range(3):
        engine.step()
    long = [t for q in p[1:6] for t in q][:900]
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=2))
    short = engine._requests["short"][0]
    assert short.num_output_tokens == 3
    limits = {}
    for name, since_first_s in (("spent", 39 * tpot_ms / 1e3), ("ahead", 0.0)):
        short.request.metrics.first_token_time_s = time.monotonic() - since_first_s
        limits[name] = engine.slo.prefill_limit([short], 1)
    assert len(long) > 800 and 100 < limits["spent"] < len(long)
    assert limits["spent"] == prefill_token_limit([tpot_ms], 1, 4096, _fresh_chunk_step_s(engine.controller, 1))
    assert limits["ahead"] >= len(long) > limits["spent"]
    out = engine.scheduler.schedule(engine.kv.num_free, engine._decode_cost, limits["ahead"])
    assert out.chunks["long-0"] == len(long) and [s.seq_id for s in out.decodes] == ["short-0"]


def test_an_aborted_request_is_not_counted_for_attainment():
    # A request its client abandoned after its first token counted as met (with nothing delivered
    # to the client, a trial saw), so attainment rose with abandoned requests.
    engine = engine_with(seqs=4, default_slo_class="batch")
    p = prompt_ids(3, 40)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("kept", p[0], params)
    engine.add_request("left", p[1], params)
    engine.step()  # both prefilled: each has its first token
    assert engine.abort_request("left")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_metrics()["slo_attainment"] == {"batch": [1, 1]}
