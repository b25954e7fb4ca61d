"""Memory of a running server over time: RSS of every process in its tree, and Ray's object store.

The embedded server (``serve_app.py``) starts its own Ray, so every process of the application is
a descendant of the server process: GCS, raylet, the dashboard agents, the Serve controller and
proxy, and the workers of the ingress and verifier replicas, the expert actors and the draft
actor. Ray workers name themselves in their command line (``ray::ServeReplica:specmoe:verifier``,
``ray::ExpertWorker``, ``ray::DraftServer.propose`` while running a method); non-worker processes
are named after their executable (``gcs_server``, ``raylet``) or Python module/script.

The sampler only reads: ``/proc`` (psutil) and the node's Prometheus endpoint (the dashboard
agent's, where the raylet pushes its object-store gauges anyway). It sends nothing to the GCS or
the raylet, whose memory it measures.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.serving.server_process import process_tree

_GCS_ADDRESS = re.compile(r"--gcs-address=(\S+)")
_RAYLET_SOCKET = re.compile(r"--raylet_socket_name=(\S+)")
# Prometheus text lines of the object-store gauges the raylet reports (labels, value)
_STORE_METRIC = re.compile(r'^ray_object_store_(used_memory|num_local_objects)\{[^}]*\} (\S+)$', re.M)
_SPILLED_METRIC = re.compile(r'^ray_object_store_memory\{[^}]*Location="SPILLED"[^}]*\} (\S+)$', re.M)


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


def _search_cmdlines(pid: int, pattern: re.Pattern) -> re.Match | None:
    """The first match of ``pattern`` in the command line of ``pid`` or one of its descendants
    (processes that exit while being read are skipped)."""
    for p in process_tree(pid):
        try:
            match = pattern.search(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        if match:
            return match
    return None


def gcs_address(pid: int) -> str | None:
    """``host:port`` of the GCS of the Ray that server process ``pid`` started (from the command
    line of the raylet and the agents, ``--gcs-address``); None if there is none (yet)."""
    match = _search_cmdlines(pid, _GCS_ADDRESS)
    return match[1] if match else None


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


def metrics_export_url(pid: int) -> str | None:
    """URL of the Prometheus endpoint of the Ray that server process ``pid`` started: the node's
    dashboard agent serves every component's metrics there; it writes the port it picked to
    ``<session dir>/metrics_export_port_<node id>`` (the raylet's socket lives in ``<session
    dir>/sockets/``). None if there is none (yet)."""
    match = _search_cmdlines(pid, _RAYLET_SOCKET)
    if match is None:
        return None
    ports = sorted(Path(match[1]).parents[1].glob("metrics_export_port_*"))
    return f"http://127.0.0.1:{ports[0].read_text().strip()}/metrics" if ports else None


def object_store_stats_from_metrics(url: str) -> dict | None:
    """Object-store use as the raylet last reported it to the metrics agent (every
    ``metrics_report_interval_ms``, 10 s by default): the same ``bytes_used`` / ``num_objects`` as
    :func:`object_store_stats` (the plasma store's allocated bytes and local object count), and
    ``bytes_spilled``. None while the raylet has not reported yet.

    Unlike :func:`object_store_stats` this sends nothing to Ray: it reads the agent's HTTP endpoint,
    which serves what the raylet pushes anyway. Polling the raylet (``FormatGlobalMemoryInfo``, a
    new GCS client and gRPC channel per call) grows the raylet's own RSS by ~14 KiB a call
    (docs/BENCHMARKS.md, "Soak"), which a memory-flatness check must not measure.
    """
    import httpx

    return parse_store_metrics(httpx.get(url, timeout=10).text)


def parse_store_metrics(text: str) -> dict | None:
    """``bytes_used``, ``num_objects``, ``bytes_spilled`` from a Prometheus text page of one node
    (:func:`object_store_stats_from_metrics`); None if the raylet's gauges are not on it."""
    values = {name: float(v) for name, v in _STORE_METRIC.findall(text)}
    if len(values) < 2:
        return None
    spilled = _SPILLED_METRIC.search(text)
    return {"bytes_used": int(values["used_memory"]), "num_objects": int(values["num_local_objects"]),
            "bytes_spilled": int(float(spilled[1])) if spilled else 0}


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
    _metrics_url: str | None = None

    def sample(self) -> MemorySample:
        rss = {}
        for p in process_tree(self.pid):
            try:
                rss[f"{process_label(p.cmdline())}[{p.pid}]"] = p.memory_info().rss
            except psutil.Error:
                continue
        self._metrics_url = self._metrics_url or metrics_export_url(self.pid)
        store = None
        if self._metrics_url is not None:
            try:
                store = object_store_stats_from_metrics(self._metrics_url)
            except Exception:  # a busy agent: this sample has no object-store figure
                store = None
        s = MemorySample(time.monotonic() - self._start_s, rss, store, os.getloadavg()[0])
        self.samples.append(s)
        return s
