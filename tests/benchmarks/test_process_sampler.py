"""The soak sampler's object-store reading from the node's Prometheus page (no Ray needed)."""

from benchmarks.serving.process_sampler import parse_store_metrics

LABELS = 'Component="raylet",NodeAddress="127.0.0.1",SessionName="s",Version="2.60.0",WorkerId=""'
PAGE = f"""# HELP ray_object_store_used_memory Amount of memory currently occupied in the object store.
# TYPE ray_object_store_used_memory gauge
ray_object_store_used_memory{{{LABELS}}} 4.0225549e+07
ray_object_store_num_local_objects{{{LABELS}}} 42.0
ray_object_store_memory{{{LABELS},Location="MMAP_SHM",ObjectState="SEALED"}} 4.0225549e+07
ray_object_store_memory{{{LABELS},Location="SPILLED",ObjectState=""}} 1048576.0
ray_object_store_dist_count{{{LABELS},Source="CreatedByWorker"}} 73.0
"""


def test_reads_used_bytes_objects_and_spilled_bytes():
    assert parse_store_metrics(PAGE) == {"bytes_used": 40225549, "num_objects": 42, "bytes_spilled": 1048576}


def test_no_figure_before_the_raylet_reported():
    assert parse_store_metrics("# HELP process_cpu_seconds_total x\nprocess_cpu_seconds_total 1.0\n") is None
    unspilled = "\n".join(line for line in PAGE.splitlines() if "SPILLED" not in line)
    assert parse_store_metrics(unspilled)["bytes_spilled"] == 0
