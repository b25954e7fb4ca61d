"""Prefill chunk sizing under latency budgets, at the policy level (engine.slo.SLOPolicy with a
fixed clock and a linear step cost, no engine): TPOT slack lets a larger chunk through, an ITL
budget caps it, the wait estimate frees the budget as running decodes finish, and a cap the
decode-only step already exceeds caps nothing. The engine-level tests of the same budgets are
in tests/engine/test_slo_scheduling.py."""

import math

import msgspec
import pytest

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from engine.slo import SLOClass
from engine.slo_budget import prefill_token_limit, wait_estimate_s


def policy_at_1000_s(monkeypatch, slo_classes: dict, **config):
    """An SLO policy over ``slo_classes`` whose clock reads 1000 s, with a controller that drafts
    nothing and costs a step 5 ms + 0.1 ms a target token; returns it and that cost function."""
    from types import SimpleNamespace

    from engine import slo as slo_module
    from engine.scheduler import Scheduler
    from engine.slo import SLOPolicy
    from engine.spec_controller import Decision, SpeculationController

    monkeypatch.setattr(slo_module, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    controller = SpeculationController(max_k=4)
    controller.last = Decision(k={})
    linear = lambda tokens, passes=0, drafted=0, prefill_pairs=0.0: 0.005 + 0.0001 * tokens  # noqa: E731
    controller.predict_step_s = linear
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, slo_classes=slo_classes, **config))
    return SLOPolicy(scheduler, controller), linear


def test_a_decode_with_tpot_slack_lets_a_larger_chunk_through(monkeypatch):
    """TPOT is judged per request ((finish - first token) / (tokens - 1)), so a decode whose
    remaining output fits its budget with time to spare can absorb a longer step: it allows the
    decode-only step plus half its projected slack. One without slack, behind its budget or
    without a first token allows its per-token budget (the flat cap)."""
    from types import SimpleNamespace

    from engine.slo_budget import projected_slack_s, step_allowance_ms

    policy, linear = policy_at_1000_s(monkeypatch, {"i": SLOClass(tpot_ms=20.0)}, default_slo_class="i")

    def decode(sid, first_token_s, tokens, max_tokens=12):
        metrics = RequestMetrics(arrival_time_s=990.0, first_token_time_s=first_token_s)
        return SimpleNamespace(seq_id=sid, params=SamplingParams(max_tokens=max_tokens), num_output_tokens=tokens,
                               request=SimpleNamespace(metrics=metrics))

    # 11 of 12 tokens out; the whole output may take 20 ms x 11 = 220 ms after the first token and
    # the last step, decode-only, takes 5.1 ms (1 target token)
    ahead = decode("ahead", 999.9, 11)  # 100 ms used: 114.9 ms of slack
    on_time, behind = decode("on_time", 999.8, 11), decode("behind", 999.0, 11)  # 14.9 ms; -785.1 ms
    started = decode("started", 1000.0, 1, max_tokens=13)  # first token now: 240 - 12 x 5.1 = 178.8 ms
    fresh = decode("fresh", None, 0)
    slack = {d.seq_id: projected_slack_s(d, 0.02, 1000.0, policy.steps_left(d), 0.0051)
             for d in (ahead, on_time, behind, started, fresh)}
    assert slack["ahead"] == pytest.approx(0.1149) and slack["on_time"] == pytest.approx(0.0149)
    assert slack["behind"] == pytest.approx(-0.7851) and slack["started"] == pytest.approx(0.1788)
    assert slack["fresh"] is None
    assert step_allowance_ms(20.0, 1.0, 5.1, 114.9) == pytest.approx(62.55)
    assert step_allowance_ms(20.0, 1.0, 5.1, 14.9) == step_allowance_ms(20.0, 1.0, 5.1, -785.1) == 20.0
    assert step_allowance_ms(20.0, 1.0, 5.1, None) == 20.0
    flat = prefill_token_limit([20.0], 1, 4096, linear)
    assert 148 <= flat <= 149  # 5 ms + 0.1 ms x (1 + c) <= 20 ms
    assert 573 <= policy.prefill_limit([ahead], 1) <= 574  # 5 + 0.1 x (1 + c) <= 5.1 + 114.9 / 2 ms
    assert 893 <= policy.prefill_limit([started], 1) <= 894  # <= 5.1 + 178.8 / 2 ms
    for other in (on_time, behind, fresh):
        assert policy.prefill_limit([other], 1) == flat
        assert policy.prefill_limit([ahead, other], 2) == prefill_token_limit([20.0], 2, 4096, linear)  # tightest


