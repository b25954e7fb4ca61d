"""Fixtures for the serving-benchmark tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from actors.config import ExpertPoolConfig
from tests.benchmarks.stub_server import StubConfig, StubServer


@pytest.fixture(scope="session")
def quiet_ray_app() -> None:
    """Wait, once, until a Ray Serve app this session started (tests/actors' ``served``) has parked
    its compiled graphs: their channel readers spin on both cores for ``graph_idle_park_s`` after
    the last request, and the stub tests time real sleeps against a 15 ms tolerance (run right
    after tests/actors/test_http_parity.py, 3 of them failed)."""
    import ray

    if ray.is_initialized():
        time.sleep(ExpertPoolConfig().graph_idle_park_s + 1.0)


@pytest.fixture
def stub(quiet_ray_app) -> Iterator[StubServer]:
    """A fresh scripted server (own counters and request log) on a free loopback port."""
    server = StubServer(StubConfig()).start()
    yield server
    server.stop()
