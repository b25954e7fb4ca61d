"""Memory of a running server over time: RSS of every process in its tree, and Ray's object store.

The embedded server (``serve_app.py``) starts its own Ray, so every process of the application is
a descendant of the server process: GCS, raylet, the dashboard agents, the Serve controller and
proxy, and the workers of the ingress and verifier replicas, the expert actors and the draft
actor. Ray workers name themselves in their command line (``ray::ServeReplica:specmoe:verifier``,
``ray::ExpertWorker``, ``ray::DraftServer.propose`` while running a method); non-worker processes
are named after their executable (``gcs_server``, ``raylet``) or Python module/script.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import psutil

from benchmarks.serving.server_process import process_tree

_GCS_ADDRESS = re.compile(r"--gcs-address=(\S+)")


def process_label(cmdline: list[str]) -> str:
    """A stable name for a process of the app from its command line.

    ``ray::ExpertWorker.forward_graph`` -> ``ray::ExpertWorker``,
    ``ray::ServeReplica:specmoe:verifier.handle_request`` -> ``ray::ServeReplica:specmoe:verifier``
    (the method part changes with every task); ``/.../gcs_server --flags`` -> ``gcs_server``; ``python -m ray.util.x`` ->
    ``ray.util.x``; ``python /.../serve_app.py ...`` -> ``serve_app.py``.
    """
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith("ray::"):
        return first.split()[0].split(".")[0]
    if "python" in os.path.basename(first) and len(cmdline) > 1:
        if cmdline[1] == "-m" and len(cmdline) > 2:
            return cmdline[2]
        script = next((a for a in cmdline[1:] if not a.startswith("-")), first)
        return os.path.basename(script)
    return os.path.basename(first.split()[0])


def gcs_address(pid: int) -> str | None:
    """``host:port`` of the GCS of the Ray that server process ``pid`` started (from the command
    line of the raylet and the agents, ``--gcs-address``); None if there is none (yet)."""
    for p in process_tree(pid):
        try:
            match = _GCS_ADDRESS.search(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        if match:
            return match[1]
    return None


def object_store_stats(address: str) -> dict:
    """Object store use of the cluster at GCS ``address``, as ``ray memory --stats-only`` reads it
    (the raylet's FormatGlobalMemoryInfo): ``bytes_used``, ``num_objects``, ``bytes_spilled``.

    The address is used as given (``ray memory`` would first rewrite a loopback address to the machine's LAN
    address, where the loopback-only embedded Ray does not listen).
    """
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )
    from ray._private.internal_api import get_memory_info_reply
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    # A new local Ray turns token auth on (~/.ray/auth_token); the CLIs present the token likewise.
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    state = GlobalState()
    state._initialize_global_state(GcsClientOptions.create(address, None, allow_cluster_id_nil=True,
                                                           fetch_cluster_id_if_nil=False))
    try:
        stats = get_memory_info_reply(state, timeout_seconds=30).store_stats
    finally:
        state.disconnect()
    return {"bytes_used": stats.object_store_bytes_used, "num_objects": stats.num_local_objects,
            "bytes_spilled": stats.spilled_bytes_total}


@dataclass
class MemorySample:
    """One sample: ``t_s`` seconds since sampling began; RSS bytes per ``label[pid]``."""

    t_s: float
    rss_bytes: dict[str, int]
    object_store: dict | None  # None: the raylet did not answer this time
    load_avg_1m: float


@dataclass
class MemorySampler:
    """Samples the tree of server process ``pid`` (call :meth:`sample` periodically)."""

    pid: int
    samples: list[MemorySample] = field(default_factory=list)
    _start_s: float = field(default_factory=time.monotonic)
    _address: str | None = None

    def sample(self) -> MemorySample:
        rss = {}
        for p in process_tree(self.pid):
            try:
                rss[f"{process_label(p.cmdline())}[{p.pid}]"] = p.memory_info().rss
            except psutil.Error:
                continue
        self._address = self._address or gcs_address(self.pid)
        store = None
        if self._address is not None:
            try:
                store = object_store_stats(self._address)
            except Exception:  # a busy raylet: this sample has no object-store figure
                store = None
        s = MemorySample(time.monotonic() - self._start_s, rss, store, os.getloadavg()[0])
        self.samples.append(s)
        return s