def test_an_itl_budget_caps_what_tpot_slack_allows(monkeypatch):
    """Slack buys one long gap at the same TPOT; a class's itl_ms caps that gap (the p99 ITL a
    streaming client sees), and a class with only itl_ms still sizes chunks."""
    from types import SimpleNamespace

    def decode(sid, cls):
        metrics = RequestMetrics(arrival_time_s=990.0, first_token_time_s=999.9)  # 114.9 ms of slack
        return SimpleNamespace(seq_id=sid, params=SamplingParams(max_tokens=12, slo_class=cls), num_output_tokens=11,
                               request=SimpleNamespace(metrics=metrics))

    classes = {"tpot": SLOClass(tpot_ms=20.0), "capped": SLOClass(tpot_ms=20.0, itl_ms=30.0),
               "itl": SLOClass(itl_ms=12.0), "tight": SLOClass(tpot_ms=20.0, itl_ms=10.0)}
    policy, linear = policy_at_1000_s(monkeypatch, classes, default_slo_class="tpot")
    assert 573 <= policy.prefill_limit([decode("a", "tpot")], 1) <= 574  # 5.1 + 114.9 / 2 ms, uncapped
    capped = policy.prefill_limit([decode("a", "capped")], 1)
    assert capped == prefill_token_limit([30.0], 1, 4096, linear) and 248 <= capped <= 249  # 5 + 0.1 x (1 + c) <= 30
    only_itl = policy.prefill_limit([decode("a", "itl")], 1)
    assert only_itl == prefill_token_limit([12.0], 1, 4096, linear) and 68 <= only_itl <= 69
    # below the TPOT floor too (20 ms a token): the gap is what the client sees
    tight = policy.prefill_limit([decode("a", "tight")], 1)
    assert tight == prefill_token_limit([10.0], 1, 4096, linear) and 48 <= tight <= 49
    with pytest.raises(ValueError, match=r"slo_classes\.tight\.itl_ms must be > 0"):
        SchedulerConfig(slo_classes={"tight": SLOClass(itl_ms=0.0)})


def test_the_wait_estimate_frees_the_budget_as_running_decodes_finish(monkeypatch):
    """A decode with 2 tokens left under a tight TPOT budget caps prefill chunks for 2 steps
    only; a looser one with 5 left for 3 more; then the step's whole token budget prefills. The
    old estimate held the tightest cap for the whole wait (a burst of short completions, whose
    decodes end within a few steps, had later requests refused that FCFS served in time)."""
    from types import SimpleNamespace

    policy, linear = policy_at_1000_s(monkeypatch, {"tight": SLOClass(tpot_ms=20.0),
                                                    "loose": SLOClass(tpot_ms=100.0)})

    def decode(sid, slo_class, tokens, max_tokens):  # its whole TPOT budget spent: no slack, flat caps
        first = 1000.0 - {"tight": 0.02, "loose": 0.1}[slo_class] * (max_tokens - 1)
        return SimpleNamespace(seq_id=sid, params=SamplingParams(max_tokens=max_tokens, slo_class=slo_class),
                               num_output_tokens=tokens,
                               request=SimpleNamespace(metrics=RequestMetrics(0.0, first_token_time_s=first)))

    tight, loose = decode("a", "tight", 11, 13), decode("b", "loose", 4, 9)
    assert policy.steps_left(tight) == 2 and policy.steps_left(loose) == 5
    phases = policy.prefill_phases([loose, tight])
    assert [p[:2] for p in phases] == [(2, 2), (3, 1), (float("inf"), 0)]
    assert phases[0][2] == policy.prefill_limit([loose, tight], 2) and 140 <= phases[0][2] <= 148
    assert phases[1][2] == policy.prefill_limit([loose], 1) and 940 <= phases[1][2] <= 949
    assert phases[2][2] == 4096
    p1, p2 = phases[0][2], phases[1][2]
    rest = 4000 - 2 * p1 - 3 * p2
    assert wait_estimate_s(4000, phases, linear) == pytest.approx(
        2 * linear(2 + p1) + 3 * linear(1 + p2) + linear(rest))  # 0.43 s
    held = wait_estimate_s(4000, [(float("inf"), 2, p1)], linear)  # the tight cap for the whole wait
    assert held > 0.52 and wait_estimate_s(4000, phases, linear) < 0.44


