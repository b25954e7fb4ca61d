"""The speculation controller on synthetic costs: it must find the k a known cost model makes best."""

import numpy as np
import pytest

from engine.spec_controller import SpeculationController
from engine.spec_cost import prefill_attention_pairs
from tests.helpers.spec_sim import SyntheticStep, adaptive_plan, controller, drive_realised


def test_expensive_draft_turns_speculation_off():
    sim = SyntheticStep(d_pass=0.02, c0=0.01, c_tok=0.0005)  # a draft pass costs 2 target steps
    caps = {f"s{i}": 8 for i in range(4)}
    decision = sim.run(controller(), caps, dict.fromkeys(caps, 0.5), np.random.default_rng(0), 60)
    assert decision.reason == "adaptive"
    assert decision.k == dict.fromkeys(caps, 0)


def test_a_window_drafted_ahead_is_drafted_when_drafting_would_not_pay():
    """Pipelined drafting: a sequence that accepted all 3 tokens of its last window probably has
    the next 3 ready; they cost only their verification, so the controller takes them (and no
    more: drafting past the ready window would redraft it), while the others stay at 0."""
    sim = SyntheticStep(d_pass=0.015, c0=0.01, c_tok=0.0005)  # a draft pass costs 1.5 target steps
    caps = {f"s{i}": 8 for i in range(4)}
    ctl = controller()
    sim.run(ctl, caps, dict.fromkeys(caps, 0.97), np.random.default_rng(0), 60)
    assert ctl.plan(caps, 4).k == dict.fromkeys(caps, 0)
    ctl.note_drafted_ahead("s1", 3)
    assert ctl.plan(caps, 4).k == {"s0": 0, "s1": 3, "s2": 0, "s3": 0}
    assert ctl.plan(caps, 4).k == dict.fromkeys(caps, 0)  # good for one step only


def test_high_acceptance_and_flat_verify_drafts_the_maximum():
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)  # cheap draft, verify cost flat in tokens
    caps = {f"s{i}": 8 for i in range(4)}
    decision = sim.run(controller(), caps, dict.fromkeys(caps, 0.95), np.random.default_rng(1), 80)
    assert decision.k == dict.fromkeys(caps, 8)
    assert decision.expected_tokens > 4 * 5  # 4 sequences x E[tokens | k = 8, a = 0.95] ~ 7


def test_verify_cost_of_activated_experts_shortens_drafts():
    """The MoE effect: each extra verified token activates more experts; k must come down."""
    caps = {f"s{i}": 8 for i in range(2)}
    acceptance = dict.fromkeys(caps, 0.75)
    flat = SyntheticStep(d_pass=0.0001, c0=0.004)  # best k: 8 (rate 771 tok/s vs 754 at k = 6)
    moe = SyntheticStep(d_pass=0.0001, c0=0.004, c_exp=0.0004, experts=(64, 4, 2))
    k_flat = flat.run(controller(), caps, acceptance, np.random.default_rng(2), 80).k
    k_moe = moe.run(controller(experts=(64, 4, 2)), caps, acceptance, np.random.default_rng(2), 80).k
    assert min(k_flat.values()) >= 6
    assert 1 <= max(k_moe.values()) < min(k_flat.values())


def test_each_sequence_gets_the_k_its_own_acceptance_pays_for():
    sim = SyntheticStep(d_pass=0.0005, c0=0.01, c_tok=0.001)
    caps = {"easy": 8, "hard": 8}
    decision = sim.run(controller(), caps, {"easy": 0.95, "hard": 0.1}, np.random.default_rng(3), 120)
    assert decision.k["easy"] > decision.k["hard"]
    assert decision.k["hard"] <= 1


def test_caps_are_respected():
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)
    ctl = controller()
    sim.run(ctl, {"a": 3, "b": 8}, {"a": 0.95, "b": 0.95}, np.random.default_rng(4), 40)
    d = ctl.plan({"a": 3, "b": 8}, 2)
    assert d.k["a"] <= 3 and d.k["b"] <= 8 and d.k["b"] > 3  # high acceptance, cheap drafts: past a's cap


