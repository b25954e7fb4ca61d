"""The speculation controller's cost pieces on their own: the online linear step-cost fit, the
realised-goodput check (switching, explore cadence and time share), the expert-activation meter,
the online quantile of step overruns and the prefill attention feature."""

import numpy as np
import pytest

from engine.spec_cost import ExpertActivation, LogQuantile, OnlineLinearCost, prefill_attention_pairs
from engine.spec_realised import RealisedCheck


def test_online_cost_recovers_a_linear_model_with_non_negative_coefficients():
    model = OnlineLinearCost(3, forgetting=1.0)
    rng = np.random.default_rng(6)
    for _ in range(200):
        x = [1.0, rng.integers(1, 50), rng.integers(0, 16)]
        model.observe(x, 0.004 + 0.0003 * x[1] + 0.001 * x[2])
    assert model.theta == pytest.approx([0.004, 0.0003, 0.001], rel=1e-2)
    collinear = OnlineLinearCost(3)
    for t in range(1, 30):  # features 1 and 2 identical: the fit must not go negative
        collinear.observe([1.0, t, t], 0.01 + 0.001 * t)
    assert (collinear.theta >= 0).all()
    assert collinear.predict(1.0, 10, 10) == pytest.approx(0.02, rel=0.05)


def test_a_fixed_cost_takes_what_steps_of_one_shape_cannot_split():
    """Every step alike ([1, 1, 8]: 1 token, 8 experts, 5 ms): the data cannot tell the fixed cost
    from the slopes. With ``fixed_cost`` the constant takes it all, so a 7-token step is priced at
    5 ms until steps of that shape say otherwise; a ridge on every feature split it evenly and made
    up a slope (~2x for 8 -> 27 experts)."""
    free, ridged = OnlineLinearCost(3, fixed_cost=True), OnlineLinearCost(3)
    for _ in range(40):
        for model in (free, ridged):
            model.observe([1.0, 1.0, 8.0], 0.005)
    assert free.theta == pytest.approx([0.005, 0.0, 0.0], abs=1e-9)
    assert free.predict(1.0, 7.0, 27.0) == pytest.approx(0.005, rel=1e-6)
    assert ridged.predict(1.0, 7.0, 27.0) > 0.008
    for t in range(2, 60):  # then steps of other shapes: the slopes are learned as before
        free.observe([1.0, t % 9 + 1, 2.0 * (t % 5) + 8], 0.004 + 0.0003 * (t % 9 + 1) + 0.0001 * (2 * (t % 5) + 8))
    assert free.predict(1.0, 7.0, 27.0) == pytest.approx(0.004 + 0.0021 + 0.0027, rel=0.1)


def _fit_with_stalls(huber: float) -> tuple[OnlineLinearCost, np.ndarray, np.ndarray]:
    """A draft-cost-like model fitted on steps with 5 % noise, one step in ten stalled 3-8x (a
    shared core), and every cost doubling half-way (a load change)."""
    model = OnlineLinearCost(4, forgetting=0.95, huber=huber)
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 1e-3, 0.2e-3, 0.05e-3])
    for t in range(600):
        passes = rng.integers(0, 9)
        x = np.array([1.0, passes, passes * rng.integers(1, 5), rng.integers(0, 50)])
        y = truth @ x * (1 + 0.05 * rng.standard_normal()) * (2 if t >= 300 else 1)
        model.observe(list(x), y * (rng.uniform(3, 8) if rng.random() < 0.1 else 1.0))
    grid = np.array([[1.0, p, p * d, c] for p in range(9) for d in (1, 4) for c in (0, 40)])
    return model, grid @ model.theta, grid @ (2 * truth)


def test_online_cost_shrugs_off_stalled_steps_and_follows_a_load_change():
    robust, predicted, true = _fit_with_stalls(huber=2.0)
    assert np.abs(robust.theta / [4e-3, 2e-3, 0.4e-3, 0.1e-3] - 1).max() < 0.3
    assert np.abs(predicted / true - 1).max() < 0.15
    _, plain, _ = _fit_with_stalls(huber=float("inf"))  # unweighted least squares: the stalls win
    assert np.abs(plain / true - 1).max() > 0.3


