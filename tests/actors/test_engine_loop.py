"""The verifier's request loop without Ray: streams equal the offline API, aborts free slots,
bad input answers 400, and a hung engine thread fails the health check."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from actors.engine_loop import EngineHung, EngineLoop
from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.llm import build_engine
from tests.actors.conftest import DRAFT, TARGET

PARAMS = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected_texts():
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
    llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=3)
    outs = llm.generate(prompts, msgspec.convert(PARAMS, SamplingParams))
    tokenizer = llm.tokenizer
    return [(tokenizer.encode(p).ids, o.outputs[0].text) for p, o in zip(prompts, outs)]


def _new_loop(engine, **kw) -> EngineLoop:
    return EngineLoop(engine, ThreadPoolExecutor(1), **kw)


async def _collect(loop: EngineLoop, ids: list[int], params: dict = PARAMS) -> tuple[list[dict], str]:
    items = [item async for item in loop.generate(ids, params)]
    text = "".join(c["new_text"] for item in items[1:] if item["type"] == "step" for c in item["choices"])
    return items, text


def test_concurrent_streams_equal_the_offline_api(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET, draft_model=DRAFT, num_speculative_tokens=3))
    changes = []

    async def run():
        loop = _new_loop(engine, on_change=lambda _metrics: changes.append(1))
        return await asyncio.gather(*[_collect(loop, ids) for ids, _ in expected_texts])

    results = asyncio.run(run())
    for (items, text), (_, expected) in zip(results, expected_texts):
        assert items[0]["type"] == "accepted"
        assert items[-1]["finished"] and items[-1]["usage"]["completion_tokens"] == 24
        assert text == expected
    assert changes and not engine.has_unfinished_requests() and engine.kv.num_used == 0


def test_closing_a_stream_aborts_the_request_and_bad_input_answers_400(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET))

    async def run():
        loop = _new_loop(engine)
        stream = loop.generate(expected_texts[0][0], {**PARAMS, "max_tokens": 200})
        assert (await anext(stream))["type"] == "accepted"
        assert (await anext(stream))["type"] == "step"
        assert engine.kv.num_used > 0
        await stream.aclose()  # the client went away
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        bad = [item async for item in loop.generate([10**6], PARAMS)]
        return bad

    bad = asyncio.run(run())
    assert engine.kv.num_used == 0 and engine.finished_by_reason.get("abort") == 1
    assert bad == [{"type": "error", "status": 400, "message": bad[0]["message"], "finished": True,
                    "param": "prompt", "code": None}]
    assert "outside the vocabulary" in bad[0]["message"]


class _HangingEngine:
    """Accepts one request; its step blocks until released (a hung expert call, say)."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.unfinished = False

    def add_request(self, *args) -> None:
        self.unfinished = True

    def abort_request(self, request_id: str) -> bool:
        self.unfinished = False
        return True

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def step(self) -> list:
        self.entered.set()
        self.release.wait(10)
        self.unfinished = False
        return []


def test_a_hung_engine_step_fails_the_health_check():
    engine = _HangingEngine()

    async def run():
        loop = _new_loop(engine, step_timeout_s=0.2)
        stream = loop.generate([1, 2, 3], PARAMS)
        assert (await anext(stream))["type"] == "accepted"
        loop.check_health()  # a step that just started is healthy
        while not engine.entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        with pytest.raises(EngineHung, match="engine step running"):
            loop.check_health()
        engine.release.set()
        deadline = time.monotonic() + 5
        while loop._step_started is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        loop.check_health()  # healthy again once the step returns
        await stream.aclose()

    asyncio.run(run())


def test_transport_config_errors_name_the_field(tmp_path):
    from actors.config import ServeConfig
    from engine.errors import ConfigError
    from engine.yaml_config import load_yaml

    cfg = tmp_path / "serve.yaml"
    base = "model_name: m\nengine:\n  model: /x\nexperts:\n"
    cfg.write_text(base + "  transport: grpc\n")
    with pytest.raises(ConfigError, match=r"\$\.experts\.transport"):
        load_yaml(cfg, ServeConfig)
    cfg.write_text(base + "  graph_idle_park_s: 0\n")
    with pytest.raises(ConfigError, match=r"experts\.graph_idle_park_s"):
        load_yaml(cfg, ServeConfig)
    cfg.write_text(base + "  transport: actor_calls\n")
    assert load_yaml(cfg, ServeConfig).experts.transport == "actor_calls"


def _verifier(engine_factory, **config):
    from actors.verifier import VerifierServer

    return VerifierServer({"model_name": "m", "engine": {"model": TARGET}, **config}, engine_factory=engine_factory)