def test_warmup_then_periodic_probes_of_every_length_and_fixed_policy():
    ctl = controller(max_k=4, warmup_steps=4, probe_interval_steps=5)
    caps = {"a": 4}
    assert [ctl.plan(caps, 1).k["a"] for _ in range(4)] == [4, 4, 1, 1]  # the warm-up cycle
    decisions = []
    for _ in range(40):  # drafting so expensive (50 ms a pass) that adaptive chooses 0
        d = ctl.plan(caps, 1)
        decisions.append(d)
        ctl.observe_step(0.05 * d.k["a"], d.k["a"], d.k["a"], 0.01, 1 + d.k["a"], None)
        ctl.observe_acceptances([("a", d.k["a"], 0)])
    probes = [i for i, d in enumerate(decisions) if d.reason == "probe"]
    assert probes == [4, 9, 14, 19, 24, 29, 34, 39]  # every 5 decode steps after the warm-up
    assert [decisions[i].k["a"] for i in probes] == [2, 4, 0, 2] * 2  # 2, max, 0, max / 2 in turn
    # Once drafting was measured, the controller's own choice is 0 and probes do not change it.
    assert all(d.k["a"] == 0 for d in decisions[probes[0] + 1:] if d.reason == "adaptive")
    fixed = SpeculationController(4, "fixed")
    assert fixed.plan({"a": 3, "b": 0}, 2).k == {"a": 3, "b": 0}


def test_no_probes_while_the_realised_rates_say_off():
    """A probe drafts every sequence (after a stretch off: the drafter's catch-up on all of it);
    while the realised rates keep speculation off, even by a thin margin, explore steps alone
    re-measure drafting."""
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)
    caps = {f"s{i}": 8 for i in range(4)}
    ctl = controller()
    rng = np.random.default_rng(10)
    sim.run(ctl, caps, dict.fromkeys(caps, 0.9), rng, 40)
    reasons = []
    for _ in range(200):
        decision = ctl.plan(caps, len(caps))
        reasons.append(decision.reason)
        drafted = sum(decision.k.values())
        for sid, k in decision.k.items():
            ctl.observe_acceptances([(sid, k, k)])
        # Drafting realises 0.97 of plain decoding's 400 tok/s: off, by a thin margin.
        ctl.observe_goodput(4 + drafted, (4 + drafted) / (400 * 0.97) if drafted else 0.010)
    assert ctl.realised.standing(4, on=False) is False and ctl.realised._thin(ctl.realised.bucket(4).rates())
    assert "probe" not in reasons[100:] and "explore" in reasons[100:]


def test_an_explore_of_drafting_is_a_run_whose_switch_step_is_not_counted():
    """Kept off, the drafter misses every token, and the first drafting step feeds it all of them
    (at concurrency 1 over HTTP that made drafting look slower than plain decoding, and the
    controller stayed off in 4 of 6 runs). An explore of drafting lasts 3 steps; the first is left
    out of the realised drafting figure, the other two measure drafting's own rate."""
    def drive(run_steps: int) -> tuple[str, list[float]]:
        ctl = controller(explore_run_steps=run_steps)
        for _ in range(3):
            ctl.realised.observe(1, False, 1, 0.010)
            ctl.realised.observe(1, True, 2, 0.040)  # drafting at half plain decoding's rate: off
        ctl._decode_steps = ctl.settings.warmup_steps
        modes, counted = "", []
        for _ in range(150):
            drafted = sum(ctl.plan({"a": 8}, 1).k.values()) > 0
            switch = drafted and modes[-1:] == "."
            modes += "d" if drafted else "."
            before = ctl.realised.bucket(1).steps[1]
            # Drafting: 3 tokens in 10 ms (300 tok/s against 100 plain), 100 ms on a switch step.
            ctl.observe_goodput(3 if drafted else 1, (0.100 if switch else 0.010) if drafted else 0.010)
            counted.append(ctl.realised.bucket(1).steps[1] - before)
        return modes, counted

    modes, counted = drive(3)
    first = modes.index("d")
    assert modes[first:first + 4] == "ddd." and counted[first:first + 3] == [0, 1, 1]
    assert modes[-60:].count("d") >= 54  # drafting's own rate showed: on (explores of off aside)
    one_step_modes, _ = drive(1)  # single explore steps are all switch steps: drafting never shows
    assert "dd" not in one_step_modes and one_step_modes.endswith("." * 30)


