"""One local Ray + Serve app for all HTTP tests in the session (start-up costs ~20 s)."""

import socket

import msgspec
import pytest

from actors.config import ServeConfig

TARGET = "checkpoints/stdlib-moe-target"
DRAFT = "checkpoints/stdlib-draft"
MODEL_NAME = "stdlib-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_config(**engine) -> ServeConfig:
    """The embedded config, shrunk for tests: small queues so backpressure is reachable."""
    return msgspec.convert({
        "model_name": MODEL_NAME,
        "engine": {"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 4,
                   "scheduler": {"max_num_seqs": 16, "max_waiting": 16, "max_num_batched_tokens": 8192},
                   **engine},
        "experts": {"experts_per_actor": 4, "call_timeout_s": 5.0},
        "http": {"host": "127.0.0.1", "port": free_port()},
    }, ServeConfig)


@pytest.fixture(scope="session")
def served():
    """(base_url, config, verifier handle) of the running app."""
    from ray import serve

    import serve_app

    config = test_config()
    url = serve_app.start(config)
    handle = serve.get_deployment_handle("verifier", app_name=serve_app.APP_NAME)
    yield url, config, handle
    serve_app.stop()


@pytest.fixture(scope="session")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def reference_llm():
    """The in-process engine on the same checkpoints (the output HTTP must reproduce)."""
    from engine import LLM

    return LLM(TARGET, dtype="float32")


@pytest.fixture(scope="session")
def heldout_prompts():
    import json

    rows = [json.loads(line) for line in open("benchmarks/data/stdlib_heldout.jsonl")]
    return rows
