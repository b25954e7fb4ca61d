"""Ending Ray actors and compiled graphs: a failure to end one (an actor already gone, a graph
that already tore itself down) is logged at debug level or ignored, never raised to the caller."""

from __future__ import annotations

import logging
import threading

import ray

log = logging.getLogger(__name__)


class DeadMemberCancelFilter(logging.Filter):
    """Ray 2.60's compiled-graph teardown logs ``Error cancelling worker task`` with a full
    traceback (25-50 lines) for every member actor that is already dead, which is how every
    expert or draft failure ends: the actor died, or we killed it to re-create it. Such a record
    becomes one INFO line naming the error; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.msg == "Error cancelling worker task" and isinstance(error, ray.exceptions.RayActorError):
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            record.msg, record.args = "compiled graph teardown: a member actor was already gone (%s: %s)", (
                type(error).__name__, first_line[:200])
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_dead_member_teardown() -> None:
    """Install :class:`DeadMemberCancelFilter` on Ray's compiled-graph logger (once a process)."""
    ray_log = logging.getLogger("ray.dag.compiled_dag_node")
    if not any(isinstance(f, DeadMemberCancelFilter) for f in ray_log.filters):
        ray_log.addFilter(DeadMemberCancelFilter())


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
