"""Admission into full sequence slots under ``scheduling_policy: slo`` (Moore's rule, engine.slo_admission)."""

import math
from types import SimpleNamespace

from engine.drafters.base import NoneDrafter
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.slo import SLOClass
from engine.slo_admission import LATE_DEFERRAL, SlotJob, decode_hold_s, defer_until_s, deferred_jobs
from tests.engine.bundled import loaded_target, prompt_ids


def job(deadline_s: float, hold_s: float, priority: int = 0, first_token_s: float = 0.05) -> SlotJob:
    return SlotJob(deadline_s, priority, first_token_s, hold_s)


def test_nothing_is_deferred_while_every_deadline_is_met_in_deadline_order():
    jobs = [job(0.5, 2.0), job(1.0, 0.2), job(1.0, 0.3)]
    assert deferred_jobs(jobs, [0.0, 0.0, 0.0], now_s=0.0) == []  # a slot each
    assert deferred_jobs(jobs[1:], [0.0], now_s=0.0) == []  # 0.05 and 0.25 s: both in time


def test_a_long_holder_due_first_is_deferred_when_it_would_make_the_short_ones_late():
    # One slot. Deadline order runs the long job (holds the slot 2 s) first: all three short jobs
    # then start at 2 s, past their 1 s deadlines. Deferring it costs its deadline alone
    # (it starts at 0.6 s, first token at 0.65 > 0.5): one miss instead of three.
    jobs = [job(0.5, 2.0), job(1.0, 0.2), job(1.0, 0.2), job(1.0, 0.2)]
    assert deferred_jobs(jobs, [0.0], now_s=0.0) == [0]


def test_the_slot_that_frees_first_is_the_one_a_job_takes():
    # Two slots busy until 0.1 and 5.0 s: the first two short jobs fit through the early slot in
    # time (first tokens at 0.15 and 0.35 s); the third's would be at 0.65 s, past its 0.5 s
    # deadline, so the longest kept job (the second) goes last and the third's comes at 0.35 s.
    jobs = [job(0.5, 0.2), job(0.5, 0.3), job(0.5, 0.1)]
    assert deferred_jobs(jobs, [5.0, 0.1], now_s=0.0) == [1]


def test_a_job_already_past_its_deadline_goes_last_until_it_has_waited_its_budget_again():
    # At now = 1.0 the first job's deadline (0.5) has passed: serving it first would hold the only
    # slot 5 s and make the job due at 2.0 late too (earliest-deadline-first's domino under
    # overload), so it goes last. Once past its defer_until_s it takes its place again, and the
    # job behind it, now certain to be late, is the one deferred.
    late, due = job(0.5, 5.0), job(2.0, 0.2)
    assert deferred_jobs([late, due], [1.0], now_s=1.0) == [0]
    pinned = SlotJob(0.5, 0, 0.05, 5.0, defer_until_s=1.0)
    assert deferred_jobs([pinned, due], [1.0], now_s=1.0) == [1]
    assert defer_until_s(10.0, 0.5) == 10.0 + 0.5 * (1.0 + LATE_DEFERRAL)


def test_a_lower_priority_job_is_deferred_before_a_higher_priority_one_however_long():
    jobs = [job(0.5, 2.0, priority=0), job(1.0, 0.2, priority=1), job(1.0, 0.3, priority=1)]
    assert deferred_jobs(jobs, [0.0], now_s=0.0) == [1, 2]


def test_no_slot_or_no_job_defers_nothing_and_decode_hold_counts_steps():
    assert deferred_jobs([], [0.0], now_s=0.0) == [] and deferred_jobs([job(0.1, 9.0)], [], now_s=0.0) == []
    assert decode_hold_s(13, 1.0, 0.01) == 12 * 0.01
    assert decode_hold_s(13, 2.5, 0.01) == math.ceil(12 / 2.5) * 0.01
    assert decode_hold_s(1, 1.0, 0.01) == 0.0


def test_the_engine_admits_the_short_prompts_before_a_long_one_that_would_make_them_late(monkeypatch):
    """With one slot and a step predicted at 10 s, the 200-token request due first would hold
    the slot ~2000 s: its two 2-token neighbours, due 10 s later, would miss, so they go first.
    Plain earliest-deadline order (no step time learned yet) runs the long one first."""
    classes = {"tight": SLOClass(ttft_ms=30_000.0), "loose": SLOClass(ttft_ms=40_000.0)}

    def first_outputs(predicted_step_s: float) -> list[str]:
        engine = LLMEngine(loaded_target(), NoneDrafter(), 0, SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=4096, max_waiting=100, scheduling_policy="slo",
            slo_classes=classes))
        monkeypatch.setattr(engine.slo, "step_predictor", lambda batch_scale=1.0: (lambda tokens: predicted_step_s))
        p = prompt_ids(3, 40)
        engine.add_request("long", p[0], SamplingParams(temperature=0.0, max_tokens=200, slo_class="tight"))
        for i in (1, 2):
            engine.add_request(f"short{i}", p[i], SamplingParams(temperature=0.0, max_tokens=2, slo_class="loose"))
        order = []
        while engine.has_unfinished_requests():
            order += [o.request_id for o in engine.step() if o.request_id not in order]
        return order

    assert first_outputs(10.0) == ["short1", "short2", "long"]
    assert first_outputs(0.0) == ["long", "short1", "short2"]


def test_a_deferred_prompt_goes_after_the_others_of_its_priority_only():
    def order(deferred: set[str]) -> list[str]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, scheduling_policy="slo",
                                          slo_classes={"c": SLOClass(ttft_ms=1000.0)}, default_slo_class="c"))
        for name, priority, arrival_s in (("a", 0, 0.0), ("b", 0, 1.0), ("low", 1, 0.0)):
            sched.add(SimpleNamespace(seq_id=name, prompt_token_ids=[1] * 4, num_prompt_tokens_left=4, status=None,
                                      params=SamplingParams(priority=priority),
                                      request=SimpleNamespace(metrics=SimpleNamespace(arrival_time_s=arrival_s))))
        return [s.seq_id for s in sched.schedule(8, lambda s, spec: 1, None, deferred).prefills]

    assert order(set()) == ["a", "b", "low"]
    assert order({"a"}) == ["b", "a", "low"]  # deferred behind "b", not behind the lower priority
