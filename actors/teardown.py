"""Ending Ray actors and compiled graphs: a failure to end one (an actor already gone, a graph
that already tore itself down) is logged at debug level or ignored, never raised to the caller."""

from __future__ import annotations

import logging
import threading

import ray

log = logging.getLogger(__name__)


def teardown_graph(dag) -> None:
    try:
        dag.teardown()
    except Exception:  # a graph whose actor died may already have torn itself down
        log.debug("compiled graph teardown failed", exc_info=True)


def teardown_graph_in_background(dag, name: str) -> threading.Thread:
    # Teardown waits for every actor's loop to stop; a hung actor must not stall the engine thread.
    thread = threading.Thread(target=teardown_graph, args=(dag,), name=f"{name}-graph-teardown", daemon=True)
    thread.start()
    return thread


def kill_actor(handle) -> None:
    """``ray.kill`` without restart; an actor already gone is fine."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:
        pass
