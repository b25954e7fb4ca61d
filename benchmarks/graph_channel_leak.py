"""Does Ray free a compiled graph's channels? Object-store use around builds, big messages, teardowns.

    python benchmarks/graph_channel_leak.py --save-result benchmarks/results/graph_channel_leak.json

One actor, a one-node graph compiled with a 1 MB channel buffer (``experts.graph_buffer_size_bytes``
of the embedded config), then: messages larger than the buffer, a teardown (plus ``gc.collect``),
and a few rebuild/teardown cycles, reading the object store (``ray memory --stats-only``'s figures)
after each step. This is the mechanism behind the object-store and RSS growth of the soak run's
``compiled_graph`` transport (docs/BENCHMARKS.md, "Soak").
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # allow `python benchmarks/graph_channel_leak.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks.common import print_table, save_json  # noqa: E402
from benchmarks.serving.process_sampler import object_store_stats  # noqa: E402

MIB = 1 << 20
BUFFER_BYTES = 1_000_000


@ray.remote
class Echo:
    def size(self, payload: bytes, index: int) -> int:
        return len(payload)


def _compile(actor):
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as request:
        node = MultiOutputNode([actor.size.bind(request, 0)])
    return node.experimental_compile(_buffer_size_bytes=BUFFER_BYTES)


def run(message_mib: list[float], rebuilds: int) -> list[dict]:
    """Rows ``{step, store_MiB, objects}`` after each step."""
    address = ray.get_runtime_context().gcs_address
    rows = []

    def record(step: str) -> None:
        stats = object_store_stats(address)
        rows.append({"step": step, "store_MiB": stats["bytes_used"] / MIB, "objects": stats["num_objects"]})

    actor = Echo.remote()
    ray.get(actor.size.remote(b"", 0))
    record("actor up, no graph")
    dag = _compile(actor)
    ray.get(dag.execute(b"x"), timeout=120)  # the first execution starts the actor's loop
    record("graph built")
    for mib in message_mib:
        ray.get(dag.execute(b"x" * int(mib * MIB)), timeout=120)
        record(f"message of {mib:g} MiB")
    for i in range(rebuilds + 1):
        dag.teardown()
        del dag
        gc.collect()
        time.sleep(1.0)
        record(f"teardown {i} + gc")
        if i < rebuilds:
            dag = _compile(actor)
            ray.get(dag.execute(b"x"), timeout=120)
            record(f"rebuild {i + 1}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--message-mib", default="0.5,2,4,2,4,16,16", help="message sizes sent in order, MiB")
    p.add_argument("--rebuilds", type=int, default=3)
    p.add_argument("--save-result", default=None)
    args = p.parse_args(argv)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        rows = run([float(x) for x in args.message_mib.split(",")], args.rebuilds)
    finally:
        ray.shutdown()
    print_table(rows, ["step", "store_MiB", "objects"])
    save_json(args.save_result, {"buffer_bytes": BUFFER_BYTES, "ray": ray.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
