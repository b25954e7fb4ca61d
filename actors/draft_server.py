"""The draft actor: a shim over :class:`DraftModelDrafter`, plus the verifier-side client.

Each verifier replica owns one draft actor (its serving unit's drafter: a separate process
holding the draft model and its KV cache), reached from the engine thread through a compiled graph
(``experts.transport: compiled_graph``) or a plain actor call. Generators cross the hop as their
state bytes: the draft replica samples with the request's own
generator and sends the advanced state back, so a sampled request draws exactly the same random
numbers as it would in-process, and its output does not depend on which replica drafted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import ray
import torch

from actors.compiled_graph import ActorGraph, kill_actor
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
    """Serves draft proposals from a draft model.

    Args:
        draft_model: draft checkpoint directory.
        dtype, device: as for the target.
        max_seqs: sequences whose draft KV cache is kept (LRU); a miss re-prefills.
        max_len: draft cache context window.
        tracing: :class:`observability.TracingConfig` as builtins (None: environment only).
    """

    def __init__(self, draft_model: str, dtype: str = "float32", device: str = "cpu", max_seqs: int = 16,
                 max_len: int | None = None, tracing: dict | None = None) -> None:
        import msgspec

        from engine.drafters.draft_model import DraftModelDrafter
        from engine.loader import load_model
        from observability import TracingConfig, setup_tracing

        torch.set_num_threads(1)
        setup_tracing("draft", msgspec.convert(tracing, TracingConfig) if tracing else None)
        self.drafter = DraftModelDrafter(load_model(draft_model, dtype, device, skip_tokenizer_init=True),
                                         max_seqs, max_len)

    def propose(self, wire: list[dict], release: list[str] | None = None,
                carrier: dict | None = None) -> list[dict]:
        """Draft tokens for each request (wire format of :func:`requests_to_wire`).

        Returns:
            Per request ``{"token_ids", "probs" ((n, V) float32 numpy or None), "generator"}``.
        """
        from observability import SpanKind, start_span
        from observability import semconv as sc

        with start_span(sc.SPAN_DRAFT_FORWARD, carrier=carrier, kind=SpanKind.SERVER,
                        attributes={sc.STEP_BATCH_SIZE: len(wire)}):
            for seq_id in release or []:
                self.drafter.release(seq_id)
            requests = requests_from_wire(wire)
            proposals = self.drafter.propose(requests)
            # Explicit host copy: the draft probabilities cross a process boundary as numpy.
            return [{"token_ids": p.token_ids, "probs": None if p.probs is None else p.probs.detach().cpu().numpy(),
                     "generator": _gen_state(r.generator)} for p, r in zip(proposals, requests)]

    def propose_graph(self, request: tuple | None, index: int) -> list[dict] | None:
        """One compiled-graph execution: ``request`` is ``(wire, release, carrier)``, or None for
        the warm-up execution after compiling."""
        return None if request is None else self.propose(*request)

    def num_cache_misses(self) -> int:
        return self.drafter.num_cache_misses


DraftActor = ray.remote(DraftServer)


MAX_PENDING_RELEASES = 256


@dataclass
class DraftActorSpec:
    """How the verifier creates (and after a death re-creates) its draft actor."""

    draft_model: str
    dtype: str
    device: str
    max_seqs: int
    max_len: int | None
    tracing: dict | None
    name_prefix: str
    namespace: str
    num_cpus: float = 0.0
    num_gpus: float = 0.0


@dataclass
class _Member:
    handle: ray.actor.ActorHandle


class RemoteDrafter:
    """The verifier's ``Drafter``: asks its draft actor, from the engine thread.

    The hop is a compiled-graph execution when ``graph`` is set and the graph is live, else a plain
    actor call, made and awaited on the engine thread itself (no event-loop hop). A failed or slow
    draft call never fails a request: that step just runs without speculation; a dead actor is
    re-created (its cache re-prefills on the next proposals).

    Args:
        spec: the draft actor to create.
        timeout_s: longest wait for one proposal call.
        graph_config: an ``ExpertPoolConfig`` whose graph settings the draft graph uses (see
            :meth:`ActorGraph.from_config`); None: plain actor calls only.
    """

    def __init__(self, spec: DraftActorSpec, timeout_s: float = 10.0, graph_config=None) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self._released: list[str] = []
        self.num_failures = 0
        self.generation = 0
        self.member = _Member(self._make())
        self.graph = ActorGraph.from_config("draft", lambda: ([self.member], "propose_graph"), lambda n: None,
                                            graph_config) if graph_config is not None else None

    def _make(self) -> ray.actor.ActorHandle:
        s = self.spec
        # max_concurrency 2: a plain call still runs while the compiled-graph loop holds a thread.
        return DraftActor.options(name=f"{s.name_prefix}-v{self.generation}", namespace=s.namespace,
                                  get_if_exists=True, num_cpus=s.num_cpus, num_gpus=s.num_gpus,
                                  max_concurrency=2).remote(s.draft_model, s.dtype, s.device, s.max_seqs, s.max_len,
                                                            s.tracing)

    def wait_loaded(self, timeout_s: float) -> None:
        """Block until the draft actor has built its model (its constructor loads the weights).

        Raises:
            ray.exceptions.GetTimeoutError: not ready within ``timeout_s``.
            ray.exceptions.RayActorError: the actor died while loading.
        """
        ray.get(self.member.handle.__ray_ready__.remote(), timeout=timeout_s)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        from observability import inject_context, is_enabled

        release, self._released = self._released, []
        carrier = inject_context() if is_enabled() else None  # the draft.propose span, this thread
        try:
            wire = self._call((requests_to_wire(requests), release, carrier))
        except Exception as e:  # draft failure: speculation off for this step only
            self.num_failures += 1
            log.warning("draft actor failed (%s: %s); step runs without speculation", type(e).__name__, e)
            if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
                self._recreate()
            return [DraftProposal([]) for _ in requests]
        out = []
        for r, w in zip(requests, wire):
            if r.generator is not None and w["generator"] is not None:
                r.generator.set_state(torch.from_numpy(np.frombuffer(w["generator"], dtype=np.uint8).copy()))
            probs = None if w["probs"] is None else torch.from_numpy(np.array(w["probs"], copy=True))
            out.append(DraftProposal(list(w["token_ids"]), probs))
        return out

    def _call(self, request: tuple) -> list[dict]:
        # No live graph (building, torn down, failed): execute says so and this step uses a plain call.
        result = self.graph.execute(request) if self.graph is not None else None
        if result is not None:
            return result[0]
        return ray.get(self.member.handle.propose.remote(*request), timeout=self.timeout_s)

    def _recreate(self) -> None:
        kill_actor(self.member.handle)  # a hung actor keeps its model otherwise
        self.generation += 1
        self.member = _Member(self._make())

    def release(self, seq_id: str) -> None:
        """Forget ``seq_id``'s draft cache: sent with the next proposal call, or on its own once
        ``MAX_PENDING_RELEASES`` pile up (nothing drafting, e.g. every request at k = 0)."""
        self._released.append(seq_id)
        if len(self._released) >= MAX_PENDING_RELEASES:
            release, self._released = self._released, []
            try:
                self._call(([], release, None))  # an empty proposal: the same hop, in order
            except Exception as e:  # the actor forgets everything if it died anyway
                log.warning("draft cache release failed (%s: %s)", type(e).__name__, e)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
