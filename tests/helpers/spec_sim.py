"""A synthetic step-cost simulator for the speculation controller's tests: known costs, known
acceptance, so a test can check that the controller finds what those costs make best."""

import numpy as np

from engine.spec_controller import SpeculationController
from engine.spec_cost import ExpertActivation
from engine.spec_settings import ControllerSettings


class SyntheticStep:
    """Known step costs: draft = d_pass * passes + d_tok * drafted (+ d0 when drafting);
    target = c0 + c_tok * tokens + c_exp * distinct experts (uniform top-k routing)."""

    def __init__(self, d0=0.0, d_pass=0.001, d_tok=0.0, c0=0.01, c_tok=0.0, c_exp=0.0,
                 experts=(0, 0, 1), interference_s=0.0):
        self.d = (d0, d_pass, d_tok)
        self.interference_s = interference_s  # extra target time in steps that drafted (no feature has it)
        self.c = (c0, c_tok, c_exp)
        self.num_experts, self.layers, self.top_k = experts

    def distinct(self, tokens: int) -> int:
        if not self.num_experts:
            return 0
        p = self.top_k / self.num_experts
        return round(self.layers * self.num_experts * (1 - (1 - p) ** tokens))

    def run(self, controller, caps, acceptance, rng, steps):
        """Drive ``steps`` steps; ``acceptance[sid]`` is each sequence's true per-token acceptance."""
        last = None
        for _ in range(steps):
            decision = controller.plan(caps, len(caps))
            last = decision if decision.reason != "probe" else last
            ks = list(decision.k.values())
            drafted, passes = sum(ks), max(ks)
            draft_s = (self.d[0] + self.d[1] * passes + self.d[2] * drafted) if drafted else 0.0
            tokens = len(caps) + drafted
            distinct = self.distinct(tokens) if self.num_experts else None
            target_s = self.c[0] + self.c[1] * tokens + self.c[2] * (distinct or 0)
            target_s += self.interference_s if drafted else 0.0
            controller.observe_step(draft_s, passes, drafted, target_s, tokens, distinct)
            for sid, k in decision.k.items():
                accepted = 0
                while accepted < k and rng.random() < acceptance[sid]:
                    accepted += 1
                controller.observe_acceptances([(sid, k, accepted)])
        return last  # the controller's own choice (the final step may be a probe)


def controller(max_k=8, experts=None, **settings):
    activation = ExpertActivation(*experts) if experts else None
    return SpeculationController(max_k, "adaptive", activation, ControllerSettings(**settings))


def adaptive_plan(ctl, caps, **kw):
    """The controller's own (non-probe) choice for this step's state."""
    while (decision := ctl.plan(caps, len(caps), **kw)).reason != "adaptive":
        pass
    return decision


def drive_realised(ctl, sim, caps, rng, steps: int, drafting_step_s: float, tpot=None) -> list:
    """``steps`` pure-decode steps (acceptance 0.9) whose cost model keeps learning ``sim``'s costs
    while the steps as run take ``drafting_step_s`` drafting and 10 ms not (a cost the model's
    features miss); ``tpot`` goes to every plan."""
    decisions = []
    for _ in range(steps):
        decision = ctl.plan(caps, len(caps), tpot=tpot)
        decisions.append(decision)
        emitted = len(caps)
        for sid, k in decision.k.items():
            accepted = int(np.argmin(np.append(rng.random(k) < 0.9, False)))  # run of accepts
            ctl.observe_acceptances([(sid, k, accepted)])
            emitted += accepted
        drafted = sum(decision.k.values())
        ctl.observe_step(sim.d[1] * max(decision.k.values()) if drafted else 0.0, max(decision.k.values()),
                         drafted, sim.c[0], len(caps) + drafted, None)
        ctl.observe_goodput(emitted, drafting_step_s if drafted else 0.010)
    return decisions
