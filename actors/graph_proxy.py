"""One driver proxy actor per compiled graph, across its rebuilds (see :class:`DriverProxies`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager


class DriverProxies:
    """Stands in for ``CompiledDAG.DAGDriverProxyActor`` so that every build of one
    :class:`actors.compiled_graph.ActorGraph` reuses the driver proxy actor of its first build.

    Ray 2.60 creates that (empty) actor at each compile, as the driver's identity as a reader of
    the output channels, and lets it die with the graph. A new actor is a worker process starting
    up: ~0.5 s of CPU (measured on the 2-core VM during a straggler's graph rebuild, 2026-12-04),
    which a rebuild then takes from the requests being served. A rebuild compiles only after the
    previous graph's teardown has ended, so its proxy is free again. Graphs live at the same time
    (the expert and the draft graph of a verifier) keep their own: a teardown closes the channels
    of its graph's proxy, and one graph's teardown must not touch another's. A compile outside a
    graph's build (no graph on this thread) gets a new actor, as Ray's own. The options Ray passes
    name the driver's node, so a new Ray session gets a new proxy.
    """

    def __init__(self, actor_class) -> None:
        self.actor_class = actor_class
        self.building = threading.local()  # .graph: the ActorGraph compiling on this thread
        self._lock = threading.Lock()
        self._handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> (key, handle)

    def options(self, **options) -> _ProxyRequest:
        return _ProxyRequest(self, options)

    def remote(self, *args, **kwargs):
        return _ProxyRequest(self, {}).remote(*args, **kwargs)

    def forget(self, graph) -> None:
        """``graph``'s next build makes a new proxy (after a failed build: it may be what failed)."""
        with self._lock:
            self._handles.pop(graph, None)

    def get(self, options: dict, args: tuple, kwargs: dict):
        graph = getattr(self.building, "graph", None)
        key = repr((sorted(options.items()), args, sorted(kwargs.items())))
        with self._lock:
            kept = self._handles.get(graph) if graph is not None else None
            if kept is not None and kept[0] == key:
                return kept[1]
            handle = self.actor_class.options(**options).remote(*args, **kwargs)
            if graph is not None:
                self._handles[graph] = (key, handle)
            return handle


class _ProxyRequest:
    def __init__(self, proxies: DriverProxies, options: dict) -> None:
        self.proxies, self.options = proxies, options

    def remote(self, *args, **kwargs):
        return self.proxies.get(self.options, args, kwargs)


def _installed() -> DriverProxies | None:
    """Install :class:`DriverProxies` in Ray's ``CompiledDAG`` once (None where this Ray has no
    such class: it then compiles as it comes)."""
    from ray.dag.compiled_dag_node import CompiledDAG

    current = getattr(CompiledDAG, "DAGDriverProxyActor", None)
    if current is None or isinstance(current, DriverProxies):
        return current
    CompiledDAG.DAGDriverProxyActor = DriverProxies(current)
    return CompiledDAG.DAGDriverProxyActor


@contextmanager
def compiling(graph) -> Iterator[None]:
    """Around ``graph``'s compile, on its build thread: the proxy actor Ray asks for is the one
    ``graph``'s earlier builds had."""
    proxies = _installed()
    if proxies is None:
        yield
        return
    proxies.building.graph = graph
    try:
        yield
    finally:
        proxies.building.graph = None


def forget(graph) -> None:
    """``graph``'s next build makes a new proxy (after a failed build: it may be what failed)."""
    proxies = _installed()
    if proxies is not None:
        proxies.forget(graph)