def test_a_cap_the_decode_only_step_already_exceeds_does_not_cap_the_chunk(monkeypatch):
    """A 12 ms ITL cap binds while the decode-only step fits under it; once the decodes alone
    take longer (120 target tokens: 17 ms), no chunk size keeps the cap, and capping anyway held
    every step to the minimum chunk (over HTTP at concurrency 16: 2-5 of 16 requests decoding,
    time to first token 2-4 s); the TPOT budget (20 ms a token) still sizes the chunk."""
    from types import SimpleNamespace

    policy, linear = policy_at_1000_s(monkeypatch, {"both": SLOClass(tpot_ms=20.0, itl_ms=12.0)},
                                      default_slo_class="both")
    fresh = SimpleNamespace(seq_id="a", params=SamplingParams(max_tokens=12), num_output_tokens=0,
                            request=SimpleNamespace(metrics=RequestMetrics(arrival_time_s=990.0)))
    capped = policy.prefill_limit([fresh], 1)
    assert capped == prefill_token_limit([12.0], 1, 4096, linear) and 68 <= capped <= 69
    assert prefill_token_limit([12.0], 120, 4096, linear) == 0  # what the cap would allow
    heavy = policy.prefill_limit([fresh], 120)
    assert heavy == prefill_token_limit([20.0], 120, 4096, linear) and 29 <= heavy <= 30
    # 200 target tokens (25 ms) exceed the fresh decode's TPOT floor (20 ms a token) too: nothing
    # it allows can be kept, so it caps nothing (the token budget alone sizes the chunk, as in
    # vLLM); a decode with slack beside it still caps the step at what its slack allows.
    assert policy.prefill_limit([fresh], 200) is None
    ahead = SimpleNamespace(seq_id="b", params=SamplingParams(max_tokens=12), num_output_tokens=11,
                            request=SimpleNamespace(metrics=RequestMetrics(arrival_time_s=990.0,
                                                                           first_token_time_s=999.9)))
    alone = policy.prefill_limit([ahead], 200)  # 25 ms decode-only step + half its 95 ms of slack
    assert alone == prefill_token_limit([72.5], 200, 4096, linear) and 474 <= alone <= 475
    assert policy.prefill_limit([fresh, ahead], 200) == alone


