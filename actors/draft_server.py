"""The draft actor: a shim over :class:`DraftModelDrafter` or :class:`EagleDrafter`, plus the
verifier-side client.

Each verifier replica owns one draft actor (its serving unit's drafter: a separate process
holding the draft model and its KV cache), reached from the engine thread through a compiled graph
(``experts.transport: compiled_graph``) or a plain actor call. Generators cross the hop as their
state bytes: the draft replica samples with the request's own
generator and sends the advanced state back, so a sampled request draws exactly the same random
numbers as it would in-process, and its output does not depend on which replica drafted.

An EAGLE-3 head reads the target's features: the client ships each sequence's features since its
last successful call (raw bytes), and the actor answers ``miss`` for a sequence whose cache lacks
earlier rows (evicted, or a new actor); the client then resends that sequence's whole history.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import numpy as np
import ray
import torch

from actors.actor_calls import FRESH_ACTOR_START_S
from actors.compiled_graph import ActorGraph
from actors.graph_park import GraphParking
from actors.teardown import kill_actor
from actors.wire import from_bytes, to_bytes
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


def requests_to_wire(requests: list[DraftRequest], shipped: dict[str, int] | None = None) -> list[dict]:
    """Wire dicts; ``shipped[seq_id]`` feature rows the actor already has are left out."""
    shipped = shipped or {}
    return [{"seq_id": r.seq_id, "token_ids": list(r.token_ids), "k": r.k, "temperature": r.temperature,
             "top_k": r.top_k, "top_p": r.top_p, "race_seed": r.race_seed,
             # a race row draws nothing from its generator: its state stays home
             "generator": _gen_state(r.generator) if r.race_seed is None else None,
             **_features_to_wire(r, shipped.get(r.seq_id, 0))} for r in requests]


def _features_to_wire(r: DraftRequest, start: int) -> dict:
    if r.features is None:
        return {}
    start = min(start, max(0, r.features.shape[0] - 1))  # the newest row is re-run for its logits every time
    rows = r.features[start:]
    return {"features": to_bytes(rows), "features_shape": list(rows.shape), "features_start": start,
            "features_dtype": str(rows.dtype).removeprefix("torch.")}


def requests_from_wire(wire: list[dict]) -> list[DraftRequest]:
    return [DraftRequest(w["seq_id"], w["token_ids"], w["k"], w["temperature"], w["top_k"], w["top_p"],
                         _gen_from(w["generator"]), *_features_from_wire(w), race_seed=w["race_seed"]) for w in wire]


def _features_from_wire(w: dict) -> tuple[torch.Tensor | None, int]:
    if "features" not in w:
        return None, 0
    return from_bytes(w["features"], w["features_shape"], getattr(torch, w["features_dtype"])), w["features_start"]


class DraftServer(GraphParking):
    """Serves draft proposals from a draft model.

    Args:
        draft_model: draft checkpoint directory.
        dtype, device: as for the target.
        max_seqs: sequences whose draft KV cache is kept (LRU); a miss re-prefills.
        max_len: draft cache context window.
        tracing: :class:`observability.TracingConfig` as builtins (None: environment only).
        method: ``"draft"`` (a draft model) or ``"eagle3"`` (``draft_model`` is an EAGLE-3 head).
        target_model: the target checkpoint (eagle3: its config and input embedding).
        pipelined: (draft model only) draft each greedy sequence's next window ahead, while the
            verifier runs the target (:class:`engine.drafters.pipelined.PipelinedDrafter`).

    Raises:
        CheckpointError / ConfigError: a head that does not load or does not fit the target.
    """

    def __init__(self, draft_model: str, dtype: str = "float32", device: str = "cpu", max_seqs: int = 16,
                 max_len: int | None = None, tracing: dict | None = None, method: str = "draft",
                 target_model: str | None = None, pipelined: bool = False) -> None:
        import msgspec

        from engine.drafters.draft_model import DraftModelDrafter
        from engine.loader import load_model
        from observability import TracingConfig, setup_tracing

        super().__init__()
        torch.set_num_threads(1)
        setup_tracing("draft", msgspec.convert(tracing, TracingConfig) if tracing else None)
        if method == "eagle3":
            self.model_drafter = _eagle_drafter(draft_model, target_model, dtype, device, max_seqs, max_len)
        else:
            self.model_drafter = DraftModelDrafter(load_model(draft_model, dtype, device, skip_tokenizer_init=True),
                                                   max_seqs, max_len)
        self.drafter = self.model_drafter
        if pipelined and method == "draft":
            from engine.drafters.pipelined import PipelinedDrafter

            self.drafter = PipelinedDrafter(self.model_drafter)

    def propose(self, wire: list[dict], release: list[str] | None = None,
                carrier: dict | None = None) -> list[dict]:
        """Draft tokens for each request (wire format of :func:`requests_to_wire`).

        Returns:
            Per request ``{"token_ids", "probs" ((n, V) float32 numpy or None), "generator",
            "pipelined", "drafting_ahead"}`` (the :class:`DraftProposal` fields).
        """
        from observability import SpanKind, start_span
        from observability import semconv as sc

        with start_span(sc.SPAN_DRAFT_FORWARD, carrier=carrier, kind=SpanKind.SERVER,
                        attributes={sc.STEP_BATCH_SIZE: len(wire)}):
            for seq_id in release or []:
                self.drafter.release(seq_id)
            requests = requests_from_wire(wire)
            rows_kept = getattr(self.drafter, "rows_kept", None)
            missed = {i for i, r in enumerate(requests)
                      if rows_kept is not None and rows_kept(r.seq_id, r.token_ids) < r.features_start}
            proposals = iter(self.drafter.propose([r for i, r in enumerate(requests) if i not in missed]))
            # Explicit host copy: the draft probabilities cross a process boundary as numpy.
            return [{"miss": True} if i in missed else _proposal_to_wire(next(proposals), r)
                    for i, r in enumerate(requests)]

    def propose_graph(self, request: list | str | None, index: int) -> list[dict] | None:
        """One compiled-graph execution: ``request`` is ``[wire, release, carrier]``, None for
        the warm-up execution after compiling, or :data:`actors.graph_park.PARK`."""
        return None if request is None or self._parked(request) else self.propose(*request)

    def num_cache_misses(self) -> int:
        return self.model_drafter.num_cache_misses


def _proposal_to_wire(p: DraftProposal, r: DraftRequest) -> dict:
    return {"token_ids": list(p.token_ids), "probs": None if p.probs is None else p.probs.detach().cpu().numpy(),
            "generator": _gen_state(r.generator), "pipelined": p.pipelined, "drafting_ahead": p.drafting_ahead}


def _eagle_drafter(head_dir: str, target_dir: str, dtype: str, device: str, max_seqs: int, max_len: int | None):
    """An :class:`EagleDrafter` over the head, with the target's config and input embedding (only
    that tensor is read from the target checkpoint)."""
    from engine.checkpoint import CheckpointReader
    from engine.config import load_model_config
    from engine.drafters.eagle import EagleDrafter
    from engine.loader import resolve_dtype
    from engine.model.eagle3 import Eagle3Head

    config = load_model_config(target_dir)
    embed = CheckpointReader(target_dir).get("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
    return EagleDrafter(Eagle3Head(head_dir, config, embed, resolve_dtype(dtype), device), max_seqs, max_len)


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
    method: str = "draft"
    target_model: str | None = None
    feature_layers: tuple[int, ...] = ()
    pipelined: bool = False


@dataclass
class _Member:
    handle: ray.actor.ActorHandle


class RemoteDrafter:
    """The verifier's ``Drafter``: asks its draft actor, from the engine thread.

    The hop is a compiled-graph execution when ``graph`` is set and the graph is live, else a plain
    actor call, made and awaited on the engine thread itself (no event-loop hop). A failed or slow
    draft call never fails a request: that step just runs without speculation; a dead or hung
    actor is re-created (its cache re-prefills on the next proposals), and until the new one is
    constructed steps run without speculation instead of waiting for it.

    Args:
        spec: the draft actor to create.
        timeout_s: longest wait for one proposal call (an actor's first call: at least
            ``FRESH_ACTOR_START_S``, its warm-up), also each draft graph execution's.
        graph_config: an ``ExpertPoolConfig`` whose graph settings the draft graph uses (see
            :meth:`ActorGraph.from_config`); None: plain actor calls only.
    """

    def __init__(self, spec: DraftActorSpec, timeout_s: float = 10.0, graph_config=None) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.feature_layers = spec.feature_layers  # EAGLE-3: the engine then keeps target features
        self._shipped: dict[str, int] = {}  # feature rows each sequence's actor cache has been sent
        self._released: list[str] = []
        self.num_failures = 0
        self.generation = 0
        self.member = _Member(self._make())
        self._starting = None  # a re-created actor's __ray_ready__ ref, until it is constructed
        self._answered = False  # the current actor has answered a proposal
        if graph_config is not None:
            graph_config = msgspec.structs.replace(graph_config, call_timeout_s=timeout_s)
        self.graph = ActorGraph.from_config("draft", lambda: ([self.member], "propose_graph"), lambda n: None,
                                            graph_config) if graph_config is not None else None

    def _make(self) -> ray.actor.ActorHandle:
        s = self.spec
        # max_concurrency 2: a plain call still runs while the compiled-graph loop holds a thread.
        return DraftActor.options(name=f"{s.name_prefix}-v{self.generation}", namespace=s.namespace,
                                  get_if_exists=True, num_cpus=s.num_cpus, num_gpus=s.num_gpus,
                                  max_concurrency=2).remote(s.draft_model, s.dtype, s.device, s.max_seqs, s.max_len,
                                                            s.tracing, s.method, s.target_model, s.pipelined)

    def wait_loaded(self, timeout_s: float) -> None:
        """Block until the draft actor has built its model (its constructor loads the weights).

        Raises:
            ray.exceptions.GetTimeoutError: not ready within ``timeout_s``.
            ConfigError: the actor failed to start (e.g. a head that does not fit the target); the
                message carries the actor's own error.
        """
        from engine.errors import ConfigError

        try:
            ray.get(self.member.handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            lines = [ln for ln in str(e).splitlines() if "Error" in ln and ":" in ln]
            raise ConfigError(f"draft_model: the draft actor failed to load {self.spec.draft_model!r}: "
                              f"{lines[-1].strip() if lines else e}") from e

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        from observability import inject_context, is_enabled

        if not self.up():  # a re-created actor still starting: no speculation this step, no wait
            return [DraftProposal([]) for _ in requests]
        release, self._released = self._released, []
        carrier = inject_context() if is_enabled() else None  # the draft.propose span, this thread
        try:
            wire = self._call([requests_to_wire(requests, self._shipped), release, carrier])
            if missed := [i for i, w in enumerate(wire) if w.get("miss")]:  # resend whole feature histories
                for i, w in zip(missed, self._call([requests_to_wire([requests[i] for i in missed]), [], None])):
                    wire[i] = w
        except Exception as e:  # draft failure: speculation off for this step only
            self._shipped.clear()  # the actor may have lost (or never got) what was sent
            self.num_failures += 1
            log.warning("draft actor failed (%s: %s); step runs without speculation", type(e).__name__, e)
            if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
                self._recreate()
            return [DraftProposal([]) for _ in requests]
        out = []
        for r, w in zip(requests, wire):
            if r.features is not None:
                self._shipped[r.seq_id] = r.features.shape[0]
            if r.generator is not None and w["generator"] is not None:
                r.generator.set_state(torch.from_numpy(np.frombuffer(w["generator"], dtype=np.uint8).copy()))
            probs = None if w["probs"] is None else torch.from_numpy(np.array(w["probs"], copy=True))
            out.append(DraftProposal(list(w["token_ids"]), probs, w["pipelined"], w["drafting_ahead"]))
        return out

    def _call(self, request: list) -> list[dict]:
        # ``request`` and its parts are lists: a graph channel pickles tuples (ExpertRouter._submit_graph).
        # No live graph (building, torn down, replaced): this step uses a plain call.
        execution = self.graph.submit(request) if self.graph is not None else None
        result = self.graph.wait(execution) if execution is not None else None
        if result is not None:
            self._answered = True
            return result[0]
        if execution is not None and execution.timed_out:  # not the same wait again on a plain call
            raise ray.exceptions.GetTimeoutError(f"draft graph execution past {self.timeout_s:g} s")
        timeout_s = self.timeout_s if self._answered else max(self.timeout_s, FRESH_ACTOR_START_S)
        wire = ray.get(self.member.handle.propose.remote(*request), timeout=timeout_s)
        self._answered = True
        return wire

    def up(self) -> bool:
        """Whether the actor can take a proposal now: a re-created one once constructed (checked
        without waiting); one whose construction failed is re-created again."""
        if self._starting is None:
            return True
        ready, _ = ray.wait([self._starting], timeout=0)
        if not ready:
            return False
        self._starting = None
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            log.warning("re-created draft actor failed to start (%s); re-creating it", type(e).__name__)
            self._recreate()
            return False
        return True

    def _recreate(self) -> None:
        kill_actor(self.member.handle)  # a hung actor keeps its model otherwise
        self.generation += 1
        self.member = _Member(self._make())
        self._starting, self._answered = self.member.handle.__ray_ready__.remote(), False
        self._released.clear()  # the new actor holds no cache to release

    def release(self, seq_id: str) -> None:
        """Forget ``seq_id``'s draft cache: sent with the next proposal call, or on its own once
        ``MAX_PENDING_RELEASES`` pile up (nothing drafting, e.g. every request at k = 0)."""
        self._released.append(seq_id)
        self._shipped.pop(seq_id, None)
        if len(self._released) >= MAX_PENDING_RELEASES:
            release, self._released = self._released, []
            if not self.up():  # a re-created actor holds none of them (no proposal since)
                return
            try:
                self._call([[], release, None])  # an empty proposal: the same hop, in order
            except Exception as e:  # the actor forgets everything if it died anyway
                log.warning("draft cache release failed (%s: %s)", type(e).__name__, e)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
