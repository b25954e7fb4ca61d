"""The verifier as the ingress sees it, without Ray: ``generate.remote(...)`` streams from an
in-process :class:`~actors.engine_loop.EngineLoop` over a real engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from actors.engine_loop import EngineLoop

_ENGINE_LOOPS: dict[int, EngineLoop] = {}  # id(engine) -> its latest EngineLoop


class LocalStream:
    """A verifier stream as IngressServer uses it: async iteration plus ``cancel()``."""

    def __init__(self, gen) -> None:
        self.gen = gen
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.ensure_future(self.gen.aclose())


class LocalVerifier:
    """``generate.remote(...)`` over an EngineLoop (one per event loop: each test runs its own);
    ``calls`` records each call's arguments."""

    def __init__(self, engine) -> None:
        self.engine, self.loop, self.owner = engine, None, None
        self.generate = self
        self.calls: list[tuple] = []

    def remote(self, ids, params, prompt, rid, carrier, stream) -> LocalStream:
        self.calls.append((ids, params, prompt, rid, carrier, stream))
        if self.owner is not asyncio.get_running_loop():
            # One engine thread at a time steps an engine, as in a replica: the engine's last
            # EngineLoop (an earlier event loop's, or another LocalVerifier's) may still be ending
            # its burst. Left running, that thread saw this loop's new requests and stepped the
            # engine at the same time as this loop's thread: both emitted the same first token into
            # a sequence, which then finished one published token short (a batch test under load).
            previous = _ENGINE_LOOPS.get(id(self.engine))
            if previous is not None:
                previous.executor.shutdown(wait=True)
            self.loop, self.owner = EngineLoop(self.engine, ThreadPoolExecutor(1)), asyncio.get_running_loop()
            _ENGINE_LOOPS[id(self.engine)] = self.loop
        return LocalStream(self.loop.generate(ids, params, prompt, rid, carrier, stream))
