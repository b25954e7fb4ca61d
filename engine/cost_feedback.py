"""The engine's side of the online cost model (:mod:`engine.spec_cost`): building the speculation
controller (metering the target's experts where they are a cost), deciding whether steps feed
the model at all, and feeding it each step's measured costs.

:class:`engine.engine.LLMEngine` calls these once at start (:func:`build_controller`) and after
every step's target forward (:func:`learns_costs`, :func:`take_distinct_experts`,
:func:`observe_costs`).
"""

from __future__ import annotations

from engine.drafters.base import Drafter, DraftProposal, NoneDrafter
from engine.loader import LoadedModel
from engine.model import Transformer
from engine.sampling_params import MAX_SPECULATIVE_TOKENS
from engine.scheduler import SchedulerConfig, SchedulerOutput
from engine.spec_controller import SpeculationController, SpeculativePolicy
from engine.spec_cost import ActivationMeter, ExpertActivation


def build_controller(target: LoadedModel, drafter: Drafter, policy: SpeculativePolicy,
                     scheduler_config: SchedulerConfig) -> SpeculationController:
    """The engine's speculation controller: drafting up to ``MAX_SPECULATIVE_TOKENS`` with a
    drafter (0 without), its target's experts metered where steps feed the cost model."""
    moe = target.config.moe
    activation = None
    max_k = MAX_SPECULATIVE_TOKENS if not isinstance(drafter, NoneDrafter) else 0
    if moe is not None and target.model.experts is not None and learns_costs(max_k, scheduler_config):
        # Meter the target's experts: the distinct experts a verify pass activates are the MoE
        # part of its cost (engine.spec_cost).
        if not isinstance(target.model.experts, ActivationMeter):  # a reused target has one
            target.model.experts = ActivationMeter(target.model.experts)
        activation = ExpertActivation(moe.num_experts, len(moe.sparse_layers), moe.top_k)
    return SpeculationController(max_k, policy, activation)


def learns_costs(max_k: int, scheduler_config: SchedulerConfig) -> bool:
    """Whether steps feed the online cost model: it chooses draft lengths (max_k > 0) and
    predicts step times for latency budgets (SLO classes). A plain-decoding engine without
    SLO classes has no reader for it, so its steps skip the metering and the fit."""
    return max_k > 0 or bool(scheduler_config.slo_classes)


def take_distinct_experts(model: Transformer, count: bool) -> int | None:
    """Distinct (layer, expert) pairs the step's target forward activated (None: not metered,
    or not ``count``-ed: the step is not fed to the cost model)."""
    meter = model.experts
    return meter.take(count) if isinstance(meter, ActivationMeter) else None


def observe_costs(controller: SpeculationController, draft_s: float, target_s: float,
                  drafts: dict[str, DraftProposal], sched: SchedulerOutput, distinct: int | None,
                  catchup_by_seq: dict[str, int], prefill_pairs: float) -> None:
    """Feed the step's measured costs to the controller (draft phase; target + verify).

    Windows drafted ahead (pipelined) cost this step's draft phase nothing but the hop, so
    only the others count as drafted work. ``catchup_by_seq``: per sequence, the tokens the
    drafter caught up on this step; ``prefill_pairs``: the chunks' attention work
    (:func:`engine.spec_cost.prefill_attention_pairs`)."""
    lengths = [len(p.token_ids) for p in drafts.values()]
    drafted = [len(p.token_ids) for p in drafts.values() if not p.pipelined]
    catchup = sum(catchup_by_seq.get(sid, 0) for sid, p in drafts.items() if not p.pipelined)
    tokens = sum(sched.chunks.values()) + len(sched.decodes) + sum(lengths)
    controller.observe_step(draft_s if drafted else 0.0, max(drafted, default=0), sum(drafted), target_s,
                            tokens, distinct, catchup, prefill_pairs)
