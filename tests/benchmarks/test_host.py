"""What a benchmark result records of its machine (benchmarks/serving/host.py, benchmarks/common.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.common import machine
from benchmarks.serving.host import cpu_model, host_facts


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo (Linux)")
def test_the_cpu_model_is_cpuinfos_model_name():
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    assert cpu_model() == names[0] and names[0]


def test_machine_adds_torch_to_the_host_facts():
    facts, info = host_facts(), machine()
    assert facts["num_cpus"] == os.cpu_count() and len(facts["load_avg"]) == 3
    assert all(load >= 0 for load in facts["load_avg"])
    assert {k: info[k] for k in ("platform", "cpu_model", "num_cpus")} == {
        k: facts[k] for k in ("platform", "cpu_model", "num_cpus")}
    assert info["torch"].startswith("2.") and info["threads"] >= 1
