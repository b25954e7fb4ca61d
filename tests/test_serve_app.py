"""serve_app's start-up checks: clear reasons and a non-zero exit, before Ray starts."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

import serve_app
from actors.config import ServeConfig


def test_help_shows_the_default_config(capsys):
    with pytest.raises(SystemExit) as done:
        serve_app.main(["--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "--config CONFIG YAML ServeConfig (default: configs/embedded.yaml)" in help_text
    assert "default: None" not in help_text  # the overrides' default is the config's value, not None


def test_missing_checkpoint_is_a_clear_startup_error(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name: m\nengine:\n  model: does/not/exist\n")
    assert serve_app.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "engine.model" in err and "does/not/exist" in err


@pytest.mark.parametrize("ray_address", [None, "local"])
def test_port_in_use_is_a_clear_startup_error(capsys, monkeypatch, ray_address):
    # RAY_ADDRESS=local is Ray's "start a new local instance": the embedded server, port check included.
    if ray_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    port = _start_on_a_port_in_use()
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "`make serve PORT=...`" in err  # make users set PORT, not --port


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])  # TEST-NET-1: no machine's own
def test_a_host_that_is_not_this_machines_names_the_host_not_the_port(capsys, monkeypatch, host):
    """The advice used to be "is another server running? pick another port"."""
    import actors.cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(actors.cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    assert serve_app.main(["--config", "configs/embedded.yaml", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"http.host: cannot listen on {host!r}" in err and "another port" not in err


def test_a_port_taken_after_the_check_is_a_clear_startup_error(capsys, monkeypatch):
    """Ray's processes take ephemeral ports as they start, so a port free at the check can be gone
    when Serve's proxy binds it (seen in a sweep): one line and exit code 2, not a traceback."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(serve_app, "check_port", lambda host, port: None)
    port = _start_on_a_port_in_use()
    assert f"http: Serve's proxy cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_proxy_that_dies_on_a_free_port_is_not_called_a_port_clash():
    """Serve kills a proxy that misses its readiness checks (seen with the 2 cores saturated): with
    the port free, the error says the proxy failed rather than sending users after another server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = serve_app.proxy_start_error("127.0.0.1", port, RuntimeError("x"))
    free = serve_app.proxy_start_error("127.0.0.1", port, RuntimeError("The actor died unexpectedly\nmore"))
    assert str(taken) == (f"http: Serve's proxy cannot listen on 127.0.0.1:{port} (RuntimeError); pick another "
                          f"port: http.port in the config, --port, or `make serve PORT=...`")
    assert f"proxy did not start on 127.0.0.1:{port}, which is free (RuntimeError: The actor died unexpectedly)" \
        in str(free) and "more" not in str(free)


def _start_on_a_port_in_use() -> int:
    """Start the embedded config on a port something listens on: it must exit with 2. The port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert serve_app.main(["--config", "configs/embedded.yaml", "--port", str(port)]) == 2
    return port


