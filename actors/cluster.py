"""Where the application runs: an existing Ray cluster, or a local Ray that only listens on loopback.

``serve_app.py`` joins the cluster named by ``--address`` or ``RAY_ADDRESS`` and otherwise starts
its own single-node Ray (the embedded default). The embedded instance must not be reachable from
the network: every Ray component of it binds 127.0.0.1, except one that Ray 2.60 cannot confine
(see :data:`UNCONFINABLE_LISTENERS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Ray 2.60's Serve replicas start their inter-deployment gRPC server on ``[::]:0`` unconditionally
# (ray/serve/_private/replica.py, ``add_port_to_grpc_server(self._server, "[::]:0")``), so each
# Serve replica process listens on one wildcard port whatever the node address is. Nothing else of
# the embedded instance does.
UNCONFINABLE_LISTENERS = {"ray::ServeReplica": 1}
DRAIN_SIGNAL = "specmoe-drain"  # named actor through which serve_app.py tells verifiers to drain
RAY_LOCAL_ADDRESS = "local"  # ray.init's address meaning "start a new local instance"
_ray_group: list[int] = []  # the process group init_ray started the embedded Ray in, if any
FLUSH_S = 0.5  # after a drain: time for the ingress and the proxy to send the streams' last chunks


def cluster_address(cli_address: str | None = None) -> str | None:
    """The Ray cluster to join: ``--address``, else ``RAY_ADDRESS``, else None (start a local one).

    ``local`` is Ray's own value for "start a new local instance" (``ray.init(address="local")``),
    so it also means None: the loopback-only local Ray, not a join.
    """
    address = cli_address or os.environ.get("RAY_ADDRESS") or None
    return None if address == RAY_LOCAL_ADDRESS else address


def _loopback_node_address() -> None:
    """Make the local node's address 127.0.0.1 before Ray starts.

    Ray 2.60 on Linux rewrites ``ray.init(_node_ip_address="127.0.0.1")`` to the machine's LAN
    address (``services.resolve_ip_for_localhost``: it assumes every Linux node may join a
    cluster), and its gRPC servers then bind that address or the wildcard. Its single-machine
    switch, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, keeps the loopback address; with it GCS,
    raylet, object manager, core workers and the agents bind 127.0.0.1 only. The switch is read
    when ``ray`` is imported, so the imported constant is set instead; the environment is left
    alone because child processes that start clusters of their own (tests, tools) would inherit it.
    The Ray processes need nothing more: they get the node address on their command lines.
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray(namespace: str, env_vars: dict, address: str | None = None) -> bool:
    """Connect this process to Ray: join ``address`` or start a loopback-only local instance.

    Args:
        namespace: Ray namespace of the app's named actors.
        env_vars: environment of every Ray worker (the job's runtime_env).
        address: a cluster address (``ray://...``, ``host:port`` or ``auto``); None starts Ray here.

    Returns:
        True when this call started the Ray instance (the caller then owns it and shuts it down).
    """
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": env_vars}
    if address:
        ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
        log.info("joined the Ray cluster at %s", address)
        return False
    _loopback_node_address()
    # address="local", not None: with None, ray.init joins the cluster named in
    # <ray temp dir>/ray_current_cluster (written by `ray start` and ray.cluster_utils, left behind
    # when they die), and a stale or foreign one there made the embedded start fail.
    with _own_process_group():
        ray.init(address=RAY_LOCAL_ADDRESS, num_cpus=os.cpu_count(), include_dashboard=False, namespace=namespace,
                 runtime_env=runtime_env, log_to_driver=True, _node_ip_address=LOOPBACK)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:  # a Ray upgrade changed the rule above: say so rather than listen widely
        log.warning("the embedded Ray node address is %s, not %s: its ports may be reachable from the network",
                    node_ip, LOOPBACK)
    return True


@contextlib.contextmanager
def _own_process_group() -> Iterator[None]:
    """Start what runs inside in a process group of its own, then return to the caller's group.

    Ray's processes (GCS, raylet, and through the raylet every worker: Serve's controller, proxy
    and replicas) inherit the process group of the process that starts them. In the caller's group
    a signal to the whole group (``kill -TERM -PGID``, a shell's ``kill %1``, a supervisor that
    stops a process group, as ``benchmarks/serving/sweep.py`` does) would kill them at the same
    instant as this process, before its drain could end the streams: measured, a 41 s shutdown
    with the in-flight streams cut. In a group of their own they get only what this process sends
    them when it shuts Ray down (SIGINT from a terminal already spares them: Ray blocks it in its
    children). A process that leads its group cannot leave it; then nothing changes and a warning
    says to signal this process alone.
    """
    original = os.getpgrp()
    _ray_group[:] = [os.getpid()]  # Ray's group either way: this process's own, or the new one it leads
    if original == os.getpid():
        log.warning("this process leads its process group, which Ray's processes will share: stop it with a "
                    "signal to its pid, not to the group (a group SIGTERM kills Ray before streams drain)")
        yield
        return
    relay = _signal_relay()
    os.setpgid(0, 0)
    try:
        yield
    finally:
        relay.stdin.close()  # its end: it exits at end of input
        try:
            os.setpgid(0, original)
        except OSError as e:
            # The caller's group is gone: whoever started us exited meanwhile. Stop rather than
            # run on unreachable.
            raise RuntimeError(f"the process group that started this server ({original}) is gone: {e}") from e
        finally:
            try:
                relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                relay.kill()


