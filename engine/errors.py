"""Errors the engine raises for bad input; each names its culprit (field path, tensor or file)."""


class SpecmoeError(ValueError):
    """Base class: bad input to specmoe (a ValueError, so callers may treat it as one)."""


class ConfigError(SpecmoeError):
    """A model or YAML config is invalid; the message names the field path."""


class CheckpointError(SpecmoeError):
    """A checkpoint is missing, corrupt or inconsistent; the message names the file or tensor."""


class QueueFull(SpecmoeError):
    """The waiting queue is at ``max_waiting``; retry later (HTTP 503).

    ``code``: the OpenAI error body's ``code`` and the ``reason`` of ``request_refused_total``."""

    code = "queue_full"


class GenerationError(RuntimeError):
    """An engine step failed for these requests (their ``finish_reason`` is ``"error"``; the engine
    itself keeps serving). Raised by the offline :meth:`engine.llm.LLM.generate`, chained from the
    step's exception; ``outputs`` holds every output of the call, in prompt order."""

    def __init__(self, message: str, outputs: list) -> None:
        super().__init__(message)
        self.outputs = outputs
