"""Draft deployment: a shim over :class:`DraftModelDrafter`, plus the verifier-side client.

Generators cross the hop as their state bytes: the draft replica samples with the request's own
generator and sends the advanced state back, so a sampled request draws exactly the same random
numbers as it would in-process, and its output does not depend on which replica drafted.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine.drafters.base import DraftProposal, DraftRequest

log = logging.getLogger(__name__)


def _gen_state(gen: torch.Generator | None) -> bytes | None:
    return None if gen is None else gen.get_state().numpy().tobytes()


def _gen_from(state: bytes | None) -> torch.Generator | None:
    if state is None:
        return None
    gen = torch.Generator()
    gen.set_state(torch.from_numpy(np.frombuffer(state, dtype=np.uint8).copy()))
    return gen


def requests_to_wire(requests: list[DraftRequest]) -> list[dict]:
    return [{"seq_id": r.seq_id, "token_ids": list(r.token_ids), "k": r.k, "temperature": r.temperature,
             "top_k": r.top_k, "top_p": r.top_p, "generator": _gen_state(r.generator)} for r in requests]


def requests_from_wire(wire: list[dict]) -> list[DraftRequest]:
    return [DraftRequest(w["seq_id"], w["token_ids"], w["k"], w["temperature"], w["top_k"], w["top_p"],
                         _gen_from(w["generator"])) for w in wire]


class DraftServer:
    """Serves draft proposals from a draft model (any replica can serve any sequence).

    Args:
        draft_model: draft checkpoint directory.
        dtype, device: as for the target.
        max_seqs: sequences whose draft KV cache is kept (LRU); a miss re-prefills.
        max_len: draft cache context window.
    """

    def __init__(self, draft_model: str, dtype: str = "float32", device: str = "cpu", max_seqs: int = 16,
                 max_len: int | None = None, tracing: dict | None = None) -> None:
        import msgspec

        from engine.drafters.draft_model import DraftModelDrafter
        from engine.loader import load_model
        from observability import TracingConfig, setup_tracing

        torch.set_num_threads(1)
        setup_tracing("draft", msgspec.convert(tracing, TracingConfig) if tracing else None)
        self.drafter = DraftModelDrafter(load_model(draft_model, dtype, device), max_seqs, max_len)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="draft")  # one model, one thread

    def propose_sync(self, wire: list[dict], release: list[str]) -> list[dict]:
        for seq_id in release:
            self.drafter.release(seq_id)
        requests = requests_from_wire(wire)
        proposals = self.drafter.propose(requests)
        return [{"token_ids": p.token_ids, "probs": None if p.probs is None else p.probs.numpy(),
                 "generator": _gen_state(r.generator)} for p, r in zip(proposals, requests)]

    async def propose(self, wire: list[dict], release: list[str] | None = None,
                      carrier: dict | None = None) -> list[dict]:
        """Draft tokens for each request; model work runs off the event loop."""
        from observability import SpanKind, start_span
        from observability import semconv as sc

        loop = asyncio.get_running_loop()
        with start_span(sc.SPAN_DRAFT_FORWARD, carrier=carrier, kind=SpanKind.SERVER,
                        attributes={sc.STEP_BATCH_SIZE: len(wire)}):
            return await loop.run_in_executor(self._executor, self.propose_sync, wire, release or [])

    async def num_cache_misses(self) -> int:
        return self.drafter.num_cache_misses


class RemoteDrafter:
    """The verifier's ``Drafter``: asks the draft deployment, from the engine thread.

    A failed or slow draft call never fails a request: that step just runs without speculation.
    """

    def __init__(self, handle, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
        self.handle, self.loop, self.timeout_s = handle, loop, timeout_s
        self._released: list[str] = []
        self.num_failures = 0

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        from observability import inject_context, is_enabled

        release, self._released = self._released, []
        carrier = inject_context() if is_enabled() else None  # the draft.propose span, this thread
        try:
            future = asyncio.run_coroutine_threadsafe(self._call(requests_to_wire(requests), release, carrier),
                                                      self.loop)
            wire = future.result(self.timeout_s)
        except Exception as e:  # draft failure: speculation off for this step only
            self.num_failures += 1
            log.warning("draft deployment failed (%s: %s); step runs without speculation", type(e).__name__, e)
            return [DraftProposal([]) for _ in requests]
        out = []
        for r, w in zip(requests, wire):
            if r.generator is not None and w["generator"] is not None:
                r.generator.set_state(torch.from_numpy(np.frombuffer(w["generator"], dtype=np.uint8).copy()))
            probs = None if w["probs"] is None else torch.from_numpy(np.array(w["probs"], copy=True))
            out.append(DraftProposal(list(w["token_ids"]), probs))
        return out

    async def _call(self, wire: list[dict], release: list[str], carrier: dict | None) -> list[dict]:
        return await self.handle.propose.remote(wire, release, carrier)

    def release(self, seq_id: str) -> None:
        self._released.append(seq_id)  # sent with the next proposal call
