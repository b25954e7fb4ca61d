"""Hooks that let a caller observe engine steps (tracing lives outside engine/).

The engine calls :meth:`StepObserver.step` around each step and :meth:`StepObserver.phase` around
its draft, target-forward and verify phases, all on the engine's thread. The default does nothing;
the verifier deployment plugs in OpenTelemetry spans (``actors/telemetry.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

PHASE_DRAFT = "draft"
PHASE_TARGET = "target"
PHASE_VERIFY = "verify"


@dataclass
class StepStats:
    """What one engine step did.

    Attributes:
        batch_size: sequences in the step (prefills + decodes).
        num_prefills: sequences prefilled this step.
        num_drafted: draft tokens verified.
        num_accepted: accepted draft tokens that were emitted.
        num_emitted: output tokens emitted.
        k: largest draft length in the step (0 when nothing was drafted).
        duration_s: wall-clock seconds of the step.
        k_policy: how draft lengths were chosen ("fixed", "warmup", "probe", "explore", "adaptive").
        expected_tokens: tokens the speculation controller expected the step to emit.
        predicted_step_s: step seconds the controller predicted for its choice (0: no prediction).
    """

    batch_size: int = 0
    num_prefills: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    k: int = 0
    duration_s: float = 0.0
    k_policy: str = "fixed"
    expected_tokens: float = 0.0
    predicted_step_s: float = 0.0


class StepObserver(Protocol):
    def step(self, request_ids: list[str]) -> AbstractContextManager[Callable[[StepStats], None]]:
        """Wraps a step serving ``request_ids``; yields a callback the engine calls with the
        step's :class:`StepStats` before the step ends."""
        ...

    def phase(self, name: str) -> AbstractContextManager:
        """Wraps one phase: :data:`PHASE_DRAFT`, :data:`PHASE_TARGET` or :data:`PHASE_VERIFY`."""
        ...


class NullStepObserver:
    """Observes nothing."""

    def step(self, request_ids: list[str]) -> AbstractContextManager[Callable[[StepStats], None]]:
        return nullcontext(lambda stats: None)

    def phase(self, name: str) -> AbstractContextManager:
        return nullcontext()
