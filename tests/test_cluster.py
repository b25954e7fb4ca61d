"""serve_app.py joining an existing multi-node Ray cluster (``--address``; three nodes on this
machine via ``tests/helpers/ray_cluster.py``): expert actors spread over the worker nodes that
advertise ``expert_slot``, losing a worker mid-request changes no greedy output, and SIGTERM removes
only the app (and its detached expert actors), leaving the cluster up. Tests share one cluster and
one server, in file order."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from benchmarks.serving.server_process import embedded_config, free_port, serve_process
from engine import LLM, SamplingParams

NAMESPACE = "specmoe-cluster-test"
PROMPTS = ["def read_config(path):\n", "class LRUCache:\n", "import json\n\n\ndef load(", "def merge(a, b):\n"]
MAX_TOKENS = 32


class ClusterProcess:
    """The helper's process: its address and node ids, and one command at a time."""

    def __init__(self, workers: int, slots: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "tests/helpers/ray_cluster.py", str(workers), str(slots)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.info = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, "the cluster helper exited"
        return line

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def cluster():
    c = ClusterProcess(workers=2, slots=4)
    yield c
    c.close()


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    """(serve_app.py process, URL) deployed onto the cluster: 4 expert actors (2 experts each) that
    need an expert_slot, spread; the shared pool of actor calls (detached actors)."""
    config = embedded_config(free_port())
    config["http"]["proxy_location"] = "HeadOnly"
    config["engine"].update(num_speculative_tokens=4)
    config["engine"]["scheduler"].update(max_num_seqs=8, max_waiting=8)
    # The ingress and verifier stay on the head: a lost worker takes expert actors (and maybe the
    # draft actor) with it, which the unit survives, not the replicas themselves.
    config["ingress"] = config["verifier"] = {"resources": {"serving": 1}}
    config["experts"] = {"experts_per_actor": 2, "transport": "actor_calls", "call_timeout_s": 5.0,
                         "resources": {"expert_slot": 1}, "scheduling_strategy": "SPREAD", "namespace": NAMESPACE}
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    with serve_process(config, path, ("--address", cluster.info["address"])) as (proc, url, _):
        yield proc, url


@pytest.fixture(scope="module")
def expected():
    llm = LLM("checkpoints/stdlib-moe-target", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _complete(url: str, prompt: str) -> str:
    body = {"model": "stdlib-moe", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_joins_the_cluster_and_spreads_experts_over_the_worker_nodes(cluster, app, expected):
    _, url = app
    assert [_complete(url, p) for p in PROMPTS] == expected
    experts = cluster.ask(f"experts {NAMESPACE}")
    assert len(experts) == 4
    nodes = set(experts.values())
    assert nodes == set(cluster.info["workers"])  # both workers, never the head (no expert_slot there)


def test_losing_a_worker_node_mid_request_changes_no_output(cluster, app, expected):
    _, url = app
    texts: dict = {}
    threads = [threading.Thread(target=lambda i=i: texts.__setitem__(i, _complete(url, PROMPTS[i])), daemon=True)
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    time.sleep(0.5)  # requests admitted and decoding
    assert len(texts) < len(PROMPTS)  # the node goes while requests are in flight
    assert cluster.ask("remove 0") == "removed"
    for t in threads:
        t.join(180)
    assert [texts.get(i) for i in range(len(PROMPTS))] == expected
    experts = cluster.ask(f"experts {NAMESPACE}")
    assert len(experts) == 4 and set(experts.values()) == {cluster.info["workers"][1]}  # re-created on the survivor


def test_sigterm_removes_the_app_and_its_detached_experts_not_the_cluster(cluster, app):
    proc, url = app
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    exit_s = time.monotonic() - start
    assert rc == 0 and exit_s <= 10.0, (rc, exit_s)
    assert cluster.ask(f"experts {NAMESPACE}") == {}  # no orphaned detached actors
    assert cluster.ask("add")  # the cluster itself is still up and takes nodes
    print(f"SIGTERM to exit on a joined cluster: {exit_s:.1f} s")