@pytest.mark.parametrize("drafting_s", [0.040, 0.0206])  # half plain decoding's rate; 0.97 of it (thin)
def test_off_steps_feed_the_cost_model_one_in_n(drafting_s):
    """While the realised rates keep speculation off, by a wide margin or a thin one, only one
    plain step in ``off_fit_interval_steps`` is metered and fed to the cost model; explore steps
    always are."""
    ctl = controller(off_fit_interval_steps=4)
    caps = {"a": 8}
    for _ in range(3):
        ctl.realised.observe(1, False, 1, 0.010)
        ctl.realised.observe(1, True, 2, drafting_s)
    ctl._decode_steps = ctl.settings.warmup_steps  # warm-up done
    plain_fits, explore_fits = [], []
    for _ in range(200):
        decision = ctl.plan(caps, 1)
        drafted = sum(decision.k.values()) > 0
        (explore_fits if drafted else plain_fits).append(ctl.fits_last_step)
        ctl.observe_goodput(2 if drafted else 1, drafting_s if drafted else 0.010)
    assert ctl.realised.standing(1, on=False) is False
    assert ctl.realised._thin(ctl.realised.bucket(1).rates()) == (drafting_s < 0.03)
    assert explore_fits and all(explore_fits)
    assert sum(plain_fits) == pytest.approx(len(plain_fits) / 4, abs=1)


def test_a_cost_of_drafting_outside_the_features_still_turns_speculation_off():
    """Drafting slows the target pass by 20 ms (e.g. a draft process contending for cores): with
    a = 0.6, k = 4 brings 2.3 tokens in 32 ms against 1 token in 10 ms, so k = 0 is right."""
    caps = {"a": 8}
    plain = SyntheticStep(d_pass=0.0005, c0=0.01)
    hurt = SyntheticStep(d_pass=0.0005, c0=0.01, interference_s=0.02)
    assert sum(plain.run(controller(), caps, {"a": 0.6}, np.random.default_rng(7), 150).k.values()) > 0
    decision = hurt.run(controller(), caps, {"a": 0.6}, np.random.default_rng(7), 150)
    assert decision.k == {"a": 0}


def test_calibration_is_measured_over_predicted_time_per_mode_and_chunking():
    ctl = controller()
    for _ in range(40):  # off steps: 10 ms for 4 tokens; on steps: 30 ms for 4 tokens + 4 drafted
        ctl.observe_step(0.0, 0, 0, 0.010, 4, None)
        ctl.observe_step(0.004, 1, 4, 0.026, 4, None)
        # Steps with a 100-token prefill chunk: 40 ms of target either way, as the fit predicts.
        ctl.observe_step(0.0, 0, 0, 0.040, 104, None, prefill_pairs=5.0)
        ctl.observe_step(0.004, 1, 4, 0.040, 108, None, prefill_pairs=5.0)
    # Without a chunk the target model cannot tell the modes apart (same tokens): it predicts
    # ~18 ms for both, so drafting steps run 30 / 22 = 1.36x their prediction and plain ones
    # 10 / 18 = 0.55x. The well-predicted chunked steps keep their own (~1): pooled with them,
    # decode-only drafting was calibrated at ~1.17 and predicted 14 % short.
    assert ctl.calibration[True, False] == pytest.approx(30 / 22, rel=0.1)
    assert ctl.calibration[False, False] == pytest.approx(10 / 18, rel=0.1)
    assert ctl.calibration[True, True] == pytest.approx(1.0, abs=0.1)
    assert ctl.calibration[False, True] == pytest.approx(1.0, abs=0.1)
    assert ctl.predict_step_s(4) == pytest.approx(0.010, rel=0.15)
    assert ctl.predict_step_s(4, 1, 4) == pytest.approx(0.030, rel=0.15)


def test_the_target_cost_learns_what_a_late_chunk_of_a_long_prompt_costs():
    """A chunk's queries attend over everything before them: with the attention work a feature
    (``prefill_pairs``), a 241-token chunk at position 659 is predicted at what it costs, not at
    the price of the same tokens at the start of a prompt. The chunked steps' spread around their
    (calibrated) predictions sets the chunk overrun quantile; decode-only steps do not."""
    ctl = controller()

    def target_s(tokens, pairs):  # 2 ms + 0.05 ms a token + 0.02 ms per thousand pairs
        return 0.002 + 0.00005 * tokens + 0.00002 * pairs

    rng = np.random.default_rng(4)
    for t in range(300):
        if t % 3:
            ctl.observe_step(0.0, 0, 0, target_s(4, 0.0), 4, None)
            continue
        start, length = int(rng.integers(0, 800)), int(rng.integers(16, 256))
        pairs = prefill_attention_pairs(start, length)
        ctl.observe_step(0.0, 0, 0, target_s(4 + length, pairs), 4 + length, None, prefill_pairs=pairs)
    late, early = prefill_attention_pairs(659, 241), prefill_attention_pairs(0, 241)
    assert ctl.predict_step_s(245, prefill_pairs=late) == pytest.approx(target_s(245, late), rel=0.05)
    assert ctl.predict_step_s(245, prefill_pairs=early) == pytest.approx(target_s(245, early), rel=0.05)
    assert target_s(245, late) > 1.2 * target_s(245, early)
    assert ctl.chunk_overrun.value == pytest.approx(1.0, abs=0.1)  # predictions right: nothing to add
    for _ in range(600):  # chunked steps now vary +-15 % (lognormal) around their cost
        ctl.observe_step(0.0, 0, 0, target_s(4, 0.0) * (1 + 0.05 * rng.standard_normal()), 4, None)
        start, length = int(rng.integers(0, 800)), int(rng.integers(16, 256))
        pairs = prefill_attention_pairs(start, length)
        noisy_s = target_s(4 + length, pairs) * np.exp(0.15 * rng.standard_normal())
        ctl.observe_step(0.0, 0, 0, noisy_s, 4 + length, None, prefill_pairs=pairs)
    assert 1.1 < ctl.chunk_overrun.value < 1.4  # ~exp(1.28 x 0.15) = 1.21 over the mean step


