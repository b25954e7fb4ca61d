"""One local Ray + Serve app for all HTTP tests of this package (start-up costs ~20 s). It is
package-scoped, not session-scoped: stopped when tests/actors ends, so its idle processes do not
take CPU from the timing-sensitive tests that run after it (tests/benchmarks' stub tests)."""

import socket
import time

import msgspec
import psutil
import pytest
import ray

from actors.config import ServeConfig

TARGET = "checkpoints/stdlib-moe-target"
DRAFT = "checkpoints/stdlib-draft"
MODEL_NAME = "stdlib-moe"


def wait_until(predicate, timeout_s: float, what: str, poke=None) -> None:
    """Poll ``predicate`` every 50 ms (calling ``poke`` first, if given) until it holds; fail
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if poke is not None:
            poke()
        time.sleep(0.05)


def kill_and_wait(handle, timeout_s: float = 30.0) -> None:
    """``ray.kill`` an actor and return once its process has exited. ``ray.kill`` returns at
    once, and the GCS marks the actor dead ~10 ms before its process is gone: a test that
    asserts what the next call does to a dead actor must wait for the process itself."""
    pid = ray._private.state.actors(handle._actor_id.hex())["Pid"]
    ray.kill(handle)

    def exited() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(exited, timeout_s, f"actor process {pid} to exit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_config(tracing_endpoint: str | None = None, **engine) -> ServeConfig:
    """The embedded config, shrunk for tests: small queues so backpressure is reachable, and four
    expert actors (two experts each) so a dispatch has enough calls for a median. The default
    adaptive speculation (tests that need the draft in a trace send seeded sampled requests, which
    keep their k). One default SLO class with a generous TPOT budget and no TTFT budget (so
    deadline refusal never touches it), so every request counts in ``specmoe:slo_requests_total``;
    and deadline refusal with an ``instant`` class whose 1 us TTFT budget no request can meet (a
    request naming it is refused with a 503)."""
    return msgspec.convert({
        "model_name": MODEL_NAME,
        "engine": {"model": TARGET, "draft_model": DRAFT, "num_speculative_tokens": 4,
                   "scheduler": {"max_num_seqs": 16, "max_waiting": 16, "max_num_batched_tokens": 8192,
                                 "slo_classes": {"interactive": {"tpot_ms": 5_000},
                                                 "instant": {"ttft_ms": 0.001}},
                                 "default_slo_class": "interactive", "refuse_unattainable_ttft": True},
                   **engine},
        "experts": {"experts_per_actor": 2, "call_timeout_s": 5.0, "straggler_floor_ms": 20.0},
        "http": {"host": "127.0.0.1", "port": free_port()},
        "body_timeout_s": 2.0,
        "tracing": {"endpoint": tracing_endpoint, "schedule_delay_ms": 200} if tracing_endpoint else None,
    }, ServeConfig)


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP/HTTP receiver every process of the app exports its spans to."""
    from observability.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def served(otlp_receiver):
    """(base_url, config, verifier handle) of the running app."""
    from ray import serve

    import serve_app

    config = test_config(tracing_endpoint=otlp_receiver.endpoint)
    url = serve_app.start(config)
    handle = serve.get_deployment_handle("verifier", app_name=serve_app.APP_NAME)
    yield url, config, handle
    serve_app.stop()


@pytest.fixture(scope="package")
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