def test_verifier_check_health_bounds_the_build_and_reports_a_hung_step():
    def slow_build():
        time.sleep(1.0)
        return _HangingEngine()

    async def run():
        slow = _verifier(slow_build, verifier_start_timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await slow.check_health()  # the engine is still building after 0.2 s
        assert time.monotonic() - started < 0.9 and slow.loop is None

        engine = _HangingEngine()
        engine.get_metrics = lambda: {}
        verifier = _verifier(lambda: engine, engine_step_timeout_s=0.2)
        await verifier.check_health()  # builds the engine; no step yet: healthy
        assert verifier.engine is engine and verifier.loop is not None
        stream = verifier.generate([1, 2, 3], PARAMS)
        assert (await anext(stream))["type"] == "accepted"
        while not engine.entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        with pytest.raises(EngineHung, match=r"engine step running for .* \(> 0\.2 s\)"):
            await verifier.check_health()
        engine.release.set()
        await stream.aclose()

    asyncio.run(run())


def test_verifier_is_not_healthy_until_its_remote_weights_are_loaded():
    loaded = threading.Event()
    timeouts = []

    class LoadingDrafter:  # a draft actor still loading its model, for as long as the test says
        def wait_loaded(self, timeout_s: float) -> None:
            timeouts.append(timeout_s)
            if not loaded.wait(timeout_s):
                raise TimeoutError("draft weights not loaded")

    engine = _HangingEngine()
    engine.drafter = LoadingDrafter()

    async def run():
        verifier = _verifier(lambda: engine, verifier_start_timeout_s=30)
        health = asyncio.ensure_future(verifier.check_health())
        await asyncio.sleep(0.5)
        assert not health.done() and verifier.loop is None  # not healthy, nothing can be routed to it
        loaded.set()
        await asyncio.wait_for(health, 5)
        assert verifier.engine is engine and verifier.loop is not None
        assert 29 < timeouts[0] <= 30  # the load is bounded by what is left of the start-up bound

    asyncio.run(run())


def test_draining_ends_open_streams_with_503_frees_their_kv_and_refuses_new(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET))

    async def run():
        loop = _new_loop(engine)
        stream = loop.generate(expected_texts[0][0], {**PARAMS, "max_tokens": 200})
        assert (await anext(stream))["type"] == "accepted"
        assert (await anext(stream))["type"] == "step"
        assert engine.kv.num_used > 0
        assert loop.drain() == 1
        rest = [item async for item in stream]
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        refused = [item async for item in loop.generate(expected_texts[1][0], PARAMS)]
        return rest, refused

    rest, refused = asyncio.run(run())
    assert rest[-1] == {"type": "error", "status": 503, "message": rest[-1]["message"], "finished": True}
    assert "shutting down" in rest[-1]["message"]
    assert all(item["type"] == "step" for item in rest[:-1])  # steps already queued still arrive first
    assert engine.kv.num_used == 0 and engine.finished_by_reason.get("abort") == 1
    assert [item["status"] for item in refused] == [503]