def test_realised_goodput_overrules_a_model_that_favours_drafting_and_recovers():
    """The cost model sees cheap drafting (0.2 ms a pass, acceptance 0.9) and would draft, but the
    steps as run say drafting steps take 100 ms end to end (a cost outside its features) against
    10 ms for plain ones: the realised check turns speculation off, explore steps keep measuring
    drafting, and once drafting steps take 12 ms again speculation comes back on."""
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)
    caps = {f"s{i}": 8 for i in range(4)}
    ctl = controller()
    rng = np.random.default_rng(8)
    sim.run(ctl, caps, dict.fromkeys(caps, 0.9), rng, 40)  # no realised figures: the model decides
    assert sum(adaptive_plan(ctl, caps).k.values()) > 0

    def drive(steps: int, drafting_step_s: float) -> list:
        return drive_realised(ctl, sim, caps, rng, steps, drafting_step_s)

    slow = drive(200, 0.100)
    own = [d for d in slow[100:] if d.reason == "adaptive"]
    assert own and all(sum(d.k.values()) == 0 for d in own)
    assert not any(d.reason == "probe" for d in slow[100:])  # settled off: explore steps suffice
    explored = [d for d in slow[100:] if d.reason == "explore"]
    assert explored and all(sum(d.k.values()) > 0 for d in explored)  # drafting, to re-measure it
    # Steps with TPOT budgets follow the verdict too, and so does a step with a prefill chunk
    # (which neither explores nor advances the explore cadence).
    cadence = ctl.realised._since_explore
    mixed = ctl.plan(caps, len(caps) + 300, num_prefills=1)
    assert mixed.reason == "adaptive" and sum(mixed.k.values()) == 0
    assert ctl.realised._since_explore == cadence
    budgeted = adaptive_plan(ctl, caps, tpot=dict.fromkeys(caps, (1.0, 0.5)))
    assert sum(budgeted.k.values()) == 0
    # While the realised rates keep it off, only explore steps (and probes) run the model's
    # optimisation: a plain-decoding step pays none of it.
    optimised = []
    real_optimise = ctl._optimise
    ctl._optimise = lambda *a: optimised.append(1) or real_optimise(*a)
    off = drive(200, 0.100)  # explores of 100 ms steps come ~1 in 100 steps (explore_time_share)
    ctl._optimise = real_optimise
    assert len(optimised) == sum(d.reason == "explore" for d in off) > 0
    plain = [d for d in off if d.reason == "adaptive"]
    assert plain and all(d.expected_tokens == len(caps) and d.predicted_step_s > 0 for d in plain)
    fast = drive(300, 0.012)
    own = [d for d in fast[200:] if d.reason == "adaptive"]
    assert own and all(sum(d.k.values()) > 0 for d in own)
    assert any(sum(d.k.values()) == 0 for d in fast[200:] if d.reason == "explore")  # off, re-measured
    assert any(d.reason == "probe" for d in fast[200:])
    # An explore step of off pays no optimisation either (it measures off as off runs).
    optimised.clear()
    ctl._optimise = lambda *a: optimised.append(1) or real_optimise(*a)
    on = drive(130, 0.012)  # at a wide margin an explore comes at least every 128 steps
    ctl._optimise = real_optimise
    assert any(d.reason == "explore" and not sum(d.k.values()) for d in on)
    # Each optimised plan serves at most 4 steps (the first up to 3 may reuse the plan before).
    adaptive, interval = sum(d.reason == "adaptive" for d in on), ctl.settings.replan_interval_steps
    assert (adaptive - (interval - 1)) / interval <= len(optimised) < adaptive
    assert sum(ctl.plan(caps, len(caps) + 300, num_prefills=1).k.values()) > 0  # on: the model decides