def test_a_cap_the_decodes_exceed_once_the_prompts_in_line_decode_does_not_cap_the_chunk(monkeypatch):
    """A 12 ms ITL cap that 4 running decodes keep (40 target tokens: 9 ms) binds while few
    prompts wait; when those in line would take the decode-only step past it once they decode
    (12 waiting for 12 free seats, or partly prefilled ones), no chunk size keeps it in steady
    state, and capping held the batch small: over HTTP at concurrency 16, 4-5 of 16 decoding
    with ~40-token chunks and TTFT 1.6-2.0 s, in 2 of 5 servers."""
    from types import SimpleNamespace

    policy, linear = policy_at_1000_s(monkeypatch, {"itl": SLOClass(itl_ms=12.0)}, default_slo_class="itl",
                                      max_num_seqs=16)
    running = [SimpleNamespace(seq_id=f"d{i}", params=SamplingParams(max_tokens=12), num_output_tokens=3,
                               num_prompt_tokens_left=0, request=SimpleNamespace(metrics=RequestMetrics(990.0)))
               for i in range(4)]
    policy.scheduler.running = list(running)
    capped = prefill_token_limit([12.0], 40, 4096, linear)
    assert 29 <= capped <= 30  # 5 + 0.1 x (40 + c) <= 12 ms
    policy.scheduler.waiting = [object()] * 2  # 4 + 2 decodes: 60 tokens, 11 ms: still kept
    assert policy.prefill_limit(running, 40) == capped
    # Its overrun margin (12 / 1.2 = 10 ms) fits the 9 ms of the decodes now but not the 11 ms
    # once the two join: the budget itself caps, as where the decodes now leave no room for it.
    policy.controller.chunk_overrun._log = math.log(1.2)
    assert policy.prefill_limit(running, 40) == capped
    policy.controller.chunk_overrun._log = 0.0
    policy.scheduler.waiting = [object()] * 12  # 16 decodes: 160 tokens, 21 ms
    assert policy.prefill_limit(running, 40) is None
    policy.scheduler.config = msgspec.structs.replace(policy.config, max_num_seqs=6)  # 2 free seats
    assert policy.prefill_limit(running, 40) == capped
    policy.scheduler.waiting = []
    policy.scheduler.running = running + [SimpleNamespace(num_prompt_tokens_left=100)] * 4  # partly prefilled
    policy.scheduler.config = msgspec.structs.replace(policy.config, max_num_seqs=16)
    assert policy.prefill_limit(running, 40) is None  # 8 decodes x 10 tokens: 13 ms > 12

    # Drafting: the joiners draft as the running decodes do. A target token costs 0.01 ms here and
    # a drafted one 0.5 ms: 4 decodes drafting 2 each take 9.1 ms, 12 more would take 21.5 ms.
    from engine.spec_controller import Decision

    policy.scheduler.running = list(running)
    policy.controller.last = Decision(k={d.seq_id: 2 for d in running})
    policy.controller.predict_step_s = \
        lambda tokens, passes=0, drafted=0, prefill_pairs=0.0: 0.005 + 0.00001 * tokens + 0.0005 * drafted
    policy.scheduler.waiting = [object()] * 2  # 6 drafting: 11.2 ms
    assert policy.prefill_limit(running, 12) == 288  # 5 + 0.01 x (12 + c) + 4 <= 12 ms
    policy.scheduler.waiting = [object()] * 12
    assert policy.prefill_limit(running, 12) is None


def test_an_itl_budget_is_sized_for_the_chunked_steps_overrun_and_a_late_chunks_attention(monkeypatch):
    """Chunks sized for the predicted (mean) step put half the chunked steps over an ITL budget,
    and those few steps set the p99 ITL: the cap is divided by the chunked steps' measured /
    predicted 90th percentile (the budget itself where the decodes leave no room for that margin).
    A chunk continuing a long prompt is sized with that prompt's
    attention work (``prefill_pairs`` at its position), so it is smaller than a fresh prompt's."""
    import math
    from types import SimpleNamespace

    from engine.spec_cost import prefill_attention_pairs

    policy, linear = policy_at_1000_s(monkeypatch, {"itl": SLOClass(itl_ms=12.0)}, default_slo_class="itl")
    fresh = SimpleNamespace(seq_id="a", params=SamplingParams(max_tokens=12), num_output_tokens=0,
                            request=SimpleNamespace(metrics=RequestMetrics(arrival_time_s=990.0)))
    assert policy.prefill_limit([fresh], 1) == prefill_token_limit([12.0], 1, 4096, linear)
    policy.controller.chunk_overrun._log = math.log(1.2)  # chunked steps overran by 20 % (p90)
    assert policy.prefill_limit([fresh], 1) == prefill_token_limit([10.0], 1, 4096, linear)
    # Decodes of 55 target tokens (10.5 ms) leave no room for the margin (10 ms) but do under the
    # budget itself (12 ms): the budget caps the chunk, it is not dropped as unattainable.
    assert policy.prefill_limit([fresh], 55) == prefill_token_limit([12.0], 55, 4096, linear) == 15
    policy.controller.chunk_overrun._log = 0.0

    def with_attention(tokens, passes=0, drafted=0, prefill_pairs=0.0):  # + 0.01 ms per thousand pairs
        return linear(tokens) + 0.00001 * prefill_pairs

    policy.controller.predict_step_s = with_attention
    at_start = policy.prefill_limit([fresh], 1)
    assert at_start == prefill_token_limit(
        [12.0], 1, 4096, lambda t: with_attention(t, prefill_pairs=prefill_attention_pairs(0, t - 1)))
    started = SimpleNamespace(num_cached=600, num_prompt_tokens_left=300)
    policy.scheduler.running.append(started)
    late = policy.prefill_limit([fresh], 1)
    assert late == prefill_token_limit(
        [12.0], 1, 4096, lambda t: with_attention(t, prefill_pairs=prefill_attention_pairs(600, t - 1)))
    assert late < at_start