def test_online_cost_solves_when_a_prediction_needs_it():
    """Observations alone solve the fit once per ``resolve_every`` (residuals need a recent fit);
    a prediction solves whatever is pending first, so it equals an always-solved model's."""
    lazy, eager = OnlineLinearCost(3), OnlineLinearCost(3, resolve_every=1)
    solves = []
    real_solve = lazy._solve
    lazy._solve = lambda: solves.append(1) or real_solve()
    for t in range(1, 20):
        for model in (lazy, eager):
            model.observe([1.0, t % 7, t % 3], 0.004 + 0.001 * (t % 7) + 0.0005 * (t % 3))
    assert len(solves) == 2  # at the 9th and 17th observation
    assert lazy.predict(1.0, 5, 2) == pytest.approx(eager.predict(1.0, 5, 2), rel=1e-9)
    assert lazy.predict(1.0, 5, 2) == pytest.approx(0.010, rel=1e-3)
    assert len(solves) == 3
    lazy.predict(1.0, 5, 2)
    assert len(solves) == 3  # nothing pending: no solve


def test_realised_check_switches_around_the_required_gain():
    """Drafting stays on only while it realises ``required_gain`` (5 %) over plain decoding and
    comes on when it realises 5 % more (hysteresis): a tie goes to plain decoding. (With a band
    around equal rates, rates 2 % apart kept drafting on for good.)"""
    def check(ratio: float) -> RealisedCheck:
        rc = RealisedCheck(0.05, 8, 0.2, 0.99, 2.0, required_gain=0.05)
        for _ in range(20):
            rc.observe(4, False, 4, 0.010)  # plain decoding: 400 tok/s
            rc.observe(4, True, 8, 0.020 / ratio)  # drafting: 400 x ratio tok/s
        return rc
    assert check(1.02).standing(4, on=True) is False
    assert check(1.08).standing(4, on=True) is True and check(1.08).standing(4, on=False) is False
    assert check(1.12).standing(4, on=False) is True


@pytest.mark.parametrize("on, run", [(False, [True, True, True]), (True, [True, False, False])])
def test_an_explore_of_unmeasured_drafting_while_off_is_a_run(on, run):
    """Plain decoding measured, drafting not (the model kept it off, e.g. behind a TPOT budget):
    an explore step while off starts a run of ``explore_run_steps``, as it does once the rates say
    off; alone it would be a switch step, which the drafting figure leaves out, so drafting would
    never be measured. While on, an explore (of off) is one step."""
    rc = RealisedCheck(0.05, 8, 0.2, 0.99, 2.0, required_gain=0.05, explore_run_steps=3)
    rc.observe(4, False, 4, 0.010)
    verdicts = [rc.verdict(4, on) for _ in range(10)]
    first = next(i for i, (_, explore) in enumerate(verdicts) if explore)
    assert [explore for _, explore in verdicts[first:first + 3]] == run
    assert all(standing is None for standing, _ in verdicts)


def explore_gaps(rc: RealisedCheck, drafting_ratio: float, steps: int) -> list[int]:
    """Drive ``rc`` with plain steps at 400 tok/s and its explore steps (drafting) at
    ``400 x drafting_ratio``; the gaps in steps between explore steps."""
    gaps, last = [], 0
    for t in range(1, steps + 1):
        _, explore = rc.verdict(4, on=False)
        if explore:
            gaps.append(t - last)
            last = t
        rc.observe(4, explore, 8 if explore else 4, 0.020 / drafting_ratio if explore else 0.010)
    return gaps


def test_explore_steps_back_off_while_the_margin_stays_wide_and_not_when_thin():
    """Drafting realises half plain decoding's rate: explore steps (each a loss) come every 32, 64,
    then 128 steps, and the rarely measured drafting rate stays trusted between them. At 0.95 of
    plain decoding (a thin margin) they stay every 8 steps."""
    def check(doublings: int, drafting_ratio: float) -> RealisedCheck:
        rc = RealisedCheck(0.05, 8, 0.2, 0.99, 2.0, required_gain=0.05, explore_backoff_doublings=doublings)
        for _ in range(3):  # both modes measured
            rc.observe(4, False, 4, 0.010)
            rc.observe(4, True, 8, 0.020 / drafting_ratio)
        return rc
    gaps = explore_gaps(check(2, 0.5), 0.5, 1000)
    assert gaps[:3] == [32, 64, 128] and set(gaps[3:]) == {128}
    assert explore_gaps(check(0, 0.5), 0.5, 1000) == [32] * 31  # no backoff: the old cadence
    assert set(explore_gaps(check(2, 0.95), 0.95, 400)) == {8}
    # Drafting turning good again (0.5 -> 0.95 of plain) thins the margin at the next explore
    # steps, and the cadence is back to every 8 steps.
    recovered = explore_gaps(check(2, 0.5), 0.95, 600)
    assert 8 in recovered and recovered[-3:] == [8, 8, 8]