def test_a_prefill_chunk_does_not_make_drafting_look_cheap():
    """Plain decoding is faster for these decodes (a draft pass costs 3 ms, acceptance 0.5: 690
    tok/s plain against 625 at k = 1). A 500-token prefill chunk in the same step costs ~0.1 s
    whatever is drafted; judged over the whole step, drafting would look worth it (64 against 47
    tok/s), but the decodes' drafting must pay for itself: the step does not draft."""
    sim = SyntheticStep(d_pass=0.003, c0=0.005, c_tok=0.0002)
    caps = dict.fromkeys(("a", "b", "c", "d"), 4)
    ctl = controller(max_k=4)
    sim.run(ctl, caps, dict.fromkeys(caps, 0.5), np.random.default_rng(2), 200)
    assert sum(adaptive_plan(ctl, caps).k.values()) == 0
    mixed = ctl.plan(caps, len(caps) + 500, num_prefills=1)
    assert mixed.reason == "adaptive" and sum(mixed.k.values()) == 0
    assert mixed.predicted_step_s == pytest.approx(0.005 + 0.0002 * 504, rel=0.1)  # the whole step's time


def test_an_optimised_plan_is_reused_for_the_same_batch_until_something_changes():
    """Optimising costs ~0.1-0.3 ms a step: the same sequences in pure-decode steps reuse the
    last plan for up to ``replan_interval_steps`` steps; a new sequence, a prefill chunk or a
    sequence behind its TPOT budget replans at once."""
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)
    caps = {f"s{i}": 8 for i in range(4)}
    ctl = controller(probe_interval_steps=1000)
    sim.run(ctl, caps, dict.fromkeys(caps, 0.9), np.random.default_rng(9), 40)
    calls = []
    real_optimise = ctl._optimise
    ctl._optimise = lambda *a: calls.append(1) or real_optimise(*a)

    def replans(*args, **kw) -> bool:
        before = len(calls)
        ctl.plan(*args, **kw)
        return len(calls) > before

    assert [replans(caps, 4) for _ in range(9)] == [True, False, False, False] * 2 + [True]
    first = ctl.plan(caps, 4)
    assert ctl.plan({**caps, "s1": 2}, 4).k["s1"] == min(2, first.k["s1"])  # a lower cap still holds
    assert replans({**caps, "new": 8}, 5)  # another batch
    assert replans(caps, 4) and replans(caps, 304, num_prefills=1)  # a prefill chunk rides along
    ctl.plan(caps, 4)
    assert not replans(caps, 4, tpot={"s0": (0.02, 0.001)})
    assert replans(caps, 4, tpot={"s0": (0.02, -0.001)})  # s0 fell behind its budget


def test_a_fit_on_steps_of_one_shape_prices_longer_drafts_without_a_made_up_slope():
    """Batch 1 kept off (the Ray path at concurrency 1): the cost model sees plain steps that are
    all alike (1 token, 8 experts) and the odd explore at k = 1. A draft call costs a fixed 2 ms
    (the hop) plus 0.5 ms a pass, a verify 4 ms plus 0.1 ms an expert, acceptance 0.75: k = 5 is
    best (296 tok/s), k = 1 worst (221; plain 208). A ridge on every feature split each step's
    time between the fixed cost and the collinear slopes, priced a k = 6 step at ~2.4x its cost
    and kept every explore at k = 1; the fixed cost free of the ridge extrapolates flat, and the
    model picks a long draft."""
    sim = SyntheticStep(d0=0.002, d_pass=0.0005, c0=0.004, c_exp=0.0001, experts=(8, 4, 2))
    ctl = controller(experts=(8, 4, 2))
    rng = np.random.default_rng(4)
    for step in range(96):
        k = 1 if step % 8 == 7 else 0
        distinct = sim.distinct(1 + k)
        ctl.observe_step(sim.d[0] + sim.d[1] * k if k else 0.0, k, k, sim.c[0] + sim.c[2] * distinct, 1 + k,
                         distinct)
        accepted = int(np.argmin(np.append(rng.random(8) < 0.75, False)))  # the acceptance estimates'
        ctl.observe_acceptances([("s", 8, accepted)])
    six = 0.002 + 0.0005 * 6 + 0.004 + 0.0001 * sim.distinct(7)
    assert ctl.predict_step_s(7, passes=6, num_drafted=6) == pytest.approx(six, rel=0.35)
    assert adaptive_plan(ctl, {"s": 8}).k["s"] >= 3
