"""specmoe's transport-free core: model, KV cache, sampling, speculative decoding, scheduler.

Imports neither ray nor opentelemetry, so everything here runs in-process for tests and benchmarks.
Public names are imported lazily so that ``import engine.config`` stays light.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm",
    "build_engine": "engine.llm",
    "EngineArgs": "engine.args",
    "LLMEngine": "engine.engine",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SpecDecodeStats": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
