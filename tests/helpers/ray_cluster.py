"""A multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``) in its own process, so a
test process that already runs Ray can drive it: prints ``{"address", "head", "workers"}`` as one
JSON line, then answers one JSON line per command read from stdin, and shuts the cluster down at
EOF (the test's end, or its crash).

    python tests/helpers/ray_cluster.py NUM_WORKERS EXPERT_SLOTS_PER_WORKER

The head advertises ``serving`` (for the ingress and verifier), each worker ``expert_slot``.

Commands: ``experts NAMESPACE`` ({actor name: node id} of the live ``specmoe-experts-*`` actors),
``remove WORKER_INDEX``, ``add`` (one more worker; answers its node id).
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


def _experts(namespace: str) -> dict:
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith("specmoe-experts"):
            try:
                info = ray.get(ray.get_actor(entry["name"], namespace=namespace).info.remote(), timeout=30)
            except Exception:  # dead or unplaced: not live
                continue
            out[entry["name"]] = info["node_id"]
    return out


def main() -> None:
    num_workers, slots = int(sys.argv[1]), float(sys.argv[2])
    worker_args = {"num_cpus": 1, "resources": {"expert_slot": slots}}
    # A removed node is declared dead after ~1.5 s instead of Ray's default ~30 s.
    system_config = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                     "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False, "resources": {"serving": 4},
                                      "_system_config": system_config})
    workers = [cluster.add_node(**worker_args) for _ in range(num_workers)]
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id,
                      "workers": [w.node_id for w in workers]}), flush=True)
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "experts":
                answer = _experts(args[0])
            elif cmd == "remove":
                cluster.remove_node(workers[int(args[0])])
                answer = "removed"
            elif cmd == "add":
                workers.append(cluster.add_node(**worker_args))
                cluster.wait_for_nodes()
                answer = workers[-1].node_id
            else:
                answer = f"unknown command {cmd}"
            print(json.dumps(answer), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