def test_explore_steps_keep_to_their_share_of_the_time():
    """At a thin margin explores come every 8 steps, but an explore that pays the drafter's
    catch-up can take several plain steps' time: with ``explore_time_share`` 0.1 they start only
    while explore steps took at most 10 % of the recent time, however long each one is."""
    def share_and_gaps(explore_step_s: float, time_share: float) -> tuple[float, list[int]]:
        rc = RealisedCheck(0.05, 8, 0.2, 0.99, 2.0, required_gain=0.05, explore_time_share=time_share)
        for _ in range(3):  # drafting measured at 0.95 of plain decoding's rate: a thin margin
            rc.observe(4, False, 4, 0.010)
            rc.observe(4, True, 8, 0.020 / 0.95)
        gaps, last, explore_s, total_s = [], 0, 0.0, 0.0
        for t in range(1, 2001):
            _, explore = rc.verdict(4, on=False)
            step_s = explore_step_s if explore else 0.010
            if explore:
                gaps.append(t - last)
                last = t
                rc.observe(4, True, round(8 * explore_step_s / 0.021), step_s)
            else:
                rc.observe(4, False, 4, step_s)
            rc.note_time(step_s, explore)
            if t > 1000:
                explore_s, total_s = explore_s + explore * step_s, total_s + step_s
        return explore_s / total_s, gaps
    share, gaps = share_and_gaps(0.021, 1.0)
    assert set(gaps) == {8} and share > 0.2  # unbounded: a fifth of the time in explore steps
    share, gaps = share_and_gaps(0.021, 0.1)
    assert 0.07 < share <= 0.11 and min(gaps[5:]) > 8  # (an explore starting at 10 % adds its own)
    share, _ = share_and_gaps(0.080, 0.1)  # explores 8x a plain step: rarer still, same share
    assert 0.05 < share <= 0.15  # one 80 ms explore overshoots the 10 % by up to its own weight


def test_expert_activation_learns_routing_skew():
    act = ExpertActivation(num_experts=8, num_moe_layers=2, top_k=2)
    assert act.predict(np.array([1]))[0] == pytest.approx(2 * 8 * 0.25)
    for _ in range(100):  # every token routed to the same 2 experts: 4 (layer, expert) pairs
        act.observe(16, 4)
    assert act.predict(np.array([16]))[0] == pytest.approx(4, abs=0.5)
    assert act.predict(np.array([1]))[0] < 2 * 8 * 0.25


def test_prefill_attention_pairs_counts_a_chunks_causal_query_key_pairs():
    for start, length in ((0, 1), (0, 128), (659, 241), (37, 5)):
        brute = sum(start + i + 1 for i in range(length))  # query i sees keys 0 .. start + i
        assert prefill_attention_pairs(start, length) == pytest.approx(brute / 1e3)
    assert prefill_attention_pairs(659, 241) > 2.5 * prefill_attention_pairs(0, 241)


def test_log_quantile_settles_where_a_tenth_of_the_ratios_lie_above():
    rng = np.random.default_rng(3)
    sigma = 0.15
    ratios = 1.1 * np.exp(sigma * rng.standard_normal(4000))  # predictions 10 % low, +-15 % noise
    quantile, logs = LogQuantile(0.9), []
    for r in ratios[:3000]:
        quantile.observe(float(r))
        logs.append(np.log(quantile.value))
    true_p90 = 1.1 * np.exp(sigma * 1.2816)
    # A constant step keeps it moving around the quantile (+4.5 % per ratio above it): on average
    # it sits there, and at any time within ~10 %.
    assert np.exp(np.mean(logs[1000:])) == pytest.approx(true_p90, rel=0.03)
    assert quantile.value == pytest.approx(true_p90, rel=0.1)
    assert 0.07 < (ratios[3000:] > np.exp(np.mean(logs[1000:]))).mean() < 0.13
    fast = LogQuantile(0.9)  # predictions that overestimate move it below 1 (larger chunks)
    for _ in range(300):
        fast.observe(0.7)
    assert 0.68 < fast.value < 0.72
