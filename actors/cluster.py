"""Where the application runs: an existing Ray cluster, or a local Ray that only listens on loopback.

``serve_app.py`` joins the cluster named by ``--address`` or ``RAY_ADDRESS`` and otherwise starts
its own single-node Ray (the embedded default). The embedded instance must not be reachable from
the network: every Ray component of it binds 127.0.0.1, except one that Ray 2.60 cannot confine
(see :data:`UNCONFINABLE_LISTENERS`).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Ray 2.60's Serve replicas start their inter-deployment gRPC server on ``[::]:0`` unconditionally
# (ray/serve/_private/replica.py, ``add_port_to_grpc_server(self._server, "[::]:0")``), so each
# Serve replica process listens on one wildcard port whatever the node address is. Nothing else of
# the embedded instance does.
UNCONFINABLE_LISTENERS = {"ray::ServeReplica": 1}


def cluster_address(cli_address: str | None = None) -> str | None:
    """The Ray cluster to join: ``--address``, else ``RAY_ADDRESS``, else None (start a local one)."""
    return cli_address or os.environ.get("RAY_ADDRESS") or None


def _loopback_node_address() -> None:
    """Make the local node's address 127.0.0.1 before Ray starts.

    Ray 2.60 on Linux rewrites ``ray.init(_node_ip_address="127.0.0.1")`` to the machine's LAN
    address (``services.resolve_ip_for_localhost``: it assumes every Linux node may join a
    cluster), and its gRPC servers then bind that address or the wildcard. Its single-machine
    switch, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, keeps the loopback address; with it GCS,
    raylet, object manager, core workers and the agents bind 127.0.0.1 only. The switch is read
    when ``ray`` is imported, so the imported constant is set as well.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
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
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace=namespace, runtime_env=runtime_env,
             log_to_driver=True, _node_ip_address=LOOPBACK)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:  # a Ray upgrade changed the rule above: say so rather than listen widely
        log.warning("the embedded Ray node address is %s, not %s: its ports may be reachable from the network",
                    node_ip, LOOPBACK)
    return True
