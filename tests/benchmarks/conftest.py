"""Fixtures for the serving-benchmark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.benchmarks.stub_server import StubConfig, StubServer


@pytest.fixture
def stub() -> Iterator[StubServer]:
    """A fresh scripted server (own counters and request log) on a free loopback port."""
    server = StubServer(StubConfig()).start()
    yield server
    server.stop()