class _CountingExecutor(ThreadPoolExecutor):
    """The engine thread, counting the jobs the event loop hands it."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="engine-test")
        self.submissions = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submissions += 1
        return super().submit(fn, *args, **kwargs)


def _record_steps(engine) -> tuple[list[str], threading.Event]:
    """Wrap ``engine.step``: the name of the thread that ran each step, and a flag set while one runs."""
    threads, in_step, step = [], threading.Event(), engine.step

    def recorded():
        threads.append(threading.current_thread().name)
        in_step.set()
        try:
            return step()
        finally:
            in_step.clear()

    engine.step = recorded
    return threads, in_step


def test_the_engine_thread_steps_back_to_back_while_requests_are_unfinished(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET, draft_model=DRAFT, num_speculative_tokens=3))
    threads, _ = _record_steps(engine)
    executor = _CountingExecutor()

    async def run():
        loop = EngineLoop(engine, executor)
        return await asyncio.gather(*[_collect(loop, ids) for ids, _ in expected_texts[:2]])

    results = asyncio.run(run())
    assert [text for _, text in results] == [expected for _, expected in expected_texts[:2]]
    assert set(threads) == {"engine-test_0"}
    # One job per burst, not per step: the event loop did not hand out the steps one by one.
    assert executor.submissions <= 2 and len(threads) >= 4 * executor.submissions


def test_call_between_steps_runs_on_the_engine_thread_between_steps_of_a_streaming_request(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET))
    _, in_step = _record_steps(engine)
    seen = []

    def probe() -> str:
        seen.append((threading.current_thread().name, in_step.is_set(), engine.has_unfinished_requests(),
                     engine.num_steps))
        return "probed"

    async def run():
        loop = EngineLoop(engine, ThreadPoolExecutor(1, thread_name_prefix="engine-test"))
        stream = loop.generate(expected_texts[0][0], {**PARAMS, "max_tokens": 200})
        assert (await anext(stream))["type"] == "accepted"
        assert (await anext(stream))["type"] == "step"
        assert await loop.call_between_steps(probe) == "probed"
        with pytest.raises(ZeroDivisionError):
            await loop.call_between_steps(lambda: 1 / 0)
        steps_at_probe = seen[0][3]
        while engine.num_steps <= steps_at_probe + 2:  # the request streams on after the calls
            assert (await anext(stream))["type"] == "step"
        await stream.aclose()
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return await loop.call_between_steps(threading.current_thread)  # idle: a burst of the call alone

    idle_thread = asyncio.run(run())
    # Not inside a step, and while the request was unfinished (not after a whole burst).
    assert seen[0][:3] == ("engine-test_0", False, True)
    assert idle_thread.name == "engine-test_0"
    assert engine.kv.num_used == 0 and engine.finished_by_reason.get("abort") == 1


def test_metrics_snapshots_are_taken_on_the_engine_thread(expected_texts):
    engine = build_engine(EngineArgs(model=TARGET))
    threads, _ = _record_steps(engine)
    taken, get_metrics = [], engine.get_metrics

    def recorded_get_metrics() -> dict:
        taken.append((threading.current_thread().name, get_metrics()))
        return taken[-1][1]

    engine.get_metrics = recorded_get_metrics
    reported = []

    async def run():
        loop = EngineLoop(engine, ThreadPoolExecutor(1, thread_name_prefix="engine-test"),
                          on_change=reported.append)
        return await _collect(loop, expected_texts[0][0])

    asyncio.run(run())
    assert taken and {name for name, _ in taken} == {"engine-test_0"}
    assert len(reported) == len(taken) == len(threads) + 1  # every step, and the add
    assert all(r is t for r, (_, t) in zip(reported, taken))  # on_change sees each snapshot, in order
    assert reported[0]["num_waiting"] == 1 and reported[-1]["finished_by_reason"] == {"length": 1}
    assert reported[-1]["kv_slots_used"] == 0


def test_requests_are_checked_and_added_on_the_engine_thread_between_steps(expected_texts):
    """The checks read the scheduler's queues and the speculation controller's state, which a
    running step changes: they run on the engine thread, between steps, and their error is the
    stream's first item (503 when the queue is full, 400 for a duplicate id), never after an
    "accepted"."""
    engine = build_engine(msgspec.convert({"model": TARGET, "scheduler": {"max_num_seqs": 1, "max_waiting": 1}},
                                          EngineArgs))
    _, in_step = _record_steps(engine)
    adds, add_request = [], engine.add_request

    def recorded_add_request(*args, **kwargs):
        adds.append((threading.current_thread().name, in_step.is_set()))
        return add_request(*args, **kwargs)

    engine.add_request = recorded_add_request
    long = {**PARAMS, "max_tokens": 200}

    async def run():
        loop = EngineLoop(engine, ThreadPoolExecutor(1, thread_name_prefix="engine-test"))
        running = loop.generate(expected_texts[0][0], long, request_id="a")
        assert (await anext(running))["type"] == "accepted"
        assert (await anext(running))["type"] == "step"
        waiting = loop.generate(expected_texts[1][0], long, request_id="b")
        assert (await anext(waiting))["type"] == "accepted"
        full = [item async for item in loop.generate(expected_texts[2][0], PARAMS, request_id="c")]
        twin = [item async for item in loop.generate(expected_texts[2][0], PARAMS, request_id="a")]
        await running.aclose()
        await waiting.aclose()
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        again = [item async for item in loop.generate(expected_texts[2][0], PARAMS, request_id="c")]
        return full, twin, again

    full, twin, again = asyncio.run(run())
    assert [(i["type"], i["status"]) for i in full] == [("error", 503)] and "capacity" in full[0]["message"]
    assert [(i["type"], i["status"]) for i in twin] == [("error", 400)] and "already running" in twin[0]["message"]
    assert again[0]["type"] == "accepted" and again[-1]["finished"]
    assert adds == [("engine-test_0", False)] * 4  # a, b, the refused c, c again (the twin never got there)