# Sends SIGINT and SIGTERM on to the pid in argv[1] until its stdin ends. -I -S: no site, no
# environment; it starts in ~15 ms.
_RELAY_SOURCE = ("import os, signal, sys\n"
                 "pid = int(sys.argv[1])\n"
                 "for s in (signal.SIGINT, signal.SIGTERM):\n"
                 "    signal.signal(s, lambda n, _: os.kill(pid, n))\n"
                 "sys.stdin.buffer.read()\n")


def _signal_relay() -> subprocess.Popen:
    """A child left in this process's group while this process is out of it, passing on the group's
    SIGINT and SIGTERM. Without it a Ctrl-C during ``ray.init`` was lost: the terminal signals its
    foreground group, and ``make`` (in it) neither forwards the signal nor exits until its child
    does, so ``make serve`` went on starting."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _RELAY_SOURCE, str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_leftover_ray_processes(settle_s: float = 1.0) -> None:
    """SIGKILL Ray's processes left in the embedded Ray's process group after ``ray.shutdown()``.

    A start interrupted inside ``ray.init`` (Ctrl-C or SIGTERM a few seconds in) left Ray's
    dashboard and runtime-env agents running as orphans that ignore SIGTERM. Only Ray's processes
    (``ray::`` titles, Ray's binaries and scripts) of that group are killed: when this process
    leads its group, a pipeline's other commands share it. The group is scanned again until none
    is left or ``settle_s`` has passed (a raylet still shutting down may start or orphan one
    meanwhile). No-op when Ray was joined, not started here, and where ``/proc`` is missing.
    """
    import signal

    groups = set(_ray_group)
    _ray_group.clear()
    deadline = time.monotonic() + settle_s
    while pids := _ray_processes_in(groups):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)


def _ray_processes_in(groups: set[int]) -> list[int]:
    """Pids of Ray's live (not zombie) processes in these process groups, this one excluded."""
    if not groups or not os.path.isdir("/proc"):
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if fields[0] != "Z" and int(fields[2]) in groups and (cmdline.startswith(b"ray::") or b"/ray/" in cmdline):
            out.append(int(entry))
    return out


class DrainSignal:
    """One flag every verifier replica waits on (an async actor: one pending call per replica, no
    polling). Set when the process that deployed the app shuts it down: Serve kills its HTTP
    proxies at once on shutdown, so streams must end before that, and Serve has no hook that tells
    a replica its shutdown has begun."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def _flag(self) -> asyncio.Event:
        if self._event is None:  # created on the actor's event loop, at the first call
            self._event = asyncio.Event()
        return self._event

    async def wait(self) -> None:
        await self._flag().wait()

    async def set(self) -> None:
        self._flag().set()


def create_drain_signal(namespace: str):
    """The app's drain signal actor (owned by this process: it dies with it)."""
    import ray

    return ray.remote(DrainSignal).options(name=DRAIN_SIGNAL, namespace=namespace, get_if_exists=True,
                                           num_cpus=0).remote()


def drain(signal, timeout_s: float) -> bool:
    """Tell every verifier replica to end its streams (a 503 chunk and ``[DONE]``; a 503 for requests
    not yet started) and refuse new ones, then give the last chunks time to reach the clients.

    Returns:
        True when the signal was delivered within ``timeout_s``.
    """
    import ray

    try:
        ray.get(signal.set.remote(), timeout=timeout_s)
    except Exception as e:  # shutting down anyway: streams are then cut instead of ended
        log.warning("draining failed (%s: %s)", type(e).__name__, e)
        return False
    time.sleep(FLUSH_S)
    return True


async def wait_for_drain(namespace: str, on_drain) -> None:
    """Call ``on_drain()`` once the app's drain signal is set; nothing when no process deployed one
    (``serve run`` / a Serve config: Serve's own graceful shutdown applies)."""
    import ray

    try:  # a GCS lookup: off the event loop
        signal = await asyncio.to_thread(ray.get_actor, DRAIN_SIGNAL, namespace)
    except ValueError:
        return
    try:
        await signal.wait.remote()
    except ray.exceptions.RayActorError:  # the deploying process went away without draining
        return
    on_drain()


def kill_detached_actors(namespace: str, prefix: str) -> list[str]:
    """Kill this app's detached actors (the shared expert pool of ``transport: actor_calls``
    outlives the replicas that made it): on a cluster that keeps running after the app is deleted
    they would hold their weights, and GPU shares, forever.

    Returns:
        The names killed.
    """
    import ray

    from actors.teardown import kill_actor

    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace or not entry["name"].startswith(prefix):
            continue
        try:
            kill_actor(ray.get_actor(entry["name"], namespace=namespace))
        except ValueError:  # gone meanwhile
            continue
        killed.append(entry["name"])
    return killed
