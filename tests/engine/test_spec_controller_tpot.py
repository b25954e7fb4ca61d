"""The speculation controller with TPOT budgets (synthetic costs): budgets that can be kept bound
the drafts; budgets that none can keep leave the realised check in charge."""

import numpy as np
import pytest

from tests.helpers.spec_sim import SyntheticStep, adaptive_plan, controller, drive_realised


def test_a_tpot_budget_shortens_drafts_that_stretch_the_step_more_than_they_emit():
    """'easy' (acceptance 0.95) pays for long drafts (under these costs k = 6-8 are within 2 % of
    each other, k = 6 best); 'hard' (0.02) gains little from drafting but waits for every draft
    pass: 10 ms + 2 ms a pass must stay within 14 ms x E[hard's tokens] + slack."""
    sim = SyntheticStep(d_pass=0.002, c0=0.01)
    caps = {"easy": 8, "hard": 8}
    ctl = controller()
    sim.run(ctl, caps, {"easy": 0.95, "hard": 0.02}, np.random.default_rng(5), 150)
    free = adaptive_plan(ctl, caps)
    assert free.k["easy"] >= 5
    assert adaptive_plan(ctl, caps, tpot={"hard": (1.0, 0.0)}).k == free.k  # a generous budget changes nothing
    tight = adaptive_plan(ctl, caps, tpot={"hard": (0.014, 0.0)})
    drafted, passes = sum(tight.k.values()), max(tight.k.values())
    hard_tokens = 1 + np.cumprod(ctl.acceptance("hard"))[: tight.k["hard"]].sum()
    assert 2 <= passes < free.k["easy"]
    assert ctl.predict_step_s(2 + drafted, passes, drafted) <= 0.014 * hard_tokens
    behind = adaptive_plan(ctl, caps, tpot={"hard": (0.014, -0.02)})  # 20 ms behind: no step fits
    assert behind.k == {"easy": 0, "hard": 0}  # the shortest step misses the budget least


@pytest.mark.parametrize("drafting_s, on", [(0.100, False), (0.012, True)])
def test_behind_unattainable_tpot_budgets_the_realised_rates_still_decide(drafting_s, on):
    """Every sequence far behind a 1 ms TPOT budget: no draft length keeps it, so the budgets
    cannot bar the realised check's explore steps (once they barred measuring one mode, the check
    never decided, probes kept drafting and the fit alone chose). The model favours drafting (cheap
    passes, acceptance 0.9); the steps as run say drafting takes 100 ms (off wins) or 12 ms for
    ~3.4x the tokens (drafting wins), and the controller's own choices follow them."""
    sim = SyntheticStep(d_pass=0.0002, c0=0.01)
    caps = {f"s{i}": 8 for i in range(4)}
    ctl = controller()
    rng = np.random.default_rng(3)
    tpot = dict.fromkeys(caps, (0.001, -0.5))
    sim.run(ctl, caps, dict.fromkeys(caps, 0.9), rng, 40)
    decisions = drive_realised(ctl, sim, caps, rng, 300, drafting_s, tpot)
    assert ctl.realised.standing(len(caps), ctl._on) is on
    own = [d for d in decisions[150:] if d.reason == "adaptive"]
    assert own and all((sum(d.k.values()) > 0) is on for d in own)
    explored = [d for d in decisions[150:] if d.reason == "explore"]
    assert explored and all((sum(d.k.values()) > 0) is not on for d in explored)
    if not on:  # settled off: no probe drafts, and plain steps skip the optimisation
        assert not any(d.reason == "probe" for d in decisions[150:])
