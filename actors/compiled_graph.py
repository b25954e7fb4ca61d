"""The compiled-graph transport: Ray Compiled Graphs the verifier's engine thread drives.

A graph is ``InputNode -> actor_i.<method>(input, i) -> MultiOutputNode`` over a fixed list of
actors. For the experts: one replica of every expert group, one execution per MoE layer; the engine
thread writes ``(layer, calls, sent_time_s)`` to the shared input channel, every actor takes its
own call and writes its result to its own channel. For the draft: the replica's draft actor, one
execution per step. On one node the channels are shared memory (~0.1-0.5 ms a hop on a 2-core
VM, against ~1.5-2 ms for plain actor calls and ~5 ms for a Serve handle call; docs/TRANSPORT.md).

Ray's constraints shape the lifecycle (Ray 2.60): ``execute`` is not thread-safe (one lock; only
the engine thread executes once the graph is live); an actor belongs to one graph at a time (so
the actors are private to the replica); compiling plus the first execution takes ~2 s (built on a
background thread while the router falls back to actor calls); channel readers poll with
``sched_yield`` (an idle graph would burn a core per actor, so after ``graph_idle_park_s``
unused it is *parked*: every actor blocks in a parking execution until the next request wakes it,
:mod:`actors.graph_park`); and any failure (actor death, timeout) leaves the graph unusable, so
it is torn down and rebuilt from the current members. Ray frees no channel memory: a message
larger than the channel buffer goes through a new buffer that is never freed, and a teardown
frees none of the graph's buffers (``benchmarks/graph_channel_leak.py``), so callers send larger
messages another way (:meth:`ActorGraph.fits`), and idleness parks rather than tears down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from actors import graph_proxy
from actors.graph_park import PARK
from actors.graph_records import Execution, GraphStats
from actors.teardown import quiet_dead_member_teardown, teardown_graph, teardown_graph_in_background

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD_BYTES = 64 * 1024  # one execution's pickling, counts and trace carriers, at most
# Held while a graph picks its members and records them as bound (:meth:`ActorGraph.bound`), so that
# two graphs over one pool (a live one and its standby) never pick the same actor.
_SELECTING = threading.Lock()


class ActorGraph:
    """A compiled graph over the actors ``members()`` returns, built and torn down on demand.

    Args:
        name: for logs.
        members: returns ``(members, method)`` to build over (called on the build thread), or raises
            when they are not ready (the build is skipped and retried on the next request). Each
            member has an actor ``handle`` whose ``method(request, index)`` is bound with the
            member's list index.
        warmup: the request of the first, unwaited execution that starts the actors' loops.
        timeout_s: longest wait for one execution's results before the graph counts as failed.
        idle_park_s: park the graph (:mod:`actors.graph_park`) after this long without an execution.
        buffer_size_bytes: initial channel size (Ray resizes channels for larger messages).
        build_after_s: build only once the graph has been wanted (requests no more than
            ``idle_park_s`` apart) for this long: a build costs ~2 s of CPU, which on a small
            machine would delay a short burst more than actor calls do.
        teardowns: the list of background teardowns a build waits for; graphs over the same actors
            share one (an actor must leave its old graph, whichever, before joining a new one).

    Attributes:
        park_when_built: park the graph as soon as a build is live (a standby graph: its readers
            would otherwise poll until the idle park).
    """

    def __init__(self, name: str, members: Callable[[], tuple[list, str]], warmup: Callable[[int], Any],
                 timeout_s: float, idle_park_s: float, buffer_size_bytes: int, build_after_s: float = 0.0,
                 teardowns: list[threading.Thread] | None = None) -> None:
        self.name, self._members, self._warmup = name, members, warmup
        quiet_dead_member_teardown()  # a dead member's teardown: one line, not Ray's traceback
        self.timeout_s, self.build_after_s = timeout_s, build_after_s
        self.idle_park_s, self.buffer_size_bytes = idle_park_s, buffer_size_bytes
        self.stats = GraphStats()
        self._lock = threading.Lock()  # guards _dag: execute, publish and teardown never overlap
        self._dag = None
        self._actors: list = []
        self._pending: list = []  # the members of the build under way
        self.park_when_built = False
        self._inflight = 0  # executions submitted and not yet waited for (the janitor spares them)
        self._parking = None  # the parking execution's result ref while the graph is parked
        self._building = False
        self._closed = False
        self._teardowns: list[threading.Thread] = [] if teardowns is None else teardowns
        self._last_used = time.monotonic()
        self._wanted_since: float | None = None  # start of the current run of requests without a graph
        self._janitor = threading.Thread(target=self._janitor_loop, name=f"{name}-graph-janitor", daemon=True)
        self._janitor.start()

    @classmethod
    def from_config(cls, name: str, members: Callable[[], tuple[list, str]], warmup: Callable[[int], Any],
                    config, teardowns: list[threading.Thread] | None = None) -> ActorGraph:
        """Timeout, idle teardown, channel size and build delay from an ``ExpertPoolConfig``
        (the ``experts`` section: one set of graph settings for the expert and draft graphs)."""
        return cls(name, members, warmup, config.call_timeout_s, config.graph_idle_park_s,
                   config.graph_buffer_size_bytes, config.graph_build_after_s, teardowns)

    @property
    def live(self) -> bool:
        return self._dag is not None

    @property
    def inflight(self) -> int:
        """Executions submitted and not yet waited for."""
        return self._inflight

    @property
    def parked(self) -> bool:
        """Live, and idle long enough that its actors block in a parking execution."""
        return self._parking is not None

    @property
    def members(self) -> list:
        """The members inside the live graph, in bind order."""
        return list(self._actors)

    @property
    def building(self) -> bool:
        """A build is under way (on its background thread)."""
        return self._building

    def bound(self) -> list:
        """The members of the live graph or of the build under way; call it from a ``members``
        function (it runs under the selection lock, so another graph's pick is complete)."""
        return list(self._actors or self._pending)

    def fits(self, payload_bytes: int) -> bool:
        """Whether a message carrying ``payload_bytes`` of tensor bytes fits the channel buffer.

        Ray 2.60 sends a larger message through a new shared-memory buffer that it never frees
        (object store and RSS grow with every such message; the soak run in docs/BENCHMARKS.md),
        so the caller sends it by plain actor calls instead; counted in ``stats.oversize``.
        """
        if payload_bytes + MESSAGE_OVERHEAD_BYTES <= self.buffer_size_bytes:
            return True
        self.stats.oversize += 1
        return False

    def wake(self) -> None:
        """Wake the graph now if it is parked (~5 ms, more on a busy machine), so a caller that
        times its executions starts the clock after it; a member that died while parked makes
        the graph unusable (the next :meth:`submit` returns None)."""
        with self._lock:
            dag = self._dag
            if dag is None or self._parking is None:
                return
            self._last_used = time.monotonic()
            self._wake()
            parking, self._parking = self._parking, None
            try:
                ray.get(parking, timeout=self.timeout_s)  # the parking execution's result
            except Exception as e:
                self._failed(dag, e)

    def submit(self, request: tuple) -> Execution | None:
        """Start one execution without waiting (:meth:`wait` gets its results, in submission
        order); None when no graph is live (a background build is started). Several may be in
        flight: the actors run them in order, so one micro-batch's experts can run while the
        engine thread computes another's attention (two-batch overlap)."""
        self.wake()  # a no-op unless parked; a member that died while parked leaves no graph here
        with self._lock:
            dag = self._dag
            if dag is None:
                self._want()
                return None
            self._last_used = time.monotonic()
            try:
                ref = dag.execute(request)
            except Exception as e:
                self._failed(dag, e)
                return None
            self._inflight += 1
            return Execution(dag, ref, time.monotonic())

    def wait(self, execution: Execution | None, hedge_after_s: float | None = None) -> list | None:
        """The results of a submitted execution: one per actor, or None (no graph was live, or
        it failed, now or in an execution before: the graph is then torn down).

        Args:
            hedge_after_s: give up on the execution this long after its submission (the caller
                hedges it by other means): the graph is dropped, since Ray 2.60 cannot read a
                timed-out execution's outputs later (its ``CompiledDAGRef`` is spent and a partial
                read leaves the output channels out of step), ``execution.late`` is set, and no
                build is started here: the caller calls :meth:`build_now` once it has updated what
                ``members()`` will choose. None: wait up to ``timeout_s``.
        """
        if execution is None:
            return None
        hedged = hedge_after_s is not None
        try:
            if execution.dag is not self._dag:  # an earlier execution failed: the graph is gone
                return None
            timeout_s = (max(0.0, execution.sent_mono_s + hedge_after_s - time.monotonic()) if hedged
                         else self.timeout_s)
            results = ray.get(execution.ref, timeout=timeout_s)
        except Exception as e:  # actor death, timeout, channel error: the graph is unusable now
            with self._lock:
                if hedged and isinstance(e, TimeoutError):
                    execution.late = execution.dag is self._dag
                    if execution.late:
                        self.stats.late += 1
                        self._retire()
                else:
                    execution.timed_out = isinstance(e, TimeoutError)
                    self._failed(execution.dag, e)
            return None
        finally:
            with self._lock:
                self._inflight -= 1
                self._last_used = time.monotonic()
        self.stats.executions += 1
        return results

    def _failed(self, dag, e: Exception) -> None:
        """Tear ``dag`` down in the background if it is still the live graph (under the lock)."""
        if dag is not self._dag:
            return
        self.stats.failures += 1
        log.warning("compiled %s graph failed (%s: %s); falling back to actor calls", self.name, type(e).__name__, e)
        self._retire()

    def retire(self) -> None:
        """Drop the live graph (torn down in the background); no build is started."""
        with self._lock:
            if self._dag is not None:
                self._retire()

    def rebuild(self) -> None:
        """Drop the live graph (torn down in the background) and build one over the current
        ``members()`` at once (they changed). Until it is live, requests get None."""
        with self._lock:
            if self._dag is None:
                return
            self.stats.rebuilds += 1
            self._retire()
            self._start_build()  # traffic is steady (the graph was in use): no build_after_s wait

    def build_now(self) -> None:
        """Build a graph over the current ``members()`` at once unless one is live or building
        (traffic is steady: no ``build_after_s`` wait)."""
        with self._lock:
            if self._dag is None:
                self._start_build()

    def request_build(self) -> None:
        """Say the graph is wanted now: builds in the background once it has been wanted for
        ``build_after_s`` (unless a graph is live or being built)."""
        with self._lock:
            if self._dag is None:
                self._want()

    def _want(self) -> None:
        now = time.monotonic()
        if self._wanted_since is None or now - self._last_used > self.idle_park_s:
            self._wanted_since = now  # a new burst: the earlier one ended without a graph
        self._last_used = now
        if now - self._wanted_since >= self.build_after_s:
            self._start_build()

    def _start_build(self) -> None:
        if self._building or self._closed:
            return
        self._building = True
        threading.Thread(target=self._build, name=f"{self.name}-graph-build", daemon=True).start()

    def _build(self) -> None:
        """Compile over the current members, warm up, then publish (unless closed meanwhile)."""
        from ray.dag import InputNode, MultiOutputNode

        dag = None
        try:
            for t in list(self._teardowns):  # an actor must leave its old graph before joining a new one
                t.join(timeout=max(60.0, self.timeout_s))
            self._teardowns[:] = [t for t in self._teardowns if t.is_alive()]
            if self._teardowns:
                raise RuntimeError("the previous graph is still being torn down")
            with _SELECTING:
                actors, method = self._members()
                self._pending = actors
            with InputNode() as request:
                node = MultiOutputNode([getattr(a.handle, method).bind(request, i) for i, a in enumerate(actors)])
            with graph_proxy.compiling(self):  # the driver proxy actor of this graph's earlier builds
                dag = node.experimental_compile(_buffer_size_bytes=self.buffer_size_bytes)
            # The first execution starts every actor's loop; nobody waits for it.
            ray.get(dag.execute(self._warmup(len(actors))), timeout=max(60.0, self.timeout_s))
            with self._lock:
                if not self._closed:
                    self._dag, self._actors, dag = dag, actors, None
                    self._last_used, self._wanted_since = time.monotonic(), None
                    self.stats.builds += 1
                    if self.park_when_built:
                        self._park()
        except Exception as e:
            self.stats.build_failures += 1
            graph_proxy.forget(self)
            log.warning("building the compiled %s graph failed (%s: %s); using actor calls",
                        self.name, type(e).__name__, e)
        finally:
            self._building, self._pending = False, []
            if dag is not None:
                teardown_graph(dag)

    def _janitor_loop(self) -> None:
        while not self._closed:
            time.sleep(min(0.5, self.idle_park_s / 2))
            with self._lock:
                if (self._dag is None or self._parking is not None or self._inflight
                        or time.monotonic() - self._last_used < self.idle_park_s):
                    continue
                self._park()

    def _park(self) -> None:
        """Submit the parking execution (under the lock; the graph is live and idle)."""
        try:
            self._parking = self._dag.execute(PARK)
            self.stats.parks += 1
        except Exception as e:
            self._failed(self._dag, e)

    def _retire(self) -> None:
        """Drop the live graph and tear it down in the background (under the lock)."""
        self._teardowns.append(teardown_graph_in_background(self._drop(), self.name))

    def _drop(self):
        """Forget the live graph (under the lock) and return it for a teardown; a parked one is
        woken first: an actor must leave its bound method before the teardown can stop its loop."""
        self._wake()
        dag, self._dag, self._actors, self._parking = self._dag, None, [], None
        return dag

    def _wake(self) -> None:
        """Release every parked actor (under the lock): one release per binding of each actor."""
        if self._parking is None:
            return
        bindings: dict = {}
        for m in self._actors:
            key = getattr(m.handle, "_actor_id", None) or id(m.handle)
            bindings.setdefault(key, [m.handle, 0])[1] += 1
        for handle, n in bindings.values():
            try:
                handle.wake_graph.remote(n)
            except Exception:  # a dead actor: the parking execution's result says so
                log.debug("waking a parked %s graph member failed", self.name, exc_info=True)

    def close(self) -> None:
        """Tear the graph down for good (replica shutdown)."""
        with self._lock:
            self._closed = True
            dag = self._drop()
        if dag is not None:
            teardown_graph(dag)
        for t in self._teardowns:  # a rebuild's teardown still running would outlive Ray's shutdown
            t.join(timeout=max(10.0, self.timeout_s))