def test_bad_dtype_device_checkpoints_and_a_small_expert_byte_budget_fail_before_ray_starts(tmp_path, capsys, monkeypatch):
    """Each used to surface only as failed verifier replicas and hundreds of lines of tracebacks."""
    import actors.cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(actors.cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for (good, bad), culprit in ((("dtype: float32", "dtype: fp64"), "dtype: 'fp64' is not one of"),
                                 (("device: cpu", "device: cuda"), "engine.device: 'cuda', but torch sees no CUDA"),
                                 (("device: cpu", "device: tpu"), "device: 'tpu' is not 'cpu', 'cuda' or 'cuda:N'"),
                                 (("device: cpu", "device: mps"), "device: 'mps' is not 'cpu', 'cuda' or 'cuda:N'"),
                                 # checkpoints that do not fit the method or each other
                                 (("speculative_method: draft", "speculative_method: eagle3"),
                                  "stdlib-draft/config.json: config.architectures: 'LlamaForCausalLM' is not an EAGLE-3 head"),
                                 # the same with the fix named (--speculative-method eagle3 alone)
                                 (("speculative_method: draft", "speculative_method: eagle3"),
                                  "takes an EAGLE-3 head as draft_model (the bundled one: checkpoints/stdlib-eagle3)"),
                                 (("draft_model: checkpoints/stdlib-draft", "draft_model: checkpoints/stdlib-eagle3"),
                                  "stdlib-eagle3: config.architectures: unsupported architecture 'LlamaForCausalLMEagle3'"),
                                 # Was a failed ingress replica and tracebacks (the window is 1024).
                                 (("device: cpu", "device: cpu\n  max_model_len: 5000"),
                                  "engine.max_model_len: must be in [2, 1024] (the model's max_position_embeddings), "
                                  "got 5000"),
                                 (("device: cpu", "device: cpu\n  max_model_len: 1"), "engine.max_model_len: must be in"),
                                 # Was accepted and ignored: the pool has only the groups that exist.
                                 (("experts_per_actor: 8", "experts_per_actor: 8\n  hot_expert_replicas: {1: 2}"),
                                  "experts.hot_expert_replicas: group 1 does not exist (8 experts, 8 per actor: "
                                  "groups 0-0)"),
                                 # 8 experts of 3 x 256 x 128 float32 weights: 8 x 393216 bytes at least
                                 (("experts_per_actor: 8", "experts_per_actor: 8\n  max_resident_bytes: 1000"),
                                  "experts.max_resident_bytes must be >= 3145728 (one layer's 8 held and pinned "
                                  "experts of 393216 bytes), got 1000")):
        text = open("configs/embedded.yaml").read().replace(good, bad, 1)
        text = text.replace(" checkpoints/", f" {os.getcwd()}/checkpoints/")  # the file is elsewhere
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(text)
        assert serve_app.main(["--config", str(cfg), "--port", str(_free_port())]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.parametrize("checkpoint, damage, culprit", [
    ("stdlib-moe-target", "truncate", "model.safetensors: corrupt or truncated safetensors file"),
    ("stdlib-moe-target", "no weights", ": no *.safetensors file"),
    ("stdlib-moe-target", "no tokenizer", ": no tokenizer.json"),
    ("stdlib-draft", "truncate", "model.safetensors: corrupt or truncated safetensors file")])
def test_a_damaged_checkpoint_fails_before_ray_starts_naming_the_file(tmp_path, capsys, monkeypatch, checkpoint,
                                                                       damage, culprit):
    """These were found by every replica after Ray and Serve had started: three tracebacks each in a
    few hundred lines, under a last line that named no file (an operator trial, 2026-12-07)."""
    import shutil

    import actors.cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(actors.cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    damaged = tmp_path / checkpoint
    shutil.copytree(f"checkpoints/{checkpoint}", damaged)
    weights = damaged / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no weights":
        weights.unlink()
    else:
        (damaged / "tokenizer.json").unlink()
    text = open("configs/embedded.yaml").read().replace(f" checkpoints/{checkpoint}", f" {damaged}", 1)
    text = text.replace(" checkpoints/", f" {os.getcwd()}/checkpoints/")  # the other one, from here
    cfg = tmp_path / "damaged.yaml"
    cfg.write_text(text)
    assert serve_app.main(["--config", str(cfg), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert f"cannot start: {damaged}" in err and culprit in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_not_starting_is_a_clear_startup_error(monkeypatch, capsys):
    import actors.cluster

    def timed_out(*_args):  # what ray.init raises when its raylet does not register in time
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(actors.cluster, "init_ray", timed_out)
    monkeypatch.setattr(serve_app, "check_port", lambda *_: None)
    assert serve_app.main(["--config", "configs/embedded.yaml", "--address", "10.0.0.5:6379"]) == 2
    err = capsys.readouterr().err
    assert "cannot start: Ray did not start (address '10.0.0.5:6379')" in err and "timed out during startup" in err


def test_a_deployment_that_fails_is_a_clear_startup_error(monkeypatch, capsys):
    """Serve gives up on a replica whose constructor failed three times: that was a traceback."""
    from ray import serve

    import actors.cluster

    def failed(*_args, **_kwargs):  # what serve.run raises then (Ray 2.60)
        raise RuntimeError("Deploying application specmoe failed: Failed to update the deployments ['verifier'].")

    monkeypatch.setattr(actors.cluster, "init_ray", lambda *_: False)
    monkeypatch.setattr(actors.cluster, "create_drain_signal", lambda *_: None)
    monkeypatch.setattr(serve_app, "check_port", lambda *_: None)
    monkeypatch.setattr(serve, "start", lambda **_: None)
    monkeypatch.setattr(serve, "run", failed)
    monkeypatch.setattr(serve_app, "stop", lambda *_: None)
    monkeypatch.setattr(serve_app, "_running", {})  # what the start records, left to this test

    def unreadable():
        raise RuntimeError("no controller")

    monkeypatch.setattr(serve, "status", unreadable)  # Serve's status unreadable: the generic reason
    assert serve_app.main(["--config", "configs/embedded.yaml"]) == 2
    err = capsys.readouterr().err
    assert "cannot start: the application did not deploy: Deploying application specmoe failed: " in err
    assert "Traceback" not in err
    # With Serve's status, the replica's own error (its message's last line) is the reason given.
    tensor_error = ("engine.errors.CheckpointError: /ckpt/model.safetensors: tensor 'model.embed_tokens.weight' "
                    "has shape (4096, 128), expected (4096, 256)")
    deployments = {
        "verifier": SimpleNamespace(status="DeploymentStatus.DEPLOY_FAILED",
                                    message=f"Traceback (most recent call last):\n  File \"x.py\"\n{tensor_error}\n"),
        "ingress": SimpleNamespace(status="DeploymentStatus.HEALTHY", message="")}
    status = SimpleNamespace(applications={"specmoe": SimpleNamespace(deployments=deployments)})
    monkeypatch.setattr(serve, "status", lambda: status)
    assert serve_app.main(["--config", "configs/embedded.yaml"]) == 2
    err = capsys.readouterr().err
    assert ("cannot start: the application did not deploy: verifier: CheckpointError: /ckpt/model.safetensors: "
            "tensor 'model.embed_tokens.weight' has shape (4096, 128), expected (4096, 256); the replicas' "
            "tracebacks are in the log above") in err
    assert "ingress" not in err and "Traceback" not in err


def test_a_second_server_starting_at_the_same_time_on_the_port_is_refused(monkeypatch, capsys):
    """Two `make serve` started together both passed the bind check before either proxy bound the
    port (Serve's proxies bind with SO_REUSEPORT), and both served on it. The port's lock, held
    here by another process (a server still starting), refuses the second; once that process is
    gone the lock is free again."""
    import actors.cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(actors.cluster, "init_ray", lambda *_: pytest.fail("Ray started"))
    port = _free_port()
    lock = Path(tempfile.gettempdir()) / f"specmoe-port-{port}.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDONLY | os.O_CREAT, 0o644)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert serve_app.main(["--config", "configs/embedded.yaml", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"http: another specmoe server is starting or serving on port {port} on this machine" in err
    finally:
        holder.kill()
        holder.wait()
    from actors.port_checks import _port_locks, claim_port, release_ports

    claim_port(port)  # the holder's exit freed it
    assert port in _port_locks
    release_ports()
    assert not _port_locks


@pytest.mark.parametrize("cli, env, expected", [
    (None, None, None), (None, "local", None), ("local", "10.0.0.5:6379", None),
    (None, "10.0.0.5:6379", "10.0.0.5:6379"), ("ray://head:10001", "local", "ray://head:10001")])
def test_cluster_address_treats_local_as_start_here(monkeypatch, cli, env, expected):
    from actors.cluster import cluster_address

    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert cluster_address(cli) == expected


def test_sigint_stops_the_server_even_when_started_with_it_ignored():
    # `python serve_app.py &` from a script: the shell starts the job with SIGINT ignored.
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve_app.install_signal_handlers()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is serve_app._sigterm
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_a_sigint_during_the_imports_stops_a_background_start(tmp_path):
    """A background start has SIGINT ignored until serve_app installs a handler; one sent while
    torch is still being imported used to be lost, and the server came up anyway."""
    import subprocess
    import textwrap

    # Sends itself SIGINT when the first heavy module (torch) is about to be imported.
    launcher = textwrap.dedent("""
        import importlib.abc, os, runpy, signal, sys
        class SigintAtTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch":
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, SigintAtTorch())
        sys.argv = ["serve_app.py", "--config", sys.argv[1]]
        runpy.run_path("serve_app.py", run_name="__main__")
    """)
    # A missing config: were the signal lost, main() would stop there with "cannot start", rc 2.
    done = subprocess.run(
        [sys.executable, "-c", launcher, str(tmp_path / "absent.yaml")], cwd=Path(serve_app.__file__).parent,
        capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (done.returncode, done.stderr.strip()) == (0, "specmoe: interrupted while starting")


def test_a_second_sigterm_does_not_cut_the_shutdown_short(monkeypatch, capsys):
    """`kill -TERM -<pgid>` on `make serve`: GNU make forwards the group's SIGTERM to serve_app.py,
    which can get it twice; the second arrives during stop() and must not abort the drain (a new
    user found streams cut without their 503 chunk and Serve's shutdown skipped)."""
    import signal

    stopped = []

    def fake_stop(*_):
        os.kill(os.getpid(), signal.SIGTERM)  # the forwarded copy, mid-drain
        time.sleep(0.05)  # the handler runs here
        stopped.append(True)

    _serve_until(signal.SIGTERM, fake_stop, monkeypatch)
    assert stopped == [True]
    assert "already shutting down" in capsys.readouterr().err


def _serve_until(sig: int, fake_stop, monkeypatch) -> None:
    """``serve_app.main`` with start and stop faked, ``sig`` sent to this process 0.2 s in; it must
    return 0. The signal handlers it installs are put back."""
    import signal
    import threading

    monkeypatch.setattr(serve_app, "start", lambda *a, **k: "http://127.0.0.1:1")
    monkeypatch.setattr(serve_app, "stop", fake_stop)
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
    try:
        assert serve_app.main([]) == 0
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_a_ctrl_c_during_the_shutdown_kills_ray_without_a_traceback(monkeypatch, capsys):
    """A new user's second Ctrl-C while the server drained ended in a traceback."""
    import signal

    import actors.cluster

    def fake_stop(*_):
        os.kill(os.getpid(), signal.SIGINT)  # the user does not wait for the drain
        time.sleep(1)  # the handler runs here

    killed = []
    monkeypatch.setattr(actors.cluster, "kill_leftover_ray_processes", lambda: killed.append(True))
    _serve_until(signal.SIGINT, fake_stop, monkeypatch)
    assert killed == [True]
    out = capsys.readouterr()
    assert "interrupted while stopping; killing Ray's processes" in out.err and "stopped in" in out.out

def test_embedded_start_ignores_a_stale_ray_current_cluster(monkeypatch):
    """`ray start` and ray.cluster_utils record their head in <ray temp dir>/ray_current_cluster and
    leave it behind when they die; plain ray.init() would join that address. The embedded start
    must start its own Ray whatever the file says (it made the lifecycle tests' server exit in CI)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rt") as tmp:  # short: Ray's socket paths
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:1")  # nothing listens there
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setenv("RAY_TMPDIR", tmp)
        code = ("import ray; from actors.cluster import init_ray; "
                "print('started', init_ray('stale-test', {}), ray.get_runtime_context().get_node_id() is not None); "
                "ray.shutdown()")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started True True" in done.stdout


def test_an_actor_larger_than_the_embedded_machine_is_a_startup_error():
    """Was a start that hung, Serve logging an unplaceable replica every 30 s."""
    from actors.startup_checks import StartupError, check_fits_this_machine
    from engine.yaml_config import load_yaml

    config = load_yaml("configs/embedded.yaml", ServeConfig)
    check_fits_this_machine(config, {"CPU": 2.0})  # the embedded config fits 2 cores
    too_big = msgspec.structs.replace(config, verifier=msgspec.structs.replace(config.verifier, num_cpus=64))
    with pytest.raises(StartupError, match=r"verifier.num_cpus = 64, but this machine's Ray has 2 CPUs"):
        check_fits_this_machine(too_big, {"CPU": 2.0})
    gpu = msgspec.structs.replace(config, experts=msgspec.structs.replace(config.experts, num_gpus=1))
    with pytest.raises(StartupError, match=r"experts.num_gpus = 1, but this machine's Ray has 0 GPUs"):
        check_fits_this_machine(gpu, {"CPU": 2.0})
